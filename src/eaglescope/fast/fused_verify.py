"""Verify steps (2..64 tokens) of a native Llama-family target in the fused-decode layout.

Why: at 8B a one-token step on the fused kernels (fast/fused_decode.py) takes 4.0 ms, but a 64-token verify on
compiled layers takes 5.6-5.9 ms (1.34-1.40x): ~1.4 ms of it is the small kernels around cuBLAS's products. Here
each layer is, by default (the mix bench/fused_decode_check.py --sweep-verify measured fastest):

- RMSNorm: one row kernel, rounding where the module rounds (2 µs at 64 rows);
- q/k/v:   cuBLAS, then one row kernel for RoPE and the K/V cache write at each row's slot;
- attend:  fast.fused_decode.fused_attention's flash kernel: a program per kv group and 16 (row, head) pairs walks
           the cache with a running softmax, one launch per layer (the split-slot grouped kernel and two products and
           a softmax remain, attention="fused" / "matmul");
- o, down: cuBLAS (down through cuBLASLt, CUBLASLT_PRODUCTS) into a buffer; the next RMSNorm kernel adds it into
           the residual stream before it normalises, rounded as the modules round (DEFER_RESIDUAL). The residual as
           addmm's beta = 1 (defer_residual=False) needs no buffer and no add, but cuBLAS then picks a slower
           kernel for o (12.2 µs against 8.4 µs at 64 rows, fused-decode-check-20261204T191729.json): the two
           verify equally fast as a whole; beta = 1 rounds h + x @ W.T once (1-ulp differences on ~30% of bf16
           elements);
- gate/up: cuBLASLt, then one SiLU·up kernel;

and the lm_head is _rows_gemm_kernel: tensor-core tiles with no K mask, cut over K when the product has few column
tiles (the last slice of a column tile to finish adds the slices in order), with the product's epilogue. The same
kernel can run every layer product too (cublas=(); its residual epilogue rounds as the modules do): alone at 64
rows it streams the weights at 56-80% of copy against cuBLAS's 75-92%, but the lm_head at 92% against 85%.
8B: 4.84 ms at 64 tokens and 4.85 at 24 (1.21x the one-token step; with the split-slot or product attention 5.0-5.1
ms: bench/results/bench-roofline-20261204T192829.json, fused-decode-check-20261204T192953.json).

On a Hopper-or-later GPU in bf16/fp16, verifies of up to STREAM_MAX_ROWS rows run those four products on
fast.stream_mm instead (weight tiles fetched by TMA; q/k/v's, o's and down's K slices summed by the RoPE and norm
kernels that follow): the few-row products are weight streams, which the libraries' tiles read under the copy
bandwidth at 24 rows (fast/stream_mm.py). The lm_head runs there too where a launch for it is named (`stream`, or a
tuning file's "stream" key).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from eaglescope.fast.fused_decode import (
    FLASH_LAUNCH,
    RopeRows,
    attention_limit,
    attention_scratch,
    flash_scratch,
    flash_scratch_fits,
    fused_attention,
    fused_decode_supported,
    logits_dtype,
    pdl_options,
    triton,
)
from eaglescope.fast.stream_mm import SUMMED, default_stream, stream_launch, stream_mm
from eaglescope.models.targets.llama import LlamaModel, attend

log = logging.getLogger(__name__)

if triton is not None:  # without it the kernels are not defined, and `available` keeps every caller off them
    import triton.language as tl

    from eaglescope.fast.fused_decode import await_previous

MAX_ROWS = 64
# (BLOCK_N, BLOCK_K, num_warps, num_stages[, swap]), from the 64-token sweep at 8B (fused-decode-check-20261129T144905
# .json); BLOCK_N counts row pairs for qkv (j, j + D/2) and gate_up (j, F + j); swap (default 0): _rows_gemm_kernel's
# SWAP, the weight tile as the tensor-core product's M side
ROW_BLOCKS = {
    "qkv": (32, 64, 4, 4),
    "o": (32, 64, 4, 4),
    "gate_up": (32, 128, 4, 4),
    "down": (64, 64, 4, 4),
    "lm_head": (64, 128, 4, 3),
}
# ~2 waves of 132 SMs: products with few column tiles (all but lm_head at 8B) are cut over K to get there
SPLIT_PROGRAMS = 264
# products left to cuBLAS (its product, then a small kernel for RoPE / SiLU; the residual add in the next norm):
# alone at 64 rows it streams the layer weights at 75-94% of copy against 56-80% for _rows_gemm_kernel, which
# wins only on the lm_head (bench/results/fused-decode-check-20261129T144905.json)
CUBLAS_PRODUCTS = ("qkv", "o", "gate_up", "down")
# the products stream_mm may run instead: those four where cuBLAS would, and the lm_head in _rows_gemm_kernel's place
STREAM_PRODUCTS = CUBLAS_PRODUCTS + ("lm_head",)
# of those, the ones run through cuBLASLt rather than cublasGemmEx (torch picks each library's kernels by its own
# heuristics): at 64 rows at 8B, Lt streams down's weights at 88% of copy against 77%, gate/up's at 94% against
# 90%; o (88% against 94%) and q/k/v (75% both) stay (bench/results/fused-decode-check-20261204T185702.json)
CUBLASLT_PRODUCTS = ("gate_up", "down")
# attention="auto" (the mix the benchmarks run): flash attention at every row count
AUTO_ATTENTION = "flash"
# o's and down's products left for the next norm kernel to add (module docstring): as fast as beta = 1 at 24-64 rows
# (4.85 against 4.82 ms at 64, fused-decode-check-20261204T205136.json), and it rounds as the modules do
DEFER_RESIDUAL = True
# each product on cuBLAS in one call (1), or cut over K into this many (split_k_mm; fused_decode_check.py
# --sweep-k-split times 2-8)
K_SPLITS = {"qkv": 1, "o": 1, "down": 1}
# the most rows a verify runs its cuBLAS products on fast.stream_mm by default (its launches were measured at 24)
STREAM_MAX_ROWS = 32
# each product's epilogue (the kernel's MODE)
EPILOGUE = {"qkv": "qkv", "o": "residual", "gate_up": "gate_up", "down": "residual", "lm_head": "plain"}

if triton is not None:

    @triton.jit
    def _rows_rmsnorm_kernel(x, r, nw, y, eps, part_stride, keep, keep_stride, K: tl.constexpr, KP2: tl.constexpr,
                             ADD: tl.constexpr, PARTS: tl.constexpr = 1, KEEP: tl.constexpr = False,
                             PDL: tl.constexpr = False):  # fmt: skip
        """y[t] = RMSNorm(x[t]) with the module's two roundings; one program per row. With ADD, first x[t] += r[t]
        in place (the residual add, rounded as the module's `h + proj(...)`). PARTS > 1: r holds that many float32
        partials of the product over slices of K (split_k_mm), part_stride elements apart, summed in slice order
        and rounded once to x's dtype before the add, as the one product would be. KEEP: x[t] (after the add) is
        also written to keep[t] (rows keep_stride apart): a tap's copy of the state, without a kernel of its own."""
        await_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, KP2)
        ok = k < K
        xs = tl.load(x + t * K + k, mask=ok, other=0.0)
        if ADD:
            add = tl.load(r + t * K + k, mask=ok, other=0.0).to(tl.float32)
            if PARTS > 1:
                for p in tl.static_range(1, PARTS):
                    add += tl.load(r + p * part_stride + t * K + k, mask=ok, other=0.0)
                add = add.to(xs.dtype).to(tl.float32)
            xs = (xs.to(tl.float32) + add).to(xs.dtype)
            tl.store(x + t * K + k, xs, mask=ok)
        if KEEP:
            tl.store(keep + t * keep_stride + k, xs, mask=ok)
        xs = xs.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xs * xs, 0) / K + eps)
        normed = (xs * rstd).to(y.dtype.element_ty).to(tl.float32)
        w = tl.load(nw + k, mask=ok, other=0.0).to(tl.float32)
        tl.store(y + t * K + k, (w * normed).to(y.dtype.element_ty), mask=ok)

    @triton.jit
    def _rows_rope_cache_kernel(qkv, cos, sin, q, kc, vc, slots, n_heads, n_kv, S, bias, part_stride,
                                D: tl.constexpr, PARTS: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False,
                                PDL: tl.constexpr = False):  # fmt: skip
        """Program (row t, head) of a q/k/v product already in qkv [T, heads*D]: RoPE at the row's position (not
        for v), then q → q[t, head], k/v → the cache at slots[t]. PARTS > 1: qkv holds that many float32 partials
        of the product over slices of K (split_k_mm), part_stride elements apart, summed in slice order with the
        bias (HAS_BIAS) and rounded once to the cache's dtype, as the one product would be."""
        await_previous(PDL)
        HALF: tl.constexpr = D // 2
        t, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        n_all = n_heads + 2 * n_kv
        j = tl.arange(0, HALF)
        src = qkv + (t * n_all + head) * D + j
        lo, hi = tl.load(src).to(tl.float32), tl.load(src + HALF).to(tl.float32)
        if PARTS > 1:
            for p in tl.static_range(1, PARTS):
                lo += tl.load(src + p * part_stride)
                hi += tl.load(src + p * part_stride + HALF)
            if HAS_BIAS:
                lo += tl.load(bias + head * D + j).to(tl.float32)
                hi += tl.load(bias + head * D + HALF + j).to(tl.float32)
            lo = lo.to(q.dtype.element_ty).to(tl.float32)
            hi = hi.to(q.dtype.element_ty).to(tl.float32)
        if head < n_heads + n_kv:  # q and k heads rotate: x * cos + rotate_half(x) * sin
            c_lo, c_hi = tl.load(cos + t * D + j).to(tl.float32), tl.load(cos + t * D + HALF + j).to(tl.float32)
            s_lo, s_hi = tl.load(sin + t * D + j).to(tl.float32), tl.load(sin + t * D + HALF + j).to(tl.float32)
            lo, hi = lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi
        if head < n_heads:
            dst = q + (t * n_heads + head) * D + j
        elif head < n_heads + n_kv:
            dst = kc + ((head - n_heads) * S + tl.load(slots + t).to(tl.int64)) * D + j
        else:
            dst = vc + ((head - n_heads - n_kv) * S + tl.load(slots + t).to(tl.int64)) * D + j
        tl.store(dst, lo.to(q.dtype.element_ty))
        tl.store(dst + HALF, hi.to(q.dtype.element_ty))

    @triton.jit
    def _rows_silu_mul_kernel(gate_up, act, F, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """act[t, j] = SiLU(gate_up[t, j]) * gate_up[t, F + j], with the module's rounding of SiLU."""
        await_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = j < F
        gate = tl.load(gate_up + t * 2 * F + j, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up + t * 2 * F + F + j, mask=ok, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(act.dtype.element_ty).to(tl.float32)
        tl.store(act + t * F + j, (silu * up).to(act.dtype.element_ty), mask=ok)

    @triton.jit
    def _rows_gemm_kernel(x, w, b, y, cos, sin, kc, vc, slots, part, count, T, N, n_heads, n_kv, S,
                          K: tl.constexpr, K_SLICE: tl.constexpr, SPLITS: tl.constexpr, MODE: tl.constexpr,
                          PAIR: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, D: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                          PDL: tl.constexpr = False):  # fmt: skip
        """x[:T] @ W[cols].T on tensor cores, K cut into SPLITS slices whose float32 partials the last slice of a
        column tile to finish adds in slice order (a counter per tile), then the MODE's epilogue:
        "plain" y = . (+ b); "residual" y += .; "gate_up" (cols j and N + j, PAIR) y = SiLU(gate) * up;
        "qkv" (rows j and j + D/2 of a head, PAIR) RoPE on q/k heads, q → y[t, head], k/v → the cache at slots[t].
        SWAP: each step's product as W[cols] @ x.T, the weight tile on the tensor-core instruction's M side (BN rows)
        and the few tokens on its N side, as cuBLAS's tiles for few rows are (64 weight rows by 24 tokens at 24 rows,
        as the profile of cuBLAS's verify shows); the accumulator is transposed once, after the K loop."""
        await_previous(PDL)
        HALF: tl.constexpr = D // 2
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        t = tl.arange(0, BM)
        ok_t = t < T
        if MODE == "qkv":
            head = pid_n // (HALF // BN)
            j = (pid_n % (HALF // BN)) * BN + tl.arange(0, BN)
            rows_a = (head * D + j).to(tl.int64)
            rows_b = rows_a + HALF
            ok_n = j >= 0
        else:
            j = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
            rows_a, rows_b = j, j + N
            ok_n = j < N
        k_lo = pid_s * K_SLICE
        k_hi = tl.minimum(k_lo + K_SLICE, K)
        if SWAP:
            acc_a = tl.zeros((BN, BM), tl.float32)
            acc_b = tl.zeros((BN, BM), tl.float32)
        else:
            acc_a = tl.zeros((BM, BN), tl.float32)
            acc_b = tl.zeros((BM, BN), tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            kk = k0 + tl.arange(0, BK)
            if EVEN_K:  # BK divides K and K_SLICE: no K mask, so the loads stay vectorised
                xs = tl.load(x + t[:, None] * K + kk[None, :], mask=ok_t[:, None], other=0.0)
                wa = tl.load(w + rows_a[:, None] * K + kk[None, :], mask=ok_n[:, None], other=0.0)
            else:
                in_k = kk < k_hi
                xs = tl.load(x + t[:, None] * K + kk[None, :], mask=ok_t[:, None] & in_k[None, :], other=0.0)
                wa = tl.load(w + rows_a[:, None] * K + kk[None, :], mask=ok_n[:, None] & in_k[None, :], other=0.0)
            if SWAP:
                acc_a += tl.dot(wa, tl.trans(xs), input_precision="ieee")
            else:
                acc_a += tl.dot(xs, tl.trans(wa), input_precision="ieee")  # float32 weights: no TF32
            if PAIR:
                if EVEN_K:
                    wb = tl.load(w + rows_b[:, None] * K + kk[None, :], mask=ok_n[:, None], other=0.0)
                else:
                    wb = tl.load(w + rows_b[:, None] * K + kk[None, :], mask=ok_n[:, None] & in_k[None, :],
                                 other=0.0)  # fmt: skip
                if SWAP:
                    acc_b += tl.dot(wb, tl.trans(xs), input_precision="ieee")
                else:
                    acc_b += tl.dot(xs, tl.trans(wb), input_precision="ieee")
        if SWAP:  # both, PAIR or not: acc_b's shape must be [BM, BN] wherever the split combine below redefines it
            acc_a = tl.trans(acc_a)
            acc_b = tl.trans(acc_b)
        ok = ok_t[:, None] & ok_n[None, :]
        last = True
        if SPLITS > 1:
            tile = part + (pid_n * SPLITS * 2) * (BM * BN) + t[:, None] * BN + tl.arange(0, BN)[None, :]
            tl.store(tile + (pid_s * 2) * (BM * BN), acc_a)
            if PAIR:
                tl.store(tile + (pid_s * 2 + 1) * (BM * BN), acc_b)
            tl.debug_barrier()  # every warp's partial stores land before the counter says so
            last = tl.atomic_add(count + pid_n, 1) == SPLITS - 1
        if last:
            if SPLITS > 1:
                acc_a = tl.zeros((BM, BN), tl.float32)
                acc_b = tl.zeros((BM, BN), tl.float32)
                for s in range(0, SPLITS):
                    acc_a += tl.load(tile + (s * 2) * (BM * BN), cache_modifier=".cg")
                    if PAIR:
                        acc_b += tl.load(tile + (s * 2 + 1) * (BM * BN), cache_modifier=".cg")
                tl.store(count + pid_n, 0)
            if HAS_BIAS:
                acc_a += tl.load(b + rows_a, mask=ok_n, other=0.0).to(tl.float32)[None, :]
                if PAIR:
                    acc_b += tl.load(b + rows_b, mask=ok_n, other=0.0).to(tl.float32)[None, :]
            acc_a = acc_a.to(y.dtype.element_ty).to(tl.float32)  # the module's product, in the model dtype
            if MODE == "plain":
                tl.store(y + t[:, None] * N + j[None, :], acc_a.to(y.dtype.element_ty), mask=ok)
            if MODE == "residual":  # as `x + proj(...)`
                out = y + t[:, None] * N + j[None, :]
                tl.store(out, (acc_a + tl.load(out, mask=ok, other=0.0).to(tl.float32)).to(y.dtype.element_ty),
                         mask=ok)  # fmt: skip
            if MODE == "gate_up":
                up = acc_b.to(y.dtype.element_ty).to(tl.float32)
                silu = (acc_a / (1.0 + tl.exp(-acc_a))).to(y.dtype.element_ty).to(tl.float32)
                tl.store(y + t[:, None] * N + j[None, :], (silu * up).to(y.dtype.element_ty), mask=ok)
            if MODE == "qkv":
                lo, hi = acc_a, acc_b.to(y.dtype.element_ty).to(tl.float32)
                if head < n_heads + n_kv:  # q and k heads rotate: x * cos + rotate_half(x) * sin
                    at = t[:, None] * D + j[None, :]
                    c_lo = tl.load(cos + at, mask=ok, other=0.0).to(tl.float32)
                    c_hi = tl.load(cos + at + HALF, mask=ok, other=0.0).to(tl.float32)
                    s_lo = tl.load(sin + at, mask=ok, other=0.0).to(tl.float32)
                    s_hi = tl.load(sin + at + HALF, mask=ok, other=0.0).to(tl.float32)
                    lo, hi = lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi
                if head < n_heads:
                    dst = y + t[:, None] * (n_heads * D) + head * D + j[None, :]
                else:
                    slot = tl.load(slots + t, mask=ok_t, other=0).to(tl.int64)
                    if head < n_heads + n_kv:
                        dst = kc + ((head - n_heads) * S + slot[:, None]) * D + j[None, :]
                    else:
                        dst = vc + ((head - n_heads - n_kv) * S + slot[:, None]) * D + j[None, :]
                tl.store(dst, lo.to(y.dtype.element_ty), mask=ok)
                tl.store(dst + HALF, hi.to(y.dtype.element_ty), mask=ok)


def fused_verify_supported(model: LlamaModel, device) -> str | None:
    """None if FusedVerify can run `model` on `device`, else why not."""
    why = fused_decode_supported(model, device)
    if why:
        return why.replace("fused decode", "fused verify")
    if model.args.head_dim < 32:  # tensor-core tiles: half a head is at least 16 columns
        return f"fused verify needs head_dim >= 32, not {model.args.head_dim}"
    return None


def _splits(n_tiles: int, K: int, bk: int) -> int:
    """K-slices for a product with few column tiles: ~SPLIT_PROGRAMS programs, each at least 4 BLOCK_K steps."""
    return max(1, min(triton.cdiv(SPLIT_PROGRAMS, n_tiles), K // (4 * bk)))


class VerifySettings(NamedTuple):
    """What a verify of some row count runs (FusedVerify.settings): the products left to cuBLAS, those of them run
    through cuBLASLt, each product's _rows_gemm_kernel blocks, each cuBLAS product's K splits, flash attention's
    launch, and the launches of the cuBLAS products that stream_mm runs instead (fast/stream_mm.py)."""

    cublas: tuple[str, ...]
    cublaslt: tuple[str, ...]
    blocks: dict[str, tuple[int, ...]]
    k_splits: dict[str, int]
    flash_launch: tuple[int, ...]
    stream: dict[str, tuple[int, ...]]


class FusedVerify:
    """T-token steps (2 <= T <= MAX_ROWS) of `model` on `cache` (a fast.SlotCache) through the kernels above.

    Call with tokens, positions, slots [T] and mask [T, S] bool → logits [T, V] (the lm_head's dtype), aux
    [T, n_taps*H] | None; the same contract as FastTarget.run. attention: "flash" (fast.fused_decode's running-softmax
    kernel, one launch), "fused" (its split-slot grouped kernel), "matmul" (two products and a float32 softmax,
    compiled on a GPU), "auto" (AUTO_ATTENTION). `cublas` names the layer products left to cuBLAS (the rest run on
    _rows_gemm_kernel), `cublaslt` those of them run through cuBLASLt on a GPU (default: CUBLASLT_PRODUCTS);
    `defer_residual`: o's and down's residual adds (on cuBLAS) done by the next norm kernel (default DEFER_RESIDUAL),
    else by cuBLAS's beta = 1. `stream`: {product: launch} of the products fast.stream_mm runs where it fits, instead
    of cuBLAS (the layer products left to it) or _rows_gemm_kernel (lm_head); default: fast.stream_mm.default_stream's.
    `by_rows`: (max_rows, settings) for verifies of up to max_rows rows, each setting (cublas, cublaslt, blocks,
    k_splits, flash_launch, stream) in place of the one given here (fast/tuning.py's files)."""

    def __init__(self, model: LlamaModel, cache, taps: tuple[int, ...] = (), blocks: dict | None = None,
                 attention: str = "auto", cublas: tuple[str, ...] = CUBLAS_PRODUCTS,
                 cublaslt: tuple[str, ...] | None = None, defer_residual: bool = DEFER_RESIDUAL,
                 by_rows: Sequence[tuple[int, dict]] = (),
                 stream: dict[str, tuple[int, ...]] | None = None) -> None:  # fmt: skip
        why = fused_verify_supported(model, model.lm_head.weight.device)
        if why:
            raise ValueError(why)
        if cublaslt is None:  # the measured default, for those products cuBLAS runs
            cublaslt = tuple(p for p in CUBLASLT_PRODUCTS if p in cublas)
        w = model.lm_head.weight
        # the default launches were measured at 24 rows: verifies of more rows (64-token chunks, prefills) keep the
        # libraries' products, which cuBLAS's tiles for more rows suit
        self.stream_max_rows = STREAM_MAX_ROWS if stream is None else MAX_ROWS
        if stream is None:
            stream = default_stream("verify", w)
        self.stream = {name: tuple(launch) for name, launch in stream.items()}
        self._check(VerifySettings(tuple(cublas), tuple(cublaslt), {}, {}, (), self.stream), "FusedVerify")
        if attention not in ("auto", "flash", "fused", "matmul"):
            raise ValueError(f"attention is 'auto', 'flash', 'fused' or 'matmul', not {attention!r}")
        a = model.args
        self.model, self.cache, self.taps, self.args = model, cache, tuple(taps), a
        self.blocks = self._fit({**ROW_BLOCKS, **(blocks or {})})
        dev, dt = w.device, model.model.embed_tokens.weight.dtype
        R, H, nq = MAX_ROWS, a.hidden_size, a.num_heads * a.head_dim
        self.h = torch.zeros(R, H, device=dev, dtype=dt)
        self.normed = torch.zeros(R, H, device=dev, dtype=dt)
        self.q = torch.zeros(R, nq, device=dev, dtype=dt)
        self.attn = torch.zeros(R, nq, device=dev, dtype=dt)
        self.act = torch.zeros(R, a.intermediate_size, device=dev, dtype=dt)
        self.cublas, self.cublaslt = tuple(cublas), tuple(cublaslt)
        n_qkv = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        self.qkv_out = torch.zeros(R, n_qkv, device=dev, dtype=dt)  # cuBLAS's products before their epilogue kernels
        self.gate_up_out = torch.zeros(R, 2 * a.intermediate_size, device=dev, dtype=dt)
        self.defer_residual = defer_residual
        self.residual_out = torch.zeros(R, H, device=dev, dtype=dt)  # o's or down's product, added by the next norm
        self.scratch = attention_scratch(R, a.num_heads, a.head_dim, cache.size, dev)
        self.rope = RopeRows(model, cache.size, R)
        # the tap features [R, n_taps*H], in layer order, written by the norms entering the tapped layers: the aux a
        # call returns is a view of it, rewritten by the next call (as a captured graph's outputs are)
        self.tapped = sorted({i for i in self.taps if i < a.num_layers})
        self.aux = torch.zeros(R, len(self.tapped) * H, device=dev, dtype=dt) if self.tapped else None
        self.part = torch.zeros(1, device=dev, dtype=torch.float32)  # split-K partials
        self.count = torch.zeros(1, device=dev, dtype=torch.int32)  # a finish counter per column tile
        self.logits_dtype = logits_dtype(model)
        self.attention = attention
        self.flash_launch = FLASH_LAUNCH  # flash attention's (rows, slots, warps, stages[, splits]) per program
        self._flash_part: tuple[torch.Tensor, ...] | None = None
        # q/k/v, o and down on cuBLAS as this many products over K's slices (split_k_mm; o and down when their
        # residual adds are deferred and they have no bias)
        self.k_splits = dict(K_SPLITS)
        # (max_rows, settings) overriding the ones above for verifies of up to max_rows rows (fast/tuning.py)
        self.by_rows = sorted(((int(r), dict(o)) for r, o in by_rows), key=lambda e: e[0])
        for rows, _ in self.by_rows:
            self._check(self.settings(rows), f"the settings for up to {rows} rows")
        self._reserve()
        self._attend = None
        self._limit: torch.Tensor | None = None

    @staticmethod
    def supports_rows(T: int) -> bool:
        return 2 <= T <= MAX_ROWS

    def settings(self, T: int | None = None) -> VerifySettings:
        """What a T-row verify runs: the attributes above, with each key of the first by_rows entry whose max_rows
        is at least T in place of theirs (cuBLASLt then keeps only products the entry leaves to cuBLAS), and no
        stream_mm past stream_max_rows rows unless the entry names its launches; T None: the attributes alone."""
        over = next((o for rows, o in self.by_rows if T is not None and T <= rows), {})
        cublas = tuple(over.get("cublas", self.cublas))
        cublaslt = tuple(over["cublaslt"]) if "cublaslt" in over else tuple(p for p in self.cublaslt if p in cublas)
        return VerifySettings(cublas, cublaslt, self._fit({**self.blocks, **over.get("blocks", {})}),
                              {**self.k_splits, **over.get("k_splits", {})},
                              tuple(over.get("flash_launch", self.flash_launch)), self._stream(T, over))  # fmt: skip

    def _stream(self, T: int | None, over: dict) -> dict[str, tuple[int, ...]]:
        """stream_mm's launches for a T-row verify: the by_rows entry's where it names them, else the attribute's
        up to stream_max_rows rows."""
        if "stream" in over:
            return dict(over["stream"])
        return self.stream if T is None or T <= self.stream_max_rows else {}

    def _fit(self, blocks: dict) -> dict[str, tuple[int, ...]]:
        """q/k/v's BLOCK_N counts row pairs within half a head: at most half of head_dim."""
        blocks = {name: tuple(b) for name, b in blocks.items()}
        half, bn = self.args.head_dim // 2, blocks["qkv"][0]
        if half % bn:
            blocks["qkv"] = (min(bn, half),) + blocks["qkv"][1:]
        return blocks

    @staticmethod
    def _check(s: VerifySettings, where: str) -> None:
        if set(s.cublas) - set(CUBLAS_PRODUCTS):
            raise ValueError(f"{where}: cuBLAS serves the products {CUBLAS_PRODUCTS}, not {s.cublas}")
        if set(s.cublaslt) - set(s.cublas):
            raise ValueError(f"{where}: cuBLASLt runs products left to cuBLAS ({s.cublas}), not {s.cublaslt}")
        check_stream(s.stream, STREAM_PRODUCTS, where)

    def _geometry(self, name: str, N: int, K: int, blocks: tuple[int, ...]) -> tuple[int, int, int]:
        """(column tiles, K-slices, K per slice) of a product with N output columns (pairs for gate_up and qkv)."""
        bn, bk = blocks[:2]
        D = self.args.head_dim
        tiles = N // D * (D // 2 // bn) if name == "qkv" else triton.cdiv(N, bn)
        k_slice = triton.cdiv(triton.cdiv(K, bk), _splits(tiles, K, bk)) * bk
        return tiles, triton.cdiv(K, k_slice), k_slice

    def _reserve(self) -> None:
        """Split-K scratch for the blocks of every row count's settings at MAX_ROWS rows: allocated outside any graph
        capture."""
        a = self.args
        D, H, F = a.head_dim, a.hidden_size, a.intermediate_size
        shapes = {"qkv": ((a.num_heads + 2 * a.num_kv_heads) * D, H), "o": (H, a.num_heads * D), "gate_up": (F, H),
                  "down": (H, F), "lm_head": (a.vocab_size, H)}  # fmt: skip
        need, tiles_max = 1, 1
        for blocks in [self.blocks] + [self.settings(rows).blocks for rows, _ in self.by_rows]:
            for name, (N, K) in shapes.items():
                tiles, splits, _ = self._geometry(name, N, K, blocks[name])
                if splits > 1:
                    need = max(need, tiles * splits * 2 * MAX_ROWS * blocks[name][0])
                tiles_max = max(tiles_max, tiles)
        dev = self.h.device
        # flash attention's split partials for every launch that splits, so that no row count's first call remakes
        # them under another row count's captured graph
        launches = [x for x in [self.flash_launch] + [self.settings(r).flash_launch for r, _ in self.by_rows]
                    if len(x) > 4 and x[4] > 1]  # fmt: skip
        if launches:
            self._flash_scratch(launches[0], *launches[1:])
        if need > self.part.numel():
            self.part = torch.zeros(need, device=dev, dtype=torch.float32)
        if tiles_max > self.count.numel():
            self.count = torch.zeros(tiles_max, device=dev, dtype=torch.int32)

    def set_blocks(self, name: str, blocks: tuple[int, ...]) -> None:
        self.blocks[name] = tuple(blocks)
        self._reserve()

    def _product(self, name: str, s: VerifySettings, x, weight, bias, y, T: int, N: int, **rope) -> None:
        """y (per the product's EPILOGUE) from x[:T] @ weight.T; N output columns (pairs for gate_up and qkv)."""
        bn, bk, warps, stages, *swap = s.blocks[name]
        K, D = weight.shape[1], self.args.head_dim
        tiles, splits, k_slice = self._geometry(name, N, K, s.blocks[name])
        mode = EPILOGUE[name]
        BM = max(16, triton.next_power_of_2(T))
        need = tiles * splits * 2 * BM * bn if splits > 1 else 0
        if need > self.part.numel() or tiles > self.count.numel():  # a shape _reserve did not size (tests)
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("fused verify: split-K scratch too small inside a graph capture (set_blocks)")
            self.part = torch.zeros(max(need, self.part.numel()), device=x.device, dtype=torch.float32)
            self.count = torch.zeros(max(tiles, self.count.numel()), device=x.device, dtype=torch.int32)
        a, c = self.args, self.cache
        _rows_gemm_kernel[(tiles, splits)](
            x, weight, bias if bias is not None else weight, y, rope.get("cos", x), rope.get("sin", x),
            rope.get("kc", x), rope.get("vc", x), rope.get("slots", x), self.part, self.count, T, N, a.num_heads,
            a.num_kv_heads, c.size, K=K, K_SLICE=k_slice, SPLITS=splits, MODE=mode, PAIR=mode in ("qkv", "gate_up"),
            HAS_BIAS=bias is not None, EVEN_K=K % bk == 0, D=D, BM=BM, BN=bn, BK=bk, SWAP=bool(swap and swap[0]),
            num_warps=warps, num_stages=stages, **pdl_options(x),
        )  # fmt: skip

    @staticmethod
    def _library(name: str, s: VerifySettings, x: torch.Tensor) -> contextlib.AbstractContextManager:
        return blas_library("cublaslt" if name in s.cublaslt and x.is_cuda else None)

    def _norm(self, norm, x, T: int, add: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x's T rows into self.normed; with `add` ([T, K], or split_k_mm's partials [parts, T, K]),
        x += add first (in place); with `keep` [T, K] (rows of unit stride), x's rows after the add are copied there."""
        K = x.shape[1]
        parts = add.shape[0] if add is not None and add.dim() == 3 else 1  # split_k_mm's partials
        _rows_rmsnorm_kernel[(T,)](x, add if add is not None else x, norm.weight, self.normed, norm.eps,
                                   add.stride(0) if parts > 1 else 0, keep if keep is not None else x,
                                   keep.stride(0) if keep is not None else 0, K=K, KP2=triton.next_power_of_2(K),
                                   ADD=add is not None, PARTS=parts, KEEP=keep is not None,
                                   **pdl_options(x))  # fmt: skip
        return self.normed

    def _residual(self, name: str, s: VerifySettings, x, layer_proj, h, T: int) -> torch.Tensor | None:
        """h += x @ W.T (+ b) for the o or down product; → the product when its add is deferred to the next norm
        (defer_residual), else None (added now: addmm's beta = 1 on cuBLAS, the kernel's epilogue otherwise)."""
        if name not in s.cublas:
            self._product(name, s, x, layer_proj.weight, layer_proj.bias, h, T, h.shape[1])
            return None
        stream = stream_launch(s.stream, name, x[:T], layer_proj.weight, layer_proj.bias)
        if self.defer_residual and stream is not None:
            return stream_mm(x[:T], layer_proj.weight, stream, self.residual_out[:T])
        with self._library(name, s, h):
            if self.defer_residual:
                if s.k_splits[name] > 1 and layer_proj.bias is None:  # partials, summed by the next norm kernel
                    return split_k_mm(x[:T], layer_proj.weight, s.k_splits[name])
                return _mm(x[:T], layer_proj.weight, layer_proj.bias, self.residual_out[:T])
            _mm_residual(x[:T], layer_proj.weight, layer_proj.bias, h)
        return None

    def _flash_scratch(self, launch: tuple[int, ...], *more: tuple[int, ...]) -> tuple[torch.Tensor, ...] | None:
        """Flash attention's split partials for MAX_ROWS rows at `launch` and `more` (None: one split needs none),
        made again when a launch outgrows them (_reserve sizes them for every row count's launch; a launch set after
        it is remade by a graph's warm-up runs, before its capture)."""
        a = self.args
        if len(launch) < 5 or launch[4] == 1:
            return None
        fits = self._flash_part is not None and all(
            flash_scratch_fits(self._flash_part, MAX_ROWS, a.num_heads, x) for x in (launch, *more)
        )
        if not fits:
            self._flash_part = flash_scratch(MAX_ROWS, a.num_heads, a.head_dim, launch, self.h.device, *more)
        return self._flash_part

    def _attention(self, i: int, s: VerifySettings, mask, T: int) -> None:
        a, D = self.args, self.args.head_dim
        q, out = self.q[:T].view(T, a.num_heads, D), self.attn[:T].view(T, a.num_heads, D)
        kind = AUTO_ATTENTION if self.attention == "auto" else self.attention
        if kind in ("flash", "fused"):
            scratch = self.scratch if kind == "fused" else self._flash_scratch(s.flash_launch)
            fused_attention(q, self.cache.k[i, 0], self.cache.v[i, 0], mask, out, scratch, flash=kind == "flash",
                            limit=self._limit, launch=s.flash_launch)  # fmt: skip
            return
        k, v = self.cache.k[i, 0], self.cache.v[i, 0]
        if self._attend is None:  # compiled, the mask and softmax become one kernel between the two products
            cpu = q.device.type == "cpu"
            self._attend = _attend_products if cpu else torch.compile(_attend_products, dynamic=False)
        try:
            out.copy_(self._attend(q, k, v, mask))
        except Exception as e:  # inductor failing here must not take the decoder down: the plain ops do the same
            if self._attend is _attend_products:
                raise
            log.warning("the fused verify's compiled attention failed (%s: %s); uncompiled", type(e).__name__, e)
            self._attend = _attend_products
            out.copy_(_attend_products(q, k, v, mask))

    @torch.inference_mode()
    def __call__(
        self, tokens, positions, mask, slots, limit: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`limit` [1] int32: one past the highest slot any row of `mask` allows, where the caller knows it (a
        tree's verify: its own last row's slot + 1); else computed from the mask (attention_limit)."""
        m, a = self.model, self.args
        T, D = tokens.shape[0], a.head_dim
        if not self.supports_rows(T):
            raise ValueError(f"FusedVerify runs 2..{MAX_ROWS} tokens, not {T}")
        h = self.h[:T]
        torch.index_select(m.model.embed_tokens.weight, 0, tokens, out=h)
        cos, sin = self.rope(positions)
        if (AUTO_ATTENTION if self.attention == "auto" else self.attention) == "flash":
            # every layer's flash attention visits the slots below it
            self._limit = attention_limit(mask) if limit is None else limit
        F, nq = a.intermediate_size, a.num_heads * D
        s = self.settings(T)
        pending = None  # a residual product the next norm adds into h (defer_residual)
        for i, layer in enumerate(m.model.layers):
            # a tapped layer's state: the norm completes h with the previous layer's down, and keeps a copy
            keep = self._tap_view(i, T)
            qkv, x = layer.self_attn.qkv_proj, self._norm(layer.input_layernorm, h, T, add=pending, keep=keep)
            kc, vc = self.cache.k[i], self.cache.v[i]
            if "qkv" in s.cublas:
                heads, split = a.num_heads + 2 * a.num_kv_heads, s.k_splits["qkv"]
                stream = stream_launch(s.stream, "qkv", x[:T], qkv.weight, qkv.bias)
                if stream is not None:
                    split = stream[2]
                with_bias = split > 1 and qkv.bias is not None  # else the product added it
                if stream is not None:  # one split's product, or float32 partials as split_k_mm's
                    out = stream_mm(x[:T], qkv.weight, stream, self.qkv_out[:T])
                elif split > 1:  # float32 partials over K's slices, summed (with the bias) by the RoPE kernel
                    out = split_k_mm(x[:T], qkv.weight, split)
                else:
                    out = _mm(x[:T], qkv.weight, qkv.bias, self.qkv_out[:T])
                _rows_rope_cache_kernel[(T, heads)](out, cos, sin, self.q, kc, vc, slots, a.num_heads,
                                                    a.num_kv_heads, self.cache.size, qkv.bias if with_bias else out,
                                                    out.stride(0) if split > 1 else 0, D=D, PARTS=split,
                                                    HAS_BIAS=with_bias, **pdl_options(out))  # fmt: skip
            else:
                self._product("qkv", s, x, qkv.weight, qkv.bias, self.q, T, nq + 2 * a.num_kv_heads * D, cos=cos,
                              sin=sin, kc=kc, vc=vc, slots=slots)  # fmt: skip
            self._attention(i, s, mask, T)
            pending = self._residual("o", s, self.attn, layer.self_attn.o_proj, h, T)
            gu, x = layer.mlp.gate_up_proj, self._norm(layer.post_attention_layernorm, h, T, add=pending)
            if "gate_up" in s.cublas:
                stream = stream_launch(s.stream, "gate_up", x[:T], gu.weight, gu.bias)
                if stream is not None:
                    out = stream_mm(x[:T], gu.weight, stream, self.gate_up_out[:T])
                else:
                    with self._library("gate_up", s, x):
                        out = _mm(x[:T], gu.weight, gu.bias, self.gate_up_out[:T])
                _rows_silu_mul_kernel[(T, triton.cdiv(F, 1024))](out, self.act, F, BLOCK=1024, **pdl_options(out))
            else:
                self._product("gate_up", s, x, gu.weight, gu.bias, self.act, T, F)
            pending = self._residual("down", s, self.act, layer.mlp.down_proj, h, T)
        logits = torch.empty(T, a.vocab_size, device=h.device, dtype=self.logits_dtype)
        x = self._norm(m.model.norm, h, T, add=pending)
        # one K slice, accumulated in float32 and rounded once to the logits' dtype, as _rows_gemm_kernel's plain
        # epilogue does (float32 logits for a Float32Logits head)
        stream = stream_launch(s.stream, "lm_head", x[:T], m.lm_head.weight, None)
        if stream is not None:
            stream_mm(x[:T], m.lm_head.weight, stream, logits)
        else:
            self._product("lm_head", s, x, m.lm_head.weight, None, logits, T, a.vocab_size)
        return logits, (self.aux[:T] if self.aux is not None else None)

    def _tap_view(self, layer: int, T: int) -> torch.Tensor | None:
        """Where the state entering `layer` goes in the verify's aux (its T rows), if the layer is tapped."""
        if layer not in self.tapped:
            return None
        H, j = self.args.hidden_size, self.tapped.index(layer)
        return self.aux[:T, j * H : (j + 1) * H]


@contextlib.contextmanager
def blas_library(name: str | None) -> Iterator[None]:
    """torch's choice of "cublas" or "cublaslt" for the products inside (None: as it is). The choice is process-wide,
    so it is put back after; a CUDA graph captured inside keeps the kernels chosen then."""
    if name is None:
        yield
        return
    was = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(was)


def split_k_mm(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x [T, K] @ weight.T as `splits` products over K's slices → their float32 partials [splits, T, N], for a kernel
    to sum. Why: at 64 rows the q/k/v product is 96 output tiles of 64 for 132 SMs and streams its weights at 75% of
    copy with cuBLAS and cuBLASLt alike (fused-decode-check-20261204T185702.json); cut four ways over K it is 384
    tiles. One batched call on strided views of both operands (no copies); bf16 inputs accumulate into float32
    outputs on CUDA (bmm's out_dtype), so the partials are not rounded before their sum."""
    T, K = x.shape
    N = weight.shape[0]
    if K % splits:
        raise ValueError(f"split_k_mm cuts K = {K} into equal slices: {splits} does not divide it")
    xs = x.view(T, splits, K // splits).transpose(0, 1)  # [splits, T, K/splits]
    ws = weight.view(N, splits, K // splits).permute(1, 2, 0)  # [splits, K/splits, N]
    if x.is_cuda and x.dtype != torch.float32:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs, ws).float()


def check_stream(stream: dict[str, tuple[int, ...]], products: tuple[str, ...], where: str) -> None:
    """stream_mm's launches name products it may run, four numbers each, K splits only where the next kernel sums
    the partials (SUMMED)."""
    for name, launch in stream.items():
        if name not in products:
            raise ValueError(f"{where}: stream_mm runs the products {products}, not {name!r}")
        if len(launch) != 4 or min(launch) < 1:
            raise ValueError(f"{where}: {name}'s stream_mm launch is (BN, BK, splits, stages), not {launch}")
        if launch[2] > 1 and name not in SUMMED:
            raise ValueError(f"{where}: {name}'s product has no kernel after it to sum K splits ({launch})")


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)


def _mm_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor) -> None:
    """h += x @ weight.T (+ bias): the residual add as the product's beta = 1, no kernel of its own."""
    h.addmm_(x, weight.t())
    if bias is not None:
        h.add_(bias)


def _attend_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] over the slot cache k/v [Hkv, S, D] with mask [T, S], as two products and a float32 softmax."""
    y = attend(q.transpose(0, 1)[None], k[None], v[None], mask[None, None], impl="matmul")
    return y[0].transpose(0, 1)
