"""Batch-invariant kernels: a row's result does not depend on how many other rows share the call.

Why: greedy speculative decoding is exact only if the target's logits for a token are the same whether the
token was decoded alone (vanilla: 1 row) or verified inside a tree (T rows, tree slots in the cache). cuBLAS
and fused attention pick different kernels, tile shapes and split-K factors for M=1 and M=T, and fused
attention groups keys into blocks by cache slot, so in bf16 the two paths round differently and near-ties
flip (measured on an H200: 19-22% of 256-token outputs diverged). Here every kernel has one fixed tiling:

- `invariant_linear`: fixed BLOCK_M x BLOCK_N tiles, the K loop always in the same BLOCK_K steps, float32
  accumulation, a split-K factor chosen from the weight's shape alone (slices summed in a fixed order), no
  autotuning; a row's products are the same MMA sequence whatever M is.
- `invariant_rms_norm`: one program per row.
- `invariant_attention`: one program per (query row, head); the keys a row may see are first compacted in
  slot order (`KeyIndex`), so the row at position p always reduces over the same p+1 keys in the same blocks,
  whether they sit contiguously after a 1-token step or at scattered tree slots during a verify.

Elementwise work (RoPE, SiLU, residuals) is batch-invariant already. On a machine without a GPU the kernels
run under Triton's interpreter (TRITON_INTERPRET=1), which is how the CPU tests exercise them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from eaglescope.errors import EagleScopeError

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path and the CLI work without it; these kernels do not
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64  # one tiling for every call: that is the invariance
SLICE_PROGRAMS = 256  # programs a product's K-slicing aims at (see k_slices)
SLICE_MIN_WEIGHT = 1 << 23  # elements; smaller products stay whole (see k_slices)
ATTN_BLOCK = 64
# Under Triton's CPU interpreter tl.dot is numpy's matmul, i.e. OpenBLAS, whose AVX2 (Haswell, Zen) sgemm kernels
# round a row differently by its place in the tile: the same row alone (tile row 0) and at tile row 7 differ in
# the last bit (20 of 180 cases in a seed sweep; OPENBLAS_CORETYPE=Haswell reproduces it on any x86 machine).
# The GPU's MMA has no such dependence. So the interpreted kernels reduce each product elementwise in a fixed
# order instead, which keeps the CPU tests a check of the tiling rather than of the BLAS build underneath.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run for tensors on `device` (a GPU, or any device under the interpreter)."""
    if triton is None:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def supports(head_dim: int, device: torch.device | str) -> bool:
    """Whether a target with this head_dim can run on these kernels here (the attention block is a power of two)."""
    return available(device) and head_dim & (head_dim - 1) == 0


def _require(t: torch.Tensor) -> None:
    if not available(t.device):
        raise EagleScopeError(
            "batch-invariant kernels need Triton and a CUDA device (or TRITON_INTERPRET=1 to run them on the CPU)"
        )


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x, w, b, y, part, M, N, K, K_SLICE, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWWISE: tl.constexpr):  # fmt: skip
        pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)  # rows * N passes 2**31 for a long prompt's logits
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_lo = pid_s * K_SLICE
        k_hi = tl.minimum(k_lo + K_SLICE, K)
        for k0 in range(k_lo, k_hi, BK):
            kk = k0 + ks
            in_k = kk < k_hi
            a = tl.load(x + rows[:, None] * K + kk[None, :], mask=(rows[:, None] < M) & in_k[None, :], other=0.0)
            bt = tl.load(w + cols[None, :] * K + kk[:, None], mask=(cols[None, :] < N) & in_k[:, None], other=0.0)
            if ROWWISE:  # see INTERPRETED
                acc += tl.sum(a[:, :, None] * bt[None, :, :], axis=1)
            else:
                acc += tl.dot(a, bt, input_precision="ieee")
        out_mask = (rows[:, None] < M) & (cols[None, :] < N)
        if PARTIAL:  # this K-slice's float32 sums; _sum_slices_kernel adds the slices in a fixed order
            tl.store(part + pid_s.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :], acc, mask=out_mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y + rows[:, None] * N + cols[None, :], acc.to(y.dtype.element_ty), mask=out_mask)

    @triton.jit(do_not_specialize=["numel"])
    def _sum_slices_kernel(part, b, y, numel, N, SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.load(part + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SLICES):
            acc += tl.load(part + s * numel + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(y + offs, acc.to(y.dtype.element_ty), mask=ok)

    @triton.jit
    def _rms_norm_kernel(x, w, y, H, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        xs = tl.load(x + row * H + cols, mask=cols < H, other=0.0)
        xf = xs.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        # the same two roundings as RMSNorm.forward: normalise in float32, cast, then scale by the weight
        normed = (xf * rstd).to(xs.dtype).to(tl.float32)
        wf = tl.load(w + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(y + row * H + cols, (wf * normed).to(y.dtype.element_ty), mask=cols < H)

    @triton.jit
    def _attention_kernel(q, k, v, idx, cnt, o, S, n_heads, rep, scale, sq_t, sq_h, sk_h, sk_s, so_t, so_h,
                          D: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        t, h = tl.program_id(0), tl.program_id(1)
        g = h // rep
        d = tl.arange(0, D)
        qv = tl.load(q + t * sq_t + h * sq_h + d).to(tl.float32)
        n_keys = tl.load(cnt + t)
        m_i = tl.full((1,), float("-inf"), tl.float32)
        l_i = tl.zeros((1,), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for n0 in range(0, n_keys, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            valid = offs < n_keys
            slot = tl.load(idx + t * S + offs, mask=valid, other=0)
            kv_off = g * sk_h + slot[:, None] * sk_s + d[None, :]
            kb = tl.load(k + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(kb * qv[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            vb = tl.load(v + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * vb, axis=0)
            m_i = m_new
        tl.store(o + t * so_t + h * so_h + d, (acc / l_i).to(o.dtype.element_ty))


def k_slices(N: int, K: int) -> int:
    """Into how many K-slices a product's reduction is cut: a function of the weight's shape only, never of the
    row count, so a row's slice sums and their fixed-order total are the same in every call.

    Why cut at all: with one program per 64 output columns, a one-row product with few columns and a long
    reduction (the 8B down product: 64 programs x 224 K-steps) leaves most SMs idle and each program
    latency-bound; slices give ~SLICE_PROGRAMS programs, each at least 4 K-steps long. Products under
    SLICE_MIN_WEIGHT elements stay whole: there the step is launch-bound, and the second kernel would cost more
    than the parallelism gains (8B shape, H200: invariant step 9.29 → 6.67 ms with slices; the 197M target's
    products are all below the threshold)."""
    if N * K < SLICE_MIN_WEIGHT:
        return 1
    steps = triton.cdiv(K, BLOCK_K)
    want = triton.cdiv(SLICE_PROGRAMS, triton.cdiv(N, BLOCK_N))
    return max(1, min(want, steps // 4))


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    slices: int = 1,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) with one fixed tiling; accumulates in float32, returns out_dtype
    (default x's dtype). `slices` cuts the reduction into that many K-slices (see k_slices); it must not depend
    on the row count, or the invariance is lost."""
    _require(x)
    N, K = weight.shape
    flat = x.reshape(-1, K).contiguous()
    M = flat.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=out_dtype or x.dtype)
    w = weight.contiguous()
    b = bias if bias is not None else w
    k_slice = triton.cdiv(triton.cdiv(K, BLOCK_K), slices) * BLOCK_K
    slices = triton.cdiv(K, k_slice)  # rounding k_slice up to whole steps may leave a slice empty: drop it
    part = torch.empty(slices, M, N, device=x.device, dtype=torch.float32) if slices > 1 else y
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), slices)
    _linear_kernel[grid](flat, w, b, y, part, M, N, K, k_slice, HAS_BIAS=bias is not None, PARTIAL=slices > 1,
                         BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, ROWWISE=INTERPRETED)  # fmt: skip
    if slices > 1:
        _sum_slices_kernel[(triton.cdiv(M * N, 1024),)](part, b, y, M * N, N, SLICES=slices,
                                                        HAS_BIAS=bias is not None, BLOCK=1024)  # fmt: skip
    return y.view(*x.shape[:-1], N)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _require(x)
    H = x.shape[-1]
    flat = x.reshape(-1, H).contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(flat.shape, device=x.device, dtype=out_dtype)
    _rms_norm_kernel[(flat.shape[0],)](flat, weight, y, H, eps, BLOCK=triton.next_power_of_2(H))
    return y.view(x.shape)


@dataclass
class KeyIndex:
    """The keys each query row may see, compacted in slot order: slots [T, S] (valid prefix of length count[t]),
    count [T]. Built once per forward from the boolean mask and shared by every layer."""

    slots: torch.Tensor
    count: torch.Tensor

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> KeyIndex:
        """mask [T, S] bool (True = attend) → the attended slots first, in slot order (a stable sort of ~mask)."""
        order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices
        return cls(order.to(torch.int32).contiguous(), mask.sum(-1).to(torch.int32))


def invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: KeyIndex | torch.Tensor | None
) -> torch.Tensor:
    """q [1, H, T, D], k/v [1, Hkv, S, D] (the whole slot cache) → [1, H, T, D]; row t attends to the slots
    keys.slots[t, :keys.count[t]] in that order. A boolean mask [1, 1, T, S] or None (causal) is compacted here
    (the fast path builds the KeyIndex once per forward instead of once per layer)."""
    _require(q)
    B, H, T, D = q.shape
    if not isinstance(keys, KeyIndex):
        S = k.shape[2]
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        keys = KeyIndex.from_mask(keys.reshape(T, S) if keys is not None else causal)
    if B != 1:
        raise ValueError("invariant_attention decodes one sequence (batch 1)")
    if D & (D - 1):
        raise EagleScopeError(f"batch-invariant attention needs a power-of-two head_dim, not {D}")
    qt = q[0].transpose(0, 1)  # [T, H, D] view
    kk, vv = k[0], v[0]
    if kk.stride(-1) != 1 or vv.stride() != kk.stride():
        kk, vv = kk.contiguous(), vv.contiguous()
    if qt.stride(-1) != 1:
        qt = qt.contiguous()
    out = torch.empty(T, H, D, device=q.device, dtype=q.dtype)
    S = keys.slots.shape[-1]
    _attention_kernel[(T, H)](qt, kk, vv, keys.slots, keys.count, out, S, H, H // kk.shape[0], D**-0.5,
                              qt.stride(0), qt.stride(1), kk.stride(0), kk.stride(1), out.stride(0), out.stride(1),
                              D=D, BLOCK=ATTN_BLOCK)  # fmt: skip
    return out.transpose(0, 1)[None]


class _Swapped(nn.Module):
    """A replacement that shares `original`'s weights and remembers it (unregistered) to swap back."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)


class InvariantLinear(_Swapped):
    """A Linear-like module (nn.Linear, GemvLinear, Float32Logits) through `invariant_linear`; `sliced` cuts
    long reductions into K-slices (k_slices: fixed per weight shape)."""

    def __init__(self, original: nn.Module, out_dtype: torch.dtype | None = None, sliced: bool = True) -> None:
        super().__init__(original)
        self.weight, self.bias, self.out_dtype = original.weight, getattr(original, "bias", None), out_dtype
        self.slices = k_slices(*self.weight.shape) if sliced else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias, self.out_dtype, self.slices)


class InvariantRMSNorm(_Swapped):
    def __init__(self, original: nn.Module) -> None:
        super().__init__(original)
        self.weight, self.eps = original.weight, original.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_rms_norm(x, self.weight, self.eps)
