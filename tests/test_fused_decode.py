"""Fused one-token decode kernels (fast/fused_decode.py), run on the CPU under Triton's interpreter in float32:
each kernel and the whole step against the model's own modules, and greedy decoding through them against the
reference decoder."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from models import attention_case, make_checkpoint  # noqa: E402
from tolerance import assert_close_float32, assert_step_matches_modules  # noqa: E402

from eaglescope.decode.vanilla import generate_vanilla  # noqa: E402
from eaglescope.fast import FastTarget, FastVanilla  # noqa: E402
from eaglescope.fast import invariant as inv  # noqa: E402
from eaglescope.fast.fused_decode import (  # noqa: E402
    FusedDecode,
    RopeRows,
    attend_fused,
    attention_limit,
    attention_scratch,
    attention_splits,
    flash_scratch,
    fused_attention,
    fused_decode_supported,
    fused_linear,
)
from eaglescope.models.targets import load_target  # noqa: E402
from eaglescope.models.targets.llama import RMSNorm, attend, fuse_projections  # noqa: E402

pytestmark = pytest.mark.skipif(not inv.available("cpu"), reason="needs TRITON_INTERPRET=1 on a CPU-only machine")


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 140),
    k=st.integers(1, 150),
    bn=st.sampled_from([1, 2, 4, 8]),
    bk=st.sampled_from([16, 64]),
    norm=st.booleans(),
    bias=st.booleans(),
    residual=st.booleans(),
    seed=st.integers(0, 99),
)
def test_fused_linear_matches_modules(n, k, bn, bk, norm, bias, residual, seed):
    """Partial row and K tiles included: out = [res +] W @ [RMSNorm](x) [+ b]."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    rms = RMSNorm(k, 1e-5)
    rms.weight.data = torch.randn(k, generator=g)
    res = torch.randn(1, n, generator=g)
    want = torch.nn.functional.linear(rms(x) if norm else x, w, b) + (res if residual else 0)
    out = res.clone() if residual else None
    got = fused_linear(x, w, b, norm=rms if norm else None, out=out, residual=residual, blocks=(bn, bk, 1))
    assert_close_float32(got, want, depth=2 if norm else 1)


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 20), S=st.integers(1, 300), rep=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_attention_matches_masked_reference(T, S, rep, seed):
    """Rows over up to five 64-slot splits, each split's partial sums combined by whichever program ends last; one
    row per program for T = 1, blocks of up to 64 (row, head) pairs of a kv group on tensor cores above."""
    q, k, v, mask = attention_case(T, S, rep, seed, density=0.3)
    want = attend(q, k, v, mask[None, None])
    assert_close_float32(attend(q, k, v, mask[None, None], impl=attend_fused), want)
    scratch = attention_scratch(T, q.shape[1], q.shape[3], S, "cpu")
    for _ in range(2):  # one scratch serves every call: its counters come back zeroed
        got = fused_attention(q[0].transpose(0, 1), k[0], v[0], mask, scratch=scratch)
        assert_close_float32(got.transpose(0, 1)[None], want)
    assert not scratch[3].any()
    assert attention_splits(S)[1] == -(-S // 64)


@settings(max_examples=8, deadline=None)
@given(T=st.integers(2, 40), S=st.integers(700, 4600), rep=st.sampled_from([1, 4]), seed=st.integers(0, 99))
def test_attention_over_many_splits_combines_every_split(T, S, rep, seed):
    """A long cache (12-64 splits of 64 or 128 slots) for a few rows: the last split to finish combines the others'
    maxima and sums at once and their outputs a few splits a load (1-4 by the row block), slots in any split."""
    q, k, v, mask = attention_case(T, S, rep, seed, density=0.02)
    mask[:, -1] = True  # the last split holds a slot of every row
    want = attend(q, k, v, mask[None, None])
    got = fused_attention(q[0].transpose(0, 1), k[0], v[0], mask)
    assert_close_float32(got.transpose(0, 1)[None], want)


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 70), S=st.integers(1, 2600), density=st.sampled_from([0.0, 0.001, 0.3]), seed=st.integers(0, 99)
)
def test_attention_limit_is_one_past_the_highest_allowed_slot(T, S, density, seed):
    """The kernel's answer (row blocks of 16, slot blocks of 256 folded by one atomic maximum each) against the
    definition, torch's: the highest slot any row allows, plus one; 0 for a mask that allows nothing."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(T, S, generator=g) < density
    if seed % 3 == 0:  # the highest allowed slot in one late row only, in the last slot block
        mask[T - 1, int(torch.randint(0, S, (1,), generator=g))] = True
    want = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 0
    got = attention_limit(mask)
    assert got.dtype == torch.int32 and got.shape == (1,)
    assert int(got) == want
    # a strided view (the verify's rows of a wider buffer) reads the same mask
    wide = torch.zeros(T, S + 7, dtype=torch.bool)
    wide[:, :S] = mask
    assert int(attention_limit(wide[:, :S])) == want


@settings(max_examples=30, deadline=None)
@given(
    T=st.integers(1, 40),
    S=st.integers(1, 300),
    rep=st.sampled_from([1, 2, 4]),
    cut=st.floats(0.05, 1.0),
    seed=st.integers(0, 99),
    rows=st.sampled_from([16, 32, 64]),
    slots=st.sampled_from([32, 64, 128]),
    splits=st.sampled_from([1, 2, 3, 5]),
    reuse=st.booleans(),
)
def test_flash_attention_matches_masked_reference(T, S, rep, cut, seed, rows, slots, splits, reuse):
    """The running-softmax kernel: rows in blocks of 16-64 (row, head) pairs, the slots in 32-128-slot blocks (the
    launches --sweep-flash times) up to one past the highest allowed slot (`cut` leaves the cache's tail unused, as a
    verify early in a long cache does); blocks with nothing allowed for some rows, rows whose first allowed slot
    comes late; the walk in 1-5 interleaved splits combined by the last to finish (splits with no block at all where
    the cache is short), its scratch made here or reused from a larger launch's, its counters left at zero."""
    q, k, v, mask = attention_case(T, S, rep, seed, density=0.3)
    mask[:, max(1, int(S * cut)) :] = False
    mask[
        torch.arange(T), torch.randint(0, max(1, int(S * cut)), (T,), generator=torch.Generator().manual_seed(seed))
    ] = True
    want = attend(q, k, v, mask[None, None])
    limit = attention_limit(mask)
    assert int(limit) == int(mask.any(0).nonzero().max()) + 1
    launch = (rows, slots, 4, 3, splits)
    scratch = None
    if reuse:  # partials not yet written read as NaN (the interpreter runs programs one after another, so "the first
        # to finish combines" still ends right here: that order is tests/gpu's to check)
        scratch = flash_scratch(T + 7, q.shape[1], q.shape[-1], launch, q.device)
        for part in scratch[:3]:
            part.fill_(float("nan"))
    got = fused_attention(
        q[0].transpose(0, 1), k[0], v[0], mask, scratch=scratch, flash=True, limit=limit, launch=launch
    )
    assert_close_float32(got.transpose(0, 1)[None], want)
    if scratch is not None:
        assert not scratch[3].any()  # every row block's counter back at zero for the next call


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def target(request, tmp_path_factory):
    ckpt = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=5, num_hidden_layers=3)
    return load_target(ckpt, device="cpu", dtype=torch.float32)


def test_step_matches_the_modules(target):
    """A step at a slot away from its position, with a mask that skips slots (a tree-like row) spread over three
    attention splits of 64 slots: the same logits, taps and cache writes as the model's modules. Small blocks so
    every kernel has several programs and a partial tile (vocab 96 over 64-row blocks)."""
    model = fuse_projections(copy.deepcopy(target.model))
    ft = FastTarget(model, size=150, taps=(0, 2), float32_logits=True)
    ft.prefill(torch.tensor([3, 17, 5, 40, 22, 9, 61]))
    blocks = {"qkv": (2, 16, 1), "o": (4, 32, 1), "gate_up": (8, 16, 1), "down": (2, 64, 1), "lm_head": (64, 32, 2)}
    fd = FusedDecode(model, ft.cache, taps=(0, 2), blocks=blocks)
    assert fd.attn_splits == 3
    mask = torch.zeros(1, 150, dtype=torch.bool)
    mask[0, :7] = True
    mask[0, [70, 131]] = True  # an earlier tree node on this row's path, and the row's own slot
    slot, pos, tok = torch.tensor([131]), torch.tensor([8]), torch.tensor([33])
    ft.cache.k[:, :, :, 60:80].normal_()  # that node's keys, and masked-out neighbours
    ft.cache.v[:, :, :, 60:80].normal_()
    depth = len(model.model.layers) + 1  # every layer, then the head
    assert_step_matches_modules(ft, lambda t, p, m, s: fd(t, p, m[0], s), tok, pos, mask, slot, depth)


def test_greedy_decoding_through_the_kernels_is_vanilla_greedy(target):
    prompt, n = [3, 17, 5, 40, 22, 9], 8
    ref = generate_vanilla(target, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(copy.deepcopy(target.model), size=32, fuse=True, fused_decode=True)
    assert ft.fused is not None
    assert FastVanilla(ft, n).generate(prompt).tokens == ref


@pytest.mark.parametrize("rope_type", ["default", "llama3", "dynamic"])
def test_rope_rows_are_what_rope_for_gives_each_position(tmp_path, rope_type):
    """The fused steps' table gather against the model's own rope_for, in bf16 as the GPU runs it: every position
    below the cache's size, in any order and repeated, bit for bit. "dynamic" rescales past max_position_embeddings
    (32 here), so it must keep rope_for: a table of the first 32 positions would be wrong beyond them."""
    scaling = {"llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16},
               "dynamic": {"rope_type": "dynamic", "factor": 2.0}}  # fmt: skip
    extra = {"rope_scaling": scaling[rope_type]} if rope_type in scaling else {}
    ckpt = make_checkpoint("llama", tmp_path / rope_type, num_hidden_layers=1, max_position_embeddings=32, **extra)
    model = load_target(ckpt, device="cpu", dtype=torch.bfloat16).model
    assert model.args.rope.rope_type == rope_type
    rows = RopeRows(model, size=90, rows=7)
    assert (rows.table is None) == (rope_type == "dynamic")
    for positions in ([0, 1, 2, 3, 4, 5, 6], [89, 3, 3, 60, 31, 32, 0], [88]):
        p = torch.tensor(positions)
        want = model.rope_for(p[None])
        got = rows(p)
        for g, w in zip(got, want):
            assert g.dtype == torch.bfloat16
            assert torch.equal(g, w.reshape(len(positions), -1))


def test_unsupported_targets_are_refused_with_the_reason(tmp_path):
    qwen3 = load_target(make_checkpoint("qwen3", tmp_path / "q3", num_hidden_layers=2), device="cpu")
    assert "q/k norms" in fused_decode_supported(fuse_projections(qwen3.model), "cpu")
    llama = load_target(make_checkpoint("llama", tmp_path / "l", num_hidden_layers=2), device="cpu")
    unfused = copy.deepcopy(llama.model)
    with pytest.raises(ValueError, match="fuse_projections"):
        FastTarget(unfused, size=16, fused_decode=True)
    with pytest.raises(ValueError, match="reduction order"):
        FastTarget(copy.deepcopy(llama.model), size=16, fuse=True, fused_decode=True, batch_invariant=True)
