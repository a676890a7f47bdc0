"""How long `eaglescope doctor --trace` takes at the scale users debug, on one GPU, as a user runs it.

    PYTHONPATH=src:tests python3 bench/doctor_speed.py --out DIR [--work DIR] [--commit SHA] [--profile]

An 8B-shaped random bf16 Llama (Llama-3-8B's shape, built on the GPU and saved as a normal checkpoint: tests/models.py
`make_llama8b`) and a random EAGLE-3 draft (32000-token draft vocabulary); `eaglescope generate` records a trace of the
default tree over a 64-token prompt, 48 new tokens, with the default (static-shape) decoder, in full and fingerprint
mode; then `eaglescope doctor --target --draft --trace --json` runs in a process of its own, and its wall time (load
included, the interpreter's start too) is what is reported, with the time each of its progress lines arrived.
`--profile` also runs doctor in this process under cProfile and writes the table of each mode beside the JSON.
Writes doctor-speed.json under DIR; prints one table last. --work keeps the checkpoints (the GPU tests read the same
pair when EAGLESCOPE_GPU_WORK names that directory).

`--faults` also times doctor on traces of the same pair with one wiring mistake each, at that scale: every tap one
layer late (the target's capture), fc skipped (the draft reads the first tap's columns), steps k>0 fed the target's
features instead of the draft's own, and every verified row handed to the next round (stale rows); recorded by the
reference decoder with tests/faults.py's plants, full mode, and the top finding doctor names for each is reported
beside its time (a measurement: whether doctor names them is the CPU suite's claim, on engines it did not write)."""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = ",".join(str((i * 7919) % 120000 + 100) for i in range(64))
NEW = 48
DEVICE = "cuda"


def cli(argv: list[str], log: Path) -> dict:
    """One `eaglescope` process: exit code, wall seconds, and when (seconds from its start) each stderr line came."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    lines: list[tuple[float, str]] = []
    with open(log, "w") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "eaglescope.cli", *argv], stdout=out, stderr=subprocess.PIPE,
                             text=True, env=env)  # fmt: skip

        def read() -> None:
            for line in p.stderr:
                lines.append((round(time.perf_counter() - t0, 2), line.rstrip()))

        reader = threading.Thread(target=read)
        reader.start()
        rc = p.wait()
        wall = time.perf_counter() - t0
        reader.join()
    return {"argv": argv, "rc": rc, "wall_s": round(wall, 2), "stderr": lines[-40:]}


def profile_doctor(target: Path, draft: Path, trace: Path, out: Path) -> float:
    from eaglescope.detective.doctor import run_doctor

    prof = cProfile.Profile()
    t = time.perf_counter()
    # every 5 s the stack, so that a run cut short by a time limit still shows where it spent its time
    with open(out.with_name("doctor-stacks.txt"), "a") as stacks:
        print(f"== {trace}", file=stacks, flush=True)
        faulthandler.dump_traceback_later(5, repeat=True, file=stacks)
        prof.enable()
        try:
            report = run_doctor(target, draft, trace=trace)
            torch.cuda.synchronize()
        finally:
            prof.disable()
            faulthandler.cancel_dump_traceback_later()
    wall = round(time.perf_counter() - t, 2)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    out.write_text(f"run_doctor in-process: {wall:.2f} s, healthy={report.healthy}\n\n{buf.getvalue()}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/doctor-speed")
    ap.add_argument("--commit", default=None, help="the commit measured (a device copy may have no git metadata)")
    ap.add_argument("--profile", action="store_true", help="also profile doctor in this process (cProfile)")
    ap.add_argument("--profile-only", action="store_true", help="the in-process profiles only, no timed CLI doctor")
    ap.add_argument("--layers", type=int, default=32, help="fewer layers than 8B's 32 (a quicker look only)")
    ap.add_argument("--reuse-traces", action="store_true", help="traces already under --work are used as they are")
    ap.add_argument("--faults", action="store_true", help="also time doctor on traces with named faults (see above)")
    args = ap.parse_args()
    from drafts import save_random_draft
    from models import LLAMA_8B, make_llama8b

    from eaglescope import trace as T

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": args.commit or git or None,
        "target": {**LLAMA_8B, "num_hidden_layers": args.layers, "dtype": "bfloat16"},
        "prompt_tokens": 64,
        "new_tokens": NEW,
        "tree": "default (generate's EAGLE-2 tree)",
    }

    def save() -> None:
        (out / "doctor-speed.json").write_text(json.dumps(res, indent=1))

    t = time.perf_counter()
    name = "llama8b" if args.layers == LLAMA_8B["num_hidden_layers"] else f"llama8b-{args.layers}layers"
    target = make_llama8b(work / name, num_hidden_layers=args.layers)
    draft = save_random_draft(target, work / f"{name}-draft", 32000)
    res["build_s"] = round(time.perf_counter() - t, 1)
    res["generate"], res["doctor"] = {}, {}
    for mode in ("full", "fingerprint"):
        trace = work / f"trace-{mode}"
        if not (args.reuse_traces and (trace / "manifest.json").is_file()):
            argv = ["generate", "--target", str(target), "--draft", str(draft), "--prompt-ids", PROMPT,
                    "--max-new-tokens", str(NEW), "--trace", str(trace), "--trace-mode", mode, "--json"]  # fmt: skip
            res["generate"][mode] = cli(argv, work / f"generate-{mode}.log")
            save()
        res["doctor"][mode] = r = {"trace_rounds": len(T.load_trace(trace).rounds())}
        if not args.profile_only:
            argv = ["doctor", "--target", str(target), "--draft", str(draft), "--trace", str(trace), "--json"]
            r |= cli(argv, work / f"doctor-{mode}.log")
            try:
                report = json.loads((work / f"doctor-{mode}.log").read_text())
                r["healthy"] = report["healthy"]
                r |= agreement(report)
            except (json.JSONDecodeError, KeyError):
                r["healthy"] = None
            print(f"doctor {mode}: rc {r['rc']}, {r['wall_s']} s, healthy {r['healthy']}", flush=True)
        if args.profile or args.profile_only:
            r["in_process_profiled_s"] = profile_doctor(target, draft, trace, out / f"doctor-profile-{mode}.txt")
        save()
    if args.faults:
        res["faults"] = {}
        for name, trace in fault_traces(target, draft, work).items():
            argv = ["doctor", "--target", str(target), "--draft", str(draft), "--trace", str(trace), "--json"]
            r = res["faults"][name] = cli(argv, work / f"doctor-{name}.log")
            try:
                report = json.loads((work / f"doctor-{name}.log").read_text())
                top = (report["findings"] or [None])[0]
                r["top"] = None if top is None else f"{top['code']}@{top['stage']} r{top['round']}"
                r |= agreement(report)
            except (json.JSONDecodeError, KeyError):
                r["top"] = None
            print(f"doctor {name}: rc {r['rc']}, {r['wall_s']} s, top {r['top']}", flush=True)
            save()
    print(f"\n{'8B-shaped target, 64-token prompt, 48 new tokens':<52}{'rc':>4}{'wall s':>9}  healthy / top finding")
    for mode, r in res["doctor"].items():
        if "wall_s" in r:
            print(f"{'eaglescope doctor --trace (' + mode + ')':<52}{r['rc']:>4}{r['wall_s']:>9.1f}  {r['healthy']}")
        if "in_process_profiled_s" in r:
            print(f"{'  in this process, under cProfile':<52}{'':>4}{r['in_process_profiled_s']:>9.1f}")
    for name, r in res.get("faults", {}).items():
        print(f"{'  fault: ' + name:<52}{r['rc']:>4}{r['wall_s']:>9.1f}  {r['top']}")
    return 0


def agreement(report: dict) -> dict:
    """How far the bf16 trace and doctor's replay differ where doctor judged them equal, and at the first stage judged
    different. In the stage table's own units, which differ by stage: a relative error for hidden states (whole-tensor;
    the tolerance is also applied per row), nats for log-probs, a share of rows for top-k ids; so the largest one is
    a rough look at the 16-bit tolerances (PRECISION_16: rel 0.08, 0.3 nats) on a scale they were not chosen on, not
    a check."""
    table = report.get("context", {}).get("stage_table") or []
    equal = [row["rel_err"] for row in table if row.get("match") and row.get("rel_err") is not None]
    differ = [row for row in table if row.get("match") is False and row.get("rel_err") is not None]
    return {
        "largest_error_where_equal": max(equal, default=None),
        "first_differing": None if not differ else {k: differ[0][k] for k in ("stage", "round", "rel_err")},
    }


def fault_traces(target_dir: Path, draft_dir: Path, work: Path) -> dict[str, Path]:
    """Full traces of the pair with one planted mistake each (tests/faults.py), recorded by the reference decoder."""
    from faults import Setup, TapFault, aux_of_round, edit_trace, fault, record

    from eaglescope.models.targets import load_target
    from eaglescope.taps import TapContract

    target = load_target(target_dir, device=DEVICE, dtype=torch.bfloat16)
    setup = Setup(target, draft_dir, work, [int(x) for x in PROMPT.split(",")], target_dir)
    H = target.hidden_size
    late = TapFault(target, {j: ("hs", i + 1) for j, i in enumerate(TapContract.default(target.num_layers).layers)})
    plants = {
        "taps one layer late": dict(target=late),
        "fc skipped": dict(proposer_cls=fault("features", lambda p, aux: aux[:, :H], 2)),
        "steps k>0 fed target features": dict(
            proposer_cls=fault("child_hidden", lambda p, h: p.features(p.state.aux)[-1:].expand(h.shape[0], -1), 2)
        ),
    }
    out = {}
    for name, plant in plants.items():
        trace = work / ("trace-" + name.replace(" ", "-").replace(">", "gt"))
        out[name], _ = record(setup, trace, shape=(4, 4, 16), max_new_tokens=NEW, dtype=torch.bfloat16, **plant)
    clean, _ = record(setup, work / "trace-reference-clean", shape=(4, 4, 16), max_new_tokens=NEW,
                      dtype=torch.bfloat16)  # fmt: skip
    out["every verified row handed on (stale)"] = edit_trace(clean, work / "trace-stale", aux_of_round(2))
    del target, late
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    sys.exit(main())
