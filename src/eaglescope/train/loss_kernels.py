"""The TTT loss's soft cross-entropy as two Triton kernels, one pass over each row of logits.

Why: at 8B shape a TTT step's logits are [8,192, 32,000] bf16 for the draft and as many for the teacher (0.5 GB each).
The loss needs, per row r, lse(z_r), lse(t_r') and Σ softmax(t_r')·z_r (r' = r + shift), and its gradient
softmax(z_r) - softmax(t_r'); all of these are sums a single read of both rows can produce with running maxima (the
"online" softmax). Composed of torch ops, or compiled by inductor (which splits reductions this wide and then gives
up the online form), the same work read each row three or more times: 27.6 ms of a 487 ms training step at batch 4
(bench/results/train-speed-20261202T114111-profile.txt) against about 4 ms at the H200's bandwidth.

forward:  per row, loss_r = lse(z_r) - Σ_i softmax(t_r')_i z_ri (= -Σ p log q with Σp = 1), plus both lse kept
          (8 bytes a row) for the backward; the weighting and the sum over rows stay in torch (a fixed order, so the
          result does not depend on scheduling).
backward: per row, dz_r = (softmax(z_r) - softmax(t_r')) · w_r · grad, written in z's dtype; rows with w_r = 0
          (padding, positions past the sample, teacher argmax outside the draft vocabulary) are written as zeros.

Everything is float32 inside; inputs may be bf16, fp16 or float32. On a machine without a GPU the kernels run under
Triton's interpreter (TRITON_INTERPRET=1), which is how the CPU tests compare them with the float32 torch form.
"""

from __future__ import annotations

import torch

try:  # an optional accelerator: the trainer imports and runs without it, on the torch form of the loss
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096  # columns per load: a 32,000-token row in 8 loads of 8 KB (bf16) per tensor
WARPS = 8


def kernels_available(device: torch.device) -> bool:
    """Whether train's loss runs on these kernels: a GPU and Triton (the CPU keeps the torch form; the interpreter
    is for tests, far too slow for a training run)."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _soft_ce_forward_kernel(z, t, w, loss, lse_z, lse_t, N, V, shift, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        src = tl.minimum(r + shift, N - 1)
        one = r + tl.arange(0, 1)  # the row's slot in the [N] outputs, as a 1-element block
        if tl.load(w + r) == 0.0:
            zero = tl.zeros((1,), tl.float32)
            tl.store(loss + one, zero)
            tl.store(lse_z + one, zero)
            tl.store(lse_t + one, zero)
        else:
            # running maxima and sums, 1-element blocks (the form the invariant attention kernel uses)
            m_z = tl.full((1,), float("-inf"), tl.float32)
            s_z = tl.zeros((1,), tl.float32)
            m_t = tl.full((1,), float("-inf"), tl.float32)
            s_t = tl.zeros((1,), tl.float32)
            dot = tl.zeros((1,), tl.float32)  # Σ exp(t - m_t) · z
            for c0 in range(0, V, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                ok = cols < V
                zb = tl.load(z + r * V + cols, mask=ok, other=0.0).to(tl.float32)
                tb = tl.load(t + src * V + cols, mask=ok, other=0.0).to(tl.float32)
                zm = tl.where(ok, zb, float("-inf"))
                tm = tl.where(ok, tb, float("-inf"))
                # a maximum still -inf (every entry so far -inf: a masked block) shifts by 0, not by -inf,
                # so that exp(-inf - -inf) never makes a NaN; torch's softmax treats such entries the same way
                new_m_z = tl.maximum(m_z, tl.max(zm, axis=0))
                shift_z = tl.where(new_m_z == float("-inf"), 0.0, new_m_z)
                s_z = s_z * tl.exp(m_z - shift_z) + tl.sum(tl.exp(zm - shift_z), axis=0)
                m_z = new_m_z
                new_m_t = tl.maximum(m_t, tl.max(tm, axis=0))
                shift_t = tl.where(new_m_t == float("-inf"), 0.0, new_m_t)
                e_t = tl.exp(tm - shift_t)
                scale = tl.exp(m_t - shift_t)
                s_t = s_t * scale + tl.sum(e_t, axis=0)
                dot = dot * scale + tl.sum(e_t * zb, axis=0)  # masked lanes: e_t = 0 and zb = 0
                m_t = new_m_t
            log_s_z = m_z + tl.log(s_z)
            tl.store(loss + one, log_s_z - dot / s_t)
            tl.store(lse_z + one, log_s_z)
            tl.store(lse_t + one, m_t + tl.log(s_t))

    @triton.jit
    def _soft_ce_backward_kernel(z, t, w, grad, lse_z, lse_t, dz, N, V, shift, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        src = tl.minimum(r + shift, N - 1)
        scale = tl.load(w + r) * tl.load(grad)
        lz = tl.load(lse_z + r)
        lt = tl.load(lse_t + r)
        for c0 in range(0, V, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < V
            if scale == 0.0:
                g = tl.zeros((BLOCK,), tl.float32)
            else:
                zb = tl.load(z + r * V + cols, mask=ok, other=0.0).to(tl.float32)
                tb = tl.load(t + src * V + cols, mask=ok, other=0.0).to(tl.float32)
                g = (tl.exp(zb - lz) - tl.exp(tb - lt)) * scale
            tl.store(dz + r * V + cols, g.to(dz.dtype.element_ty), mask=ok)


def _check(logits: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the soft cross-entropy kernels need Triton")
    if logits.dim() != 2 or teacher.shape != logits.shape or weight.shape != logits.shape[:1]:
        raise ValueError(f"logits and teacher [N, V], weight [N]: got {logits.shape}, {teacher.shape}, {weight.shape}")


def soft_ce_forward(logits: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, shift: int):
    """(Σ_r w_r · H(softmax(teacher[min(r + shift, N-1)]), softmax(logits[r])) as a float32 scalar, lse of the logits
    rows, lse of the teacher rows) for [N, V] logits and teacher and [N] float32 weight."""
    _check(logits, teacher, weight)
    logits, teacher, weight = logits.contiguous(), teacher.contiguous(), weight.contiguous().float()
    N, V = logits.shape
    rows = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse_z, lse_t = torch.empty_like(rows), torch.empty_like(rows)
    _soft_ce_forward_kernel[(N,)](logits, teacher, weight, rows, lse_z, lse_t, N, V, shift, BLOCK=BLOCK,
                                  num_warps=WARPS)  # fmt: skip
    return (rows * weight).sum(), lse_z, lse_t


def soft_ce_backward(logits: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, shift: int,
                     grad: torch.Tensor, lse_z: torch.Tensor, lse_t: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """d(soft_ce_forward's scalar)/d logits · grad (a float32 scalar tensor), in the logits' dtype."""
    _check(logits, teacher, weight)
    logits, teacher, weight = logits.contiguous(), teacher.contiguous(), weight.contiguous().float()
    N, V = logits.shape
    out = torch.empty_like(logits)
    grad = grad.reshape(1).float()
    _soft_ce_backward_kernel[(N,)](logits, teacher, weight, grad, lse_z, lse_t, out, N, V, shift, BLOCK=BLOCK,
                                   num_warps=WARPS)  # fmt: skip
    return out
