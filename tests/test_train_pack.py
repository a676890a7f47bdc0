"""`train --pack` (train/packing.py): a micro-batch's samples packed into rows as documents train exactly as the same
samples run alone: the same logits at every real position and TTT step, the same loss, per-step accuracies and
gradients (float32, CPU, a tiny Llama target run online and a draft built here); over random length mixes
(hypothesis); the packed flex mask allowing exactly the dense packed mask's pairs; and the command itself, whose
held-out acc_k matches the padded run's."""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import make_checkpoint

from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract
from eaglescope.train import attention
from eaglescope.train.loop import collate, make_batch
from eaglescope.train.packing import ROW_MULTIPLE, collate_packed, plan
from eaglescope.train.ttt import draft_vocab_ids, ttt_loss, ttt_mask, ttt_unroll

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny native Llama target (tapped) and a random draft for it; the draft trains (gradients), float32."""
    path = make_checkpoint("llama", tmp_path_factory.mktemp("pack") / "target", seed=3)
    target = load_target(path, device="cpu", dtype=torch.float32)
    target.set_taps(TapContract.default(target.num_layers))
    draft, _ = make_draft(path, draft_vocab_size=40, seed=1)
    return path, target, draft.train()


def samples_of(lengths: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    """Samples of these lengths: random ids, a prompt (a random prefix) outside the loss mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.long)
        mask[: int(torch.randint(0, max(1, n // 2), (1,), generator=g))] = 0
        out.append({"input_ids": torch.randint(0, 96, (n,), generator=g), "loss_mask": mask})
    return out


def run(target, draft, raw, K, attention_kind="dense", grad=True):
    """make_batch, the TTT unroll and the per-sample loss, as the training step runs them → (batch, logits, loss,
    gradients by name)."""
    batch = make_batch(target, raw, torch.device("cpu"), torch.float32, draft_vocab_ids(draft))
    draft.zero_grad()
    with torch.set_grad_enabled(grad):
        unrolled = ttt_unroll(draft, batch.input_ids, batch.aux, K, attention_kind, None, batch.positions, batch.doc)
        res = ttt_loss(draft, unrolled, batch.teacher, batch.loss_mask, batch.valid, per_sample=True, doc=batch.doc)
    grads = {}
    if grad:
        res.loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return batch, unrolled.logits, res, grads


def where(raw: dict) -> list[tuple[int, int, int]]:
    """(row, start, end) of each sample of a packed raw batch, in sample order."""
    layout = raw["layout"]
    out = [None] * len(layout.order)
    for i, seg in zip(layout.order, layout.segments, strict=True):
        out[i] = seg
    return out


def assert_same_logits(packed_raw, packed_logits, padded_logits, lengths):
    for k, (lp, ld) in enumerate(zip(packed_logits, padded_logits, strict=True)):
        for i, (r, a, b) in enumerate(where(packed_raw)):
            torch.testing.assert_close(lp[r, a:b], ld[i, : lengths[i]], rtol=0, atol=1e-5, msg=f"step {k} sample {i}")


@pytest.mark.parametrize("K", [2, 4])
def test_a_packed_batch_trains_as_its_samples_alone(pair, K):
    _, target, draft = pair
    lengths = [37, 5, 60, 18, 33, 2, 41]
    samples = samples_of(lengths, K)
    packed_raw = collate_packed(samples, 64)
    assert packed_raw["input_ids"].shape[0] < len(samples)  # several samples share a row
    _, packed_logits, packed, packed_grads = run(target, draft, packed_raw, K)
    # each sample alone (a batch of one, no padding): the per-sample mean loss, averaged, and its gradient
    alone = [run(target, draft, collate([s], 64), K) for s in samples]
    n = len(samples)
    torch.testing.assert_close(packed.loss, sum(a[2].loss for a in alone) / n, rtol=1e-5, atol=1e-6)
    for name, g in packed_grads.items():
        expected = sum(a[3][name] for a in alone) / n
        torch.testing.assert_close(g, expected, rtol=0, atol=1e-5 * max(1.0, float(expected.abs().max())), msg=name)
    # the per-step counts and accuracies are positions summed over the samples
    for k in range(K):
        assert packed.step_count[k] == sum(a[2].step_count[k] for a in alone)
        hits = sum(a[2].step_acc[k] * a[2].step_count[k] for a in alone if a[2].step_count[k])
        assert packed.step_acc[k] * packed.step_count[k] == pytest.approx(hits, abs=1e-6)
    # and the logits at every real position and step are the sample's own (the padded batch's)
    padded_raw = collate(samples, 64)
    _, padded_logits, padded, _ = run(target, draft, padded_raw, K, grad=False)
    assert_same_logits(packed_raw, packed_logits, padded_logits, lengths)
    assert packed.step_loss == pytest.approx(padded.step_loss, rel=1e-5)


def test_packing_without_document_masks_would_differ(pair):
    """The check above can fail: the same rows with one document per row (the masks off) give other logits."""
    _, target, draft = pair
    samples = samples_of([20, 30, 10], 7)
    raw = collate_packed(samples, 64)
    _, masked, _, _ = run(target, draft, raw, 3, grad=False)
    merged = dict(raw, doc=torch.where(raw["doc"] >= 0, 0, -1))  # every row one document
    merged["positions"] = torch.arange(raw["input_ids"].shape[1]).expand_as(raw["doc"]).contiguous()
    _, unmasked, _, _ = run(target, draft, merged, 3, grad=False)
    r, a, b = next(seg for seg in where(raw) if seg[1] > 0)  # a document that does not start its row
    assert (masked[2][r, a:b] - unmasked[2][r, a:b]).abs().max() > 1e-3


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=9),
    capacity=st.integers(70, 200),
    K=st.integers(2, 3),
    seed=st.integers(0, 2**16),
)
def test_any_length_mix_packs_to_the_padded_result(pair, lengths, capacity, K, seed):
    _, target, draft = pair
    samples = samples_of(lengths, seed)
    packed_raw = collate_packed(samples, capacity)
    layout = packed_raw["layout"]
    # the layout: every sample once, rows within capacity, documents contiguous, in row order, padding at row ends
    assert sorted(layout.order) == list(range(len(lengths)))
    doc = packed_raw["doc"]
    for r in range(layout.rows):
        row = doc[r][doc[r] >= 0]
        assert len(row) <= capacity and bool((row.diff() >= 0).all()) and bool((doc[r][len(row) :] == -1).all())
    _, packed_logits, packed, _ = run(target, draft, packed_raw, K, grad=False)
    _, padded_logits, padded, _ = run(target, draft, collate(samples, capacity), K, grad=False)
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-5, atol=1e-6)
    assert packed.step_count == padded.step_count
    assert_same_logits(packed_raw, packed_logits, padded_logits, lengths)


def test_plan_is_first_fit_longest_first():
    # longest first: 9 opens row 0, 7 row 1, 5 fills row 1, 3 fills row 0, 2 opens row 2
    layout = plan([5, 9, 3, 7, 2], 12)
    assert layout.rows == 3 and layout.order == [1, 2, 3, 0, 4] and layout.length == 12
    assert plan([1000, 30], 1100).length == 1152 == 9 * ROW_MULTIPLE  # 1,030 tokens, a row flex runs: 9 blocks
    assert layout.segments == [(0, 0, 9), (0, 9, 12), (1, 0, 7), (1, 7, 12), (2, 0, 2)]
    with pytest.raises(ValueError):
        plan([13], 12)


def padded_doc(lengths: list[int], capacity: int, multiple: int = 1) -> torch.Tensor:
    """A packed layout's doc [R, T], its rows padded (-1) to a multiple of `multiple`."""
    doc = collate_packed(samples_of(lengths, 0), capacity)["doc"]
    pad = -doc.shape[1] % multiple
    return torch.nn.functional.pad(doc, (0, pad), value=-1)


# aligned rows (T a multiple of 128: the block-range construction) and a short unaligned one (create_block_mask)
@pytest.mark.parametrize(
    "lengths,k,multiple",
    [([100, 200, 60, 150], 0, 128), ([100, 200, 60, 150], 3, 128), ([300, 7, 7, 130], 2, 128), ([50, 20, 70], 2, 1)],
)
def test_the_packed_block_mask_allows_exactly_the_dense_packed_pairs(lengths, k, multiple):
    doc = padded_doc(lengths, 384, multiple)
    R, T = doc.shape
    S = (k + 1) * T
    bm = attention.packed_ttt_block_mask(doc, S)
    dense = ttt_mask(T, k, "cpu", doc)[:, 0]
    q = torch.arange(T)[:, None].expand(T, S)
    kv = torch.arange(S)[None, :].expand(T, S)
    h = torch.zeros((), dtype=torch.long)
    for b in range(R):
        assert torch.equal(bm.mask_mod(torch.tensor(b), h, q, kv), dense[b])
    # the blocks computed are exactly those holding an allowed pair, and the blocks marked full hold allowed pairs only
    nq, nk = -(-T // 128), -(-S // 128)
    tiles = torch.nn.functional.pad(dense, (0, nk * 128 - S, 0, nq * 128 - T)).reshape(R, nq, 128, nk, 128)
    blocks = bm.to_dense()[:, 0].bool()
    assert torch.equal(blocks, tiles.any(4).any(2))
    if multiple == 128:
        full = torch.zeros_like(blocks)
        n_full = bm.full_kv_num_blocks[:, 0]
        for b in range(R):
            for i in range(nq):
                full[b, i, bm.full_kv_indices[b, 0, i, : n_full[b, i]].long()] = True
        assert torch.equal(full, tiles.all(4).all(2))
        # a 300-token document at a row's start fills blocks 0 and 1: full blocks are exercised there
        assert bool(full.any()) == (max(lengths) >= 256)


# rows of 240 tokens (create_block_mask) and rows of 1,100 real tokens padded to 1,152 (the block-range construction)
@pytest.mark.parametrize("lengths,capacity", [([150, 40, 200, 90], 256), ([600, 300, 500, 200], 1100)])
def test_the_flex_unroll_of_a_packed_batch_gives_the_dense_logits(pair, lengths, capacity):
    _, _, draft = pair
    raw = collate_packed(samples_of(lengths, 11), capacity)
    assert (raw["input_ids"].shape[1] % 128 == 0) == (capacity > 1000)
    aux = torch.randn(*raw["input_ids"].shape, draft.fc.in_features, generator=torch.Generator().manual_seed(1))
    args = (raw["input_ids"], aux, 3)
    with torch.no_grad():
        dense = ttt_unroll(draft, *args, "dense", None, raw["positions"], raw["doc"])
        flex = ttt_unroll(draft, *args, "flex", None, raw["positions"], raw["doc"])
    valid = raw["valid"].bool()
    for k in range(3):
        torch.testing.assert_close(flex.logits[k][valid], dense.logits[k][valid], rtol=0, atol=1e-5, msg=f"step {k}")


def test_a_transformers_target_is_run_padded_and_moved_into_the_packed_layout(pair):
    path, native, draft = pair
    hf = load_target(path, device="cpu", dtype=torch.float32, backend="hf")
    hf.set_taps(TapContract.default(hf.num_layers))
    samples = samples_of([30, 12, 50], 5)
    raw = collate_packed(samples, 64)
    vocab_ids = draft_vocab_ids(draft)
    a = make_batch(native, raw, torch.device("cpu"), torch.float32, vocab_ids)
    b = make_batch(hf, raw, torch.device("cpu"), torch.float32, vocab_ids)
    valid = raw["valid"].bool()
    torch.testing.assert_close(a.aux[valid], b.aux[valid], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.teacher.logits[valid], b.teacher.logits[valid], rtol=1e-4, atol=1e-4)


def test_stored_hidden_states_pack_as_the_online_target_runs_them(pair):
    """prepare --hidden-states data: each sample's stored states are moved into the packed layout, and equal what the
    target computes for the packed rows online."""
    _, target, draft = pair
    samples = samples_of([25, 40, 9], 2)
    stored = []
    for s in samples:
        out = target.hidden_states(s["input_ids"][None], torch.ones(1, len(s["input_ids"])), logits=False)
        stored.append(s | {"aux": out.aux[0].clone(), "final_hidden": out.final_hidden[0].clone()})
    vocab_ids = draft_vocab_ids(draft)
    online = make_batch(target, collate_packed(samples, 64), torch.device("cpu"), torch.float32, vocab_ids)
    offline = make_batch(target, collate_packed(stored, 64), torch.device("cpu"), torch.float32, vocab_ids)
    valid = online.valid.bool()
    assert torch.equal(online.doc, offline.doc) and torch.equal(online.positions, offline.positions)
    torch.testing.assert_close(offline.aux[valid], online.aux[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(offline.teacher.logits[valid], online.teacher.logits[valid], rtol=1e-5, atol=1e-5)


# -- the command ---------------------------------------------------------------------------------------------------
def test_train_pack_matches_the_padded_run(tmp_path_factory, tmp_path, capsys):
    """`eaglescope train --pack` on the order-2-chain data of tests/test_train.py (samples of 20-60 tokens, online
    target): the same steps over the same samples, so the loss curve and the held-out acc_k equal the padded run's."""
    import json

    from test_train import MAX_LEN, shared_env

    from eaglescope.cli import main

    env = shared_env(tmp_path_factory)
    common = ["train", "--target", str(env["target"]), "--data", str(env["prep"]), "--max-steps", "40",
              "--batch-size", "8", "--lr", "2e-3", "--eval-fraction", "0.25", "--max-length", str(MAX_LEN),
              "--ttt-length", "4", "--device", "cpu", "--dtype", "float32", "--seed", "0"]  # fmt: skip
    metrics = {}
    for mode in ("padded", "pack"):
        out = tmp_path / mode
        rc = main(common + ["--out", str(out)] + (["--pack"] if mode == "pack" else []))
        assert rc in (0, None), capsys.readouterr().err
        metrics[mode] = json.loads((out / "training_metrics.json").read_text())
    padded, packed = metrics["padded"], metrics["pack"]
    assert packed["acc"] == pytest.approx(padded["acc"], abs=0.01)
    assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-3)
    assert packed["acc"][0] > 0.4  # it learned (an untrained draft sits near 1/8)
    # packed rows hold fewer pad tokens: the same real tokens were counted
    assert packed["speed"]["tokens"] == padded["speed"]["tokens"]


def test_bench_train_pack_tiny_runs_the_product_padded_and_packed(tmp_path, capsys):
    """bench/train_pack.py --tiny: the 8B benchmark's code path on the CPU. Both runs take the same samples (batch 2),
    so they count the same real tokens, step by step; packing computes no more positions than padding."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import train_pack

    args = ["--tiny", "--no-compile", "--runs", "padded:2,pack:2", "--steps", "3", "--out", str(tmp_path)]
    rc = train_pack.main(args)
    assert rc == 0, capsys.readouterr().err
    (path,) = tmp_path.glob("train-pack-*-tiny.json")
    result = json.loads(path.read_text())
    padded, packed = result["runs"]
    assert (padded["mode"], packed["mode"]) == ("padded", "pack") and padded["rc"] == packed["rc"] == 0
    tokens = [s["tokens"] for s in padded["steps"]]
    assert [s["tokens"] for s in packed["steps"]] == tokens and len(tokens) == 3
    assert padded["tokens_per_second"] > 0 and packed["tokens_per_second"] > 0
    # eager: only the first step is left out of the rates (nothing compiles)
    assert [s["left_out"] for s in packed["steps"]] == [True, False, False] and packed["timed_steps"] == 2
    assert packed["layout"]["real_tokens"] == padded["layout"]["real_tokens"] == sum(tokens)
    assert packed["layout"]["computed_positions"] <= padded["layout"]["computed_positions"]
    assert packed["heldout"]["acc"] is not None and path.with_suffix(".md").is_file()
