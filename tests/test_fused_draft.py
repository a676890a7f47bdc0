"""The draft layer on fused kernels (fast/fused_draft.py), under Triton's interpreter in float32: a catch-up and a
tree level against the draft's own modules (its output, the final norm's logits, the draft-cache writes) for the
EAGLE 3.1 norm flags, speculative decoding through it against vanilla greedy and the modules' run, and doctor on
a trace recorded through it."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from drafts import check_finalize, check_level_inputs, check_tree_start, make_draft  # noqa: E402
from models import WIDE_HEADS, make_checkpoint  # noqa: E402
from tolerance import assert_close_float32, assert_draft_step_matches_modules  # noqa: E402

from eaglescope import trace as T  # noqa: E402
from eaglescope.decode.speculative import Eagle3Proposer, draft_slot_cache, target_embedding  # noqa: E402
from eaglescope.decode.tree import TreeBuilder, expand_level, top_k_rows, tree_capacity  # noqa: E402
from eaglescope.decode.vanilla import generate_vanilla  # noqa: E402
from eaglescope.detective.diagnose import diagnose_trace  # noqa: E402
from eaglescope.fast import FastEagle, FastTarget  # noqa: E402
from eaglescope.fast import invariant as inv  # noqa: E402
from eaglescope.fast.fused_draft import (  # noqa: E402
    FusedDraftStep,
    expand_level_fused,
    fused_draft_supported,
    log_softmax_top_k,
)
from eaglescope.models.draft import load_draft, save_draft  # noqa: E402
from eaglescope.models.targets import load_target  # noqa: E402
from eaglescope.models.targets.llama import fuse_projections  # noqa: E402
from eaglescope.taps import TapContract  # noqa: E402

pytestmark = pytest.mark.skipif(not inv.available("cpu"), reason="needs TRITON_INTERPRET=1 on a CPU-only machine")

S = 40  # draft cache slots


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("fd"), seed=5, num_hidden_layers=7)


def _draft(target_dir, **options):
    draft, _ = make_draft(target_dir, draft_vocab_size=48, seed=9, random_norms=True, **options)
    return fuse_projections(draft)


def _calls():
    """(rows, positions, slots, mask): a catch-up of 5 positions after 7 cached ones (causal), and a tree level of
    4 rows at slots 30..33 that see the 12-slot context and their own ancestors at scattered slots."""
    g = torch.Generator().manual_seed(0)
    catch_slots = 7 + torch.arange(5)
    catch_mask = torch.arange(S)[None, :] <= catch_slots[:, None]
    tree_slots = 30 + torch.arange(4)
    tree_mask = torch.zeros(4, S, dtype=torch.bool)
    tree_mask[:, :12] = True
    tree_mask[torch.arange(4), tree_slots] = True
    tree_mask[1, 26] = tree_mask[2, [25, 27]] = tree_mask[3, 26] = True
    pos = torch.full((4,), 13)
    return [(5, 7 + torch.arange(5), catch_slots, catch_mask), (4, pos, tree_slots, tree_mask)], g


@pytest.mark.parametrize(
    "options",
    [{}, {"norm_before_residual": True}, {"norm_output": True, "norm_before_fc": True}, {"logit_scale": 0.7},
     {"k_splits": {"o": 2, "down": 4}}, {"k_splits": {"down": 2}, "norm_before_residual": True}],
    ids=["eagle3", "norm_before_residual", "norm_output", "logit_scale", "k_splits", "k_splits_nbr"],
)  # fmt: skip
def test_draft_step_matches_the_modules(target_dir, options):
    """Each call's output (what the next step receives), the head's logits over the final norm and the keys and
    values written at its slots: the modules' `step` and `logits` from the same cache, to float32's bound; o and
    down also as float32 partials over K's slices that the next norm kernel sums (k_splits)."""
    options = dict(options)
    k_splits = options.pop("k_splits", {})
    set_after = ("logit_scale", "norm_before_residual")  # config fields for_target does not take
    draft = _draft(target_dir, **{k: v for k, v in options.items() if k not in set_after})
    for k in set_after:
        if k in options:
            setattr(draft.config, k, options[k])
    draft.midlayer.norm_before_residual = draft.config.norm_before_residual
    cache = draft_slot_cache(draft, S)
    cache.k.normal_(generator=torch.Generator().manual_seed(1))
    cache.v.normal_(generator=torch.Generator().manual_seed(2))
    fused = FusedDraftStep(draft, cache, rows=5)
    fused.k_splits.update(k_splits)
    H = draft.config.hidden_size
    calls, g = _calls()
    for rows, positions, slots, mask in calls:
        embeds, hidden = torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g) * 3
        assert_draft_step_matches_modules(fused, draft, embeds, hidden, positions, slots, mask)


def test_the_embedding_goes_first_in_the_attention_input(target_dir):
    """The 2H input's halves are told apart: the fused step's q/k/v input is [input_layernorm(embedding),
    hidden_norm(h)], so a draft whose q/k/v weights are swapped between the halves gives another output."""
    draft = _draft(target_dir)
    swapped = copy.deepcopy(draft)
    w = swapped.midlayer.self_attn.qkv_proj.weight
    H = draft.config.hidden_size
    with torch.no_grad():
        w.copy_(torch.cat([w[:, H:], w[:, :H]], dim=1))
    (rows, positions, slots, mask), g = _calls()[0][0], torch.Generator().manual_seed(3)
    embeds, hidden = torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g)
    cos, sin = (x[0, 0] for x in draft.midlayer.rotary(positions[None], embeds.dtype))
    outs = []
    for d in (draft, swapped):
        outs.append(FusedDraftStep(d, draft_slot_cache(d, S), rows=rows)(embeds, hidden, cos, sin, slots, mask)[0])
    with torch.inference_mode():
        want = draft.step(embeds[None], hidden[None], positions[None], draft_slot_cache(draft, S), slots,
                          mask[None, None])[0]  # fmt: skip
    assert_close_float32(outs[0], want, depth=2)
    assert (outs[1] - want).abs().amax() > 100 * (outs[0] - want).abs().amax() + 1e-3


@pytest.mark.parametrize("norm_output", [False, True])
def test_speculative_decoding_through_the_fused_draft_is_vanilla_greedy(target_dir, norm_output):
    """FastEagle with the draft layer on the fused kernels: vanilla greedy's tokens, and the very acceptance of the
    same round on the draft's modules (the draft proposes the same trees)."""
    tgt = load_target(target_dir, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(target_dir, taps=tgt.taps, seed=14, norm_output=norm_output)
    draft.load_target_embedding(target_embedding(tgt))
    fuse_projections(draft)
    prompt, n = [3, 17, 5, 40, 22, 9, 11], 14
    ref = generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids
    runs = []
    for fused in (False, True):
        ft = FastTarget(copy.deepcopy(tgt.model), 64, taps=tgt.taps.layers)
        fe = FastEagle(ft, draft, 3, 3, 8, max_len=len(prompt) + n + 2, fused_draft=fused)
        assert (fe.fused_layer is not None) == fused
        runs.append(fe.generate(prompt, n))
    assert runs[1].tokens == runs[0].tokens == ref
    assert runs[1].accepted == runs[0].accepted
    assert sum(runs[1].accepted) > 0


def test_a_tree_levels_inputs_in_one_launch_are_the_composed_ones(target_dir, monkeypatch):
    """FusedDraftStep.level_inputs (one kernel) against Eagle3Proposer.level_inputs at every level of every round of
    a real decode (a 48-token draft vocabulary, so draft ids map to the target's): the same tokens, positions,
    embeddings, features, slots, mask rows and writes to slot_of, exactly; the decode through it is vanilla greedy.
    With the kernel off, and for a proposer overriding one hook, the composed function runs."""
    tgt = load_target(target_dir, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(target_dir, taps=tgt.taps, seed=14, draft_vocab_size=48)
    draft.load_target_embedding(target_embedding(tgt))
    fuse_projections(draft)
    assert draft.d2t.any()
    checked = check_level_inputs(monkeypatch)
    prompt, n = [3, 17, 5, 40, 22, 9, 11], 14
    ref = generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(copy.deepcopy(tgt.model), 64, taps=tgt.taps.layers)
    fe = FastEagle(ft, draft, 4, 3, 10, max_len=len(prompt) + n + 2, fused_draft=True)
    assert fe.generate(prompt, n).tokens == ref
    assert checked and set(checked) == {1, 2, 3}  # levels 1..depth-1 of every round
    fe.set_one_launch(False)
    assert fe.proposer.pieces.level_inputs == fe.proposer.level_inputs
    fault = FastEagle(ft, draft, 4, 3, 10, max_len=len(prompt) + n + 2, fused_draft=True,
                      proposer_cls=_FeedbackPostnorm)  # fmt: skip
    assert fault.fused_layer.one_launch and fault.proposer.pieces.level_inputs == fault.proposer.level_inputs


@pytest.mark.parametrize("depth,top_k", [(4, 3), (3, 10)])
def test_a_trees_start_in_one_launch_is_the_composed_one(target_dir, depth, top_k):
    """FusedDraftStep.tree_start (one kernel) against Eagle3Proposer.tree_start: the builder's buffers of the root
    alone, the context's mask, slot_of and level 1's parents and features, exactly; again over buffers a round has
    filled with other values (every entry is rewritten)."""
    tgt = load_target(target_dir, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(target_dir, taps=tgt.taps, seed=14, draft_vocab_size=48)
    fuse_projections(draft)
    ft = FastTarget(copy.deepcopy(tgt.model), 64, taps=tgt.taps.layers)
    fe = FastEagle(ft, draft, depth, top_k, 10, max_len=30, fused_draft=True)
    assert fe.proposer.pieces.tree_start == fe.fused.tree_start
    check_tree_start(fe, tree_capacity(top_k, depth, 48), seed=top_k)


def test_the_fused_draft_is_the_default_where_the_target_verifies_on_fused_kernels(tmp_path):
    """FastEagle's fused_draft=None: the fused draft layer where the target's verifies run the fused kernels and the
    draft is one it runs; the modules on a target without them, or for a draft it cannot run (unfused projections)."""
    target_dir = make_checkpoint("llama", tmp_path, seed=5, num_hidden_layers=7, **WIDE_HEADS)
    tgt = load_target(target_dir, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    fused_model = fuse_projections(copy.deepcopy(tgt.model))
    on_kernels = FastTarget(fused_model, 64, taps=tgt.taps.layers, fused_decode=True, fused_verify=True)
    plain = FastTarget(copy.deepcopy(tgt.model), 64, taps=tgt.taps.layers)
    assert on_kernels.fused_rows is not None and plain.fused_rows is None
    draft, _ = make_draft(target_dir, taps=tgt.taps, seed=14)
    unfused = copy.deepcopy(draft)
    fuse_projections(draft)
    layer = lambda ft, d: FastEagle(ft, d, 3, 3, 8, max_len=20).fused_layer  # noqa: E731
    assert isinstance(layer(on_kernels, draft), FusedDraftStep)
    assert layer(plain, draft) is None
    assert layer(on_kernels, unfused) is None


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(3, 700), st.integers(1, 8), st.integers(0, 2**31 - 1),
       st.sampled_from(["distinct", "ties", "masked"]), st.sampled_from([torch.float32, torch.bfloat16]),
       st.sampled_from([16, 64, 2048]))  # fmt: skip
def test_log_softmax_top_k_is_torchs(m, vocab, k, seed, kind, dtype, chunk):
    """The one-launch top-k children of a head's logits, its rows cut into 1-44 chunks whose last program merges:
    torch's log-softmax values (float32), best first, at distinct columns that hold them; the very columns where
    nothing ties; with -inf entries (a masked vocabulary: whole chunks of -inf, rows with fewer finite entries than
    k) still distinct columns; the row counters left at zero for the next call."""
    k = min(k, vocab)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, vocab, generator=g) * 3).to(dtype)
    if kind == "ties":
        x = (x * 2).round() / 2
    if kind == "masked":  # most of every row masked out (one column of each kept), the first row all but one
        drop = torch.rand(m, vocab, generator=g) < 0.9
        drop[torch.arange(m), torch.randint(vocab, (m,), generator=g)] = False
        x = x.masked_fill(drop, float("-inf"))
        x[0, :] = float("-inf")
        x[0, vocab // 2] = 1.0
    lp = torch.log_softmax(x.float(), dim=-1)
    count = torch.zeros(m + 1, dtype=torch.int32)
    vals, ids = log_softmax_top_k(x, k, count, chunk=chunk)
    assert not count.any()
    ref_vals, ref_ids = top_k_rows(lp, k)
    assert vals.dtype == torch.float32 and ids.dtype == torch.long and vals.shape == ids.shape == (m, k)
    torch.testing.assert_close(vals, ref_vals, rtol=1e-6, atol=1e-6)
    assert torch.equal(lp.gather(1, ids), vals) or torch.allclose(lp.gather(1, ids), vals, rtol=1e-6, atol=1e-6)
    assert all(len(set(r)) == k for r in ids.tolist())
    assert bool((ids >= 0).all() and (ids < vocab).all())
    if kind == "distinct" and dtype == torch.float32:
        assert torch.equal(ids, ref_ids)


def test_log_softmax_top_k_breaks_ties_towards_the_lower_column():
    x = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    vals, ids = log_softmax_top_k(x, 4)
    assert ids.tolist() == [[1, 3, 4, 2]]
    torch.testing.assert_close(vals, torch.log_softmax(x, -1)[:, [1, 3, 4, 2]])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(3, 40), st.integers(0, 2**31 - 1), st.booleans())
def test_expand_level_in_one_launch_is_the_builders(top_k, levels, vocab, seed, ties):
    """A whole tree grown level by level through the one-launch expansion and through decode/tree.py's: the same
    builder buffers (tokens, parents, depths, scores, lineage, next id) after every level, and the same frontier, best
    first (with coarse log-probs, where candidates tie, the same cumulative log-probs at distinct new ids)."""
    g = torch.Generator().manual_seed(seed)
    builders = [TreeBuilder(7, top_k, "cpu", levels=levels, vocab=vocab, expand_fn=fn)
                for fn in (expand_level, expand_level_fused)]  # fmt: skip
    frontiers = [torch.tensor([0])] * 2
    for _ in range(levels):
        lp = torch.log_softmax(torch.randn(frontiers[0].shape[0], vocab, generator=g) * 3, -1)
        if ties:
            lp = (lp * 2).round() / 2
        k = min(top_k, vocab)
        nxt = []
        for b, f in zip(builders, frontiers, strict=True):
            nxt.append(b.expand(f, top_k_rows(lp, k)))
        ref, got = builders
        for name in ("tokens", "parents", "depths", "scores", "lineage", "next_id"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name
        if ties:
            assert torch.equal(ref.scores[nxt[1]], ref.scores[nxt[0]]) and len(set(nxt[1].tolist())) == len(nxt[1])
            nxt[1] = nxt[0]  # grow both from the same frontier
        else:
            assert torch.equal(nxt[1], nxt[0])
        frontiers = nxt


@pytest.fixture(scope="module")
def small_vocab_eagle(target_dir):
    """A FastEagle whose Eagle3Proposer runs on the fused draft layer, with a 48-token draft vocabulary (so ids map
    to the target's)."""
    tgt = load_target(target_dir, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(target_dir, taps=tgt.taps, seed=14, draft_vocab_size=48)
    fuse_projections(draft)
    assert draft.d2t.any()
    ft = FastTarget(copy.deepcopy(tgt.model), 64, taps=tgt.taps.layers)
    return FastEagle(ft, draft, 4, 3, 10, max_len=30, fused_draft=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(2, 48), st.integers(0, 2**31 - 1),
       st.sampled_from(["distinct", "ties", "nan"]), st.integers(1, 140))  # fmt: skip
def test_a_trees_finalize_in_one_launch_is_the_composed_one(small_vocab_eagle, top_k, levels, vocab, seed, scores,
                                                           total):  # fmt: skip
    """FusedDraftStep.finalize (one kernel) against Eagle3Proposer.finalize over a builder grown by decode/tree.py:
    the same tokens (draft ids mapped to the target's), parents, depths, scores, source ids and ancestor mask,
    exactly, whatever the total kept. With coarse log-probs many candidates tie (the rank then goes to the shallower,
    then the earlier node); with one draft row all NaN its subtree ranks last (NaN as -inf, in both), so no node is kept
    without its parent."""
    check_finalize(small_vocab_eagle, top_k, levels, vocab, seed, scores, total)


def test_finalize_runs_in_one_launch_only_for_the_proposers_own_wiring_and_small_trees(target_dir):
    """The one-launch finalize stands in for Eagle3Proposer's own finalize on trees its kernel holds (the (4, 3) tree's
    40 nodes); a proposer overriding the draft-to-target map it hard-codes, the switch off, and a (7, 10) tree's 611
    nodes run the composed finalize."""
    tgt = load_target(target_dir, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(target_dir, taps=tgt.taps, seed=14)
    fuse_projections(draft)
    ft = FastTarget(copy.deepcopy(tgt.model), 128, taps=tgt.taps.layers)
    small = FastEagle(ft, draft, 4, 3, 10, max_len=30, fused_draft=True)
    assert small.proposer.pieces.finalize == small.fused.finalize
    small.set_one_launch(False)
    assert small.proposer.pieces.finalize == small.proposer.finalize
    wide = FastEagle(ft, draft, 7, 10, 60, max_len=30, fused_draft=True).proposer
    assert tree_capacity(10, 7, draft.config.draft_vocab_size) == 611 and wide.pieces.finalize == wide.finalize
    own_map = FastEagle(ft, draft, 4, 3, 10, max_len=30, fused_draft=True, proposer_cls=_ShiftedIds)
    assert own_map.fused_layer.one_launch and own_map.proposer.pieces.finalize == own_map.proposer.finalize


def test_unsupported_drafts_are_refused_with_the_reason(target_dir):
    draft, _ = make_draft(target_dir, draft_vocab_size=48)
    assert "fuse_projections" in fused_draft_supported(draft)
    with pytest.raises(ValueError, match="fuse_projections"):
        FusedDraftStep(draft, draft_slot_cache(draft, S), rows=4)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_round_around_the_fused_draft_is_vanilla_greedy(target_dir, monkeypatch):
    """With `compile`, the pieces around the fused layer (the catch-up's inputs, RoPE, the head's logits) compile and
    the round still decodes vanilla greedy's tokens; the draft layer and a level's inputs (one launch) stay on their
    kernels, and with the level kernel off the composed inputs are the compiled ones."""
    torch._dynamo.reset()
    tgt = load_target(target_dir, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(target_dir, taps=tgt.taps, seed=14)
    draft.load_target_embedding(target_embedding(tgt))
    fuse_projections(draft)
    prompt, n = [3, 17, 5, 40, 22, 9, 11], 10
    ref = generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(copy.deepcopy(tgt.model), 64, taps=tgt.taps.layers)
    fe = FastEagle(ft, draft, 3, 3, 8, max_len=len(prompt) + n + 2, compile=True, fused_draft=True)
    out = fe.generate(prompt, n)
    assert fe.compiled and out.tokens == ref
    compiled = fe.composed
    assert fe.proposer.pieces.tree_level == fe.fused.tree_level  # the layer stays on its kernels
    assert fe.proposer.pieces.level_inputs == fe.fused.level_inputs
    assert fe.proposer.pieces.finalize == fe.fused.finalize
    assert fe.proposer.pieces.catch_up_inputs is compiled.catch_up_inputs
    fe.set_one_launch(False)
    assert fe.proposer.pieces.level_inputs is compiled.level_inputs
    assert fe.proposer.pieces.tree_start is compiled.tree_start
    assert fe.proposer.pieces.finalize is compiled.finalize
    one_launch = []
    for name in ("level_inputs", "tree_start", "finalize"):
        monkeypatch.setattr(FusedDraftStep, name, lambda *a, **k: one_launch.append(1))
    assert fe.generate(prompt, n).tokens == ref and not one_launch  # the compiled piece is the composed function
    torch._dynamo.reset()


class _ShiftedIds(Eagle3Proposer):
    """Draft ids mapped one past the target's (a lost vocabulary map, as an engine might get it wrong)."""

    def to_target_ids(self, draft_ids):
        return self.draft.to_target_ids(draft_ids) + 1


class _FeedbackPostnorm(Eagle3Proposer):
    """A tree step fed its parent's normed output instead of the pre-norm one (an engine's wiring mistake)."""

    def child_hidden(self, parent_out):
        return self.draft.norm(parent_out)


@pytest.mark.parametrize("proposer_cls", [Eagle3Proposer, _FeedbackPostnorm], ids=["clean", "feedback_postnorm"])
def test_doctor_reads_a_trace_of_the_fused_draft(target_dir, tmp_path, proposer_cls):
    """A trace recorded with the draft layer on its kernels (the round's stages copied out as on the modules):
    doctor's replay calls the clean run healthy, and names a hook fault that ran in the fused round's level inputs."""
    target = load_target(target_dir, device="cpu")
    draft, contract = make_draft(target_dir, draft_vocab_size=48, scale=3.0)
    save_draft(draft, contract, tmp_path / "draft")
    loaded = load_draft(tmp_path / "draft", target.num_layers)
    loaded.model.load_target_embedding(target_embedding(target))
    fuse_projections(loaded.model)
    prompt = [5, 9, 14, 2, 33, 7, 21, 4, 17, 11]
    rec = T.TraceRecorder(tmp_path / "t", producer="test-fused-draft")
    rec.set_meta(prompt_ids=prompt, settings={"chain": None, "tree": "3,2,6"}, taps=contract.taps.to_dict())
    max_len = len(prompt) + 24
    ft = FastTarget(target.model, max_len + 12, taps=contract.taps.layers)
    fe = FastEagle(ft, loaded.model, 3, 2, 6, max_len=max_len, recorder=rec, proposer_cls=proposer_cls,
                   fused_draft=True)  # fmt: skip
    out = fe.generate(prompt, 16)
    rec.close()
    assert out.tokens == generate_vanilla(target, prompt, 16, stop_ids=[]).token_ids
    findings, ctx = diagnose_trace(target, load_draft(tmp_path / "draft", target.num_layers), tmp_path / "t")
    if proposer_cls is Eagle3Proposer:
        assert not findings, [(f.code, f.stage, f.verdict) for f in findings]
    else:
        assert findings, ctx.get("first_divergence")
        top = findings[0]
        assert (top.code, top.stage, top.round) == ("FEEDBACK_POSTNORM", T.draft_hidden_in(1), 1), [
            (f.code, f.stage, f.round) for f in findings
        ]
