"""The decoders users run, timed through the command line on one GPU, and checked first.

    PYTHONPATH=src python3 bench/cli_speed.py --out DIR [--skip-8b]

1. Correctness on a tiny random target and draft on the GPU, `eaglescope generate` in this process (`ok`, all must
   be true): speculation (chain and tree) gives vanilla's tokens on the default (static-shape) decoder in bf16 and
   on `--reference` in float32; the two decoders give the same tokens in float32; `--fast --trace` gives vanilla's
   tokens and writes its trace. Measured besides (`backends_bf16`): whether the two decoders' tokens are the same in
   bf16 and, where they first differ, the float32 logits' top-2 gap there. They need not be: the default decoder
   runs the target on batch-invariant Triton kernels, the reference one on cuBLAS, and their bf16 roundings differ,
   which breaks a near-tie of this random target's logits either way.
2. An 8B-shaped random bf16 Llama (hidden 4096, 32 layers, 32/8 heads, FFN 14336, vocab 128256) saved as a normal
   checkpoint, then `eaglescope generate` through the CLI, one process each, 64-token prompt, 256 new tokens:
   no flag; --fast --no-batch-invariant; --reference; and with a random EAGLE-3 draft --tree 6,4,24 (τ ≈ 1: the
   cost of a round). Each CLI process reports its own tokens/s (load and graph capture excluded).
3. The same target in transformers, eager `generate` (greedy, 256 new tokens; SDPA on its flash backend), and
   eaglescope's reference decoder in-process with a torch.profiler table of its top kernels and host functions.
Writes cli-speed.json (and logs) under DIR; prints one table last."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from drafts import save_random_draft  # noqa: E402
from models import make_checkpoint, make_llama8b  # noqa: E402

PROMPT64 = [(i * 7919) % 120000 + 100 for i in range(64)]


def cli(argv: list[str], log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "eaglescope.cli", *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    log.write_text(f"$ eaglescope {' '.join(argv)}\nrc={r.returncode}\n--- stderr\n{r.stderr}\n--- stdout\n{r.stdout}")
    if r.returncode != 0:
        return {"argv": argv, "rc": r.returncode, "stderr": r.stderr[-2000:], "wall_s": wall}
    out = json.loads(r.stdout)
    return {"argv": argv, "rc": 0, "wall_s": wall, "token_ids": out["token_ids"], "stats": out["stats"],
            "stderr": r.stderr[-500:]}  # fmt: skip


def generate_in_process(argv: list[str]) -> dict:
    """`eaglescope generate ... --json` in this process (the correctness part needs no per-process timing)."""
    from eaglescope.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"eaglescope {' '.join(argv)} exited {rc}")
    return json.loads(buf.getvalue())


def float32_margin(target: Path, prompt: list[int], tokens: list[int], at: int) -> dict:
    """The target's float32 logits where two runs' greedy tokens first differ: the top-2 gap and both tokens' gap to
    the best (a near-tie that bf16 rounding can break either way, or a real disagreement)."""
    from eaglescope.models.targets import load_target

    t = load_target(target, device="cuda", dtype=torch.float32)
    t.reset(len(prompt) + at + 2)
    with torch.inference_mode():
        logits = t.forward(torch.tensor(prompt + tokens[:at], device="cuda")).logits[-1].double()
    top = logits.topk(2)
    return {"top2_gap": float(top.values[0] - top.values[1]), "float32_argmax": int(top.indices[0])}


def part_correctness(work: Path) -> dict:
    """On a tiny random target and draft. Must hold (`ok`): speculation is lossless on each backend (the default one in
    bf16, on its batch-invariant kernels; the reference one in float32, whose cuBLAS products round differently for
    different row counts); the two backends agree in float32; the trace is written. Measured, not required
    (`backends_bf16`): whether the default and the reference backend give the same tokens in bf16, and where they
    first differ the float32 logits' top-2 gap there."""
    target = make_checkpoint("llama", work / "tiny", num_hidden_layers=8, hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                             max_position_embeddings=512)  # fmt: skip
    draft = save_random_draft(target, work / "tiny-draft", 128)
    prompt = [t % 500 for t in PROMPT64[:24]]
    base = ["generate", "--target", str(target), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "48"]
    base += ["--json"]
    spec = {"chain": ["--draft", str(draft), "--chain", "3"], "tree": ["--draft", str(draft), "--tree", "3,2,6"]}
    runs = {}
    for dtype in ("bfloat16", "float32"):
        for backend, flags in (("default", []), ("reference", ["--reference"])):
            for method, extra in {"vanilla": [], **spec}.items():
                runs[dtype, backend, method] = generate_in_process(base + ["--dtype", dtype, *flags, *extra])
    fast_trace = generate_in_process(base + spec["tree"] + ["--fast", "--trace", str(work / "trace")])

    def ids(dtype, backend, method):
        return runs[dtype, backend, method]["token_ids"]

    ok = {
        "speculative_is_vanilla_default_bf16": all(ids("bfloat16", "default", m)
                                                   == ids("bfloat16", "default", "vanilla") for m in spec),
        "speculative_is_vanilla_reference_float32": all(ids("float32", "reference", m)
                                                        == ids("float32", "reference", "vanilla") for m in spec),
        "default_is_reference_float32": all(ids("float32", "default", m) == ids("float32", "reference", m)
                                            for m in ("vanilla", *spec)),
        "fast_trace_is_vanilla": fast_trace["token_ids"] == ids("bfloat16", "default", "vanilla"),
        "trace_written": (work / "trace" / "manifest.json").is_file(),
    }  # fmt: skip
    bf16 = {}
    for m in ("vanilla", *spec):
        a, b = ids("bfloat16", "default", m), ids("bfloat16", "reference", m)
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        bf16[m] = {"identical": a == b, "first_difference": at}
        if at is not None:
            bf16[m] |= {"default_token": a[at], "reference_token": b[at]} | float32_margin(target, prompt, b, at)
    return {"ok": ok, "backends_bf16": bf16, "tokens": {"/".join(k): v["token_ids"] for k, v in runs.items()}}


def transformers_eager(target: Path, new: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.enable_cudnn_sdp(False)  # its per-key-length plans made transformers 4x slower here
    m = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([PROMPT64], device="cuda")
    kw = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    m.generate(ids, **{**kw, "max_new_tokens": 16, "min_new_tokens": 16})
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = m.generate(ids, **kw)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    n = out.shape[1] - ids.shape[1]
    del m
    torch.cuda.empty_cache()
    torch.backends.cuda.enable_cudnn_sdp(True)
    return {"new_tokens": int(n), "seconds": s, "tokens_per_second": n / s, "ms_per_token": 1000 * s / n}


def reference_profile(target_dir: Path, new: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from eaglescope.decode.loop import generate_vanilla
    from eaglescope.models.targets import load_target

    t = load_target(target_dir, device="cuda", dtype=torch.bfloat16)  # turns SDPA's cuDNN backend off
    generate_vanilla(t, PROMPT64, 8, stop_ids=[])
    res = generate_vanilla(t, PROMPT64, new, stop_ids=[])
    torch.backends.cuda.enable_cudnn_sdp(True)  # what it was before: the cost of cuDNN's per-length plans
    generate_vanilla(t, PROMPT64, 8, stop_ids=[])
    cudnn = generate_vanilla(t, PROMPT64, new, stop_ids=[])
    torch.backends.cuda.enable_cudnn_sdp(False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate_vanilla(t, PROMPT64, 16, stop_ids=[])
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    del t
    torch.cuda.empty_cache()
    return {"tokens_per_second": res.tokens_per_second, "ms_per_token": 1000 / res.tokens_per_second,
            "with_cudnn_sdp_tokens_per_second": cudnn.tokens_per_second, "top_kernels": table,
            "top_host": host}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args()
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/cli-speed")
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
    }

    def save() -> None:
        (out / "cli-speed.json").write_text(json.dumps(res, indent=1))

    t0 = time.perf_counter()
    res["correctness"] = part_correctness(work)
    res["correctness_s"] = time.perf_counter() - t0
    save()
    print("correctness:", res["correctness"]["ok"], flush=True)
    print("default against reference in bf16:", res["correctness"]["backends_bf16"], flush=True)
    if args.skip_8b:
        return 0
    t = time.perf_counter()
    target = make_llama8b(work / "llama8b")
    draft = save_random_draft(target, work / "llama8b-draft", 32000)
    res["build_8b_s"] = time.perf_counter() - t
    save()
    base = ["generate", "--target", str(target), "--prompt-ids", ",".join(map(str, PROMPT64))]
    base += ["--max-new-tokens", str(args.new), "--json"]
    runs = {
        "generate (no flag)": [],
        "generate --fast --no-batch-invariant": ["--fast", "--no-batch-invariant"],
        "generate --reference": ["--reference"],
        "generate --draft --tree 6,4,24 (no flag; random draft)": ["--draft", str(draft), "--tree", "6,4,24"],
    }
    res["cli_8b"] = {}
    for name, extra in runs.items():
        r = cli(base + extra, logs / f"8b-{len(res['cli_8b'])}.log")
        res["cli_8b"][name] = {k: v for k, v in r.items() if k != "token_ids"}
        res["cli_8b"][name]["first_tokens"] = (r.get("token_ids") or [])[:8]
        save()
        print(name, r.get("stats", {}).get("tokens_per_second"), r.get("rc"), flush=True)
    res["transformers_eager_8b"] = transformers_eager(target, args.new)
    save()
    res["reference_in_process_8b"] = reference_profile(target, 64)
    save()
    print("\n" + res["reference_in_process_8b"]["top_kernels"][:3000])
    print("\n" + res["reference_in_process_8b"]["top_host"][:3000])
    print(f"\n{'8B-shaped, 64-token prompt, ' + str(args.new) + ' new tokens':<58}{'tok/s':>9}{'ms/token':>10}")
    for name, r in res["cli_8b"].items():
        tps = (r.get("stats") or {}).get("tokens_per_second")
        print(f"{name:<58}{tps if tps is None else round(tps, 1)!s:>9}{'' if not tps else round(1000 / tps, 2)!s:>10}")
    for name, key in (("transformers eager generate", "transformers_eager_8b"),
                      ("reference decoder in-process", "reference_in_process_8b")):  # fmt: skip
        r = res[key]
        print(f"{name:<58}{r['tokens_per_second']:>9.1f}{r['ms_per_token']:>10.2f}")
    print(f"{'reference decoder in-process, cuDNN SDPA on':<58}"
          f"{res['reference_in_process_8b']['with_cudnn_sdp_tokens_per_second']:>9.1f}")  # fmt: skip
    print("correctness:", res["correctness"]["ok"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
