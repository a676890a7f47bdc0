"""`train --compile` on the GPU (train/compiled.py), against the eager step it speeds up: one step's taps, teacher
logits, TTT loss and every gradient with flex attention in float32, and the held-out acc_k and α_k of the
order-2-chain run of tests/test_train.py (TTT 7, 150 steps, online) trained each way. The CPU half is
tests/test_train_compiled.py."""

from __future__ import annotations

import copy

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint
from test_train_compiled import compare, step_results

from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract
from eaglescope.train.compiled import compile_training
from eaglescope.train.loop import train


def test_a_compiled_flex_step_gives_the_eager_loss_and_gradients(tmp_path):
    ckpt = make_checkpoint("llama", tmp_path / "target", seed=5, max_position_embeddings=2048)
    target = load_target(ckpt, device="cuda", dtype=torch.float32)
    target.set_taps(TapContract.default(target.num_layers))
    draft, _ = make_draft(ckpt, draft_vocab_size=40, seed=2, random_norms=True)
    draft = draft.cuda().train()
    g = torch.Generator().manual_seed(1)
    B, T, K = 2, 300, 7
    ids = torch.randint(0, target.fingerprint.vocab_size, (B, T), generator=g).cuda()
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 211:] = 0
    valid = valid.cuda()
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).long().cuda()
    eager = step_results(target, draft, ids, valid, loss_mask, K, "flex")
    twin = copy.deepcopy(draft)
    compile_training(target, twin)
    compare(eager, step_results(target, twin, ids, valid, loss_mask, K, "flex"), 1e-4)


def test_same_seed_heldout_acc_compiled_and_eager_within_noise(tmp_path_factory, tmp_path):
    from test_train import STEPS, TTT, config, shared_env

    env = shared_env(tmp_path_factory)
    runs = {}
    for compiled in (True, False):
        # online (the target runs in the step, so its compiled layers are on the path), not from stored hidden states
        cfg = config(env, tmp_path / f"c{compiled}", data=str(env["prep"]), ttt_length=TTT, max_steps=STEPS,
                     device="cuda", dtype="float32")  # fmt: skip
        cfg.compile = compiled
        runs[compiled] = train(cfg, progress=False)
    a, b = runs[True], runs[False]
    print(f"held-out acc_k compiled {a.metrics['acc']} eager {b.metrics['acc']}")
    assert a.metrics["speed"]["compiled"] and not b.metrics["speed"]["compiled"]
    assert a.metrics["acc"][0] > 0.8  # a trained draft, not two untrained ones agreeing
    assert a.metrics["acc"] == pytest.approx(b.metrics["acc"], abs=0.02)
    assert a.metrics["predicted_accept_length"] == pytest.approx(b.metrics["predicted_accept_length"], abs=0.15)
