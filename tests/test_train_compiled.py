"""`train --compile` (train/compiled.py) computes what the eager step computes: the target's taps and teacher logits,
the TTT loss and every gradient, in float32 through inductor on the CPU (the GPU half, with flex attention and a trained
draft's held-out acc_k, is tests/gpu/test_train_compiled.py), and the compiled modules keep their parameter names, so
a checkpoint saved from a compiled run is the same file."""

from __future__ import annotations

import copy

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint

from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract
from eaglescope.train import ttt
from eaglescope.train.compiled import compile_training
from eaglescope.train.loop import make_batch


def step_results(target, draft, ids, valid, loss_mask, K, attention="dense"):
    """One training step's forward and backward → (taps, teacher logits, loss, per-step losses, gradients)."""
    vocab_ids = ttt.draft_vocab_ids(draft)
    raw = {"input_ids": ids, "valid": valid, "loss_mask": loss_mask}
    batch = make_batch(target, raw, ids.device, torch.float32, vocab_ids)
    draft.zero_grad()
    unrolled = ttt.ttt_unroll(draft, batch.input_ids, batch.aux, K, attention)
    res = ttt.ttt_loss(draft, unrolled, batch.teacher, batch.loss_mask, batch.valid, per_sample=True)
    res.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return batch.aux, batch.teacher.logits, res.loss.detach(), res.step_loss, grads


def compare(eager, compiled, tol: float) -> None:
    (aux_e, fin_e, loss_e, steps_e, g_e), (aux_c, fin_c, loss_c, steps_c, g_c) = eager, compiled
    torch.testing.assert_close(aux_c, aux_e, rtol=0, atol=tol * float(aux_e.abs().max()))
    torch.testing.assert_close(fin_c, fin_e, rtol=0, atol=tol * float(fin_e.abs().max()))
    assert float(loss_c) == pytest.approx(float(loss_e), rel=tol)
    assert steps_c == pytest.approx(steps_e, rel=tol)
    assert g_c.keys() == g_e.keys() and "midlayer.self_attn.q_proj.weight" in g_e and "fc.weight" in g_e
    for n in g_e:
        scale = float(g_e[n].abs().max())
        assert scale > 0, n
        torch.testing.assert_close(g_c[n], g_e[n], rtol=0, atol=tol * scale, msg=n)


def test_a_compiled_step_gives_the_eager_loss_and_gradients(tmp_path):
    # EAGLE 3.1's norms before fc on: every region train/compiled.py compiles runs (about 30 s of inductor here)
    options = {"norm_before_fc": True, "fc_norm": True}
    ckpt = make_checkpoint("llama", tmp_path / "target", seed=5)
    target = load_target(ckpt, device="cpu", dtype=torch.float32)
    target.set_taps(TapContract.default(target.num_layers))
    draft, _ = make_draft(ckpt, draft_vocab_size=40, seed=2, random_norms=True, **options)
    draft.train()
    g = torch.Generator().manual_seed(0)
    B, T, K = 2, 24, 3
    ids = torch.randint(0, target.fingerprint.vocab_size, (B, T), generator=g)
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 17:] = 0  # right padding
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).long()
    eager = step_results(target, draft, ids, valid, loss_mask, K)
    names = list(draft.state_dict())
    twin = copy.deepcopy(draft)
    regions = compile_training(target, twin)
    assert any("target" in r for r in regions) and any("q/k/v" in r for r in regions)
    assert list(twin.state_dict()) == names  # the same modules: a checkpoint saved from them has the same names
    compiled = step_results(target, twin, ids, valid, loss_mask, K)
    compare(eager, compiled, 1e-5)
    # the compiled regions are what ran: a region replaced by a wrong one changes the result
    twin.midlayer.feed_forward = lambda h: h
    wrong = step_results(target, twin, ids, valid, loss_mask, K)
    assert abs(float(wrong[2]) - float(eager[2])) > 1e-3
