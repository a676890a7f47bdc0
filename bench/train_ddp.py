"""`eaglescope train` on one GPU against `torchrun --nproc-per-node N` with the same global batch.

    PYTHONPATH=src python3 bench/train_ddp.py --out DIR [--work DIR] [--nproc 2] [--steps 120] [--global-batch 16]
        [--fast] [--device cpu]

The target and its prepared data are the demo's (`eaglescope demo`'s build_target / build_data: a Llama pretrained
on the installed Python sources, the target's own continuations, tap features stored), built on the CPU. Then the
same draft is trained by the product's CLI, once as one process and once under torchrun with batch_size =
global_batch / N, each for --steps optimizer steps with the same seed, so both see the same global batches in the
same order. The JSON (DIR/train-ddp-<time>.json) holds, per run: the exit code and its last stderr lines (a run
torchrun refuses is a result too: on a node with fewer GPUs than N it is eaglescope's one-line error), the loss at
every step (from the run's TensorBoard events), the final held-out acc_k and predicted τ (training_metrics.json),
wall seconds of the whole command and tokens/s per GPU over the steps; and the largest loss difference per step
and the scaling efficiency (N-GPU tokens/s over N × one-GPU tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from eaglescope.data.shards import PreparedData
from eaglescope.demo import DemoConfig, build_data, build_target, open_workdir


def train_argv(nproc: int, target: Path, data: Path, out: Path, batch: int, steps: int, device: str) -> list[str]:
    args = ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--max-steps", str(steps)]
    args += ["--batch-size", str(batch), "--lr", "3e-3", "--warmup-steps", "20", "--seed", "0"]
    dtype = "bfloat16" if device == "cuda" else "float32"
    args += ["--device", device, "--dtype", dtype, "--overwrite"]
    if nproc == 1:
        return [sys.executable, "-m", "eaglescope.cli", *args]
    # --standalone: the launcher binds its own free port (a port chosen here could be taken before it binds)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*run, "-m", "eaglescope.cli", *args]


def losses(tb: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for events in sorted(tb.glob("**/events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "train/loss" in acc.Tags().get("scalars", []):
            out |= {e.step: e.value for e in acc.Scalars("train/loss")}
    return out


def run_one(nproc: int, target: Path, data: Path, out: Path, batch: int, steps: int, tokens: float, device: str):
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off, as the device notes ask
    t0 = time.perf_counter()
    argv = train_argv(nproc, target, data, out, batch // nproc, steps, device)
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    row: dict = {"nproc": nproc, "rc": res.returncode, "wall_s": wall, "argv": argv[1:]}
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    # eaglescope's own lines (its errors are one line each, per rank) and the end of torchrun's summary
    row["eaglescope_lines"] = [x for x in lines if x.startswith("eaglescope:") and "%|" not in x][-8:]
    row["stderr_tail"] = lines[-6:]
    if res.returncode != 0:
        return row
    metrics = json.loads((out / "training_metrics.json").read_text())
    row["acc"] = metrics.get("acc")
    row["predicted_accept_length"] = metrics.get("predicted_accept_length")
    row["loss"] = losses(out / "tb")
    # tokens/s per GPU over the whole command (loading and evaluation included: the same for both runs)
    row["tokens_per_s_per_gpu"] = tokens * steps / wall / nproc
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    ap.add_argument("--work", type=Path, help="the models, data and drafts (default OUT/work)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--fast", action="store_true", help="the demo's smaller target and data")
    ap.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo: a smoke run of this script)")
    args = ap.parse_args()
    if args.global_batch % args.nproc:
        ap.error("--global-batch must be a multiple of --nproc")
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    open_workdir(work)
    cfg = DemoConfig(workdir=str(work), fast=args.fast)
    t0 = time.perf_counter()
    target = build_target(cfg, work)
    data = build_data(cfg, work, target)
    built = time.perf_counter() - t0
    m = PreparedData.open(str(data), verify=False).manifest
    tokens = m["num_tokens"] / m["num_samples"] * args.global_batch  # tokens per optimizer step, on average
    gpus = torch.cuda.device_count()
    rows = [run_one(n, target, data, work / f"draft-{n}", args.global_batch, args.steps, tokens, args.device)
            for n in (1, args.nproc)]  # fmt: skip
    one, many = rows
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if gpus else "cpu",
        "gpus": gpus,
        "torch": torch.__version__,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "settings": {"nproc": args.nproc, "steps": args.steps, "global_batch": args.global_batch, "fast": args.fast},
        "build_s": built,
        "tokens_per_step": tokens,
        "runs": rows,
    }
    if one["rc"] == 0 and many["rc"] == 0:
        common = sorted(set(one["loss"]) & set(many["loss"]))
        result["max_loss_diff"] = max(abs(one["loss"][s] - many["loss"][s]) for s in common)
        result["scaling_efficiency"] = many["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
    path = args.out / f"train-ddp-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"} | {
        "runs": [{k: r.get(k) for k in ("nproc", "rc", "wall_s", "tokens_per_s_per_gpu", "predicted_accept_length",
                                        "eaglescope_lines")} for r in rows]}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
