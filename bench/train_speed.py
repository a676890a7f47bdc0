"""Training throughput and memory at 8B shape: `eaglescope train` online, TTT 7, 2,048-token samples.

    PYTHONPATH=src python3 bench/train_speed.py --out bench/results              # one H200, < 8 min
    PYTHONPATH=src python3 bench/train_speed.py --smoke --out /tmp/ts          # CPU, tiny shape, the same code

1. A Llama target of Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads / 8 KV heads, FFN 14336, vocabulary
   128,256) with random bf16 weights, built on the GPU by transformers and saved with `save_pretrained`.
2. A prepared-data directory in the format `eaglescope.data.shards` reads, of synthetic token ids (Zipf-distributed
   over the vocabulary, so the 32,000-token draft vocabulary covers most of them; the first eighth of each sample is
   the "prompt", outside the loss mask), its draft vocabulary built by the product's `build_draft_vocab`. Written
   here rather than by `eaglescope prepare`, which would need a 128,256-token tokenizer and a second 16 GB load.
3. For each batch size, `python -m eaglescope.cli train --compile` (the command itself, one process per run so each
   run's peak memory is its own) for --steps optimizer steps; its `training_metrics.json` "speed" section and its
   closing stderr line are the result: tokens/s, model FLOPs per token, fraction of the dense bf16 peak, peak memory
   (docs/training-speed.md). --no-compile runs the eager step instead; --eager-baseline adds, after the compiled
   runs, one eager run of the first batch size, so the two are measured in one invocation on one machine.

The JSON (OUT/train-speed-<time>.json, rewritten after every run) has one entry per run under `runs` (batch_size,
tokens_per_second, fraction_of_peak, peak_memory_gb, model_flops_per_token, rc, commit, ...) and the commit. A run
that fails (out of memory) is a result too: its exit code and last stderr lines.

--profile adds one more run of the first batch size, in this process through `eaglescope.train.loop.train`, under
torch.profiler for two steps after a warm-up step: where the step's time goes, op by op (OUT/...-profile.txt, its
first 40 rows; every op, costliest first, under `profile.ops` in the JSON); --profile-only makes that run alone.
With --work, a target already built there by an earlier invocation is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from eaglescope.data.shards import FORMAT_VERSION, MANIFEST, SAMPLES, VOCAB, save_atomic, write_json_atomic
from eaglescope.models.targets.loading import fingerprint_of, read_config
from eaglescope.models.vocab import build_draft_vocab, count_tokens

LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5)  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6)  # fmt: skip


def build_target(shape: dict, out: Path, device: str, dtype: torch.dtype) -> Path:
    """A random Llama of `shape`, built on `device` in `dtype` by transformers and saved with save_pretrained."""
    import transformers

    config = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
        model.save_pretrained(out)
    finally:
        torch.set_default_dtype(before)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def write_prepared(out: Path, target: Path, num_samples: int, length: int, draft_vocab: int, seed: int = 0) -> Path:
    """A prepared-data directory (online mode: token ids and loss masks, no hidden states) of synthetic samples."""
    return write_prepared_lengths(out, target, [length] * num_samples, draft_vocab, seed, "bench/train_speed.py")


def write_prepared_lengths(out: Path, target: Path, lengths: list[int], draft_vocab: int, seed: int = 0,
                           producer: str = "bench") -> Path:  # fmt: skip
    """A prepared-data directory of synthetic samples of these lengths: Zipf-distributed ids over the vocabulary, the
    first eighth of each sample its prompt (outside the loss mask), the draft vocabulary by build_draft_vocab."""
    fp = fingerprint_of(target, read_config(target))
    V = fp.vocab_size
    total = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / (torch.arange(V, dtype=torch.float64) + 10.0)
    ids = torch.randperm(V, generator=g)[torch.multinomial(zipf, total, True, generator=g)]
    mask = torch.ones(total, dtype=torch.uint8)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    for a, n in zip(offsets[:-1].tolist(), lengths, strict=True):
        mask[a : a + max(1, n // 8)] = 0  # the prompt
    out.mkdir(parents=True, exist_ok=True)
    samples = {"input_ids": ids.to(torch.int32), "loss_mask": mask, "offsets": offsets}
    samples_file = {"file": SAMPLES, **save_atomic(samples, out / SAMPLES)}
    counts = count_tokens([(ids, mask)], V)
    d2t, t2d = build_draft_vocab(counts, draft_vocab)
    vocab_file = {"file": VOCAB, **save_atomic({"d2t": d2t, "t2d": t2d, "token_counts": counts}, out / VOCAB)}
    manifest = {
        "format_version": FORMAT_VERSION,
        "producer": f"{producer} (synthetic token ids)",
        "target": fp.to_dict(),
        "chat_template_sha256": None,
        "taps": None,  # online: train takes the default taps
        "num_samples": len(lengths),
        "num_tokens": total,
        "num_supervised_tokens": int(mask.sum()),
        "max_length": max(lengths),
        "regenerated": False,
        "draft_vocab_size": draft_vocab,
        "samples_file": samples_file,
        "vocab_file": vocab_file,
        "hidden_states": False,
        "shards": [],
    }
    write_json_atomic(manifest, out / MANIFEST)
    return out


def train_argv(target: Path, data: Path, out: Path, batch: int, steps: int, length: int, eval_fraction: float,
               device: str, dtype: str, compiled: bool) -> list[str]:  # fmt: skip
    args = ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--max-steps", str(steps)]
    args += ["--batch-size", str(batch), "--ttt-length", "7", "--max-length", str(length), "--seed", "0"]
    args += ["--eval-fraction", f"{eval_fraction:.6f}", "--device", device, "--dtype", dtype, "--overwrite"]
    return [sys.executable, "-m", "eaglescope.cli", *args, *(["--compile"] if compiled else [])]


def run_one(argv: list[str], out: Path, batch: int) -> dict:
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True)
    row: dict = {"batch_size": batch, "compiled": "--compile" in argv, "rc": res.returncode,
                 "wall_s": time.perf_counter() - t0, "argv": argv[2:]}  # fmt: skip
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    row["stderr_tail"] = lines[-4:] if res.returncode == 0 else lines[-30:]  # a failure: its traceback
    if res.returncode == 0:
        speed = json.loads((out / "training_metrics.json").read_text())["speed"]
        row |= {
            "tokens_per_second": speed["tokens_per_second"],
            "fraction_of_peak": speed["fraction_of_peak"],
            "peak_memory_gb": speed["peak_memory_bytes"] / 1e9,
            "model_flops_per_token": speed["model_flops_per_token"],
            "closing_line": lines[-1] if lines else None,
            "speed": speed,
        }
    shutil.rmtree(out, ignore_errors=True)  # a draft and its optimizer state: 7 GB at 8B shape
    return row


def profile_run(target: Path, data: Path, out: Path, batch: int, length: int, eval_fraction: float, device: str,
                dtype: str, compiled: bool) -> dict:  # fmt: skip
    """One more train() of 4 steps in this process, steps 3 and 4 under torch.profiler → its op table (ms per step)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from eaglescope.config import TrainConfig
    from eaglescope.train.loop import train

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    cfg = TrainConfig(target=str(target), data=str(data), out=str(out), ttt_length=7, max_steps=4, batch_size=batch,
                      max_length=length, eval_fraction=eval_fraction, device=device, dtype=dtype,
                      overwrite=True, compile=compiled)  # fmt: skip
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=2)) as prof:
        train(cfg, progress=False, on_step=lambda step, logs: prof.step())
    shutil.rmtree(out, ignore_errors=True)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    ops = [{"op": e.key, "calls_per_step": e.count / 2, "self_ms_per_step": getattr(e, key) / 2e3} for e in events]
    return {"batch_size": batch, "compiled": compiled, "profiled_steps": 2, "sorted_by": key, "ops": ops,
            "table": prof.key_averages().table(sort_by=key, row_limit=40)}  # fmt: skip


def commit() -> str:
    # the device copy of the tree may have no .git: the caller can pass the commit in the environment
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return os.environ.get("EAGLESCOPE_COMMIT") or (head if len(head) == 40 else "unknown")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    ap.add_argument("--work", type=Path, help="target, data and drafts (default: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (float32): the same code path")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 4,8; smoke 2,4)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 6; smoke 3)")
    ap.add_argument("--length", type=int, default=None, help="tokens per sample (default 2048; smoke 64)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary (default 32000; smoke 128)")
    ap.add_argument("--time-limit", type=float, default=450.0, help="no new run starts after this many seconds")
    ap.add_argument("--no-compile", action="store_true", help="the eager step (train without --compile)")
    ap.add_argument("--eager-baseline", action="store_true", help="then one eager run of the first batch size")
    ap.add_argument("--profile", action="store_true", help="one more run of the first batch size under torch.profiler")
    ap.add_argument("--profile-only", action="store_true", help="the profiled run alone (of the first batch size)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    shape = TINY if smoke else LLAMA_8B
    batches = [int(b) for b in (args.batch_sizes or ("2,4" if smoke else "4,8")).split(",")]
    steps = args.steps or (3 if smoke else 6)
    length = args.length or (64 if smoke else 2048)
    draft_vocab = args.draft_vocab or (128 if smoke else 32000)
    device = "cpu" if smoke else "cuda"
    dtype = "float32" if smoke else "bfloat16"
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"train-speed-{datetime.now(UTC):%Y%m%dT%H%M%S}{'-smoke' if smoke else ''}.json"
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not smoke else "cpu",
        "torch": torch.__version__,
        "commit": commit(),
        "settings": {
            "shape": shape,
            "smoke": smoke,
            "ttt_length": 7,
            "draft_vocab_size": draft_vocab,
            "sample_tokens": length,
            "steps": steps,
            "dtype": dtype,
        },  # fmt: skip
        "runs": [],
    }

    def write() -> None:  # after every run: a command stopped at its time limit still leaves the runs it finished
        result["wall_s"] = time.perf_counter() - t_start
        path.write_text(json.dumps(result, indent=2) + "\n")

    runs = result["runs"]
    with tempfile.TemporaryDirectory(prefix="train-speed-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        target = work / "target"
        if not (args.work and (target / "config.json").is_file()):  # --work kept from an earlier run: reused
            build_target(shape, target, device, getattr(torch, dtype))
        result["build_target_s"] = time.perf_counter() - t0
        n_eval = 2
        n = result["settings"]["num_samples"] = max(batches) * steps + n_eval
        data = write_prepared(work / "data", target, n, length, draft_vocab)
        compiled = not args.no_compile
        plan = [(b, compiled) for b in batches] + ([(batches[0], False)] if args.eager_baseline and compiled else [])
        for b, c in [] if args.profile_only else plan:
            if time.perf_counter() - t_start > args.time_limit:
                runs.append({"batch_size": b, "compiled": c, "rc": None,
                             "skipped": f"--time-limit {args.time_limit:.0f} s reached"})  # fmt: skip
                continue
            out = work / f"draft-b{b}"
            argv = train_argv(target, data, out, b, steps, length, n_eval / n, device, dtype, c)
            runs.append(run_one(argv, out, b))
            runs[-1]["commit"] = result["commit"]
            write()
            print(json.dumps({k: runs[-1].get(k) for k in ("batch_size", "compiled", "rc", "tokens_per_second",
                              "fraction_of_peak", "peak_memory_gb", "wall_s")}), file=sys.stderr)  # fmt: skip
        if args.profile_only or (args.profile and time.perf_counter() - t_start < args.time_limit):
            profiled = profile_run(target, data, work / "draft-profile", batches[0], length, n_eval / n, device, dtype,
                                   compiled)  # fmt: skip
            path.with_name(path.stem + "-profile.txt").write_text(profiled.pop("table") + "\n")
            result["profile"] = profiled
    write()
    keys = ("batch_size", "compiled", "rc", "tokens_per_second", "fraction_of_peak", "peak_memory_gb")
    print(json.dumps({"path": str(path), "runs": [{k: r.get(k) for k in keys} for r in runs]}, indent=2))
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
