"""One-token decode of a native Llama-family target in five Triton kernels per layer.

Why: at 8B a batch-1 step reads 15 GB of weights. The products alone, back to back, run at ~87% of copy
bandwidth on an H200, but the ten-odd small kernels per layer around them (norms, RoPE, cache writes,
attention, SiLU, residual adds) cost ~1 ms per token even compiled (bench/fused_decode_check.py measures it). Here each
product carries its neighbours, so a layer is five launches:

- qkv:     RMSNorm as the prologue; bias, RoPE and the K/V cache write in the epilogue. A program owns
           matching rows of both halves of a head, so the rotation needs no second pass.
- attend:  one program per (query head, block of cache slots) over the slots its mask row allows; the last
           block of a head to finish combines the float32 partial softmax sums.
- o:       the residual add in the epilogue (the residual stream is updated in place).
- gate/up: RMSNorm prologue; SiLU(gate) * up in the epilogue (a program owns matching gate and up rows).
- down:    the residual add in the epilogue.

The final norm rides in the lm_head's prologue. Every product program owns BLOCK_N output rows and streams
their weights once in a fixed-order K loop with float32 accumulation; the roundings match the modules' (a
product's output is rounded to the model dtype before the next op uses it). Only one-token steps: a verify
(T > 1) stays on the model's modules. Not for q/k-normed (Qwen3) targets. On a machine without a GPU the
kernels run under Triton's interpreter, which is how the CPU tests exercise them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from eaglescope.fast.invariant import available, triton
from eaglescope.fast.layers import Float32Logits
from eaglescope.models.targets.llama import LlamaModel, attend

if triton is not None:
    import triton.language as tl

# (BLOCK_N output rows per program, BLOCK_K, num_warps[, num_stages]) per product; bench/fused_decode_check.py
# sweeps them: the fastest of the sweep at 8B on an H200 (bench/results/fused-decode-check-*.json)
DEFAULT_BLOCKS: dict[str, tuple[int, ...]] = {
    "qkv": (4, 512, 4),
    "o": (4, 2048, 8),
    # a whole 4096-wide row per load: 101% of copy against 97% at 512 (fused-decode-check-20261204T185702.json)
    "gate_up": (1, 4096, 4),
    "down": (4, 512, 8),
    "lm_head": (4, 4096, 8),
}
ATTN_BLOCK = 64
# flash attention's launch: (row, head) pairs per program (16: 128 programs for a 64-row verify at 8B), slots per
# block of its loop, warps, software-pipelining stages of that loop[, splits of the walk: 1 when absent].
# 128-slot blocks on 8 warps, 2 stages: 6.8 µs a layer at 24 rows and 7.5 at 64 against 8.8 for 64-slot blocks on
# Triton's default 4 warps, 3 stages; the 64-row verify 4.767 → 4.704 ms (bench/fused_decode_check.py
# --sweep-flash, fused-decode-check-20261205T030428.json)
FLASH_LAUNCH = (16, 128, 8, 2)
# attention_limit's tile: a program folds LIMIT_ROWS rows at a time over LIMIT_COLS slots (two programs for the
# benchmarks' 480-slot cache; a 32k-slot cache gets 128, so a long cache is not read by one SM); 4096 values a tile
# keep it in registers at the default four warps
LIMIT_ROWS, LIMIT_COLS = 16, 256


# Programmatic dependent launch (sm_90 on), off: with it every kernel of this package is launched so that it may
# start while the kernel before it in the stream drains, and its first instruction (await_previous) waits until that
# kernel has finished and its writes are visible (only the launch's latency overlaps, never a read or write), then
# lets the next such kernel launch at once. The idea: a 24-row verify at 8B is ~300 kernels, and between two kernels
# of a graph the SMs idle for about a microsecond. Measured on an H100 at 8B, on against off in one run: the
# one-token step 5.450 → 5.520 ms, the 24-row verify 6.202 → 6.258, the replayed round 8.409 → 8.394
# (run-roofline-20261205T191028-pdl-on.log against ...-pdl-off.log in bench/results): slower where it is not noise,
# so plain launches stay the default.
PDL = False


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9 and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")


def pdl_options(x: torch.Tensor) -> dict[str, bool]:
    """A kernel's launch keywords for PDL where it runs: on a Hopper-or-later GPU with a Triton that has
    griddepcontrol (3.5 on), else plain (the interpreter has no griddepcontrol)."""
    if PDL and x.is_cuda and _has_pdl(x.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def launch_options(blocks: tuple[int, ...]) -> dict[str, int]:
    """num_warps (and num_stages when the block tuple names it) for a product kernel's launch."""
    return {"num_warps": blocks[2], **({"num_stages": blocks[3]} if len(blocks) > 3 else {})}


def logits_dtype(model: LlamaModel) -> torch.dtype:
    """What the model's lm_head returns: float32 for a Float32Logits head, else the weights' dtype."""
    return torch.float32 if isinstance(model.lm_head, Float32Logits) else model.lm_head.weight.dtype


def fused_decode_supported(model: nn.Module, device: torch.device | str) -> str | None:
    """None if FusedDecode can run `model` on `device`, else why not (one line)."""
    if not isinstance(model, LlamaModel):
        return "fused decode runs eaglescope's native LlamaModel only"
    if not available(device):
        return "fused decode needs Triton and a CUDA device (or TRITON_INTERPRET=1)"
    a = model.args
    if a.qk_norm:
        return "fused decode does not support q/k norms (Qwen3): the rotation would need the whole head"
    if a.head_dim & (a.head_dim - 1) or a.head_dim < 2:
        return f"fused decode needs a power-of-two head_dim, not {a.head_dim}"
    if a.rope.rope_type == "dynamic":
        return "fused decode does not support dynamic RoPE (its frequencies depend on the sequence length)"
    layer = model.model.layers[0]
    if layer.self_attn.qkv_proj is None or layer.mlp.gate_up_proj is None:
        return "fused decode needs fused q/k/v and gate/up projections (fuse_projections)"
    return None


if triton is not None:

    @triton.jit
    def await_previous(PDL: tl.constexpr):
        """With PDL: wait for the kernel before this one in the stream (its writes visible after), then let the next
        kernel launch. Every load and store of a kernel comes after it."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _rstd(x, K: tl.constexpr, eps, BK: tl.constexpr, KP2: tl.constexpr):
        """1/RMS of x[:K] in float32. Rows up to 16k wide are read in one load: every program computes this
        before its first weight load, so a loop of dependent L2 round trips here would idle the whole launch."""
        if KP2 <= 16384:  # KP2: K rounded up to a power of two
            kk = tl.arange(0, KP2)
            xf = tl.load(x + kk, mask=kk < K, other=0.0).to(tl.float32)
            ss = tl.sum(xf * xf, 0)
        else:
            acc = tl.zeros((BK,), tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                xf = tl.load(x + kk, mask=kk < K, other=0.0).to(tl.float32)
                acc += xf * xf
            ss = tl.sum(acc, 0)
        return 1.0 / tl.sqrt(ss / K + eps)

    @triton.jit
    def _scaled_tile(x, nw, wt, kk, in_k, rstd, NORM: tl.constexpr):
        """W tile * in[kk] in float32, in = RMSNorm(x) when NORM (with the module's two roundings: normalise in
        float32, cast, then scale by the weight)."""
        xs = tl.load(x + kk, mask=in_k, other=0.0)
        if NORM:
            normed = (xs.to(tl.float32) * rstd).to(xs.dtype).to(tl.float32)
            xs = (tl.load(nw + kk, mask=in_k, other=0.0).to(tl.float32) * normed).to(xs.dtype)
        return wt.to(tl.float32) * xs.to(tl.float32)[None, :]

    @triton.jit
    def _dot_rows(x, nw, w, rows, ok, eps, K: tl.constexpr, NORM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
                  KP2: tl.constexpr):  # fmt: skip
        """sum_k W[rows, k] * in[k] for R rows (int64 `rows`), in = RMSNorm(x) when NORM. The first weight tile is
        loaded before the norm's statistics: the RMS is a reduction across the program's warps, and a product that
        fits in one wave of programs (q/k/v, o at 8B) would otherwise start its weight stream a round trip late."""
        kk = tl.arange(0, BK)
        in_k = kk < K
        first = tl.load(w + rows[:, None] * K + kk[None, :], mask=ok[:, None] & in_k[None, :], other=0.0)
        rstd = 1.0
        if NORM:
            rstd = _rstd(x, K, eps, BK, KP2)
        acc = _scaled_tile(x, nw, first, kk, in_k, rstd, NORM)
        for k0 in range(BK, K, BK):
            kk = k0 + tl.arange(0, BK)
            in_k = kk < K
            wt = tl.load(w + rows[:, None] * K + kk[None, :], mask=ok[:, None] & in_k[None, :], other=0.0)
            acc += _scaled_tile(x, nw, wt, kk, in_k, rstd, NORM)
        return tl.sum(acc, 1)

    @triton.jit
    def _paired_rows(first, partner, BN: tl.constexpr):
        """Rows first+i and partner+i interleaved ([2*BN], int64), so the two results come apart with tl.split."""
        i = tl.arange(0, 2 * BN)
        return (tl.where(i % 2 == 0, first, partner) + i // 2).to(tl.int64)

    @triton.jit
    def _gemv_kernel(x, nw, w, b, y, N, eps, K: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                     RESIDUAL: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KP2: tl.constexpr,
                     PDL: tl.constexpr = False):  # fmt: skip
        """y[rows] = W[rows] @ in (+ bias) (+ y[rows] when RESIDUAL: the residual stream, updated in place)."""
        await_previous(PDL)
        rows = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
        ok = rows < N
        acc = _dot_rows(x, nw, w, rows, ok, eps, K, NORM, BN, BK, KP2)
        if HAS_BIAS:
            acc += tl.load(b + rows, mask=ok, other=0.0).to(tl.float32)
        if RESIDUAL:  # as `x + proj(...)`: the product is rounded to the model dtype, then added
            acc = acc.to(y.dtype.element_ty).to(tl.float32) + tl.load(y + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(y + rows, acc.to(y.dtype.element_ty), mask=ok)

    @triton.jit
    def _qkv_rope_kernel(x, nw, w, b, cos, sin, q, kc, vc, slot, n_heads, n_kv, S, eps, K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         KP2: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """Program (head, chunk): rows j and j + D/2 of one q, k or v head; RoPE (not for v), then q → q[head],
        k/v → their cache at `slot`."""
        await_previous(PDL)
        HALF: tl.constexpr = D // 2
        pid = tl.program_id(0)
        head = pid // (HALF // BN)
        j0 = (pid % (HALF // BN)) * BN
        j = j0 + tl.arange(0, BN)
        rows = _paired_rows(head * D + j0, head * D + HALF + j0, BN)
        ok = rows >= 0  # BN divides D/2: every row exists
        acc = _dot_rows(x, nw, w, rows, ok, eps, K, True, 2 * BN, BK, KP2)
        if HAS_BIAS:
            acc += tl.load(b + rows).to(tl.float32)
        lo, hi = tl.split(tl.reshape(acc.to(q.dtype.element_ty).to(tl.float32), (BN, 2)))
        if head < n_heads + n_kv:  # q and k heads rotate: x * cos + rotate_half(x) * sin
            c_lo, c_hi = tl.load(cos + j).to(tl.float32), tl.load(cos + HALF + j).to(tl.float32)
            s_lo, s_hi = tl.load(sin + j).to(tl.float32), tl.load(sin + HALF + j).to(tl.float32)
            lo, hi = lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi
        if head < n_heads:
            dst = q + head * D
        elif head < n_heads + n_kv:
            dst = kc + ((head - n_heads) * S + tl.load(slot)) * D
        else:
            dst = vc + ((head - n_heads - n_kv) * S + tl.load(slot)) * D
        tl.store(dst + j, lo.to(q.dtype.element_ty))
        tl.store(dst + HALF + j, hi.to(q.dtype.element_ty))

    @triton.jit
    def _attend_kernel(q, kc, vc, mask, y, part_m, part_l, part_acc, count, S, NS, H, rep, scale, sq_t, sq_h,
                       sm_t, sy_t, sy_h, D: tl.constexpr, KB: tl.constexpr, NS_P2: tl.constexpr,
                       PDL: tl.constexpr = False):  # fmt: skip
        """Program (h, split, t): query row t, head h, against the KB cache slots of its split that the row's
        mask allows (masked loads fetch nothing, so unused slots cost nothing); float32 partial softmax sums go to
        part_*. The last split of a (row, head) to finish combines them (a counter each, reset after use): one
        launch, and no program walks the whole cache in sequence (one program per head was latency-bound:
        14 µs per layer at 8B)."""
        await_previous(PDL)
        h, sp, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        d = tl.arange(0, D)
        offs = sp * KB + tl.arange(0, KB)
        valid = (tl.load(mask + t * sm_t + offs, mask=offs < S, other=0) != 0) & (offs < S)
        qv = tl.load(q + t * sq_t + h * sq_h + d).to(tl.float32)
        kv_off = ((h // rep) * S + offs[:, None]).to(tl.int64) * D + d[None, :]
        kb = tl.load(kc + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(kb * qv[None, :], axis=1) * scale, float("-inf"))
        m = tl.max(s, axis=0)
        p = tl.where(valid, tl.exp(s - m), 0.0)
        vb = tl.load(vc + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        row = t * H + h
        tl.store(part_m + row * NS + sp, m)
        tl.store(part_l + row * NS + sp, tl.sum(p, axis=0))
        tl.store(part_acc + (row * NS + sp) * D + d, tl.sum(p[:, None] * vb, axis=0))
        # acq_rel: the other splits' partials are visible to whichever program sees the last count
        tl.debug_barrier()  # every warp's partial stores land before the counter says so
        if tl.atomic_add(count + row, 1) == NS - 1:
            ss = tl.arange(0, NS_P2)
            ok = ss < NS
            ms = tl.load(part_m + row * NS + ss, mask=ok, other=float("-inf"), cache_modifier=".cg")
            wgt = tl.where(ok, tl.exp(ms - tl.max(ms, axis=0)), 0.0)
            ls = tl.load(part_l + row * NS + ss, mask=ok, other=0.0, cache_modifier=".cg")
            accs = tl.load(part_acc + (row * NS + ss)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            out = tl.sum(wgt[:, None] * accs, axis=0) / tl.sum(wgt * ls, axis=0)
            tl.store(y + t * sy_t + h * sy_h + d, out.to(y.dtype.element_ty))
            tl.store(count + row, 0)  # ready for the next call

    @triton.jit
    def _attend_rows_kernel(q, kc, vc, mask, y, part_m, part_l, part_acc, count, S, NS, T, H, rep, scale, sq_t,
                            sq_h, sm_t, sy_t, sy_h, D: tl.constexpr, KB: tl.constexpr, BR: tl.constexpr,
                            NS_P2: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """Program (kv group g, split, row block): BR rows (t, r) of the T x rep query heads sharing kv head g,
        against one KB-slot block, on tensor cores: each K/V block is loaded once for all of them (one program per
        row re-read K/V per row: 11.3 ms for a 64-token verify at 8B). Partials as _attend_kernel; the last split
        to finish combines them: every split's maximum and sum in one load each, the outputs CH splits a load.
        Why not one split after another: each of those loads waits on L2 before the next is issued, ~0.7 µs a
        split, so the combine, not the slots, set the time (8.8 µs a call for a 4-row draft level at ~7 splits,
        bench-roofline-20261205T050738.json; 64 splits at a 4k-slot cache)."""
        await_previous(PDL)
        g, sp, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i = rb * BR + tl.arange(0, BR)
        ok_i = i < T * rep
        t, h = i // rep, g * rep + i % rep
        d = tl.arange(0, D)
        offs = sp * KB + tl.arange(0, KB)
        in_s = offs < S
        qt = tl.load(q + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :], mask=ok_i[:, None], other=0.0)
        both = ok_i[:, None] & in_s[None, :]
        allow = (tl.load(mask + t[:, None] * sm_t + offs[None, :], mask=both, other=0) != 0) & both
        needed = tl.max(allow.to(tl.int32), axis=0) > 0  # slots some row sees: the only ones fetched
        kv_off = (g * S + offs[:, None]).to(tl.int64) * D + d[None, :]
        kb = tl.load(kc + kv_off, mask=needed[:, None], other=0.0)
        s = tl.where(allow, tl.dot(qt, tl.trans(kb), input_precision="ieee") * scale, float("-inf"))
        m = tl.max(s, axis=1)
        p = tl.where(allow, tl.exp(s - m[:, None]), 0.0)
        vb = tl.load(vc + kv_off, mask=needed[:, None], other=0.0)
        row = t * H + h
        tl.store(part_m + row * NS + sp, m, mask=ok_i)
        tl.store(part_l + row * NS + sp, tl.sum(p, axis=1), mask=ok_i)
        acc = tl.dot(p.to(vb.dtype), vb, input_precision="ieee")
        tl.store(part_acc + (row * NS + sp)[:, None] * D + d[None, :], acc, mask=ok_i[:, None])
        counter = count + g * tl.cdiv(T * rep, BR) + rb
        tl.debug_barrier()  # every warp's partial stores land before the counter says so
        if tl.atomic_add(counter, 1) == NS - 1:
            j = tl.arange(0, NS_P2)
            at = row[:, None] * NS + j[None, :]
            ok = ok_i[:, None] & (j[None, :] < NS)
            ms = tl.load(part_m + at, mask=ok, other=float("-inf"), cache_modifier=".cg")  # -inf: a split of no slot
            top = tl.max(ms, axis=1)
            top = tl.where(top == float("-inf"), 0.0, top)  # a padding row (every row of the mask allows a slot)
            wgt = tl.where(ok, tl.exp(ms - top[:, None]), 0.0)
            total = tl.sum(wgt * tl.load(part_l + at, mask=ok, other=0.0, cache_modifier=".cg"), axis=1)
            c = tl.arange(0, CH)
            out = tl.zeros((BR, D), tl.float32)
            for j0 in range(0, NS, CH):  # [BR, CH, D] partial outputs a load
                jc = j0 + c
                w_c = tl.sum(tl.where(j[None, None, :] == jc[None, :, None], wgt[:, None, :], 0.0), axis=2)
                ok_c = ok_i[:, None] & (jc[None, :] < NS)
                a_c = tl.load(part_acc + ((row[:, None] * NS + jc[None, :]) * D)[:, :, None] + d[None, None, :],
                              mask=ok_c[:, :, None], other=0.0, cache_modifier=".cg")  # fmt: skip
                out += tl.sum(w_c[:, :, None] * a_c, axis=1)
            out = out / tl.where(ok_i, total, 1.0)[:, None]
            tl.store(y + t[:, None] * sy_t + h[:, None] * sy_h + d[None, :], out.to(y.dtype.element_ty),
                     mask=ok_i[:, None])  # fmt: skip
            tl.store(counter, 0)

    @triton.jit
    def _attention_limit_kernel(mask, limit, T, S, sm_t, BT: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr = False):
        """Program j: limit = max(limit, one past the highest slot among j*BS .. j*BS+BS-1 that any of the T rows of
        `mask` allows; 0 where none does). `limit` comes in zeroed."""
        await_previous(PDL)
        cols = tl.program_id(0) * BS + tl.arange(0, BS)
        in_s = cols < S
        seen = tl.zeros((BS,), tl.int32)
        for t0 in range(0, T, BT):
            t = t0 + tl.arange(0, BT)
            both = (t[:, None] < T) & in_s[None, :]
            allow = tl.load(mask + t[:, None].to(tl.int64) * sm_t + cols[None, :], mask=both, other=0) != 0
            seen = tl.maximum(seen, tl.max(tl.where(allow & both, cols[None, :] + 1, 0), axis=0))
        tl.atomic_max(limit, tl.max(seen, axis=0))

    @triton.jit
    def _attend_flash_kernel(q, kc, vc, mask, y, limit, part_m, part_l, part_acc, count, S, T, H, rep, scale, sq_t,
                             sq_h, sm_t, sy_t, sy_h, D: tl.constexpr, KB: tl.constexpr, BR: tl.constexpr,
                             SPLITS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """Program (kv group g, row block, split): BR rows (t, r) of the T x rep query heads sharing kv head g against
        the cache slots below `limit` (a device scalar: one past the highest slot any row allows), KB slots at a time
        with a running softmax (the maximum and the sum rescaled at each block). SPLITS = 1: one program walks every
        block, no partials (_attend_rows_kernel's combine of its 64-slot splits, one after another, made it slower
        than two products and a softmax at 64 rows, as measured at 8B). SPLITS > 1: split s walks blocks s, s + SPLITS,
        ... and writes its maximum, sum and float32 output; the last of a row block's splits to finish combines
        them in split order (a counter per row block, reset after): a few splits, where the walk, not the combine,
        is what a program waits on (with many splits the serial combine costs more than the shorter walks save)."""
        await_previous(PDL)
        g, rb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i = rb * BR + tl.arange(0, BR)
        ok_i = i < T * rep
        t, h = i // rep, g * rep + i % rep
        d = tl.arange(0, D)
        qt = tl.load(q + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :], mask=ok_i[:, None], other=0.0)
        top = tl.full((BR,), float("-inf"), tl.float32)
        total = tl.zeros((BR,), tl.float32)
        acc = tl.zeros((BR, D), tl.float32)
        end = tl.load(limit)
        for s0 in range(sp * KB, end, SPLITS * KB):
            offs = s0 + tl.arange(0, KB)
            in_s = offs < end
            both = ok_i[:, None] & in_s[None, :]
            allow = (tl.load(mask + t[:, None] * sm_t + offs[None, :], mask=both, other=0) != 0) & both
            kv_off = (g * S + offs[:, None]).to(tl.int64) * D + d[None, :]
            kb = tl.load(kc + kv_off, mask=in_s[:, None], other=0.0)
            vb = tl.load(vc + kv_off, mask=in_s[:, None], other=0.0)
            s = tl.where(allow, tl.dot(qt, tl.trans(kb), input_precision="ieee") * scale, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, axis=1))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row with nothing allowed yet
            p = tl.where(allow, tl.exp(s - shift[:, None]), 0.0)
            keep = tl.exp(top - shift)  # 0 while top is -inf
            total = total * keep + tl.sum(p, axis=1)
            acc = acc * keep[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision="ieee")
            top = new_top
        if SPLITS > 1:
            r = tl.arange(0, BR)
            block = g * tl.num_programs(1) + rb
            at = (block * SPLITS + sp) * BR + r
            tl.store(part_m + at, top)
            tl.store(part_l + at, total)
            tl.store(part_acc + at[:, None] * D + d[None, :], acc)
            tl.debug_barrier()  # every warp's partial stores land before the counter says so
            if tl.atomic_add(count + block, 1) == SPLITS - 1:
                first = block * SPLITS * BR + r
                top = tl.full((BR,), float("-inf"), tl.float32)
                for j in range(0, SPLITS):
                    top = tl.maximum(top, tl.load(part_m + first + j * BR, cache_modifier=".cg"))
                shift = tl.where(top == float("-inf"), 0.0, top)  # a row no split saw a slot for
                total = tl.zeros((BR,), tl.float32)
                acc = tl.zeros((BR, D), tl.float32)
                for j in range(0, SPLITS):
                    keep = tl.exp(tl.load(part_m + first + j * BR, cache_modifier=".cg") - shift)
                    total += keep * tl.load(part_l + first + j * BR, cache_modifier=".cg")
                    part = tl.load(part_acc + (first + j * BR)[:, None] * D + d[None, :], cache_modifier=".cg")
                    acc += keep[:, None] * part
                out = acc / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(y + t[:, None] * sy_t + h[:, None] * sy_h + d[None, :], out.to(y.dtype.element_ty),
                         mask=ok_i[:, None])  # fmt: skip
                tl.store(count + block, 0)  # ready for the next call
        else:
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(y + t[:, None] * sy_t + h[:, None] * sy_h + d[None, :], out.to(y.dtype.element_ty),
                     mask=ok_i[:, None])  # fmt: skip

    @triton.jit
    def _gate_up_kernel(x, nw, w, b, act, F, eps, K: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, KP2: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """Rows j of gate and F + j of up (the fused [2F, K] weight) → act[j] = SiLU(gate) * up."""
        await_previous(PDL)
        j0 = tl.program_id(0) * BN
        j = j0 + tl.arange(0, BN)
        rows = _paired_rows(j0, F + j0, BN)
        ok = (j0 + tl.arange(0, 2 * BN) // 2) < F
        acc = _dot_rows(x, nw, w, rows, ok, eps, K, True, 2 * BN, BK, KP2)
        if HAS_BIAS:
            acc += tl.load(b + rows, mask=ok, other=0.0).to(tl.float32)
        gate, up = tl.split(tl.reshape(acc.to(act.dtype.element_ty).to(tl.float32), (BN, 2)))
        silu = (gate / (1.0 + tl.exp(-gate))).to(act.dtype.element_ty).to(tl.float32)
        tl.store(act + j, (silu * up).to(act.dtype.element_ty), mask=j < F)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: nn.Module | None = None,
    out: torch.Tensor | None = None,
    residual: bool = False,
    blocks: tuple[int, ...] = DEFAULT_BLOCKS["o"],
) -> torch.Tensor:
    """One row: out = weight @ in (+ bias), in = norm(x) when a norm (an RMSNorm: weight, eps) is given; with
    `residual`, out += that in place (out is then the residual stream and must be given). Returns out [1, N]."""
    N, K = weight.shape
    if out is None:
        if residual:
            raise ValueError("residual=True adds into `out`: pass the residual stream")
        out = torch.empty(1, N, device=x.device, dtype=x.dtype)
    bn, bk = blocks[:2]
    nw, eps = (norm.weight, norm.eps) if norm is not None else (weight, 0.0)
    _gemv_kernel[(triton.cdiv(N, bn),)](x, nw, weight, bias if bias is not None else weight, out, N, eps, K=K,
                                        NORM=norm is not None, HAS_BIAS=bias is not None, RESIDUAL=residual,
                                        BN=bn, BK=bk, KP2=triton.next_power_of_2(K), **launch_options(blocks),
                                        **pdl_options(x))  # fmt: skip
    return out


def attention_splits(S: int) -> tuple[int, int]:
    """(slots per split, splits) for a cache of S slots: 64-slot blocks, at most 64 splits per head."""
    keys = max(ATTN_BLOCK, triton.next_power_of_2(triton.cdiv(S, 64)))
    return keys, triton.cdiv(S, keys)


def attend_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """target.llama.attend's signature on the split-slot kernel: a masked batch-1 step over the whole slot cache
    (q [1, H, T, D], k/v [1, Hkv, S, D], mask [1, 1, T, S]); anything else goes to the modules' own attention."""
    if mask is None or q.shape[0] != 1:
        return attend(q, k, v, mask)
    y = fused_attention(q[0].transpose(0, 1), k[0], v[0], mask.reshape(q.shape[2], k.shape[2]))
    return y.transpose(0, 1)[None]


def attention_limit(mask: torch.Tensor) -> torch.Tensor:
    """One past the highest slot any row of `mask` [T, S] allows, as a device scalar [1] int32 (flash attention
    visits the slots below it; computed once per step, every layer shares the mask).

    Why a kernel: torch's form (a column `any`, a `where`, an `amax`) is three launches, and the column reduction
    alone took 7.5 µs of a 64-row verify at 8B on an H200; here a memset and one launch, a program
    per LIMIT_COLS slots, each folding its columns over every row into one atomic maximum."""
    T, S = mask.shape
    if not available(mask.device):
        slots = torch.arange(1, S + 1, device=mask.device, dtype=torch.int32)
        return torch.where(mask.any(0), slots, 0).amax().reshape(1)
    limit = torch.zeros(1, device=mask.device, dtype=torch.int32)
    mask = mask.contiguous()
    _attention_limit_kernel[(triton.cdiv(S, LIMIT_COLS),)](mask, limit, T, S, mask.stride(0), BT=LIMIT_ROWS,
                                                           BS=LIMIT_COLS, **pdl_options(mask))  # fmt: skip
    return limit


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None = None,
    scratch: tuple[torch.Tensor, ...] | None = None, flash: bool = False, limit: torch.Tensor | None = None,
    launch: tuple[int, ...] = FLASH_LAUNCH,
) -> torch.Tensor:  # fmt: skip
    """q [T, H, D] (any strides with unit last), k/v [Hkv, S, D] (one layer of a slot cache), mask [T, S] bool
    (True = attend; every row must allow at least one slot) → out [T, H, D]. `scratch` = (part_m, part_l,
    part_acc, count) from attention_scratch, reusable across calls (the counters come back zeroed). `flash`: one
    program per (kv group, block of rows) walking the slots below `limit` (attention_limit(mask) when None) with a
    running softmax; it needs 16-wide heads (tensor cores); `launch` as FLASH_LAUNCH, and with more than one split
    `scratch` from flash_scratch (allocated here when None or too small, which a graph capture does not allow)."""
    T, H, D = q.shape
    Hkv, S, _ = k.shape
    keys, NS = attention_splits(S)
    if out is None:
        out = torch.empty(T, H, D, device=q.device, dtype=q.dtype)
    # a bool mask goes in as it is: Triton loads torch.bool as bytes (a uint8 view is not traceable by inductor)
    # one layer of the cache is contiguous already; q is a few KB: canonical strides keep the compiled call simple
    q, k, v, mask = q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous()
    if out.stride(-1) != 1:
        raise ValueError("fused_attention writes rows of unit stride: pass a contiguous `out`")
    rep = H // Hkv
    if flash:
        if D < 16:
            raise ValueError(f"flash attention runs heads of 16 or more on tensor cores, not {D}")
        limit = attention_limit(mask) if limit is None else limit
        BR, KB, warps, stages, *more = launch
        splits = more[0] if more else 1
        part = (out,) * 4  # unused with one split
        if splits > 1:
            part = scratch if scratch is not None and flash_scratch_fits(scratch, T, H, launch) else None
            if part is None:
                if q.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("flash attention's split scratch is missing inside a graph capture")
                part = flash_scratch(T, H, D, launch, q.device)
        _attend_flash_kernel[(Hkv, triton.cdiv(T * rep, BR), splits)](
            q, k, v, mask, out, limit, *part, S, T, H, rep, D**-0.5, q.stride(0), q.stride(1), mask.stride(0),
            out.stride(0), out.stride(1), D=D, KB=KB, BR=BR, SPLITS=splits, num_warps=warps, num_stages=stages,
            **pdl_options(q),
        )  # fmt: skip
        return out
    part_m, part_l, part_acc, count = scratch if scratch is not None else attention_scratch(T, H, D, S, q.device)
    if T == 1 or D < 16:  # one row: a program per head; tensor cores need 16 rows and 16-wide heads
        _attend_kernel[(H, NS, T)](q, k, v, mask, out, part_m, part_l, part_acc, count, S, NS, H, rep, D**-0.5,
                                   q.stride(0), q.stride(1), mask.stride(0), out.stride(0), out.stride(1), D=D,
                                   KB=keys, NS_P2=triton.next_power_of_2(NS), **pdl_options(q))  # fmt: skip
    else:
        BR = min(64, max(16, triton.next_power_of_2(T * rep)))
        _attend_rows_kernel[(Hkv, NS, triton.cdiv(T * rep, BR))](
            q, k, v, mask, out, part_m, part_l, part_acc, count, S, NS, T, H, rep, D**-0.5, q.stride(0), q.stride(1),
            mask.stride(0), out.stride(0), out.stride(1), D=D, KB=keys, BR=BR, NS_P2=triton.next_power_of_2(NS),
            CH=max(1, min(64 // BR, triton.next_power_of_2(NS))), **pdl_options(q),
        )  # fmt: skip
    return out


def _flash_blocks(T: int, H: int, launch: tuple[int, ...]) -> int:
    """Row blocks of a flash launch over T rows of H query heads: (kv group, BR (row, head) pairs) each."""
    return H * T // launch[0] + H + 1  # kv groups x cdiv(T * rep, BR) <= T * H / BR + kv groups


def flash_scratch(T: int, H: int, D: int, launch: tuple[int, ...], device,
                  *more: tuple[int, ...]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(part_m, part_l, part_acc, count) for flash attention split `launch[4]` ways over up to T rows: each split's
    maximum, sum and output per (row, head) pair of its block, and a counter per row block (zeroed; the kernel
    leaves it zeroed). With `more` launches, sized for each of them too (a verify whose row counts launch
    differently keeps one scratch, made before any graph capture)."""
    launches = (launch, *more)
    blocks = max(_flash_blocks(T, H, x) for x in launches)
    pairs = max(_flash_blocks(T, H, x) * x[0] * (x[4] if len(x) > 4 else 1) for x in launches)
    f32 = dict(device=device, dtype=torch.float32)
    count = torch.zeros(blocks, device=device, dtype=torch.int32)
    return torch.empty(pairs, **f32), torch.empty(pairs, **f32), torch.empty(pairs * D, **f32), count


def flash_scratch_fits(scratch: tuple[torch.Tensor, ...], T: int, H: int, launch: tuple[int, ...]) -> bool:
    splits = launch[4] if len(launch) > 4 else 1
    blocks = _flash_blocks(T, H, launch)
    return scratch[3].numel() >= blocks and scratch[0].numel() >= blocks * launch[0] * splits


def attention_scratch(T: int, H: int, D: int, S: int, device) -> tuple[torch.Tensor, ...]:
    NS = attention_splits(S)[1]
    f32 = dict(device=device, dtype=torch.float32)
    count = torch.zeros(T * H, device=device, dtype=torch.int32)
    return torch.empty(T * H * NS, **f32), torch.empty(T * H * NS, **f32), torch.empty(T * H * NS * D, **f32), count


class RopeRows:
    """cos, sin [T, D] of positions [T] for the fused steps, gathered from tables of every slot's position.

    Why tables: the model's rope_for (positions to float, the product with inv_freq, a cat, cos, sin, two casts) is
    seven small kernels a step, inside every round's captured verify; two row gathers do the same. The tables are
    rope_for over positions 0..S-1, and rope_for is elementwise in the position, so a gathered row is the value
    rope_for gives that position. Positions stay below the cache's S: a row at position p sits at slot >= p (a tree's
    rows at t_len + i carry t_len + depth). "dynamic" RoPE rescales with the longest position, so it keeps rope_for."""

    def __init__(self, model: LlamaModel, size: int, rows: int) -> None:
        self.model, self.D = model, model.args.head_dim
        self.table = None
        if model.args.rope.rope_type != "dynamic":
            every = torch.arange(size, device=model.lm_head.weight.device)
            cos, sin = model.rope_for(every[None])
            self.table = (cos.reshape(size, self.D).contiguous(), sin.reshape(size, self.D).contiguous())
            self.rows = (torch.empty_like(self.table[0][:rows]), torch.empty_like(self.table[1][:rows]))

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = positions.shape[0]
        if self.table is None:
            cos, sin = self.model.rope_for(positions[None])
            return cos.reshape(T, self.D).contiguous(), sin.reshape(T, self.D).contiguous()
        cos, sin = self.rows[0][:T], self.rows[1][:T]
        torch.index_select(self.table[0], 0, positions, out=cos)
        torch.index_select(self.table[1], 0, positions, out=sin)
        return cos, sin


class FusedDecode:
    """One-token steps of `model` on `cache` (a fast.SlotCache) through the kernels above.

    Call with token, position, slot [1] (device tensors, so the step can be graph-captured) and the mask row
    [S] bool → logits [1, V] (the lm_head's dtype: float32 for Float32Logits), aux [1, n_taps*H] | None."""

    def __init__(self, model: LlamaModel, cache, taps: tuple[int, ...] = (), blocks: dict | None = None) -> None:
        why = fused_decode_supported(model, model.lm_head.weight.device)
        if why:
            raise ValueError(why)
        a = model.args
        self.model, self.cache, self.taps, self.args = model, cache, tuple(taps), a
        self.blocks = {**DEFAULT_BLOCKS, **(blocks or {})}
        if (a.head_dim // 2) % self.blocks["qkv"][0]:
            self.blocks["qkv"] = (min(self.blocks["qkv"][0], a.head_dim // 2),) + self.blocks["qkv"][1:]
        w = model.lm_head.weight
        dev, dt = w.device, model.model.embed_tokens.weight.dtype
        self.h = torch.zeros(1, a.hidden_size, device=dev, dtype=dt)  # the residual stream
        self.q = torch.zeros(a.num_heads * a.head_dim, device=dev, dtype=dt)
        self.attn = torch.zeros(a.num_heads * a.head_dim, device=dev, dtype=dt)
        self.act = torch.zeros(a.intermediate_size, device=dev, dtype=dt)
        self.attn_splits = attention_splits(cache.size)[1]
        self.scratch = attention_scratch(1, a.num_heads, a.head_dim, cache.size, dev)
        self.logits_dtype = logits_dtype(model)
        self.rope = RopeRows(model, cache.size, 1)

    # one launch each, so bench/fused_decode_check.py can time every product over all layers on its own
    def qkv(self, i: int, cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor) -> None:
        a, layer = self.args, self.model.model.layers[i]
        norm, qkv = layer.input_layernorm, layer.self_attn.qkv_proj
        bn, bk = self.blocks["qkv"][:2]
        D = a.head_dim
        _qkv_rope_kernel[((a.num_heads + 2 * a.num_kv_heads) * (D // 2 // bn),)](
            self.h, norm.weight, qkv.weight, qkv.bias if qkv.bias is not None else qkv.weight, cos, sin, self.q,
            self.cache.k[i], self.cache.v[i], slot, a.num_heads, a.num_kv_heads, self.cache.size, norm.eps,
            K=a.hidden_size, HAS_BIAS=qkv.bias is not None, D=D, BN=bn, BK=bk,
            KP2=triton.next_power_of_2(a.hidden_size), **launch_options(self.blocks["qkv"]), **pdl_options(self.h),
        )  # fmt: skip

    def attend(self, i: int, mask: torch.Tensor) -> None:
        a = self.args
        q, out = self.q.view(1, a.num_heads, a.head_dim), self.attn.view(1, a.num_heads, a.head_dim)
        fused_attention(q, self.cache.k[i, 0], self.cache.v[i, 0], mask, out, self.scratch)

    def o(self, i: int) -> None:
        o = self.model.model.layers[i].self_attn.o_proj
        fused_linear(self.attn, o.weight, o.bias, out=self.h, residual=True, blocks=self.blocks["o"])

    def gate_up(self, i: int) -> None:
        layer = self.model.model.layers[i]
        norm, gu, F = layer.post_attention_layernorm, layer.mlp.gate_up_proj, self.args.intermediate_size
        bn, bk = self.blocks["gate_up"][:2]
        _gate_up_kernel[(triton.cdiv(F, bn),)](
            self.h, norm.weight, gu.weight, gu.bias if gu.bias is not None else gu.weight, self.act, F, norm.eps,
            K=self.args.hidden_size, HAS_BIAS=gu.bias is not None, BN=bn, BK=bk,
            KP2=triton.next_power_of_2(self.args.hidden_size), **launch_options(self.blocks["gate_up"]),
            **pdl_options(self.h),
        )  # fmt: skip

    def down(self, i: int) -> None:
        down = self.model.model.layers[i].mlp.down_proj
        fused_linear(self.act, down.weight, down.bias, out=self.h, residual=True, blocks=self.blocks["down"])

    def lm_head(self, logits: torch.Tensor) -> None:
        m = self.model
        fused_linear(self.h, m.lm_head.weight, None, norm=m.model.norm, out=logits, blocks=self.blocks["lm_head"])

    @torch.inference_mode()
    def __call__(self, token, position, mask, slot) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.model
        torch.index_select(m.model.embed_tokens.weight, 0, token, out=self.h)
        cos, sin = self.rope(position)
        mask = mask.reshape(1, -1)
        captured = []
        for i in range(len(m.model.layers)):
            if i in self.taps:
                captured.append(self.h.clone())
            self.qkv(i, cos, sin, slot)
            self.attend(i, mask)
            self.o(i)
            self.gate_up(i)
            self.down(i)
        logits = torch.empty(1, self.args.vocab_size, device=self.h.device, dtype=self.logits_dtype)
        self.lm_head(logits)
        aux = torch.cat(captured, dim=-1) if captured else None
        return logits, aux
