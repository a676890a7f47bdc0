"""train/loss_kernels.py under Triton's interpreter (the CPU half; tests/gpu/test_train_loss_kernels.py runs them
compiled at the 8B run's width): the soft cross-entropy's forward and backward kernels against train/ttt.py's float32
torch form, and wired into the autograd function train's loss goes through."""

from __future__ import annotations

import pytest
import torch

from eaglescope.fast import invariant
from eaglescope.train import loss_kernels, ttt

pytestmark = pytest.mark.skipif(not invariant.available("cpu"), reason="needs TRITON_INTERPRET=1 on a CPU-only machine")


def inputs(N, V, shift, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(N, V, generator=g)).to(dtype)
    teacher = (4 * torch.randn(N, V, generator=g)).to(dtype)
    weight = torch.rand(N, generator=g)
    weight[torch.rand(N, generator=g) < 0.3] = 0
    weight[-shift:] = 0
    return logits, teacher, weight


def torch_form(logits, teacher, weight, shift, grad):
    z = logits.clone().requires_grad_()
    total = ttt._SoftCrossEntropy.apply(z, teacher, weight, shift)
    (dz,) = torch.autograd.grad(total * grad, z)
    return total.detach(), dz


@pytest.mark.parametrize("V", [7, 4096, 5000])  # under one block, exactly one, one and a remainder
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_give_the_torch_loss_and_gradient(V, dtype):
    shift = 3
    logits, teacher, weight = inputs(23, V, shift, dtype, seed=V)
    grad = torch.tensor(0.37)
    want, want_dz = torch_form(logits, teacher, weight, shift, grad)
    total, lse_z, lse_t = loss_kernels.soft_ce_forward(logits, teacher, weight, shift)
    dz = loss_kernels.soft_ce_backward(logits, teacher, weight, shift, grad, lse_z, lse_t)
    assert float(total) == pytest.approx(float(want), rel=1e-5)
    assert dz.dtype == dtype and torch.all(dz[weight == 0] == 0)
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: one rounding of the same float32 value apart at most
    # the two forms cancel differently (softmax(z) - p against softmax(z) · Σp - p): absolute, near the largest entry
    torch.testing.assert_close(dz.float(), want_dz.float(), rtol=tol, atol=1e-6 * float(want_dz.abs().max()))
    # the teacher row is `shift` later: the same kernels with the teacher unshifted give another loss
    other, _, _ = loss_kernels.soft_ce_forward(logits, teacher, weight, 0)
    assert abs(float(other) - float(want)) > 1e-3 * abs(float(want))


def test_the_ttt_loss_on_the_kernels_equals_it_on_torch(monkeypatch):
    """The path train takes on a GPU (kernels_available), here interpreted: ttt_loss's value and gradient."""
    logits, teacher, weight = inputs(2 * 19, 300, 2, torch.float32, seed=1)
    z = logits.reshape(2, 19, 300)
    t = teacher.reshape(2, 19, 300)
    w = weight.reshape(2, 19)
    results = {}
    for kernels in (False, True):
        monkeypatch.setattr(ttt, "kernels_available", lambda device, kernels=kernels: kernels)
        zz = z.clone().requires_grad_()
        loss = ttt.soft_cross_entropy(zz, t, w, 2)
        loss.backward()
        results[kernels] = (float(loss), zz.grad)
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-6)
    torch.testing.assert_close(results[True][1], results[False][1], rtol=1e-5, atol=1e-8)


def test_bad_shapes_are_refused():
    logits, teacher, weight = inputs(5, 9, 1, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        loss_kernels.soft_ce_forward(logits, teacher[:4], weight, 1)


def test_masked_teacher_entries_and_nan_logits():
    """-inf teacher logits (a masked vocabulary: a whole first block of a row, and scattered entries) are zero
    probability, as in torch's softmax, not NaN; a NaN in the draft's logits makes the loss NaN, so train's
    non-finite check still sees it."""
    logits, teacher, weight = inputs(6, 5000, 1, torch.float32, seed=3)
    weight[:] = 1.0
    teacher[0, :4096] = float("-inf")
    teacher[1, ::7] = float("-inf")
    grad = torch.tensor(1.0)
    want, want_dz = torch_form(logits, teacher, weight, 0, grad)
    assert torch.isfinite(want)
    total, lse_z, lse_t = loss_kernels.soft_ce_forward(logits, teacher, weight, 0)
    dz = loss_kernels.soft_ce_backward(logits, teacher, weight, 0, grad, lse_z, lse_t)
    assert float(total) == pytest.approx(float(want), rel=1e-5)
    torch.testing.assert_close(dz, want_dz, rtol=1e-5, atol=1e-6 * float(want_dz.abs().max()))
    logits[2, 17] = float("nan")
    total, _, _ = loss_kernels.soft_ce_forward(logits, teacher, weight, 0)
    assert torch.isnan(total)
