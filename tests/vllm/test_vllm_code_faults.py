"""Wiring faults made inside real vLLM's own code, served under `eaglescope capture`, and what doctor says of them.

vLLM's installed package is copied privately (tests/vllm/vllm_faults.py: links to every file, real copies of the four
it patches) and served by one vLLM process; each fault is an exact replacement of whole statements in vLLM's model,
runner or proposer code, switched on for one run at a time. The base environment is checked unchanged afterwards.
Doctor must name each fault (FAULT_TABLE.md says what it names, and where) or call it DIVERGENCE_UNEXPLAINED, never
name a wrong cause; clean runs of the patched copy, with and without vLLM's padded drafter batch, must be healthy;
and a drafter that raises leaves traces that are never healthy (capture exits 1 and says why).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from capture_build import K, _export, _train
from test_vllm_capture import capture_argv, finish, run_logged
from test_vllm_serving import MAX_LEN, base, cli, order2_chain
from vllm_faults import FAULTS, SWITCH, private_vllm, sha256
from vllm_support import HERE, REPO, runner_env

from eaglescope.trace import load_trace

PROMPTS = 2
MAX_NEW = 40
CLEAN = {"clean": {}, "clean-unpadded": {"disable_padded_drafter_batch": True}}
CRASH = "drafter-crash"
TABLE = HERE / "FAULT_TABLE.md"
# fault → (the code doctor names first, the stage it names it at); checked against FAULT_TABLE.md's rows too
EXPECTED = {
    "tap-capture": ("TAP_OFF_BY_ONE", "target.aux"),
    "concat-order": ("TAP_ORDER", "target.aux"),
    "concat-order-unpadded": ("TAP_ORDER", "target.aux"),
    "feedback-postnorm": ("FEEDBACK_POSTNORM", "draft.step2.hidden_in"),
    "feedback-target": ("FEEDBACK_TARGET_FEATURES", "draft.step1.hidden_in"),
    "final-norm-skipped": ("DRAFT_FINAL_NORM_SKIPPED", "draft.step0.topk"),
    "hidden-norm-skipped": ("DIVERGENCE_UNEXPLAINED", "draft.step0.hidden_out"),
    "norm-output-assumed": ("EAGLE31_NORM", "draft.step0.hidden_out"),
    "positions-tree": ("POSITION_OFFSET", "draft.step1.positions"),
    "positions-catch-up": ("POSITION_OFFSET", "draft.step0.positions"),
    "accepted-rows": ("STALE_ACCEPTED", "next.hidden_in"),
    "d2t-ignored": ("VOCAB_MAP", "draft.step0.topk"),
    "tokens-unrotated": ("SHIFT_OFF_BY_ONE", "draft.step0.tokens"),
    CRASH: ("TRACE_INCOMPLETE", None),
}


def installed_package(python: str) -> Path:
    """The directory of the vllm package `python` imports (found without importing it)."""
    code = "import importlib.util; print(importlib.util.find_spec('vllm').submodule_search_locations[0])"
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, env=runner_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    return Path(p.stdout.strip())


@pytest.fixture(scope="module")
def served(tmp_path_factory, vllm_python: str) -> dict:
    root = tmp_path_factory.mktemp("code-faults")
    out, spec_path, log = root / "vllm", root / "spec.json", root / "capture.log"
    out.mkdir()
    package = installed_package(vllm_python)
    shadow = root / "private-vllm"
    originals = private_vllm(shadow, package)
    names = [*CLEAN, *(f for f in FAULTS if f != CRASH), CRASH]  # the crash last: its engine is not reused
    env = runner_env() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": f"{shadow}:{REPO / 'src'}"}
    t0 = time.perf_counter()
    proc = run_logged(capture_argv(root / "traces", len(names) * PROMPTS, spec_path, out, vllm_python), log, env)
    try:
        b = base(tmp_path_factory)
        draft = _export(_train(root, b["target"], b["prep"], "clean", K), b["target"], "vllm", root / "vllm-clean")
        rng, perm = b["rng"], b["perm"]
        convs = [[{"role": "user", "content": order2_chain(rng, perm, rng.randint(8, 16))}] for _ in range(PROMPTS)]
        runs = []
        for name in names:
            run = {"name": name, "target": str(b["target"]), "draft": str(draft), "conversations": convs}
            if name in CLEAN:
                run["speculative_args"] = CLEAN[name]
            else:
                run["speculative_args"] = FAULTS[name].speculative_args or {}
                run["env"] = {SWITCH: name}
            runs.append(run)
        spec = {"max_tokens": MAX_NEW, "num_speculative_tokens": K, "max_model_len": MAX_LEN, "runs": runs}
        spec_path.with_suffix(".tmp").write_text(json.dumps(spec))
        spec_path.with_suffix(".tmp").rename(spec_path)
        rc = finish(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    sys.stderr.write(f"code faults served and captured in {time.perf_counter() - t0:.1f}s\n")
    return {
        "root": root,
        "names": names,
        "rc": rc,
        "log": log,
        "result": json.loads((out / "result.json").read_text()),
        "traces": root / "traces",
        "target": str(b["target"]),
        "draft": str(draft),
        "package": package,
        "shadow": shadow,
        "originals": originals,
    }


def trace_of(served: dict, name: str, prompt: int) -> Path:
    return served["traces"] / f"request-{served['names'].index(name) * PROMPTS + prompt}"


def doctor(served: dict, name: str, prompt: int) -> dict:
    rc, out, err = cli(["doctor", "--target", served["target"], "--draft", served["draft"], "--trace",
                        str(trace_of(served, name, prompt)), "--json"])  # fmt: skip
    assert rc in (0, 1), err
    report = json.loads(out)
    assert report["healthy"] is (rc == 0)
    return report


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Parametrized here, not with @pytest.mark.parametrize: see test_vllm_serving.py (one folded skip line).
    if "fault" in metafunc.fixturenames:
        metafunc.parametrize("fault", list(EXPECTED))
    if "clean" in metafunc.fixturenames:
        metafunc.parametrize("clean", list(CLEAN))
    if "prompt" in metafunc.fixturenames:
        metafunc.parametrize("prompt", range(PROMPTS))


def test_the_private_copy_served_and_the_installed_vllm_is_unchanged(served):
    assert served["result"]["vllm_file"] == str(served["shadow"] / "vllm" / "__init__.py")
    for rel, digest in served["originals"].items():
        assert sha256(served["package"] / rel) == digest, rel  # the installed file is as it was
        copy = served["shadow"] / "vllm" / rel
        assert not copy.is_symlink() and sha256(copy) != digest
        assert copy.read_text().count(f'environ.get("{SWITCH}")') == sum(
            p.path == rel for f in FAULTS.values() for p in f.patches
        )
    links = [p for p in (served["shadow"] / "vllm").rglob("*") if p.is_file()]
    assert sum(not p.is_symlink() for p in links) == len(served["originals"])  # nothing else was copied
    for name in served["names"]:
        err = served["result"]["runs"][name]["error"]
        assert (err is not None) is (name == CRASH), (name, err)


def test_clean_runs_of_the_patched_copy_are_healthy(served, clean, prompt):
    report = doctor(served, clean, prompt)
    assert report["healthy"], report["findings"]
    t = load_trace(trace_of(served, clean, prompt))
    assert t.meta["complete"] is True and len(t.rounds()) > 2
    stages = set(t.stages())
    assert {f"draft.step{k}.positions" for k in range(K)} <= stages and "draft.step0.tokens" in stages


def test_fault_is_named_or_honestly_unexplained(served, fault):
    # one request per fault (the other was served beside it, in the same batch): doctor's time is the suite's
    code, stage = EXPECTED[fault]
    report = doctor(served, fault, 0)
    top = report["findings"][0] if report["findings"] else None
    assert top is not None and (top["code"], top["stage"]) == (code, stage), report["findings"]
    if code == "DIVERGENCE_UNEXPLAINED":
        assert {f["code"] for f in report["findings"]} == {code}  # nothing named beside it
    verdict, ev = top["verdict"], top["evidence"]
    if fault.startswith("positions-"):
        # the pass and the sign, and the golden path re-run with that offset reproduces the step's output too
        pass_ = fault.removeprefix("positions-")
        assert ev["pass"] == pass_ and ev["offset"] == 1 and ev["hidden_out_reproduced"] is True
        assert ("tree steps" if pass_ == "tree" else "catch-up pass") in verdict and "offset by +1" in verdict
    if fault.startswith("concat-order"):
        assert ev["found"] == [f"hs{i}" for i in (6, 4, 2)]
    if fault == "tap-capture":
        assert ev["found"] == [f"hs{i}" for i in (1, 3, 5)]
    if fault == "tokens-unrotated":
        assert ev["bonus_row"] is True  # vLLM's layout: the sampled row still holds the round's newest token
    if fault == "d2t-ignored":
        assert ev["reproduced_by"].startswith("d2t not applied")
    if fault == CRASH:
        assert "RuntimeError" in verdict and "stops after round 0" in verdict and ev["complete"] is False


def test_a_crashed_drafter_fails_the_capture_in_one_warning(served):
    assert served["rc"] == 1
    text = served["log"].read_text()
    warnings = [ln for ln in text.splitlines() if "engine step raised while" in ln]
    assert len(warnings) == 1 and f"{PROMPTS} traced request(s)" in warnings[0]
    index = json.loads((served["traces"] / "capture.json").read_text())
    assert len(index["raised"]) == PROMPTS and all("RuntimeError" in ln for ln in index["raised"])
    crashed = {t["trace"] for t in index["traces"] if t["complete"] is False}
    assert crashed == {trace_of(served, CRASH, p).name for p in range(PROMPTS)}


def test_the_fault_table_is_what_the_suite_checks():
    rows = {}
    for line in TABLE.read_text().splitlines():
        m = re.match(r"^\| `([a-z0-9-]+)` \|.*\| (\w+)@([\w.]+|-) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), None if m.group(3) == "-" else m.group(3))
    assert rows == EXPECTED
