"""bench/run_bench.py --smoke: the protocol that every committed GPU figure comes from, run on the CPU through the
same code (corpus, target, `eaglescope prepare`/`train`, every decoding row, the transformers rows, the roofline).

A GPU call is scarce; a protocol that broke in a refactor would cost one. Here the whole run, then its roofline
again replaying the first run's acceptance, is checked for what the results tables claim: each eaglescope row's
outputs equal vanilla greedy's, η is speedup over τ, and the replayed rounds are the ones the acceptance forces."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import run_bench  # noqa: E402

# the smoke's replay cycles through this many of its source's rounds, for this many new tokens
SMOKE_REPLAYED_ROUNDS, REPLAY_NEW_TOKENS = run_bench.REPLAYED_ROUNDS_SMOKE, run_bench._Roofline.ctx_new


def _run_bench(*args: str, out: Path, work: Path) -> tuple[dict, str, str]:
    # without Triton's interpreter (tests/conftest.py turns it on for this process): the 8B section's fused kernels
    # interpreted take minutes a step shape, and their own CPU tests run them so; here the protocol runs its rows on
    # cuBLAS and SDPA and its roofline on the modules, in ~40 s
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "bench" / "run_bench.py"), "--smoke", "--out", str(out), "--work", str(work)]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("bench-smoke-*.json")
    return json.loads(path.read_text()), proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def protocol(tmp_path_factory) -> tuple[dict, str, str, Path]:
    tmp = tmp_path_factory.mktemp("run_bench")
    # paired with this checkout itself (--pair-with; a GPU pairing names an earlier version): its 8B section replays
    # this run's acceptance in its own process
    res, out, err = _run_bench("--part", "all", "--pair-with", str(ROOT), out=tmp / "all", work=tmp / "work")
    return res, out, err, tmp


def _check_replay(roof: dict, per_round: list[int]) -> None:
    """The replay ran `per_round` (accepted drafts a round, cycled) as it was: every round accepted its forced
    depth (the roofline's draft is confident enough that its trees reach it; none fell short), and the rounds are
    the ones those acceptances need for the new tokens (the prefill gives the first, a round its accepted and a
    bonus), so τ is the source's and η is speedup over it."""
    accepted = roof["replay_accepted"]
    assert accepted == [per_round[i % len(per_round)] for i in range(len(accepted))]
    assert roof["replay_rounds_short"] == 0 and roof["replay_rounds"] == len(accepted)
    tokens = [a + 1 for a in accepted]
    assert 1 + sum(tokens[:-1]) < REPLAY_NEW_TOKENS <= 1 + sum(tokens)
    assert roof["replay_tau"] == pytest.approx(REPLAY_NEW_TOKENS / len(accepted), abs=1e-4)
    assert roof["replay_eta"] == pytest.approx(roof["replay_speedup"] / roof["replay_tau"], abs=1e-3)


def test_every_eaglescope_row_decodes_as_vanilla_greedy_and_eta_is_speedup_over_tau(protocol):
    res, _, _, _ = protocol
    rows = {r["method"]: r for r in res["rows"]}
    ours = [m for m in rows if m.startswith(("eaglescope vanilla", "eagle3 ", "ablation "))]
    # the vanilla row, the chain, the official and the tuned tree, and the TTT-1 ablation's chain and tree
    assert len(ours) == 6, list(rows)
    for m in ours:
        r = rows[m]
        assert r["prompts"] == res["config"]["prompts"] and r["match_vanilla_fraction"] == 1.0, r
        if r["accept_length"] is not None:  # τ counts the bonus token: at least one token a round
            assert r["accept_length"] >= 1.0
            assert r["eta"] == pytest.approx(r["speedup_vs_vanilla"] / r["accept_length"], abs=1e-3), r
    # the transformers rows judge from outside: its greedy generate equals eaglescope vanilla on these prompts
    hf = rows["transformers vanilla generate"]
    assert hf["match_vanilla_fraction"] == 1.0 and hf["timed_prompts"] >= 1
    # the training stages ran the product's train: a held-out acc_k for every TTT step of the EAGLE-3 draft
    e3 = res["stages"]["eagle3"]
    assert len(e3["heldout_acc"]) == e3["ttt_length"] and all(0.0 <= a <= 1.0 for a in e3["heldout_acc"])


def test_stdout_is_the_table_and_the_progress_goes_to_stderr(protocol):
    res, out, err, _ = protocol
    paired_header = "| figure | before | after | after / before |"
    lines = out.splitlines()
    table = [line for line in lines[: lines.index(paired_header)] if line.startswith("| ")]
    assert table[0].startswith("| method | τ |")
    methods = [line.split(" | ")[0][2:] for line in table[1:]]
    assert methods == [r["method"] for r in res["rows"]]
    assert not re.search(r"^\[\s*\d+\.\ds\]", out, re.M), "progress lines on stdout"
    assert re.search(r"^\[\s*\d+\.\ds\] roofline replay: τ", err, re.M)


def test_the_roofline_replays_the_tuned_trees_acceptance_round_for_round(protocol):
    """The 8B section decodes with the tuned tree's acceptance forced, round for round, and so does a second run
    replaying the first's JSON (--replay-from, as the H100 and H200 pairings do)."""
    res, out, _, tmp = protocol
    replay, roof = res["replay"], res["roofline"]
    tuned = next(r["method"] for r in res["rows"] if r["method"].startswith("eagle3 tree tuned"))
    shape = [int(x) for x in re.search(r"\(([\d, ]+)\)", tuned).group(1).split(",")]  # "... tuned (3, 3, 8)"
    assert list(replay["shape"]) == shape and roof["replay_shape"] == shape
    forced = replay["per_round"][:SMOKE_REPLAYED_ROUNDS]
    assert max(forced) <= shape[0], "a round accepts at most the tree's depth"
    _check_replay(roof, forced)
    # the GPU's clocks and power at the 8B section's start and end (here: none to read)
    assert roof["gpu_state_start"] == roof["gpu_state_end"] == {"unavailable": "not a GPU"}

    # --pair-with: the second run replayed the first's JSON (as the H100 and H200 pairings do), in its own process
    (first,) = (tmp / "all").glob("bench-smoke-all-*.json")
    (second,) = (tmp / "all" / "before").glob("bench-smoke-roofline-*.json")
    again = json.loads(second.read_text())
    r2 = again["roofline"]
    assert again["rows"] == [] and "error" not in r2 and r2["replay_shape"] == shape
    _check_replay(r2, forced)

    # and the two side by side, on stdout after the run's table and beside its JSON; η is each run's own
    paired = (tmp / "all" / f"paired-{first.stem}.md").read_text()
    assert paired in out
    eta_row = next(line for line in paired.splitlines() if line.startswith("| η |"))
    ratio = roof["replay_eta"] / r2["replay_eta"]
    assert eta_row == f"| η | {r2['replay_eta']:.3f} | {roof['replay_eta']:.3f} | {ratio:.3f} |"
    # a run that replayed other rounds, or ran on another card, is refused in one line
    pair = [sys.executable, str(ROOT / "bench" / "pair_rooflines.py"), str(first)]
    unpaired = {
        "acceptance": lambda r: r["roofline"].update(replay_accepted=[a + 1 for a in r["roofline"]["replay_accepted"]]),
        "card": lambda r: r.update(device="NVIDIA H200"),
    }
    for name, edit in unpaired.items():
        other = json.loads(second.read_text())
        edit(other)
        edited = tmp / f"unpaired-{name}.json"
        edited.write_text(json.dumps(other))
        proc = subprocess.run([*pair, str(edited)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and proc.stdout == "", (name, proc.stdout)
        assert proc.stderr.startswith("pair_rooflines: not a pair: ") and proc.stderr.count("\n") == 1, proc.stderr


def _fake_nvidia_smi(tmp_path: Path, monkeypatch, body: str) -> None:
    """An `nvidia-smi` first on PATH that runs `body` (a shell script's lines)."""
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\n" + body + "\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_the_gpus_state_is_read_field_by_field(tmp_path, monkeypatch):
    import torch

    values = ["P0", "1980", "2619", "1980", "2619", "351.20", "700.00", "44", "0x0000000000000000"]
    _fake_nvidia_smi(tmp_path, monkeypatch, f'echo "$@" > {tmp_path}/args\necho "{", ".join(values)}"')
    state = run_bench.gpu_state(torch.device("cuda", 0))
    assert state == dict(zip(run_bench.GPU_STATE_FIELDS, values, strict=True))
    args = (tmp_path / "args").read_text()
    assert "--id=0" in args and ",".join(run_bench.GPU_STATE_FIELDS) in args and "nounits" in args
    assert run_bench.gpu_state(torch.device("cpu")) == {"unavailable": "not a GPU"}


@pytest.mark.parametrize(
    "body,why",
    [
        ('echo "Field \\"clocks_event_reasons.active\\" is not a valid field to query." >&2; exit 2', "not a valid"),
        ('echo "P0, 1980"', "P0, 1980"),  # fewer values than fields
    ],
)
def test_a_gpu_state_nvidia_smi_cannot_give_says_why(tmp_path, monkeypatch, body, why):
    import torch

    _fake_nvidia_smi(tmp_path, monkeypatch, body)
    state = run_bench.gpu_state(torch.device("cuda", 0))
    assert list(state) == ["unavailable"] and why in state["unavailable"]
