"""Formula tests of the trace diagnosis: each case plants the mistake one hypothesis describes into eaglescope's own
decoding run, recorded trace or checkpoint, and checks that the hypothesis recognises it, at the right stage and
round; the same runs without a fault give no finding.

Several plants are built with the very formula the hypothesis tests (the tiled fc is diagnose's `_tile_fc`, every
tree row handed on is one of its STALE_ACCEPTED candidates, the normed tap is its `normed` candidate): such a case
shows the formula works, not that doctor finds the fault in an engine it did not write. That claim rests on
tests/test_independent_engine.py, whose faults are code changes in a separate engine (tests/engines/); the cases
kept here are the ones that engine does not cover: the transformers backend, a contract that taps the embedding,
single segments and later rounds, negative offsets, a scaled embedding and a checkpoint that ships another one, an
off-by-one map, and the formulas themselves.
"""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft
from faults import (
    OwnPositionTokens,
    RoundCounting,
    Setup,
    TapFault,
    aux_of_round,
    edit_trace,
    fault,
    permute_segments,
    record,
    scaled_embedding,
    tile_project,
)
from models import make_checkpoint

from eaglescope import trace as T
from eaglescope.decode.speculative import Eagle3Proposer
from eaglescope.detective.diagnose import diagnose_trace
from eaglescope.detective.diagnose.stale import path_to_front
from eaglescope.detective.doctor import run_doctor
from eaglescope.models.draft import save_draft
from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract

PROMPT = list(range(5, 15))
TREE, CHAIN = (3, 3, 8), (3, 1, 4)


@pytest.fixture(scope="module")
def setups(tmp_path_factory) -> dict[str, Setup]:
    root = tmp_path_factory.mktemp("faults")
    a = make_checkpoint("llama", root / "a", seed=0)
    b = make_checkpoint(
        "llama",
        root / "b",
        seed=1,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=12,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    out = {}
    ta, tb = load_target(a, device="cpu"), load_target(b, device="cpu")
    for name, target, ckpt, kw in (
        ("a", ta, a, {"draft_vocab_size": 48}),
        ("b", tb, b, {"draft_vocab_size": 64, "seed": 1}),
        # a contract that taps the embedding output: the reverse TAP_EMBEDDING
        ("e", ta, a, {"draft_vocab_size": 48, "taps": TapContract((0, 3, 5), 8), "seed": 2}),
    ):
        draft, contract = make_draft(ckpt, scale=3.0, **kw)
        save_draft(draft, contract, root / f"{name}-draft")
        out[name] = Setup(target, root / f"{name}-draft", root, PROMPT, ckpt)
    out["hf"] = Setup(load_target(a, device="cpu", backend="hf"), root / "a-draft", root, PROMPT, a)
    # A checkpoint that ships an embedding from another model (the draft was trained against the wrong one).
    draft, contract = make_draft(a, draft_vocab_size=48, scale=3.0)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(
            torch.randn(draft.embed_tokens.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.15
        )
    save_draft(draft, contract, root / "own-embed-draft", save_embedding=True)
    out["own-embed"] = Setup(ta, root / "own-embed-draft", root, PROMPT)
    # bf16 engine against the float32 replay. The draft has unit-scale weights: the x3 drafts above are chaotic
    # (near one-hot attention), so bf16 rounding alone moves them by more than any trained draft moves.
    draft, contract = make_draft(a, draft_vocab_size=48, scale=1.0, seed=3)
    save_draft(draft, contract, root / "unit-draft")
    out["unit"] = Setup(ta, root / "unit-draft", root, PROMPT)
    out["unit-bf16"] = Setup(load_target(a, device="cpu", dtype=torch.bfloat16), root / "unit-draft", root, PROMPT)
    return out


def diagnose(S: Setup, trace_dir):
    return diagnose_trace(S.target, S.draft(), trace_dir)


# -- injections ----------------------------------------------------------------------------------------
def taps(swap: dict, from_round: int = 0, **kw):
    return lambda S, out: record(S, out, target=TapFault(S.target, swap, from_round), **kw)[0]


def hook(name: str, impl, from_round: int = 1, **kw):
    return lambda S, out: record(S, out, proposer_cls=fault(name, impl, from_round), **kw)[0]


def proposer(cls, **kw):
    return lambda S, out: record(S, out, proposer_cls=cls, **kw)[0]


def edited(edits: dict, **kw):
    def make(S, out):
        clean, _ = record(S, out.with_name(out.name + "-clean"), **kw)
        return edit_trace(clean, out, edits)

    return make


def _H(p) -> int:
    return p.draft.embed_tokens.weight.shape[1]


def offset(kind: str, delta: int, from_round: int = 1):
    if kind == "tree":
        return fault("tree_position", lambda p, r, lvl: r + lvl - 1 + delta, from_round)
    return fault("catch_up_positions", lambda p, s, n: torch.arange(s, s + n) + delta, from_round)


def shifted(from_round: int):
    return type(f"Shift{from_round}", (OwnPositionTokens,), {"shift_from_round": from_round})


def _shift_map(p, ids):
    n = p.draft.d2t.shape[0]
    return (ids + 1) % n + p.draft.d2t[(ids + 1) % n]


# (code, variant, setup, make(S, out) -> trace dir, stage family, round where it first shows); "formula" in a variant
# marks a plant made with the hypothesis's own formula
CASES = [
    # taps: the engine's capture code, labels kept as the contract's
    ("TAP_OFF_BY_ONE", "seg1-1", "a", taps({1: ("hs", 3)}), "target.aux", 0),
    ("TAP_OFF_BY_ONE", "all+1-hf", "hf", taps({0: ("hs", 3), 1: ("hs", 5), 2: ("hs", 6)}), "target.aux", 0),
    ("TAP_WRONG_LAYER", "seg0-to-6-hf", "hf", taps({0: ("hs", 6)}), "target.aux", 0),
    ("TAP_ORDER", "swap12-hf", "hf", taps({1: ("hs", 5), 2: ("hs", 4)}), "target.aux", 0),
    ("TAP_ORDER", "edited-round3", "b", edited({(T.TARGET_AUX, 3): permute_segments([0, 2, 1])}), "target.aux", 3),
    # the taps concatenated in another order for the accepted rows only (an engine that hands the draft those rows
    # and no target.aux of its own, as vLLM without its padded drafter batch): tap hypotheses at next.hidden_in
    (
        "TAP_ORDER",
        "handed-on-rows-from-round2",
        "b",
        hook(
            "next_round_features",
            lambda p, out, res: permute_segments([2, 1, 0])(Eagle3Proposer.next_round_features(p, out, res), None),
            2,
        ),
        "next.hidden_in",
        2,
    ),
    ("TAP_EMBEDDING", "hf", "hf", taps({0: ("hs", 0)}), "target.aux", 0),
    ("TAP_EMBEDDING", "layer1-where-embedding-expected", "e", taps({0: ("hs", 1)}), "target.aux", 0),
    ("TAP_EMBEDDING", "layer2-where-embedding-expected", "e", taps({0: ("hs", 2)}, from_round=1), "target.aux", 1),
    ("TAP_NORMED", "formula-seg0-hf", "hf", taps({0: ("normed", 2)}), "target.aux", 0),
    ("TAP_NORMED", "formula-from-round2", "a", taps({2: ("normed", 5)}, from_round=2), "target.aux", 2),
    # fc
    (
        "FC_SKIPPED",
        "first-tap-from-round3",
        "a",
        hook("features", lambda p, aux: aux[:, : _H(p)], 3),
        "draft.fc.out",
        3,
    ),
    (
        "FC_REPEATED",
        "formula-step0",
        "a",
        hook("features", lambda p, aux: tile_project(p, p.draft.project(aux))),
        "draft.fc.out",
        1,
    ),
    (
        "FC_REPEATED",
        "formula-steps-k",
        "a",
        hook("child_hidden", lambda p, h: tile_project(p, h)),
        "draft.hidden_in",
        1,
    ),
    # feedback between draft steps
    (
        "FEEDBACK_TARGET_FEATURES",
        "raw-last-tap-chain",
        "a",
        hook("child_hidden", lambda p, h: p.state.aux[-1:, -_H(p) :].expand(h.shape[0], -1), shape=CHAIN),
        "draft.hidden_in",
        1,
    ),
    (
        "FEEDBACK_TARGET_FEATURES",
        "12layers-from-round2",
        "b",
        hook("child_hidden", lambda p, h: p.features(p.state.aux)[-1:].expand(h.shape[0], -1), 2),
        "draft.hidden_in",
        2,
    ),
    # what is handed to the next round: every tree row, a mistake a proposer cannot make without breaking the loop
    ("STALE_ACCEPTED", "formula-all-rows-edited-round2", "b", edited(aux_of_round(2)), "next.hidden_in", 2),
    # positions: the reference proposer records each step's positions, where an offset shows first (traces without
    # them, e.g. the independent engine's in tests/engines, are diagnosed from the hidden states)
    ("POSITION_OFFSET", "tree-1-12layers", "b", proposer(offset("tree", -1)), "draft.positions", 1),
    (
        "POSITION_OFFSET",
        "catch-up-1-from-round3-chain",
        "b",
        proposer(offset("catchup", -1, 3), shape=CHAIN),
        "draft.positions",
        3,
    ),
    # token pairing (the step's token ids are recorded: a shift shows there first) and embedding
    ("SHIFT_OFF_BY_ONE", "from-round3-accepting", "b", proposer(shifted(3), accept=True), "draft.tokens", 3),
    (
        "EMBEDDING_MISMATCH",
        "scaled-12layers",
        "b",
        hook("embed", lambda p, ids: scaled_embedding(p)[ids]),
        "draft.embed_in",
        1,
    ),
    (
        "EMBEDDING_MISMATCH",
        "checkpoint-ships-other-embedding",
        "own-embed",
        proposer(RoundCounting),
        "draft.embed_in",
        1,
    ),
    # vocabulary map
    ("VOCAB_MAP", "off-by-one-map-12layers", "b", hook("to_target_ids", _shift_map), "draft.topk", 1),
]


@pytest.mark.parametrize("code,variant,setup,make,family,rnd", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_injected_fault_is_the_top_finding(setups, tmp_path, code, variant, setup, make, family, rnd):
    S = setups[setup]
    findings, ctx = diagnose(S, make(S, tmp_path / "trace"))
    assert findings, f"no finding; first divergence {ctx['first_divergence']}"
    top = findings[0]
    assert (top.code, T.parse_stage(top.stage)[0], top.round) == (code, family, rnd), (
        top.verdict,
        top.evidence,
    )


# the clean counterpart of every setup the cases above use (each fault means something only against a clean run)
HEALTHY = [
    ("tree", "a", {}),
    ("12layers-accepting-chain", "b", {"accept": True, "shape": CHAIN}),
    ("hf", "hf", {}),
    ("embedding-tap-contract", "e", {}),
]


@pytest.mark.parametrize("variant,setup,kw", HEALTHY, ids=[h[0] for h in HEALTHY])
def test_uninjected_run_gives_no_finding(setups, tmp_path, variant, setup, kw):
    S = setups[setup]
    trace_dir, res = record(S, tmp_path / "trace", **kw)
    findings, ctx = diagnose(S, trace_dir)
    assert findings == [], [(f.code, f.stage, f.round, f.verdict) for f in findings]
    assert ctx["first_divergence"] is None
    if kw.get("accept"):
        assert sum(res.stats.accepted) >= 4  # the oracle trees really do accept


def test_bf16_run_against_float32_replay_gives_no_finding(setups, tmp_path):
    trace_dir, _ = record(setups["unit-bf16"], tmp_path / "trace", shape=TREE, dtype=torch.bfloat16)
    assert T.load_trace(trace_dir).get(T.TARGET_AUX, 0).dtype == torch.bfloat16
    findings, ctx = diagnose(setups["unit"], trace_dir)
    assert findings == [], [(f.code, f.stage, f.round, f.verdict) for f in findings]
    # and the comparison did measure bf16 rounding, not nothing
    assert max(r["rel_err"] or 0.0 for r in ctx["stage_table"] if r["stage"] == T.TARGET_AUX) > 1e-3


@pytest.mark.parametrize("scale", [1.04, 1.5])
def test_a_small_divergence_that_changes_no_decision_says_so(setups, tmp_path, scale):
    # An engine whose step-0 output in round 1 is off by a few percent (a kernel that sums otherwise), and one whose
    # is far off, while every draft token it proposed stays what the draft's own head picks: only the small one is
    # said to change no decision, with the margin; both stay DIVERGENCE_UNEXPLAINED (nothing reproduces them).
    S = setups["a"]
    trace_dir = edited({(T.draft_hidden_out(0), 1): lambda x, tr: x * scale})(S, tmp_path / "trace")
    findings, ctx = diagnose(S, trace_dir)
    top = findings[0]
    assert (top.code, top.stage, top.round) == ("DIVERGENCE_UNEXPLAINED", T.draft_hidden_out(0), 1), top.verdict
    small = top.evidence.get("below_decision")
    if scale < 1.1:
        assert small is not None and "changes no decision" in top.verdict, top.verdict
        assert small["decisions"] > 0 and small["margin_nats"] > 2 * small["logprob_diff_nats"]
    else:
        assert small is None and "changes no decision" not in top.verdict


def test_doctor_on_the_transformers_backend_names_the_injected_fault_first(setups, tmp_path):
    # run_doctor's own replay on the transformers backend (the independent engine's cases use the native one)
    code, _, setup, make, family, rnd = next(c for c in CASES if c[1] == "swap12-hf")
    S = setups[setup]
    report = run_doctor(S.target_dir, S.draft_dir, trace=make(S, tmp_path / "trace"), device="cpu", backend="hf")
    assert not report.healthy
    top = report.findings[0]
    assert (top.code, T.parse_stage(top.stage)[0], top.round) == (code, family, rnd), top.verdict


def test_a_tree_engine_that_moves_the_accepted_path_to_the_front_is_laid_out_as_sglang_does():
    # SGLang's tree of depth 3 (4 path slots), 6 verified nodes, path root → 2: rows 0, 2, then the root's twice as
    # padding, then nodes 4 and 5 in tree order (eagle_worker_common._compact_accept_to_front)
    assert path_to_front([0, 2], 6, 3) == [0, 2, 0, 0, 4, 5]
    assert path_to_front([0, 1, 3, 5], 6, 3) == [0, 1, 3, 5, 4, 5]
    assert path_to_front([0, 1], 3, 3) is None  # fewer verified rows than path slots: not that layout
