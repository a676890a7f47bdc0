"""Training speed on a realistic length mix, padded against packed (`train --pack`), at 8B shape.

    PYTHONPATH=src python3 bench/train_pack.py --out bench/results       # one H100/H200, about 5 min
    PYTHONPATH=src python3 bench/train_pack.py --tiny --out /tmp/tp      # CPU, tiny shape, the same code path

1. The target of bench/train_speed.py: a random bf16 Llama of Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads /
   8 KV heads, FFN 14336, vocabulary 128,256), built by transformers and saved with `save_pretrained`.
2. A prepared-data directory (the format `eaglescope.data.shards` reads; online: token ids and loss masks) whose sample
   lengths follow a ShareGPT-like mix: lognormal, median 600 tokens, σ 0.9 (mean about 880 before clipping), clipped
   to 64..4,096, seeded (--seed). Ids are Zipf-distributed over the vocabulary (as train_speed's); the first eighth of
   each sample is its prompt, outside the loss mask; the draft vocabulary (32,000) by the product's build_draft_vocab.
3. For each run of --runs (default padded:4, pack:16, then pack:8 if --time-limit allows: mode and batch size; batch
   8 padded would not fit 80 GB when a 4,096-token sample comes), `eaglescope train --compile --max-length 4096
   --ttt-length 7` (with `--pack` for pack runs), one process per run so each peak memory is its own, for --steps
   optimizer steps. The process is the command's own (`eaglescope.cli.main`) with one hook: each step's seconds,
   tokens and model FLOPs as the product's meter (train/speed.py) timed them, and dynamo's count of compiled graphs,
   are also written to a file, so the rates leave out every step that compiled (the lengths change from step to step:
   under --compile the first steps compile until dynamo has made the sizes symbolic). Tokens are real tokens (padding
   is not counted), the fraction of the dense bf16 peak that of the model FLOPs of the real samples (train/speed.py, as
   bench/train_speed.py reports it); memory torch.cuda.max_memory_allocated. train's own figures (the first step left
   out) are kept beside (`product_report`), and the held-out acc_k and loss. A run that fails (out of memory) is
   recorded with its exit code and stderr.
4. Beside each run, its layout replayed from the same data order (train's _Order): the positions the steps computed
   (padded: batch × longest sample; packed: rows × row length, one row per micro-batch under flex attention), and the
   share of them that are real tokens.

OUT/train-pack-<time>[-tiny].json (rewritten after every run) and OUT/train-pack-<time>[-tiny].md (a table).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import LLAMA_8B, TINY, build_target, commit, write_prepared_lengths  # noqa: E402

from eaglescope.config import TrainConfig  # noqa: E402
from eaglescope.train.loop import _Order  # noqa: E402
from eaglescope.train.packing import plan  # noqa: E402

# The length mix: (median, sigma, shortest, longest). 8B: ShareGPT-like conversations under a Llama-3 tokenizer
# (median ~600, a long tail); tiny: the same shape scaled to the tiny target's 256 positions.
MIX_8B = (600.0, 0.9, 64, 4096)
MIX_TINY = (40.0, 0.9, 8, 128)
TTT = 7
# The rates leave out every step during which dynamo compiled a graph (the first always; under --compile the next
# ones whose lengths are new, until dynamo has made the sizes symbolic, or whose attention kind is new: flex from
# 1,024 tokens, dense below). If no step is left, the steps after the first WARMUP_STEPS are taken.
# train's own figure, the first step left out only, is kept beside as product_report.
WARMUP_STEPS = 2


def sample_lengths(n: int, mix: tuple[float, float, int, int], seed: int) -> list[int]:
    median, sigma, low, high = mix
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    return [int(x) for x in (math.log(median) + sigma * z).exp().round().clamp(low, high).tolist()]


def write_prepared_mix(out: Path, target: Path, lengths: list[int], draft_vocab: int, seed: int = 0) -> Path:
    """A prepared-data directory (online mode: token ids and loss masks) of synthetic samples of these lengths."""
    return write_prepared_lengths(out, target, lengths, draft_vocab, seed, "bench/train_pack.py, lognormal lengths")


def layout_of(lengths: list[int], batch: int, steps: int, eval_fraction: float, max_length: int, pack: bool,
              row_tokens: int | None) -> dict:  # fmt: skip
    """The positions the run's steps compute, replayed from train's data order: real tokens, positions, their share
    (the first step included; the speed report leaves it out). `row_tokens`: a packed row's capacity as train picks it
    (None: one row, under flex attention on a GPU; --max-length under the dense form on the CPU)."""
    cfg = TrainConfig(target="", data="", out="", batch_size=batch, eval_fraction=eval_fraction, seed=0)
    order = _Order(cfg, len(lengths), 1)
    real = computed = 0
    rows = []
    for step in range(steps):
        ls = [min(lengths[i], max_length) for i in order.global_batch(step)]
        real += sum(ls)
        if pack:
            lay = plan(ls, row_tokens)
            computed += lay.rows * lay.length
            rows.append([lay.rows, lay.length])
        else:
            computed += len(ls) * max(ls)
            rows.append([len(ls), max(ls)])
    return {"real_tokens": real, "computed_positions": computed, "real_share": real / computed, "rows_x_length": rows}


def train_args(target: Path, data: Path, out: Path, batch: int, steps: int, max_length: int, eval_fraction: float,
               device: str, dtype: str, pack: bool, compiled: bool) -> list[str]:  # fmt: skip
    args = ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--max-steps", str(steps)]
    args += ["--batch-size", str(batch), "--ttt-length", str(TTT), "--max-length", str(max_length), "--seed", "0"]
    args += ["--eval-fraction", f"{eval_fraction:.6f}", "--device", device, "--dtype", dtype, "--overwrite"]
    return args + (["--compile"] if compiled else []) + (["--pack"] if pack else [])


def child(steps_file: str, args: list[str]) -> int:
    """`eaglescope train ARGS` in this process, appending each optimizer step's (seconds, tokens, model FLOPs), as the
    product's meter (train/speed.py Throughput) timed it, to `steps_file`: the bench leaves out the compiling steps."""
    from torch._dynamo.utils import counters

    from eaglescope.cli import main as cli_main
    from eaglescope.train import speed

    stop = speed.Throughput.stop

    def recording_stop(self) -> None:
        stop(self)
        graphs = counters["stats"]["unique_graphs"]  # graphs dynamo has compiled in this process so far
        with open(steps_file, "a") as f:
            f.write(json.dumps([*self.steps[-1], graphs]) + "\n")

    speed.Throughput.stop = recording_stop
    return cli_main(args)


def run_train(args: list[str], out: Path, work: Path, batch: int) -> dict:
    """One train run in its own process (its peak memory its own) → its speed, per-step times and held-out metrics."""
    steps_file = work / f"{out.name}-steps.jsonl"
    steps_file.unlink(missing_ok=True)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, __file__, "--child", str(steps_file), "--", *args], capture_output=True,
                         text=True)  # fmt: skip
    row: dict = {"batch_size": batch, "rc": res.returncode, "wall_s": time.perf_counter() - t0, "argv": args}
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    row["stderr_tail"] = lines[-4:] if res.returncode == 0 else lines[-30:]
    steps = [json.loads(x) for x in steps_file.read_text().splitlines()] if steps_file.is_file() else []
    # left out: the first step (one-off costs, as train's report leaves it out) and each step during which dynamo's
    # graph count grew (it compiled)
    compiled = [i == 0 or g > steps[i - 1][3] for i, (_, _, _, g) in enumerate(steps)]
    row["steps"] = [{"seconds": s, "tokens": t, "model_flops": f, "left_out": c}
                    for (s, t, f, _), c in zip(steps, compiled, strict=True)]  # fmt: skip
    if res.returncode == 0:
        metrics = json.loads((out / "training_metrics.json").read_text())
        speed = metrics["speed"]
        peak = speed["peak_bf16_flops_per_device"]
        steady = [x[:3] for x, c in zip(steps, compiled, strict=True) if not c]
        if not steady:  # every step compiled: the steps after the warm-up ones, as the best there is
            steady = [x[:3] for x in steps[WARMUP_STEPS:]]
        seconds = sum(s for s, _, _ in steady)
        flops = None if any(f is None for _, _, f in steady) else sum(f for _, _, f in steady)
        row |= {
            "tokens_per_second": sum(t for _, t, _ in steady) / seconds if seconds else None,
            "fraction_of_peak": flops / seconds / peak if flops is not None and seconds and peak else None,
            "timed_steps": len(steady),
            "product_report": {k: speed[k] for k in ("tokens_per_second", "fraction_of_peak", "timed_steps")},
            "peak_memory_gb": speed["peak_memory_bytes"] / 1e9,
            "model_flops_per_token": speed["model_flops_per_token"],
            "heldout": {k: metrics.get(k) for k in ("acc", "loss", "predicted_accept_length", "num_samples")},
            "closing_line": lines[-1] if lines else None,
        }
    shutil.rmtree(out, ignore_errors=True)  # a draft and its optimizer state: 7 GB at 8B shape
    return row


def markdown(result: dict) -> str:
    s = result["settings"]
    mix, drawn = s["mix"], s["length_stats"]
    lines = [
        f"# train --pack at {'tiny' if s['tiny'] else '8B'} shape: {result['device']}, commit {result['commit'][:7]}",
        "",
        f"Lengths: lognormal, median {mix['median']:.0f}, σ {mix['sigma']}, "
        f"clipped {mix['shortest']}..{mix['longest']}, seed {s['seed']} "
        f"(drawn: mean {drawn['mean']:.0f}, median {drawn['median']:.0f}, "
        f"p90 {drawn['p90']:.0f}, max {drawn['max']}). "
        f"TTT {TTT}, --max-length {s['max_length']}, {s['steps']} steps per run (rates over the steps that compiled "
        "nothing), "
        f"{'--compile, ' if s['compiled'] else ''}{s['dtype']}.",
        "",
        "| mode | batch | tokens/s | fraction of peak | train's own report (first step left out) | peak memory GB | "
        "real share of computed positions | held-out acc_0, loss_0 | rc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def pct(x) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    for r in result["runs"]:
        own, held = r.get("product_report") or {}, r.get("heldout") or {}
        frac, own_frac = r.get("fraction_of_peak"), own.get("fraction_of_peak")
        lines.append(
            f"| {r['mode']} | {r['batch_size']} | {num(r.get('tokens_per_second'), ',.0f')} | "
            f"{pct(frac)} | {num(own.get('tokens_per_second'), ',.0f')} tok/s, "
            f"{pct(own_frac)} | {num(r.get('peak_memory_gb'), '.1f')} | "
            f"{r['layout']['real_share']:.2f} | {num((held.get('acc') or [None])[0], '.3f')}, "
            f"{num((held.get('loss') or [None])[0], '.4f')} | {r.get('rc')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # one run, started by run_train: --child STEPS_FILE -- TRAIN ARGS
        return child(argv[1], argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where the JSON and the table go")
    ap.add_argument("--work", type=Path, help="target, data and drafts (default: a temporary directory)")
    ap.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (float32): the same code path")
    ap.add_argument("--runs", help="mode:batch,... (default padded:4,pack:16,pack:8; tiny: padded:2,pack:4)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 7; tiny 4)")
    ap.add_argument("--seed", type=int, default=0, help="the length mix's and the token ids' seed")
    ap.add_argument("--time-limit", type=float, default=330.0, help="no new run starts after this many seconds")
    ap.add_argument("--no-compile", action="store_true", help="the eager step (train without --compile)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    shape, mix = (TINY, MIX_TINY) if tiny else (LLAMA_8B, MIX_8B)
    runs_spec = [(m, int(b)) for m, b in (x.split(":") for x in (args.runs or ("padded:2,pack:4" if tiny else
                 "padded:4,pack:16,pack:8")).split(","))]  # fmt: skip
    if any(m not in ("padded", "pack") for m, _ in runs_spec):
        ap.error("--runs: each entry is padded:N or pack:N")
    steps = args.steps or (4 if tiny else 7)
    if steps <= WARMUP_STEPS:
        ap.error(f"--steps must be more than {WARMUP_STEPS}: the first steps compile")
    max_length = mix[3]
    draft_vocab = 128 if tiny else 32000
    device, dtype = ("cpu", "float32") if tiny else ("cuda", "bfloat16")
    compiled = not args.no_compile
    n_eval = 2
    n = max(b for _, b in runs_spec) * steps + n_eval
    lengths = sample_lengths(n, mix, args.seed)
    ordered = sorted(lengths)
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"train-pack-{datetime.now(UTC):%Y%m%dT%H%M%S}{'-tiny' if tiny else ''}.json"
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not tiny else "cpu",
        "torch": torch.__version__,
        "commit": commit(),
        "settings": {
            "shape": shape,
            "tiny": tiny,
            "ttt_length": TTT,
            "draft_vocab_size": draft_vocab,
            "mix": dict(zip(("median", "sigma", "shortest", "longest"), mix, strict=True)),
            "seed": args.seed,
            "num_samples": n,
            "length_stats": {
                "mean": sum(lengths) / n,
                "median": ordered[n // 2],
                "p90": ordered[int(0.9 * (n - 1))],
                "max": ordered[-1],
            },  # fmt: skip
            "max_length": max_length,
            "steps": steps,
            "dtype": dtype,
            "compiled": compiled,
        },
        "runs": [],
    }

    def write() -> None:  # after every run: a command stopped at its time limit keeps the runs it finished
        result["wall_s"] = time.perf_counter() - t_start
        path.write_text(json.dumps(result, indent=2) + "\n")
        path.with_suffix(".md").write_text(markdown(result))

    runs = result["runs"]
    with tempfile.TemporaryDirectory(prefix="train-pack-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        target = work / "target"
        if not (args.work and (target / "config.json").is_file()):
            build_target(shape, target, device, getattr(torch, dtype))
        result["build_target_s"] = time.perf_counter() - t0
        data = write_prepared_mix(work / f"data-{args.seed}", target, lengths, draft_vocab, args.seed)
        for mode, b in runs_spec:
            pack = mode == "pack"
            layout = layout_of(lengths, b, steps, n_eval / n, max_length, pack, max_length if tiny else None)
            if time.perf_counter() - t_start > args.time_limit:
                runs.append({"mode": mode, "batch_size": b, "rc": None, "layout": layout,
                             "skipped": f"--time-limit {args.time_limit:.0f} s reached"})  # fmt: skip
                write()
                continue
            out = work / f"draft-{mode}-b{b}"
            args_ = train_args(target, data, out, b, steps, max_length, n_eval / n, device, dtype, pack, compiled)
            row = run_train(args_, out, work, b)
            runs.append({"mode": mode, **row, "layout": layout, "commit": result["commit"]})
            write()
            print(json.dumps({k: runs[-1].get(k) for k in ("mode", "batch_size", "rc", "tokens_per_second",
                              "fraction_of_peak", "peak_memory_gb", "wall_s")}), file=sys.stderr)  # fmt: skip
    write()
    print(path.with_suffix(".md").read_text())
    print(json.dumps({"path": str(path)}))
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
