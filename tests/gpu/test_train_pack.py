"""`train --pack` on the GPU path, in float32: a packed batch through the target's per-document attention (flash), the
draft's compiled flex attention under the packed block mask (train/attention.py `packed_ttt_block_mask`: built from
the documents' block ranges for rows of whole blocks, by create_block_mask for a short row) and the loss's Triton
kernels, against the same samples padded through dense masked SDPA and the dense float32 loss: the loss, per-step
losses and every gradient. Then train --pack --compile against the padded eager run on the order-2-chain data of
tests/test_train.py: the held-out acc_k within float32 noise. The CPU half (the dense packed masks, flex forward, the
CLI) is tests/test_train_pack.py; the CPU has no flex backward."""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint

from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract
from eaglescope.train import loop as train_loop
from eaglescope.train import ttt
from eaglescope.train.loop import collate, make_batch, train
from eaglescope.train.packing import collate_packed


def samples_of(lengths: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = (torch.rand(n, generator=g) < 0.7).long()
        mask[: n // 8] = 0
        out.append({"input_ids": torch.randint(0, 96, (n,), generator=g), "loss_mask": mask})
    return out


# one row of 1,245 tokens padded to 1,280 (whole blocks: the block-range construction), and rows of at most 512 tokens
# (a short row: create_block_mask)
@pytest.mark.parametrize("row_tokens", [None, 512])
def test_packed_flex_loss_and_gradients_equal_the_padded_dense_ones(tmp_path, row_tokens):
    path = make_checkpoint("llama", tmp_path / "target", seed=5, max_position_embeddings=2048)
    target = load_target(path, device="cuda", dtype=torch.float32)
    target.set_taps(TapContract.default(target.num_layers))
    draft, _ = make_draft(path, draft_vocab_size=40, seed=2)
    draft = draft.cuda().train()
    vocab_ids = ttt.draft_vocab_ids(draft)
    K = 7
    samples = samples_of([300, 57, 410, 128, 90, 260], 1)
    from test_train_speed import dense_ttt_loss

    results = {}
    for kind in ("packed", "padded"):
        if kind == "packed":
            raw = collate_packed(samples, 2048, row_tokens)
            assert (raw["input_ids"].shape[1] % 128 == 0) == (row_tokens is None)
        else:
            raw = collate(samples, 2048)
        batch = make_batch(target, raw, torch.device("cuda"), torch.float32, vocab_ids)
        draft.zero_grad()
        attention = "flex" if kind == "packed" else "dense"
        unrolled = ttt.ttt_unroll(draft, batch.input_ids, batch.aux, K, attention, None, batch.positions, batch.doc)
        if kind == "packed":
            res = ttt.ttt_loss(draft, unrolled, batch.teacher, batch.loss_mask, batch.valid, True, batch.doc)
        else:
            res = dense_ttt_loss(draft, unrolled, batch.teacher, batch.loss_mask, batch.valid, per_sample=True)
        res.loss.backward()
        results[kind] = (res, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    (a, ga), (b, gb) = results["packed"], results["padded"]
    assert float(a.loss) == pytest.approx(float(b.loss), rel=1e-5)
    assert a.step_loss == pytest.approx(b.step_loss, rel=1e-5)
    assert a.step_count == b.step_count
    assert ga.keys() == gb.keys() and "midlayer.self_attn.q_proj.weight" in ga
    for n in ga:
        scale = float(gb[n].abs().max())
        assert scale > 0, n
        torch.testing.assert_close(ga[n], gb[n], rtol=0, atol=1e-4 * scale, msg=n)


def test_train_pack_compiled_heldout_acc_equals_the_padded_run_within_noise(tmp_path_factory, tmp_path, monkeypatch):
    from test_train import STEPS, TTT, config, shared_env

    env = shared_env(tmp_path_factory)
    runs = {}
    for kind in ("pack", "padded"):
        # packed: flex (its rows are short here, so auto would take dense) and --compile; padded: dense, eager
        attention = "flex" if kind == "pack" else "dense"
        monkeypatch.setattr(train_loop, "default_attention", lambda draft, device, a=attention: a)
        cfg = config(env, tmp_path / kind, data=str(env["prep"]), ttt_length=TTT, max_steps=STEPS, device="cuda",
                     dtype="float32", compile=kind == "pack", pack=kind == "pack")  # fmt: skip
        runs[kind] = train(cfg, progress=False)
    a, b = runs["pack"], runs["padded"]
    print(f"held-out acc_k pack {a.metrics['acc']} padded {b.metrics['acc']}")
    assert a.metrics["acc"][0] > 0.8
    assert a.metrics["acc"] == pytest.approx(b.metrics["acc"], abs=0.02)
    assert a.metrics["predicted_accept_length"] == pytest.approx(b.metrics["predicted_accept_length"], abs=0.15)
