"""Verify steps (2..64 tokens) of a native Llama-family target in the fused-decode layout, on tensor cores.

Why: at 8B a one-token step on the fused kernels (fast/fused_decode.py) takes 4.2 ms, but a 64-token verify on
compiled layers takes 5.7-5.9 ms (1.36-1.40x): ~1 ms of it is the small kernels around cuBLAS's products, the
same overhead the fused step removed (bench/NOTES.md v10). Here the products run as tl.dot tiles of all T rows
against BLOCK_N weight rows, carrying the same neighbours:

- qkv:     the RMSNorm folded in (the tile multiplies x by the norm weight, sums x^2 on the way, and scales the
           product rows by 1/RMS at the end), bias, RoPE per row and the cache write at each row's slot;
- attend:  fast.fused_decode.fused_attention (K/V blocks loaded once per kv group);
- o, down: split-K (the weights are only 4096 rows), the last slice of a column tile to finish adds the slices in
           a fixed order and does the residual add;
- gate/up: norm folded, SiLU(gate) * up;
- lm_head: norm folded.

The folded norm rounds differently from the modules (x * weight in the model dtype, then the float32 product
scaled), which is fine for the vendor-kernel class of paths this serves, not for the batch-invariant one.
Written and CPU-tested (Triton's interpreter), not yet timed on a GPU: see bench/NOTES.md v13.
"""

from __future__ import annotations

import torch

from eaglescope.fast.fused_decode import (
    attention_scratch,
    fused_attention,
    fused_decode_supported,
    logits_dtype,
    triton,
)
from eaglescope.target.llama import LlamaModel

if triton is not None:
    import triton.language as tl

MAX_ROWS = 64
# (BLOCK_N, BLOCK_K, num_warps, num_stages); untimed guesses: wide column tiles so each program's re-read of the T
# input rows from L2 stays below its weight traffic; deeper pipelines because every tile is a fresh weight stream
ROW_BLOCKS = {
    "qkv": (16, 64, 4, 3),
    "o": (64, 64, 4, 3),
    "gate_up": (32, 64, 4, 3),
    "down": (64, 64, 4, 3),
    "lm_head": (128, 64, 8, 3),
}
SPLIT_PROGRAMS = 256

if triton is not None:

    @triton.jit
    def _rows_tiles(x, nw, w, t, ok_t, rows_a, rows_b, ok_n, k_lo, k_hi, K: tl.constexpr, NORM: tl.constexpr,
                    PAIR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        """in[t, k_lo:k_hi] @ W[rows_a].T (and W[rows_b].T when PAIR) on tensor cores, in = x * norm weight when
        NORM; also the sum of x^2 of each row over the same range (for the folded RMSNorm)."""
        acc_a = tl.zeros((BM, BN), tl.float32)
        acc_b = tl.zeros((BM, BN), tl.float32)
        ss = tl.zeros((BM,), tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            kk = k0 + tl.arange(0, BK)
            in_k = kk < k_hi
            xs = tl.load(x + t[:, None] * K + kk[None, :], mask=ok_t[:, None] & in_k[None, :], other=0.0)
            if NORM:
                xf = xs.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
                xs = (xf * tl.load(nw + kk, mask=in_k, other=0.0).to(tl.float32)[None, :]).to(xs.dtype)
            wa = tl.load(w + rows_a[:, None] * K + kk[None, :], mask=ok_n[:, None] & in_k[None, :], other=0.0)
            acc_a += tl.dot(xs, tl.trans(wa), input_precision="ieee")
            if PAIR:
                wb = tl.load(w + rows_b[:, None] * K + kk[None, :], mask=ok_n[:, None] & in_k[None, :], other=0.0)
                acc_b += tl.dot(xs, tl.trans(wb), input_precision="ieee")
        return acc_a, acc_b, ss

    @triton.jit
    def _rows_linear_kernel(x, nw, w, b, y, part, count, T, N, eps, K: tl.constexpr, K_SLICE: tl.constexpr,
                            SPLITS: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                            RESIDUAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        """y[t, cols] (+)= in[t] @ W[cols].T (+ bias); K cut into SPLITS slices (not with NORM), whose float32
        partials the last slice of a column tile to finish adds in slice order (a counter per tile)."""
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        t = tl.arange(0, BM)
        ok_t = t < T
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        ok_n = cols < N
        k_lo = pid_s * K_SLICE
        acc, _, ss = _rows_tiles(x, nw, w, t, ok_t, cols, cols, ok_n, k_lo, tl.minimum(k_lo + K_SLICE, K), K, NORM,
                                 False, BM, BN, BK)  # fmt: skip
        ok = ok_t[:, None] & ok_n[None, :]
        last = True
        if SPLITS > 1:
            tl.store(part + (pid_s * BM + t[:, None]) * N + cols[None, :], acc, mask=ok)
            tl.debug_barrier()  # every warp's partial stores land before the counter says so
            last = tl.atomic_add(count + pid_n, 1) == SPLITS - 1
        if last:
            if SPLITS > 1:
                acc = tl.zeros((BM, BN), tl.float32)
                for j in range(0, SPLITS):
                    acc += tl.load(part + (j * BM + t[:, None]) * N + cols[None, :], mask=ok, other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
                tl.store(count + pid_n, 0)
            if NORM:
                acc = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None]
            if HAS_BIAS:
                acc += tl.load(b + cols, mask=ok_n, other=0.0).to(tl.float32)[None, :]
            out = y + t[:, None] * N + cols[None, :]
            if RESIDUAL:
                acc = acc.to(y.dtype.element_ty).to(tl.float32) + tl.load(out, mask=ok, other=0.0).to(tl.float32)
            tl.store(out, acc.to(y.dtype.element_ty), mask=ok)

    @triton.jit
    def _rows_qkv_kernel(x, nw, w, b, cos, sin, q, kc, vc, slots, T, n_heads, n_kv, S, eps, K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr):  # fmt: skip
        """Program (head, chunk): rows j and j + D/2 of a q, k or v head for all T rows; RoPE at each row's
        position (not for v), then q → q[t, head], k/v → the cache at slots[t]."""
        HALF: tl.constexpr = D // 2
        pid = tl.program_id(0)
        head = pid // (HALF // BN)
        j = (pid % (HALF // BN)) * BN + tl.arange(0, BN)
        t = tl.arange(0, BM)
        ok_t = t < T
        rows = (head * D + j).to(tl.int64)
        lo, hi, ss = _rows_tiles(x, nw, w, t, ok_t, rows, rows + HALF, rows >= 0, 0, K, K, True, True, BM, BN, BK)
        rstd = (1.0 / tl.sqrt(ss / K + eps))[:, None]
        lo, hi = lo * rstd, hi * rstd
        if HAS_BIAS:
            lo += tl.load(b + rows).to(tl.float32)[None, :]
            hi += tl.load(b + rows + HALF).to(tl.float32)[None, :]
        lo = lo.to(q.dtype.element_ty).to(tl.float32)
        hi = hi.to(q.dtype.element_ty).to(tl.float32)
        ok = ok_t[:, None] & (j[None, :] >= 0)
        if head < n_heads + n_kv:  # q and k heads rotate: x * cos + rotate_half(x) * sin
            at = t[:, None] * D + j[None, :]
            c_lo = tl.load(cos + at, mask=ok, other=0.0).to(tl.float32)
            c_hi = tl.load(cos + at + HALF, mask=ok, other=0.0).to(tl.float32)
            s_lo = tl.load(sin + at, mask=ok, other=0.0).to(tl.float32)
            s_hi = tl.load(sin + at + HALF, mask=ok, other=0.0).to(tl.float32)
            lo, hi = lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi
        if head < n_heads:
            dst = q + t[:, None] * (n_heads * D) + head * D + j[None, :]
        else:
            slot = tl.load(slots + t, mask=ok_t, other=0).to(tl.int64)
            if head < n_heads + n_kv:
                dst = kc + ((head - n_heads) * S + slot[:, None]) * D + j[None, :]
            else:
                dst = vc + ((head - n_heads - n_kv) * S + slot[:, None]) * D + j[None, :]
        tl.store(dst, lo.to(q.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, hi.to(q.dtype.element_ty), mask=ok)

    @triton.jit
    def _rows_gate_up_kernel(x, nw, w, b, act, T, F, eps, K: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        """Columns j of gate and F + j of up for all T rows → act[t, j] = SiLU(gate) * up."""
        j = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
        ok_n = j < F
        t = tl.arange(0, BM)
        ok_t = t < T
        gate, up, ss = _rows_tiles(x, nw, w, t, ok_t, j, j + F, ok_n, 0, K, K, True, True, BM, BN, BK)
        rstd = (1.0 / tl.sqrt(ss / K + eps))[:, None]
        gate, up = gate * rstd, up * rstd
        if HAS_BIAS:
            gate += tl.load(b + j, mask=ok_n, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b + F + j, mask=ok_n, other=0.0).to(tl.float32)[None, :]
        gate = gate.to(act.dtype.element_ty).to(tl.float32)
        up = up.to(act.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(act.dtype.element_ty).to(tl.float32)
        tl.store(act + t[:, None] * F + j[None, :], (silu * up).to(act.dtype.element_ty),
                 mask=ok_t[:, None] & ok_n[None, :])  # fmt: skip


def _splits(n_tiles: int, K: int, bk: int) -> int:
    """K-slices for a product with few column tiles: ~SPLIT_PROGRAMS programs, each at least 4 BLOCK_K steps."""
    return max(1, min(triton.cdiv(SPLIT_PROGRAMS, n_tiles), K // (4 * bk)))


class FusedVerify:
    """T-token steps (2 <= T <= MAX_ROWS) of `model` on `cache` (a fast.SlotCache) through the kernels above.

    Call with tokens, positions, slots [T] and mask [T, S] bool → logits [T, V] (the lm_head's dtype), aux
    [T, n_taps*H] | None; the same contract as FastTarget.run."""

    def __init__(self, model: LlamaModel, cache, taps: tuple[int, ...] = (), blocks: dict | None = None) -> None:
        why = fused_decode_supported(model, model.lm_head.weight.device)
        if why:
            raise ValueError(why.replace("fused decode", "fused verify"))
        if model.args.head_dim < 32:  # tensor-core tiles: half a head is at least 16 columns
            raise ValueError(f"fused verify needs head_dim >= 32, not {model.args.head_dim}")
        a = model.args
        self.model, self.cache, self.taps, self.args = model, cache, tuple(taps), a
        self.blocks = {**ROW_BLOCKS, **(blocks or {})}
        half = a.head_dim // 2
        bn = self.blocks["qkv"][0]
        if half % bn:
            self.blocks["qkv"] = (min(bn, half),) + self.blocks["qkv"][1:]
        w = model.lm_head.weight
        dev, dt = w.device, model.model.embed_tokens.weight.dtype
        R, H, nq = MAX_ROWS, a.hidden_size, a.num_heads * a.head_dim
        self.h = torch.zeros(R, H, device=dev, dtype=dt)
        self.q = torch.zeros(R, nq, device=dev, dtype=dt)
        self.attn = torch.zeros(R, nq, device=dev, dtype=dt)
        self.act = torch.zeros(R, a.intermediate_size, device=dev, dtype=dt)
        self.scratch = attention_scratch(R, a.num_heads, a.head_dim, cache.size, dev)
        need, tiles_max = 1, 1  # split-K scratch of the o and down products (the only split ones)
        for name, K in (("o", nq), ("down", a.intermediate_size)):
            bn, bk = self.blocks[name][:2]
            tiles = triton.cdiv(H, bn)
            need, tiles_max = max(need, _splits(tiles, K, bk) * R * H), max(tiles_max, tiles)
        self.part = torch.zeros(need, device=dev, dtype=torch.float32)
        self.count = torch.zeros(tiles_max, device=dev, dtype=torch.int32)
        self.logits_dtype = logits_dtype(model)

    @staticmethod
    def supports_rows(T: int) -> bool:
        return 2 <= T <= MAX_ROWS

    def _linear(self, name: str, x, weight, bias, y, T: int, norm=None, residual: bool = False) -> None:
        bn, bk, warps, stages = self.blocks[name]
        N, K = weight.shape
        tiles = triton.cdiv(N, bn)
        splits = 1 if norm is not None else _splits(tiles, K, bk)
        k_slice = triton.cdiv(triton.cdiv(K, bk), splits) * bk
        splits = triton.cdiv(K, k_slice)
        BM = max(16, triton.next_power_of_2(T))
        if splits > 1 and splits * BM * N > self.part.numel():  # blocks changed since __init__ (a sweep)
            self.part = torch.zeros(splits * BM * N, device=x.device, dtype=torch.float32)
        if splits > 1 and tiles > self.count.numel():
            self.count = torch.zeros(tiles, device=x.device, dtype=torch.int32)
        nw, eps = (norm.weight, norm.eps) if norm is not None else (weight, 0.0)
        _rows_linear_kernel[(tiles, splits)](x, nw, weight, bias if bias is not None else weight, y, self.part,
                                             self.count, T, N, eps, K=K, K_SLICE=k_slice, SPLITS=splits,
                                             NORM=norm is not None, HAS_BIAS=bias is not None, RESIDUAL=residual,
                                             BM=BM, BN=bn, BK=bk, num_warps=warps,
                                             num_stages=stages)  # fmt: skip

    @torch.inference_mode()
    def __call__(self, tokens, positions, mask, slots) -> tuple[torch.Tensor, torch.Tensor | None]:
        m, a = self.model, self.args
        T, D, S = tokens.shape[0], a.head_dim, self.cache.size
        if not self.supports_rows(T):
            raise ValueError(f"FusedVerify runs 2..{MAX_ROWS} tokens, not {T}")
        BM = max(16, triton.next_power_of_2(T))
        h = self.h[:T]
        torch.index_select(m.model.embed_tokens.weight, 0, tokens, out=h)
        cos, sin = m.rope_for(positions[None])
        cos, sin = cos.reshape(T, D).contiguous(), sin.reshape(T, D).contiguous()
        captured = []
        for i, layer in enumerate(m.model.layers):
            if i in self.taps:
                captured.append(h.clone())
            norm, qkv = layer.input_layernorm, layer.self_attn.qkv_proj
            bn, bk, warps, stages = self.blocks["qkv"]
            _rows_qkv_kernel[((a.num_heads + 2 * a.num_kv_heads) * (D // 2 // bn),)](
                h, norm.weight, qkv.weight, qkv.bias if qkv.bias is not None else qkv.weight, cos, sin, self.q,
                self.cache.k[i], self.cache.v[i], slots, T, a.num_heads, a.num_kv_heads, S, norm.eps, K=a.hidden_size,
                HAS_BIAS=qkv.bias is not None, D=D, BM=BM, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
            )  # fmt: skip
            fused_attention(self.q[:T].view(T, a.num_heads, D), self.cache.k[i, 0], self.cache.v[i, 0], mask,
                            self.attn[:T].view(T, a.num_heads, D), self.scratch)  # fmt: skip
            o = layer.self_attn.o_proj
            self._linear("o", self.attn, o.weight, o.bias, h, T, residual=True)
            norm, gu, F = layer.post_attention_layernorm, layer.mlp.gate_up_proj, a.intermediate_size
            bn, bk, warps, stages = self.blocks["gate_up"]
            _rows_gate_up_kernel[(triton.cdiv(F, bn),)](
                h, norm.weight, gu.weight, gu.bias if gu.bias is not None else gu.weight, self.act, T, F, norm.eps,
                K=a.hidden_size, HAS_BIAS=gu.bias is not None, BM=BM, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
            )  # fmt: skip
            down = layer.mlp.down_proj
            self._linear("down", self.act, down.weight, down.bias, h, T, residual=True)
        logits = torch.empty(T, a.vocab_size, device=h.device, dtype=self.logits_dtype)
        self._linear("lm_head", h, m.lm_head.weight, None, logits, T, norm=m.model.norm)
        aux = torch.cat(captured, dim=-1) if captured else None
        return logits, aux
