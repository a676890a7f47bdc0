"""train's loss on a GPU, the two Triton kernels of train/loss_kernels.py, against the torch form they replaced
(train/ttt.py's float32 chunks, which the CPU still runs): at the 8B run's width (a 32,000-token draft vocabulary, bf16
logits and teacher), the loss and its gradient; and the held-out acc_k and α_k of the order-2-chain run of
tests/test_train.py (TTT 7, 150 steps) trained with each, so no speed was bought with a different loss."""

from __future__ import annotations

import pytest
import torch

from eaglescope.train import loss_kernels, ttt
from eaglescope.train.loop import train


def torch_form(logits, teacher, weight, shift, grad):
    z = logits.detach().clone().requires_grad_()
    total = torch.zeros((), device=z.device)
    for rows, src in ttt._chunks(z, shift):
        total = total + ttt._chunk_loss(z[rows], teacher, src, weight[rows])
    (dz,) = torch.autograd.grad(total * grad, z)
    return total.detach(), dz


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shift", [1, 7])
def test_the_kernels_give_the_torch_loss_and_gradient(dtype, shift):
    g = torch.Generator().manual_seed(shift)
    N, V = 3000, 32000
    logits = (4 * torch.randn(N, V, generator=g)).to(dtype).cuda()
    teacher = (4 * torch.randn(N, V, generator=g)).to(dtype).cuda()
    weight = torch.rand(N, generator=g).cuda()
    weight[torch.rand(N, generator=g).cuda() < 0.3] = 0  # unsupervised rows
    weight[-shift:] = 0  # past the sample: the clamped teacher rows are never used
    grad = torch.tensor(0.37, device="cuda")
    want, want_dz = torch_form(logits, teacher, weight, shift, grad)
    total, lse_z, lse_t = loss_kernels.soft_ce_forward(logits, teacher, weight, shift)
    dz = loss_kernels.soft_ce_backward(logits, teacher, weight, shift, grad, lse_z, lse_t)
    assert float(total) == pytest.approx(float(want), rel=1e-5)
    assert dz.dtype == dtype and dz.shape == logits.shape
    assert torch.all(dz[weight == 0] == 0)
    # one rounding of the output apart at most: the torch form rounds the same float32 gradient to `dtype`
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(dz.float(), want_dz.float(), rtol=tol, atol=1e-6 * float(want_dz.abs().max()))
    # the lse kept for the backward are the rows' own
    ok = weight > 0
    torch.testing.assert_close(lse_z[ok], torch.logsumexp(logits.float(), -1)[ok], rtol=1e-6, atol=1e-5)


def test_masked_teacher_entries_are_zero_probability():
    """-inf teacher logits, a whole first 4,096-column block of some rows and scattered entries of others, as torch's
    softmax treats them (tests/test_loss_kernels.py has the same case under the interpreter)."""
    g = torch.Generator().manual_seed(0)
    N, V = 512, 32000
    logits = (4 * torch.randn(N, V, generator=g)).cuda()
    teacher = (4 * torch.randn(N, V, generator=g)).cuda()
    teacher[::3, :4096] = float("-inf")
    teacher[1::3, ::7] = float("-inf")
    weight = torch.ones(N, device="cuda")
    grad = torch.tensor(1.0, device="cuda")
    want, want_dz = torch_form(logits, teacher, weight, 0, grad)
    total, lse_z, lse_t = loss_kernels.soft_ce_forward(logits, teacher, weight, 0)
    dz = loss_kernels.soft_ce_backward(logits, teacher, weight, 0, grad, lse_z, lse_t)
    assert torch.isfinite(want) and float(total) == pytest.approx(float(want), rel=1e-5)
    torch.testing.assert_close(dz, want_dz, rtol=1e-5, atol=1e-6 * float(want_dz.abs().max()))


def test_same_seed_heldout_acc_with_the_torch_loss_within_noise(tmp_path_factory, tmp_path, monkeypatch):
    from test_train import STEPS, TTT, config, shared_env

    env = shared_env(tmp_path_factory)
    runs = {}
    for kernels in (True, False):
        monkeypatch.setattr(ttt, "kernels_available", lambda device, kernels=kernels: kernels)
        cfg = config(env, tmp_path / f"k{kernels}", ttt_length=TTT, max_steps=STEPS, device="cuda", dtype="float32")
        runs[kernels] = train(cfg, progress=False)
    a, b = runs[True], runs[False]
    print(f"held-out acc_k kernels {a.metrics['acc']} torch {b.metrics['acc']}")
    assert a.metrics["acc"][0] > 0.8  # a trained draft, not two untrained ones agreeing
    assert a.metrics["acc"] == pytest.approx(b.metrics["acc"], abs=0.02)
    assert a.metrics["predicted_accept_length"] == pytest.approx(b.metrics["predicted_accept_length"], abs=0.15)
