"""Training's GPU path, compiled (flex attention, train/attention.py; the loss's Triton kernels, train/loss_kernels.py;
with train --compile the regions of train/compiled.py), against what it replaced, in float32: dense masked SDPA and the
loss computed densely (tests/test_train_speed.py's dense reference for the gradients). The TTT loss and every
parameter's gradient, and the held-out acc_k and α_k of the order-2-chain run of tests/test_train.py (TTT 7, 150
steps) trained each way. The CPU half (logits, block mask) is tests/test_train_attention.py; the CPU has no flex
backward."""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint

from eaglescope.train import loop as train_loop
from eaglescope.train import ttt
from eaglescope.train.loop import train


@pytest.mark.parametrize("B,T", [(2, 300), (1, 1024)])
def test_flex_loss_and_gradients_equal_the_dense_ones(tmp_path, B, T):
    target = make_checkpoint("llama", tmp_path / "target", seed=5, max_position_embeddings=2048)
    draft, _ = make_draft(target, draft_vocab_size=40, seed=2)
    draft = draft.cuda().train()
    K = 7
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, 96, (B, T), generator=g).cuda()
    aux = torch.randn(B, T, draft.fc.in_features, generator=g).cuda()
    teacher = (3 * torch.randn(B, T, 96, generator=g)).cuda()
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).long().cuda()
    from test_train_speed import dense_ttt_loss

    results = {}
    # train's loss on a GPU (the Triton kernels, train/loss_kernels.py) against the dense float32 form
    for kind, loss_fn in (("dense", dense_ttt_loss), ("flex", ttt.ttt_loss)):
        draft.zero_grad()
        res = loss_fn(draft, ttt.ttt_unroll(draft, ids, aux, K, kind), teacher, loss_mask, per_sample=True)
        res.loss.backward()
        results[kind] = (res, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    (a, ga), (b, gb) = results["flex"], results["dense"]
    assert float(a.loss) == pytest.approx(float(b.loss), rel=1e-5)
    assert a.step_loss == pytest.approx(b.step_loss, rel=1e-5)
    assert ga.keys() == gb.keys() and "midlayer.self_attn.q_proj.weight" in ga and "fc.weight" in ga
    for n in ga:
        scale = float(gb[n].abs().max())
        assert scale > 0, n
        torch.testing.assert_close(ga[n], gb[n], rtol=0, atol=1e-4 * scale, msg=n)


def test_same_seed_heldout_acc_with_dense_attention_within_noise(tmp_path_factory, tmp_path, monkeypatch):
    from test_train import STEPS, TTT, config, shared_env

    env = shared_env(tmp_path_factory)
    runs = {}
    for kind in ("flex", "dense"):
        monkeypatch.setattr(train_loop, "default_attention", lambda draft, device, kind=kind: kind)
        # flex and the regions compiled (--compile) against dense attention run eagerly
        cfg = config(env, tmp_path / kind, ttt_length=TTT, max_steps=STEPS, device="cuda", dtype="float32",
                     compile=kind == "flex")  # fmt: skip
        runs[kind] = train(cfg, progress=False)
    a, b = runs["flex"], runs["dense"]
    print(f"held-out acc_k flex {a.metrics['acc']} dense {b.metrics['acc']}")
    assert a.metrics["acc"][0] > 0.8  # a trained draft, not two untrained ones agreeing
    # float32 rounding differs between the kernels, so 150 steps drift apart a little: equal within that noise
    assert a.metrics["acc"] == pytest.approx(b.metrics["acc"], abs=0.02)
    assert a.metrics["predicted_accept_length"] == pytest.approx(b.metrics["predicted_accept_length"], abs=0.15)
