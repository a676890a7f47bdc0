"""Where transformers' `generate` spends its time on this machine (the protocol's transformers rows are host-bound).

    PYTHONPATH=src python3 bench/hf_generate_profile.py [--out DIR]

Random-weight models of the protocol's shapes (the 197M target, the 20M draft LM), bf16 on the GPU: ms per token of
vanilla / assisted / prompt-lookup generate, a bare cached forward for comparison, and the top host functions
(cProfile) and kernels (torch.profiler) of each, so a slow row can be traced to its cause."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_bench import sync  # noqa: E402


def model(vocab: int, d: int, layers: int, heads: int, kv: int, ffn: int, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=ffn, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    m.generation_config.do_sample = False
    return m


def timed(fn, reps: int = 2) -> float:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def top_host(fn, n: int = 18) -> str:
    pr = cProfile.Profile()
    pr.enable()
    fn()
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def top_kernels(fn, n: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/hf-profile")
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res: dict = {"host": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                 "torch_threads": torch.get_num_threads()}  # fmt: skip
    try:
        res["cpu_model"] = next(
            ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    print(res, flush=True)
    tgt = model(16384, 1024, 16, 16, 4, 2816, device, dtype)
    lm = model(16384, 512, 4, 8, 4, 1408, device, dtype)
    torch.manual_seed(1)
    x = torch.randint(3, 16384, (1, 64), device=device)
    mask = torch.ones_like(x)
    new = args.new
    methods = {"vanilla": {}, "assisted": {"assistant_model": lm}, "lookup": {"prompt_lookup_num_tokens": 10}}
    report = io.StringIO()
    for name, kw in methods.items():

        def gen(kw=kw, n=new):
            return tgt.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)

        s = timed(gen)
        res[f"{name}_ms_per_token"] = round(s / new * 1000, 3)
        print(f"{name}: {s / new * 1000:.2f} ms/token", flush=True)
        report.write(f"==== {name}: cProfile (tottime) ====\n{top_host(gen)}\n")
        report.write(f"==== {name}: torch.profiler ====\n{top_kernels(lambda kw=kw: gen(kw, 32))}\n")
    # the same model's forward with a cache, no generate around it: the floor under vanilla generate
    from transformers import DynamicCache

    def bare(n=new):
        cache = DynamicCache(config=tgt.config)
        with torch.no_grad():
            o = tgt(x, past_key_values=cache, use_cache=True)
            t = o.logits[:, -1:].argmax(-1)
            for _ in range(n - 1):
                o = tgt(t, past_key_values=cache, use_cache=True)
                t = o.logits[:, -1:].argmax(-1)

    s = timed(bare)
    res["bare_forward_ms_per_token"] = round(s / new * 1000, 3)
    print(f"bare cached forward: {s / new * 1000:.2f} ms/token", flush=True)
    torch.set_num_threads(1)
    s = timed(lambda: tgt.generate(x, attention_mask=mask, max_new_tokens=new, do_sample=False))
    res["vanilla_ms_per_token_one_thread"] = round(s / new * 1000, 3)
    print(f"vanilla, torch.set_num_threads(1): {s / new * 1000:.2f} ms/token", flush=True)
    (out / "hf-profile.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "hf-profile.txt").write_text(report.getvalue())
    print(report.getvalue()[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
