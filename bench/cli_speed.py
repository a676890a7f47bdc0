"""The decoders users run, timed through the command line on one GPU, and checked first.

    PYTHONPATH=src python3 bench/cli_speed.py --out DIR [--skip-8b]

1. Correctness on a tiny random target and draft on the GPU: `eaglescope generate` with no flag (the fast decoder is
   the default on a GPU), `--reference` and `--fast --trace` give the same tokens, vanilla and speculative (chain
   and tree); the trace is written.
2. An 8B-shaped random bf16 Llama (hidden 4096, 32 layers, 32/8 heads, FFN 14336, vocab 128256) saved as a normal
   checkpoint, then `eaglescope generate` through the CLI, one process each, 64-token prompt, 256 new tokens:
   no flag; --fast --no-batch-invariant; --reference; and with a random EAGLE-3 draft --tree 6,4,24 (τ ≈ 1: the
   cost of a round). Each CLI process reports its own tokens/s (load and graph capture excluded).
3. The same target in transformers, eager `generate` (greedy, 256 new tokens; SDPA on its flash backend), and
   eaglescope's reference decoder in-process with a torch.profiler table of its top kernels and host functions.
Writes cli-speed.json (and logs) under DIR; prints one table last."""

from __future__ import annotations

import argparse
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

from eaglescope.draft import DraftConfig, DraftContract, Eagle3Draft, save_draft  # noqa: E402
from eaglescope.taps import TapContract  # noqa: E402

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


def random_draft(target_dir: Path, out: Path, vocab_draft: int | None = None) -> Path:
    cfg = json.loads((target_dir / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    taps = TapContract.default(L)
    n = vocab_draft or cfg["vocab_size"]
    d = Eagle3Draft(DraftConfig.for_target(cfg, taps, n))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2 and name != "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    counts = torch.randint(0, 1000, (cfg["vocab_size"],), generator=g)
    from eaglescope.data.vocab import build_draft_vocab

    d.set_vocab_map(*build_draft_vocab(counts, n))
    return save_draft(d.to(torch.bfloat16), DraftContract(taps=taps, ttt_length=7), out)


def part_correctness(work: Path, logs: Path) -> dict:
    from models import make_checkpoint

    target = make_checkpoint("llama", work / "tiny", num_hidden_layers=8, hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                             max_position_embeddings=512)  # fmt: skip
    draft = random_draft(target, work / "tiny-draft", 128)
    base = ["generate", "--target", str(target), "--prompt-ids", ",".join(str(t % 500) for t in PROMPT64[:24])]
    base += ["--max-new-tokens", "48", "--json"]
    res = {}
    for name, extra in {
        "vanilla default": [],
        "vanilla --reference": ["--reference"],
        "chain default": ["--draft", str(draft), "--chain", "3"],
        "chain --reference": ["--draft", str(draft), "--chain", "3", "--reference"],
        "tree default": ["--draft", str(draft), "--tree", "3,2,6"],
        "tree --reference": ["--draft", str(draft), "--tree", "3,2,6", "--reference"],
        "tree --fast --trace": ["--draft", str(draft), "--tree", "3,2,6", "--fast", "--trace", str(work / "trace")],
    }.items():
        res[name] = cli(base + extra, logs / f"correct-{name.replace(' ', '_').replace('-', '')}.log")
    ok = {
        "vanilla": res["vanilla default"].get("token_ids") == res["vanilla --reference"].get("token_ids"),
        "chain": res["chain default"].get("token_ids") == res["chain --reference"].get("token_ids"),
        "tree": res["tree default"].get("token_ids") == res["tree --reference"].get("token_ids"),
        "tree_fast_trace": res["tree --fast --trace"].get("token_ids") == res["tree --reference"].get("token_ids"),
        "speculative_is_vanilla": res["tree default"].get("token_ids") == res["vanilla default"].get("token_ids"),
        "trace_written": (work / "trace" / "manifest.json").is_file(),
        "default_is_fast": "reference decoder" not in (res["chain default"].get("stderr") or ""),
    }
    return {"runs": {k: {kk: v for kk, v in r.items() if kk != "token_ids"} for k, r in res.items()}, "ok": ok}


def make_8b(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=2048,
                      rope_theta=500000.0, tie_word_embeddings=False)  # fmt: skip
    with torch.device("cuda"):
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
    m.generation_config.eos_token_id = None
    m.save_pretrained(out, safe_serialization=True)
    del m
    torch.cuda.empty_cache()
    return out


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
    from eaglescope.target import load_target

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
    res["correctness"] = part_correctness(work, logs)
    res["correctness_s"] = time.perf_counter() - t0
    save()
    print("correctness:", res["correctness"]["ok"], flush=True)
    if args.skip_8b:
        return 0
    t = time.perf_counter()
    target = make_8b(work / "llama8b")
    draft = random_draft(target, work / "llama8b-draft", 32000)
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
