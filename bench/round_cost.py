"""Where a speculative round's time goes on a GPU, through the product's static-shape runner (`fast_runner`).

    PYTHONPATH=src python3 bench/round_cost.py --out DIR [--trees 6,1,7 6,4,24 7,10,60] [--modes none,layer,round]
    PYTHONPATH=src python3 bench/round_cost.py --smoke --out /tmp/rc     # CPU, tiny shape, the same code

A random bf16 Llama of the benchmark protocol's target shape (hidden 1024, 16 layers, 16/4 heads, FFN 2816, vocabulary
16,384: 197M parameters), saved with `save_pretrained` and loaded by the product's loader, and a random EAGLE-3 draft
for it (tests/drafts.py). Random weights accept almost nothing, so each round is the τ ≈ 1 case: its cost against one
target step is the round's overhead. For each way of running the draft side (`--modes`: "none" as `eaglescope bench`
runs it without `--compile`; "layer": the draft layer compiled regionally; "round": what `--compile` runs, the round's
draft side and acceptance compiled piece by piece, FastEagle(compile=True)) and each tree, measured:

- `round_ms`: 256 new tokens through the runner's own `generate` (graph-captured rounds, queued ahead), per round;
- `pieces_ms`: propose (catch-up + tree), verify (the target over the tree), accept + commit, each captured alone as a
  CUDA graph (state restored after each replay), median of replays;
- `kernels`: CUDA kernels each piece launches and their summed device time (torch.profiler, the piece outside a graph),
  so `pieces_ms` − device time is what launches and gaps cost;
- `prepare_s`: the first round's compilation and capture.

Besides: the target's one-token step (`eaglescope generate` without a draft, the same runner) and its kernels.
Writes round-cost-<time>.json under DIR; prints one table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from drafts import save_random_draft  # noqa: E402
from models import make_checkpoint  # noqa: E402
from run_bench import kernels, round_pieces  # noqa: E402  (the protocol's timing: one CUDA graph, median of replays)

from eaglescope.decode.speculative import load_eagle3  # noqa: E402
from eaglescope.fast.layers import compile_layers  # noqa: E402
from eaglescope.fast.run import fast_runner  # noqa: E402
from eaglescope.models.targets import load_target  # noqa: E402

PROTOCOL = dict(vocab_size=16384, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=4, intermediate_size=2816, max_position_embeddings=2048)  # fmt: skip
SMOKE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=512)  # fmt: skip
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", type=Path, help="keep the checkpoints here (reused when present)")
    ap.add_argument("--trees", nargs="+", default=["6,1,7", "6,4,24", "7,10,60"])
    ap.add_argument("--modes", default="none,layer,round")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        print("round_cost: no GPU; use --smoke on the CPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    work = args.work or Path(tempfile.mkdtemp(prefix="round-cost-"))
    shape = SMOKE if args.smoke else PROTOCOL
    tdir = work / "target"
    if not (tdir / "config.json").is_file():
        make_checkpoint("llama", tdir, **shape)
    ddir = save_random_draft(tdir, work / "draft", dtype=dtype)
    new = 24 if args.smoke else args.new
    prompt = [(i * 7919) % (shape["vocab_size"] - 10) + 5 for i in range(64)]
    max_len = len(prompt) + new + 8
    res: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                 "commit": _commit(), "shape": shape, "new_tokens": new, "rows": []}  # fmt: skip
    target = load_target(tdir, device=dev, dtype=dtype)
    draft = load_eagle3(str(ddir), target)
    taps = target.taps
    target.set_taps(None)
    van, info = fast_runner(target, None, None, max_len)
    van.generate(prompt, new)
    v = van.generate(prompt, new)
    res["vanilla_step_ms"] = round(v.seconds / new * 1e3, 4)
    res["runner"] = info
    van._prefill(prompt)  # back to the prompt: the two steps profiled stay inside the output buffer
    with torch.inference_mode():
        res["vanilla_step_kernels"] = kernels(van._step)  # beside the verify's: what a target forward launches
    say(f"vanilla step {res['vanilla_step_ms']} ms")
    target.set_taps(taps)
    del van
    for mode in args.modes.split(","):
        if mode == "layer":
            compile_layers([draft.midlayer])
        else:  # "round" is what `--compile` runs: its pieces compile the layer inside them
            draft.midlayer._compiled_call_impl = None
        for tree in args.trees:
            tshape = tuple(int(x) for x in tree.split(","))
            t = time.perf_counter()
            fe, _ = fast_runner(target, draft, tshape, max_len, compile_round=mode == "round")
            fe.generate(prompt, new)
            prep = time.perf_counter() - t
            r = fe.generate(prompt, new)
            row = {"mode": mode, "tree": list(tshape), "compiled": fe.compiled, "prepare_s": round(prep, 1),
                   "rounds": len(r.accepted), "round_ms": round(r.seconds / len(r.accepted) * 1e3, 4),
                   "tau": round(1 + sum(r.accepted) / len(r.accepted), 3)}  # fmt: skip
            row["round_over_step"] = round(row["round_ms"] / res["vanilla_step_ms"], 3)
            row["pieces"] = round_pieces(fe)
            res["rows"].append(row)
            say(f"{mode} {tree}: round {row['round_ms']} ms ({row['round_over_step']}x a step), prepare {prep:.1f} s, "
                f"pieces {json.dumps(row['pieces'])}")  # fmt: skip
            del fe
            _write(args.out, res)
    print(_table(res))
    return 0


def _commit() -> str:
    if os.environ.get("EAGLESCOPE_COMMIT"):  # a copy without its own .git (the device machine's) names its commit
        return os.environ["EAGLESCOPE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _write(out: Path, res: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = res.setdefault("file", f"round-cost-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}.json")
    (out / name).write_text(json.dumps(res, indent=1))


def _table(res: dict) -> str:
    lines = [
        f"vanilla step {res['vanilla_step_ms']} ms ({res['device']}, {res['commit']})",
        "| mode | tree | round ms | / step | propose ms (kernels) | verify ms (kernels) | accept+commit | prepare s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        p = r["pieces"]
        pr, ve = p["propose"], p["verify"]
        lines.append(
            f"| {r['mode']} | {tuple(r['tree'])} | {r['round_ms']} | {r['round_over_step']} | {pr['ms']} "
            f"({pr.get('count', '-')}) | {ve['ms']} ({ve.get('count', '-')}) | {p['accept_commit']['ms']} | "
            f"{r['prepare_s']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
