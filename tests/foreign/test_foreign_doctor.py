"""doctor on the foreign pipeline's drafts (pipeline.py): drafts speculators trained on hidden states vLLM extracted,
diagnosed from what they do, not from what their files say (every draft's config declares the same layer ids).

Two ways in, the same question (`doctor --measure-wiring`: which features was this draft trained on?):

    full        `--target T --data held-out.jsonl`: the target runs here
    head-only   `--target HEAD --layer-states DIR`: a copy of the target without its layers, and every layer's states
                for the same held-out conversations as vLLM's own extract_hidden_states recorded them (ids 0..L, the
                layout speculators' data generation writes): what a user of a target too large to load has

The clean draft is healthy both ways; every fault is named first, with the same code both ways; none is named with
the wrong code. The table (stderr, and <root>/doctor-table.md) is the one in docs/foreign-drafts.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

import pipeline as P
import pytest
from layerless import layerless_copy

from eaglescope.cli import main

TOKENS = 1024
# what each trained case must be called; the post-norm final state is not a wiring fault (the draft's inputs are the
# clean taps; only its teacher saw the normed state twice) and is named by `doctor --training-data` (test_training_data)
EXPECTED = {
    P.CLEAN: None,
    P.TAPS_OFF_BY_ONE: "TAP_OFF_BY_ONE",
    P.UNSHIFTED: "SHIFT_OFF_BY_ONE",
    P.TTT_1: "NO_TTT",
}
MODES = ("full", "head-only")
# `doctor --training-data`: the data each case's draft was trained on (the trainer's faults train on clean data)
DATA_OF = {P.CLEAN: P.CLEAN, P.TAPS_OFF_BY_ONE: P.TAPS_OFF_BY_ONE, P.UNSHIFTED: P.CLEAN,
           P.FINAL_POST_NORM: P.FINAL_POST_NORM, P.TTT_1: P.CLEAN, P.FEATURES_SHIFTED: P.FEATURES_SHIFTED}  # fmt: skip
DATA_EXPECTED = {P.TAPS_OFF_BY_ONE: "DATA_TAP_MISMATCH", P.FINAL_POST_NORM: "DATA_FINAL_NORM",
                 P.FEATURES_SHIFTED: "DATA_SHIFT"}  # fmt: skip


def doctor_json(argv: list[str]) -> tuple[int, dict, str, float]:
    out, err = io.StringIO(), io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    seconds = time.perf_counter() - t
    assert rc in (0, 1), err.getvalue()
    return rc, json.loads(out.getvalue()), err.getvalue(), seconds


@pytest.fixture(scope="module")
def doctored(foreign_pipeline) -> dict:
    """doctor --measure-wiring on every trained draft, both ways: {(case, mode): (exit, report, seconds, argv)}."""
    p = foreign_pipeline
    held_out, states = p.root / P.HELD_OUT_DIR, p.hidden[P.ALL_LAYERS]
    head = p.root / "target-head-only"
    if not head.is_dir():
        layerless_copy(p.target, head, final_norm=True)
    common = ["--measure-wiring", "--engine", "vllm", "--wiring-tokens", str(TOKENS), "--device", "cpu",
              "--dtype", "float32", "--json"]  # fmt: skip
    out = {}
    for case, data in DATA_OF.items():
        draft = str(p.drafts[P.CLEAN if case == P.FEATURES_SHIFTED else case])
        argv = ["doctor", "--target", str(p.target), "--training-data", str(p.hidden[data]), "--draft", draft, "--json"]
        rc, report, _, seconds = doctor_json(argv)
        out[case, "data"] = (rc, report, seconds, argv)
    for case in P.TRAINED:
        draft = str(p.drafts[case])
        ways = {
            "full": ["doctor", "--target", str(p.target), "--draft", draft, "--data", str(held_out),
                     "--prompts", "2", "--max-new-tokens", "16", "--eval-samples", "8", *common],
            "head-only": ["doctor", "--target", str(head), "--draft", draft, "--layer-states", str(states), *common],
        }  # fmt: skip
        for mode, argv in ways.items():
            rc, report, _, seconds = doctor_json(argv)
            out[case, mode] = (rc, report, seconds, argv)
    return out


def top(report: dict) -> dict | None:
    return report["findings"][0] if report["findings"] else None


def table(p: P.Pipeline, doctored: dict) -> str:
    head = "| case | served τ (vLLM) | way | top code @ stage | trained for (measured) | acc_0 trained / served |"
    rows = [head + " wall s |", "|---|---|---|---|---|---|---|"]
    for case in DATA_OF:
        rc, report, seconds, _ = doctored[case, "data"]
        f = top(report)
        code = "healthy" if f is None else f"{f['code']}@{f.get('stage') or '-'}"
        tau = f"{p.served[case]['tau']:.2f}" if case in p.served else "(not trained)"
        rows.append(f"| {case} | {tau} | training data | {code} | - | - | {seconds:.1f} |")
    for case in P.TRAINED:
        for mode in MODES:
            rc, report, seconds, _ = doctored[case, mode]
            f = top(report)
            code = "healthy" if f is None else f"{f['code']}@{f.get('stage') or '-'}"
            w = report["context"].get("wiring", {})
            trained, served = w.get("trained_for") or {}, w.get("served") or {}
            acc = [x.get("acc", [float("nan")])[0] for x in (trained, served)]
            text = trained.get("wiring", {}).get("text", "-")
            rows.append(f"| {case} | {p.served[case]['tau']:.2f} | {mode} | {code} | {text} | "
                        f"{acc[0]:.3f} / {acc[1]:.3f} | {seconds:.1f} |")  # fmt: skip
    return "\n".join(rows)


def test_the_table(foreign_pipeline, doctored):
    text = table(foreign_pipeline, doctored)
    (foreign_pipeline.root / "doctor-table.md").write_text(text + "\n")
    sys.stderr.write(f"\n{text}\n")
    for (case, mode), (_, report, _, _) in doctored.items():
        assert mode == "data" or "wiring" in report["context"], (case, mode, report["context"].keys())


@pytest.mark.parametrize("case", list(DATA_OF))
def test_the_training_data_check_names_each_data_fault(doctored, case):
    """The faults that live in the data are named from the data; the trainer's own (the unshifted pairing, TTT 1)
    leave the data clean, which is what it must say."""
    rc, report, _, _ = doctored[case, "data"]
    want = DATA_EXPECTED.get(case)
    got = [f["code"] for f in report["findings"]]
    assert got[:1] == ([want] if want else []), got


@pytest.mark.parametrize("mode", MODES)
def test_the_clean_draft_is_healthy(doctored, mode):
    rc, report, _, _ = doctored[P.CLEAN, mode]
    assert rc == 0 and report["healthy"], [(f["code"], f["verdict"]) for f in report["findings"]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [c for c, code in EXPECTED.items() if code])
def test_each_fault_is_named_first(doctored, case, mode):
    rc, report, _, _ = doctored[case, mode]
    assert rc == 1, f"{case} ({mode}) called healthy"
    assert top(report)["code"] == EXPECTED[case], [(f["code"], f["verdict"]) for f in report["findings"]]


def test_the_taps_it_was_trained_on_are_measured(doctored):
    """The draft declares [2, 4, 5] (speculators wrote the verifier's default); its data held vLLM's ids [3, 5, 6]:
    the wiring doctor measures is that one, both ways."""
    for mode in MODES:
        w = doctored[P.TAPS_OFF_BY_ONE, mode][1]["context"]["wiring"]
        assert w["trained_for"]["wiring"]["engine_ids"]["vllm"] == P.OFF_BY_ONE_IDS, (mode, w["trained_for"])
        assert w["served"]["wiring"]["engine_ids"]["vllm"] == P.DEFAULT_IDS, (mode, w["served"])


def test_the_post_norm_final_state_is_not_called_a_wiring_fault(doctored):
    """Its draft reads the clean taps: whatever doctor says, it does not name a wrong tap, order or pairing."""
    wrong = {"TAP_OFF_BY_ONE", "TAP_ORDER", "SHIFT_OFF_BY_ONE", "TAP_EMBEDDING", "TRAINED_WIRING_MISMATCH"}
    for mode in MODES:
        report = doctored[P.FINAL_POST_NORM, mode][1]
        assert not wrong & {f["code"] for f in report["findings"]}, (mode, report["findings"])


def test_both_ways_agree(doctored):
    for case in P.TRAINED:
        codes = [[f["code"] for f in doctored[case, m][1]["findings"]][:1] for m in MODES]
        assert codes[0] == codes[1], (case, codes)


def test_head_only_holds_no_layer(foreign_pipeline, doctored):
    """The head-only way really had no decoder layer on disk to fall back on."""
    head = Path(foreign_pipeline.root / "target-head-only")
    names = json.loads((head / "model.safetensors.index.json").read_text())["weight_map"]
    assert names and not any(".layers." in n for n in names)
