"""doctor's fingerprints-only mode: the taps checked against the engine's own per-layer states of the prefill
(target.layer.<i>), with the target's decoder layers deleted from a copy of the target, so that nothing can run it.

The faults are code changes in the independent engine (tests/engines/plain_eagle3.py), which records the per-layer
states with its own code (transformers' output_hidden_states and its own RMSNorm); eaglescope's `generate --trace
--trace-layers` records them on both backends, and its clean traces must come out healthy. The real vLLM case is in
tests/vllm/test_vllm_layers.py.
"""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft as make_eaglescope_draft
from engines.plain_eagle3 import PlainEagle3
from engines.tiny import greedy_reference, make_draft, make_target
from layerless import layerless_copy
from models import make_checkpoint

from eaglescope import trace as T
from eaglescope.cli import main
from eaglescope.detective.doctor import format_report, run_doctor
from eaglescope.models.draft import save_draft

MAX_NEW = 10
TREE = {"depth": 3, "top_k": 3, "total_tokens": 8}
# fault → (code, what the engine put in target.aux's segments for the draft's taps [2, 4, 5] of the 8-layer target)
TAP_FAULTS = {
    "tap_plus_one": ("TAP_OFF_BY_ONE", ["hs3", "hs5", "hs6"]),
    "tap_minus_one": ("TAP_OFF_BY_ONE", ["hs1", "hs3", "hs4"]),
    "tap_wrong_layer": ("TAP_WRONG_LAYER", ["hs2", "hs4", "hs7"]),
    "tap_order": ("TAP_ORDER", ["hs5", "hs4", "hs2"]),
    "tap_embedding": ("TAP_EMBEDDING", ["hs0", "hs4", "hs5"]),
    "tap_normed": ("TAP_NORMED", ["normed2", "normed4", "normed5"]),
}


@pytest.fixture(scope="module")
def engine_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layer-taps")
    target = make_target(root / "target", seed=0)
    draft = make_draft(root / "draft", target, seed=0)
    prompt = list(range(5, 15))
    return {
        "target": target,
        "slim": layerless_copy(target, root / "slim-target"),
        "draft": draft,
        "prompt": prompt,
        "guide": prompt + greedy_reference(target, prompt, MAX_NEW + 16),
    }


def engine_trace(d: dict, out, fault=None, mode="full", record_layers="all", **run):
    engine = PlainEagle3(d["target"], d["draft"], fault=fault, record_layers=record_layers)
    engine.generate(d["prompt"], MAX_NEW, trace=out, mode=mode, guide=d["guide"], **(run or TREE))
    return out


@pytest.mark.parametrize("mode", ["full", "fingerprint"])
@pytest.mark.parametrize("fault", [None, *TAP_FAULTS, "eagle2_wiring"])
def test_tap_fault_is_named_from_per_layer_fingerprints(engine_dirs, tmp_path, fault, mode):
    trace = engine_trace(engine_dirs, tmp_path / "t", fault, mode)
    report = run_doctor(engine_dirs["slim"], engine_dirs["draft"], trace=trace, device="cpu")
    ctx = report.context
    # a full trace's draft side is replayed from its target.aux as well; a fingerprinted one has nothing to replay
    assert ctx["replay"]["mode"] == ("draft-side replay" if mode == "full" else "fingerprints only")
    assert ("stage_table" in ctx) == (mode == "full" and fault != "eagle2_wiring")  # the draft side was replayed
    assert ctx["layer_taps"]["checked"] and ctx["replay"]["cannot_name"] == []
    assert ctx["layer_taps"]["recorded"] == {"states": list(range(8)), "final": True, "normed": list(range(8))}
    assert "taps       fingerprints only: target.aux matched against" in format_report(report)
    if fault is None:
        assert report.healthy, [f.verdict for f in report.findings]
        return
    top = report.findings[0]
    if fault == "eagle2_wiring":  # the final normed state handed on, H wide: fc cannot apply to it
        assert (top.code, top.stage, top.round) == ("FC_SKIPPED", "target.aux", 0)
        assert "final normed state" in top.evidence["reproduced_by"]
        return
    code, found = TAP_FAULTS[fault]
    assert (top.code, top.stage, top.round) == (code, "target.aux", 0), top.verdict
    assert top.evidence["found"] == found and top.evidence["expected_taps"] == [2, 4, 5]


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    """A 12-layer target (taps [2, 6, 9]) run in bfloat16: the engine's states and its capture both rounded."""
    root = tmp_path_factory.mktemp("layer-taps-bf16")
    shape = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=12, num_attention_heads=6)
    target = make_target(root / "target", seed=1, num_key_value_heads=3, **shape)
    return {"target": target, "slim": layerless_copy(target, root / "slim"), "draft": make_draft(root / "d", target)}


BF16_FOUND = {
    "tap_plus_one": ["hs3", "hs7", "hs10"],
    "tap_order": ["hs9", "hs6", "hs2"],
    "tap_embedding": ["hs0", "hs6", "hs9"],
    "tap_normed": ["normed2", "normed6", "normed9"],
}


@pytest.mark.parametrize("fault", [None, *BF16_FOUND])
def test_bf16_engine_of_twelve_layers(bf16_dirs, tmp_path, fault):
    engine = PlainEagle3(bf16_dirs["target"], bf16_dirs["draft"], torch.bfloat16, fault=fault, record_layers="all")
    engine.generate([3, 17, 29, 41, 53, 7, 11, 19, 23, 31, 37, 43], 8, trace=tmp_path / "t", mode="fingerprint", **TREE)
    report = run_doctor(bf16_dirs["slim"], bf16_dirs["draft"], trace=tmp_path / "t", device="cpu")
    if fault is None:
        assert report.healthy, [f.verdict for f in report.findings]
        return
    top = report.findings[0]
    assert (top.code, top.stage, top.evidence["found"]) == (TAP_FAULTS[fault][0], "target.aux", BF16_FOUND[fault])


def test_full_target_still_replays_the_same_trace(engine_dirs, tmp_path):
    trace = engine_trace(engine_dirs, tmp_path / "t", "tap_order")
    report = run_doctor(engine_dirs["target"], engine_dirs["draft"], trace=trace, device="cpu")
    assert report.context["replay"]["mode"] == "full replay" and "layer_taps" not in report.context
    assert (report.findings[0].code, report.findings[0].stage) == ("TAP_ORDER", "target.aux")


def test_without_normed_states_a_normed_tap_is_not_guessed(engine_dirs, tmp_path):
    clean = engine_trace(engine_dirs, tmp_path / "clean", record_layers="states")
    assert run_doctor(engine_dirs["slim"], engine_dirs["draft"], trace=clean, device="cpu").healthy
    # the other faults need no normed states
    shifted = engine_trace(engine_dirs, tmp_path / "shifted", "tap_plus_one", record_layers="states")
    report = run_doctor(engine_dirs["slim"], engine_dirs["draft"], trace=shifted, device="cpu")
    assert report.findings[0].code == "TAP_OFF_BY_ONE"
    normed = engine_trace(engine_dirs, tmp_path / "normed", "tap_normed", record_layers="states")
    report = run_doctor(engine_dirs["slim"], engine_dirs["draft"], trace=normed, device="cpu")
    codes = [f.code for f in report.findings]
    assert codes == ["DIVERGENCE_UNEXPLAINED"], codes
    assert "TAP_NORMED) cannot be told" in report.findings[0].verdict
    assert report.context["replay"]["cannot_name"] == ["TAP_NORMED"]


def test_neither_layers_nor_fingerprints_says_which_is_missing(engine_dirs, tmp_path):
    trace = engine_trace(engine_dirs, tmp_path / "t", "tap_plus_one", record_layers="none")
    report = run_doctor(engine_dirs["slim"], engine_dirs["draft"], trace=trace, device="cpu")
    ctx = report.context["layer_taps"]
    assert not ctx["checked"] and ctx["missing"].startswith("target.layer.<i>")
    # the draft side replays clean from the recorded capture; what the capture holds is said to be unknown, not guessed
    assert report.healthy and "TAP_OFF_BY_ONE" in report.context["replay"]["cannot_name"]
    assert "per-layer fingerprints" in format_report(report)


def test_record_layers_refuses_a_wrong_count(tmp_path):
    rec = T.TraceRecorder(tmp_path / "t")
    with pytest.raises(T.TraceError, match="2 normed states for 3 layers"):
        rec.record_layers([torch.zeros(2, 4)] * 3, normed=[torch.zeros(2, 4)] * 2)
    rec.abort()


# -- eaglescope's own generate ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def own_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate-layers")
    target = make_checkpoint("llama", root / "target")
    draft, contract = make_eaglescope_draft(target, draft_vocab_size=48, scale=3.0)
    save_draft(draft, contract, root / "draft")
    return {"root": root, "target": target, "slim": layerless_copy(target, root / "slim"), "draft": root / "draft"}


def generate_trace(capsys, d: dict, name: str, *extra: str) -> T.Trace:
    out = d["root"] / name
    argv = ["generate", "--target", str(d["target"]), "--draft", str(d["draft"]), "--prompt-ids", "5,9,14,2,33,7,21,4"]
    argv += ["--device", "cpu", "--dtype", "float32", "--max-new-tokens", "12", "--trace", str(out), "--trace-layers"]
    capsys.readouterr()
    assert main([*argv, *extra]) == 0
    return T.load_trace(out)


@pytest.mark.parametrize("backend", ["--reference", "--fast"])
@pytest.mark.parametrize("mode", ["full", "fingerprint"])
def test_generate_records_every_layer_and_doctor_finds_it_healthy(capsys, own_dirs, backend, mode):
    trace = generate_trace(capsys, own_dirs, f"{backend[2:]}-{mode}", backend, "--trace-mode", mode)
    L = 8
    layers = [e for e in trace.events if T.parse_stage(e.stage)[0].startswith("target.layer")]
    assert {e.stage for e in layers} == {T.target_layer(i) for i in range(L + 1)} | {
        T.target_layer_normed(i) for i in range(L)
    }
    assert all(e.round == 0 and e.kind == "fingerprint" for e in layers)  # compact even in a full trace
    # each segment of target.aux is the recorded state of its tap
    aux = trace.get(T.TARGET_AUX, 0)
    taps = trace.meta["taps"]["layers"]
    for j, i in enumerate(taps):
        seg = aux.segment(j) if isinstance(aux, T.Fingerprint) else aux[:, j * 64 : (j + 1) * 64]
        assert T.compare(seg, trace.get(T.target_layer(i), 0), tol=1e-5)["match"]
    report = run_doctor(own_dirs["slim"], own_dirs["draft"], trace=trace.path, device="cpu")
    assert report.healthy and report.context["layer_taps"]["checked"], [f.verdict for f in report.findings]
    assert run_doctor(own_dirs["target"], own_dirs["draft"], trace=trace.path, device="cpu").healthy


def test_both_backends_record_the_same_layers(capsys, own_dirs):
    ref = generate_trace(capsys, own_dirs, "same-ref", "--reference")
    fast = generate_trace(capsys, own_dirs, "same-fast", "--fast")
    for i in range(9):
        for stage in (T.target_layer(i), T.target_layer_normed(i)) if i < 8 else (T.target_layer(i),):
            assert T.compare(fast.get(stage, 0), ref.get(stage, 0), tol=1e-4)["match"], stage


def test_trace_layers_needs_a_trace(capsys, own_dirs):
    argv = ["generate", "--target", str(own_dirs["target"]), "--draft", str(own_dirs["draft"]), "--prompt-ids", "5,9"]
    assert main([*argv, "--device", "cpu", "--trace-layers"]) == 2
    assert "--trace-layers adds to a trace" in capsys.readouterr().err
