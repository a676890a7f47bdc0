"""eaglescope doctor against an engine it did not write: tests/engines/plain_eagle3.py, a plain EAGLE-3
decoder built from the checkpoint and trace formats alone, its faults injected as code changes in that engine.

(a) the engine is lossless: its greedy output is transformers' greedy `generate`, chain and tree, and its sampled
    output is vanilla sampling's with the same generator;
(b) doctor calls its clean traces healthy (chain, tree, another frontier order, fingerprints, bf16, sampling,
    shallow traces, …);
(c) each injected fault's code is doctor's top finding at the first divergent stage, with the reproduction that
    named it; faults no code names give DIVERGENCE_UNEXPLAINED there, never a named cause; a shallow trace that
    cannot decide says which stages it lacks.
Where doctor is wrong today the case is xfail(strict): it turns into a failure the day doctor is fixed.
`python tests/engines/fault_table.py` prints the same cases as a table (tests/engines/FAULT_TABLE.md).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engines.cases import CHAIN, CLEAN, FAULT_CASES, TREE, UNEXPLAINED, Recorded, build_setups, said, verdict
from engines.plain_eagle3 import FAULTS, PlainEagle3
from engines.tiny import greedy_reference
from layerless import layerless_copy

from eaglescope import trace as T
from eaglescope.cli import main
from eaglescope.detective.diagnose.evidence import Head
from eaglescope.detective.diagnose.head import _resolve_ties, _tie_aware_pairs
from eaglescope.detective.doctor import run_doctor
from eaglescope.detective.draft_replay import DRAFT_SIDE, FULL, TARGET_SIDE_CODES
from eaglescope.detective.replay import match_rows, tree_shape
from eaglescope.errors import EagleScopeError

ENGINES = Path(__file__).parent / "engines"
TRACE_PY = Path(__file__).parents[1] / "src" / "eaglescope" / "trace.py"


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    return build_setups(tmp_path_factory.mktemp("independent-engine"))


@pytest.fixture(scope="module")
def recorded(setups, tmp_path_factory):
    """Every case's trace and full-replay report, made once: the draft-side tests below reuse them."""
    return Recorded(setups, tmp_path_factory.mktemp("traces"))


# -- independence -----------------------------------------------------------------------------------------------------
# the engine's dependencies, and the standard library's plumbing it uses
ALLOWED = set("torch safetensors json transformers __future__ importlib math sys dataclasses pathlib".split())


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." if node.level else node.module.split(".")[0])
    return out


@pytest.mark.parametrize("name", ["plain_eagle3.py", "tiny.py"])
def test_engine_imports_nothing_of_eaglescope(name):
    # torch, safetensors, json, transformers and the standard library's plumbing; eaglescope's recorder is loaded by
    # file path (what an engine that copied trace.py does), never imported as a package
    mods = _imports(ENGINES / name)
    assert mods <= ALLOWED, sorted(mods - ALLOWED)
    src = (ENGINES / name).read_text()
    assert "import_module" not in src and "__import__" not in src  # no import the ast walk cannot see
    assert src.count("spec_from_file_location") == (1 if name == "plain_eagle3.py" else 0)
    if name == "plain_eagle3.py":
        from engines import plain_eagle3

        assert plain_eagle3._TRACE_PY == TRACE_PY.resolve()  # the one file it loads: the recorder


_ISOLATED = r"""
import sys
sys.modules["eaglescope"] = None  # an engine's environment: importing eaglescope fails
sys.path.insert(0, sys.argv[1])
from engines.plain_eagle3 import PlainEagle3
e = PlainEagle3(sys.argv[2], sys.argv[3])
res = e.generate(list(range(5, 15)), 6, depth=3, top_k=3, total_tokens=8, trace=sys.argv[4], mode="fingerprint")
bad = sorted(m for m in sys.modules if m.startswith("eaglescope."))
assert not bad, bad
print(",".join(map(str, res.token_ids)))
"""


def test_engine_runs_where_eaglescope_is_not_installed(setups, tmp_path):
    S = setups["a"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            _ISOLATED,
            str(ENGINES.parent),
            str(S.target_dir),
            str(S.draft_dir),
            str(tmp_path / "t"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert [int(x) for x in res.stdout.strip().split(",")] == greedy_reference(S.target_dir, S.prompt, 6)
    assert T.load_trace(tmp_path / "t").mode == "fingerprint"


def test_trace_holds_every_canonical_stage(setups, tmp_path):
    S = setups["a"]
    PlainEagle3(S.target_dir, S.draft_dir).generate(S.prompt, 8, trace=tmp_path / "t", guide=S.guide, **TREE)
    tr = T.load_trace(tmp_path / "t")
    families = {T.parse_stage(s)[0] for s in tr.stages()}
    want = {
        "target.tap",
        T.TARGET_AUX,
        T.DRAFT_FC_OUT,
        "draft.embed_in",
        "draft.hidden_in",
        "draft.hidden_out",
        "draft.topk",
        T.VERIFY_TOKENS,
        T.VERIFY_PARENTS,
        T.VERIFY_ACCEPTED,
        T.VERIFY_BONUS,
        T.NEXT_HIDDEN_IN,
    }
    assert families == want and all(T.is_canonical(s) for s in tr.stages())
    assert tr.get(T.TARGET_AUX, 0).shape == (len(S.prompt), 3 * 64)
    assert sum(tr.get(T.VERIFY_ACCEPTED, r).numel() for r in tr.rounds() if r) >= 4  # the guided trees accept


# -- (a) lossless -----------------------------------------------------------------------------------------------------
LOSSLESS = [
    ("chain", "a", {}, dict(CHAIN)),
    ("chain5", "a", {}, {"depth": 5, "chain": True}),
    ("tree", "a", {}, dict(TREE)),
    ("wide-tree", "a", {}, {"depth": 4, "top_k": 4, "total_tokens": 12}),
    ("creation-order-tree", "a", {"frontier": "creation"}, dict(TREE)),
    ("12layers-tree", "b", {}, dict(TREE)),
    ("12layers-chain", "b", {}, dict(CHAIN)),
    ("eagle31-norm-before-fc-tree", "nbf", {}, dict(TREE)),
    ("eagle31-fc-norm-output-chain", "fcn", {}, dict(CHAIN)),
]


@pytest.mark.parametrize("setup,engine,run", [x[1:] for x in LOSSLESS], ids=[x[0] for x in LOSSLESS])
def test_greedy_output_is_vanilla_greedy(setups, setup, engine, run):
    S = setups[setup]
    want = greedy_reference(S.target_dir, S.prompt, 24)
    e = PlainEagle3(S.target_dir, S.draft_dir, **engine)
    assert e.generate(S.prompt, 24, **run).token_ids == want
    guided = e.generate(S.prompt, 24, guide=S.guide, **run)
    assert guided.token_ids == want and guided.accepted_total >= 8  # and when the trees do accept


def test_sampled_output_is_vanilla_sampling(setups):
    # one draw per emitted token from the engine's generator, at each node of the accepted path: the same draws, in
    # the same order, as sampling the target token by token
    S = setups["a"]
    e = PlainEagle3(S.target_dir, S.draft_dir)
    g, seq = torch.Generator().manual_seed(7), list(S.prompt)
    with torch.no_grad():
        for _ in range(16):
            logits = e.target(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.multinomial(torch.softmax(logits.float() / 0.8, -1), 1, generator=g)))
    want = seq[len(S.prompt) :]
    assert want != greedy_reference(S.target_dir, S.prompt, 16)  # the temperature does sample
    for run in (TREE, CHAIN):
        assert e.generate(S.prompt, 16, temperature=0.8, seed=7, guide=S.guide, **run).token_ids == want


# -- what the replay reads ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "meta,shape",
    [
        ({"settings": {"chain": 3, "tree": None}}, (3, 1, 4)),
        ({"settings": {"chain": None, "tree": "4,2,9"}}, (4, 2, 9)),
        ({"settings": {"chain": None, "tree": None}}, (7, 10, 60)),  # eaglescope's own default tree
        ({"decoding": {"temperature": 0.0, "tree": {"depth": 5, "topk": 4, "total_tokens": 8}}}, (5, 4, 8)),
        ({"decoding": {"chain": 2}}, (2, 1, 3)),
    ],
)
def test_tree_shape_from_either_meta_key(meta, shape):
    assert tree_shape(meta) == shape


def test_tree_shape_from_the_stages_when_meta_has_none(setups, tmp_path):
    S = setups["a"]
    PlainEagle3(S.target_dir, S.draft_dir, meta_keys="decoding").generate(S.prompt, 6, trace=tmp_path / "t", **TREE)
    tr = T.load_trace(tmp_path / "t")
    assert tree_shape({}, tr) == (TREE["depth"], TREE["top_k"], max(tr.get(T.VERIFY_TOKENS, r).numel() for r in
                                                                        tr.rounds() if r))  # fmt: skip


def test_rows_are_paired_by_content():
    g = torch.Generator().manual_seed(0)
    emb, hid = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    emb[2] = emb[1]  # two nodes with the same token under different parents: the parent's features tell them apart
    order = [3, 2, 0, 1]  # the trace's rows are the replay's rows 3, 2, 0, 1
    theirs = {"e": emb[order], "h": hid[order]}
    assert match_rows(theirs, {"e": emb, "h": hid}) == [order.index(j) for j in range(4)]
    fp = {k: T.fingerprint(v) for k, v in theirs.items()}
    assert match_rows(fp, {"e": emb, "h": hid}) == [order.index(j) for j in range(4)]
    # rows that match in no order (a fault) stay in the engine's order
    assert match_rows({"e": torch.randn(4, 8, generator=g)}, {"e": emb}) == [0, 1, 2, 3]


def test_a_fitted_map_places_entries_that_tie_outside_the_top_k():
    # draft ids 2 and 3 score within the tolerance of each other; the top-2 holds one of them: which one is open
    lp = torch.tensor([[-1.0, -5.0, -2.0, -2.01, -6.0]])
    head = Head(lp, lambda i: i.long() + 10, nats=0.05)
    pairs, ties = _tie_aware_pairs(head, torch.tensor([[40, 47]]))
    assert pairs == [(0, 40)] and ties == [([2, 3], [47])]
    f = dict(pairs)
    assert _resolve_ties(f, ties) and f == {0: 40, 2: 47}
    # an increasing map cannot send a later draft id to a smaller target id
    assert not _resolve_ties({0: 50}, [([2, 3], [47])])
    # a target id the map already gives another draft id must come from the tie
    assert not _resolve_ties({0: 40, 4: 47}, [([2, 3], [47])])


# -- (b) clean traces, (c) faults -------------------------------------------------------------------------------------
def _params(cases):
    out = []
    for c in cases:
        marks = [pytest.mark.xfail(strict=True, reason=f"doctor today: {c.doctor_today}")] if c.doctor_today else []
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


@pytest.mark.parametrize("case", _params(CLEAN))
def test_clean_trace_is_healthy(recorded, case):
    report = recorded.full(case)
    ok, said = verdict(case, report)
    assert ok, f"{said}: {report.findings[0].verdict if report.findings else ''}"


def test_enough_clean_traces_pass_today():
    assert sum(1 for c in CLEAN if c.doctor_today is None) >= 20


@pytest.mark.parametrize("case", _params(FAULT_CASES))
def test_fault_is_the_top_finding(recorded, case):
    report = recorded.full(case)
    ok, said = verdict(case, report)
    want = "|".join(case.expected) + f"@{case.stage} r{case.round}"
    if not case.catalogue:
        named = [f.code for f in report.findings if f.code != UNEXPLAINED]
        assert not named, f"a named cause for a fault no code covers: {named}"
    assert ok, f"expected {want}, doctor says {said}: {report.findings[0].verdict if report.findings else ''}"
    top = report.findings[0]
    if top.code != UNEXPLAINED:
        # named because a re-run with that mistake reproduced the divergent tensor, and the clean path did not
        assert top.evidence.get("reproduced_by") and top.evidence["clean_score"] > 1.0 >= top.evidence["score"]


def test_every_fault_is_exercised():
    assert {c.fault for c in FAULT_CASES} == set(FAULTS)
    assert sum(1 for c in FAULT_CASES if not c.catalogue and c.mode == "full") >= 6
    assert {c.mode for c in FAULT_CASES} == {"full", "fingerprint"}


def test_clean_runs_cover_what_issue_18_asks():
    # at least 20 clean traces, among them chains, trees, sampling, another frontier order and bf16
    assert len(CLEAN) >= 20
    assert any(c.run.get("chain") for c in CLEAN) and any(not c.run.get("chain") for c in CLEAN)
    assert any(c.run.get("temperature", 0) > 0 for c in CLEAN)
    assert any(c.engine.get("frontier") == "creation" for c in CLEAN)
    assert any(c.engine.get("dtype") == torch.bfloat16 for c in CLEAN)
    assert any(c.mode == "fingerprint" for c in CLEAN)


@pytest.mark.parametrize(
    "fault,pass_,sign", [("rope_tree_offset", "tree", "+1"), ("rope_catchup_offset", "catch-up", "+1")]
)
def test_offsets_that_leave_the_trace_the_same_are_named_together(recorded, fault, pass_, sign):
    # The engine records no positions. A tree-step offset of +1 and a catch-up offset of -1 leave every relative
    # position the same (and vice versa), so the hidden states cannot tell them apart: the finding names both, the
    # engine's own fault among them, with its sign.
    case = next(c for c in FAULT_CASES if c.id == f"{fault}-full")
    top = recorded.full(case).findings[0]
    other = {"tree": "catch-up", "catch-up": "tree"}[pass_]
    flipped = {"+1": "-1", "-1": "+1"}[sign]
    assert top.code == "POSITION_OFFSET" and {
        top.evidence["reproduced_by"],
        *top.evidence["equally_reproduced_by"],
    } == {
        f"{pass_} {sign}",
        f"{other} {flipped}",
    }, top.verdict
    assert "tree steps" in top.verdict and "catch-up pass" in top.verdict and "cannot tell them apart" in top.verdict


# -- (d) draft-side replay: the same traces, the target's layers deleted ---------------------------------------------
# A full trace feeds the draft-side replay (it plays the recorded target.aux back); a fault is draft-side when it
# first shows after the capture. Fingerprint traces hold no target.aux to play back (see the refusal test below).
def _target_side(case) -> bool:
    return case.stage is not None and case.stage.startswith("target.")


DRAFT_SIDE_CASES = [c for c in FAULT_CASES + CLEAN if c.mode == "full" and not _target_side(c)]
TARGET_SIDE_CASES = [c for c in FAULT_CASES if c.mode == "full" and _target_side(c)]
# fingerprint traces whose engine keeps target.aux in full: one case per family of draft-side cause, and clean ones
_FP = (
    *("fc_skipped", "fc_repeated", "feedback_target", "stale_first_rows", "rope_tree_offset", "pairing_shift"),
    *("other_embedding", "d2t_regenerated", "final_norm_skipped", "norm_before_fc_ignored", "norm_output_assumed"),
    *("rms_eps_wrong", "tree-accepting-fingerprint", "bf16-fingerprint", "eagle31-fc-norm-output-fingerprint"),
)
DRAFT_SIDE_FINGERPRINT = [
    dataclasses.replace(c, id=f"{c.id}-aux-full", engine={**c.engine, "aux_full": True})
    for c in FAULT_CASES + CLEAN
    if c.mode == "fingerprint" and (c.id in _FP or c.id.removesuffix("-fingerprint") in _FP)
]


@pytest.fixture(scope="module")
def layerless(setups, tmp_path_factory):
    """target dir → a copy of it holding only config.json, embed_tokens and lm_head (sharded)."""
    root = tmp_path_factory.mktemp("layerless")
    targets = sorted({S.target_dir for S in setups.values()})
    return {t: layerless_copy(t, root / t.name) for t in targets}


def _draft_side(recorded, layerless, case):
    S = recorded.setups[case.setup]
    return run_doctor(layerless[S.target_dir], S.draft_dir, trace=recorded.trace(case), device="cpu")


@pytest.mark.parametrize("case", _params(DRAFT_SIDE_CASES + DRAFT_SIDE_FINGERPRINT))
def test_draft_side_replay_says_what_the_full_replay_says(recorded, layerless, case):
    full, ds = recorded.full(case), _draft_side(recorded, layerless, case)
    assert full.context["replay"]["mode"] == FULL and ds.context["replay"]["mode"] == DRAFT_SIDE
    assert ds.context["replay"]["layers_on_disk"] == 0
    assert said(ds) == said(full), [f.verdict for f in ds.findings[:1]]
    assert verdict(case, ds)[0]  # and that is the right answer
    if not ds.healthy and ds.findings[0].code != UNEXPLAINED:
        top, want = ds.findings[0], full.findings[0]
        assert top.evidence["reproduced_by"] == want.evidence["reproduced_by"]
    # every draft stage the trace holds was compared; the capture is the trace's own, so it is not evidence
    compared = {row["stage"] for row in ds.context["stage_table"]}
    assert compared == {row["stage"] for row in full.context["stage_table"]} - {
        s for s in compared | {row["stage"] for row in full.context["stage_table"]} if s.startswith("target.")
    }


def test_draft_side_cases_cover_every_draft_side_fault():
    faults = {c.fault for c in DRAFT_SIDE_CASES if c.fault}
    assert faults == {c.fault for c in FAULT_CASES if not _target_side(c)} and len(faults) >= 30
    assert sum(1 for c in DRAFT_SIDE_CASES if c.healthy) >= 30
    assert len(DRAFT_SIDE_FINGERPRINT) == len(_FP)


@pytest.mark.parametrize("case", TARGET_SIDE_CASES, ids=[c.id for c in TARGET_SIDE_CASES])
def test_draft_side_replay_names_no_tap_cause_and_says_what_is_missing(recorded, layerless, case):
    ds = _draft_side(recorded, layerless, case)
    ctx = ds.context["replay"]
    assert set(case.expected) <= set(ctx["cannot_name"]) == set(TARGET_SIDE_CODES)
    assert any("layers" in m for m in ctx["missing"]) and any("per-layer fingerprints" in m for m in ctx["missing"])
    # never a guess: the capture is taken as recorded (a draft side that is right), or, when it cannot feed the
    # draft's fc at all, unexplained at target.aux with what would name it
    assert all(f.code in (UNEXPLAINED,) or f.stage is None or not f.stage.startswith("draft") for f in ds.findings)
    assert not any(f.code in TARGET_SIDE_CODES for f in ds.findings)
    if not ds.healthy:
        top = ds.findings[0]
        assert (top.code, top.stage) == (UNEXPLAINED, "target.aux") and top.evidence["missing"] == ctx["missing"]


def test_draft_side_replay_refuses_a_fingerprinted_capture(recorded, layerless):
    case = next(c for c in CLEAN if c.id == "tree-fingerprint")
    S = recorded.setups[case.setup]
    with pytest.raises(EagleScopeError, match="fingerprint.*full=True"):
        run_doctor(layerless[S.target_dir], S.draft_dir, trace=recorded.trace(case), device="cpu")


def test_doctor_cli_says_which_replay_ran(recorded, layerless, capsys):
    case = next(c for c in FAULT_CASES if c.id == "feedback_postnorm-full")
    S = recorded.setups[case.setup]
    trace = str(recorded.trace(case))
    slim = str(layerless[S.target_dir])

    def doctor(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main(["doctor", "--draft", str(S.draft_dir), "--trace", trace, "--device", "cpu", *argv])
        out = capsys.readouterr()
        return rc, out.out, out.err

    rc, out, err = doctor("--target", slim)
    assert rc == 1 and out.startswith("NOT HEALTHY") and "most likely FEEDBACK_POSTNORM" in out
    line = next(x for x in out.splitlines() if x.startswith("replay"))
    assert "draft-side replay: 0 of the target's 8 decoder layers are on disk" in line
    assert "TAP_OFF_BY_ONE" in line and "per-layer fingerprints" in line
    assert "draft-side replay" in err  # the progress line says it too
    rc, out, _ = doctor("--target", slim, "--json")
    ctx = json.loads(out)["context"]["replay"]
    assert rc == 1 and ctx["mode"] == DRAFT_SIDE and ctx["num_layers"] == 8
    rc, out, _ = doctor("--target", str(S.target_dir), "--json")
    assert rc == 1 and json.loads(out)["context"]["replay"]["mode"] == FULL
    # --replay draft-side on the full target: the same finding, the mode asked for
    rc, out, _ = doctor("--target", str(S.target_dir), "--replay", "draft-side", "--json")
    report = json.loads(out)
    assert report["context"]["replay"]["why"] == "asked for (--replay draft-side)"
    assert report["findings"][0]["code"] == "FEEDBACK_POSTNORM"
    # a full replay asked of a target without layers: one line, exit 2
    rc, out, err = doctor("--target", slim, "--replay", "full")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
