"""`eaglescope doctor --measure-wiring` at the seed's scale on this CPU: a Kimi-K2.5-shaped target whose layers are
absent, an MLA draft, and per-layer states in the layout vLLM's extract_hidden_states writes.

    PYTHONPATH=src python bench/wiring_search_kimi.py [--out bench/results] [--tokens 128] [--dtype bfloat16]

What is real and what is synthetic. Real: the shapes (Kimi-K2's config.json: hidden 7168, 61 layers, vocabulary
163,840, MLA ranks; a 32,000-token draft vocabulary), the files (a head-only target directory: config.json, a
tokenizer, `model.embed_tokens.weight`, `lm_head.weight` and `model.norm.weight` each in its own shard under a
safetensors index, no decoder layer anywhere; an MLA EAGLE-3 draft saved as eaglescope saves drafts; per-layer
states as one safetensors file per request, `token_ids` [T] and `hidden_states` [T, 62, 7168]), and the product's
own CLI doing the work in its own process. Synthetic (random, bf16): every weight; the hidden states (hs[0] is the
embedding of the tokens, as the embedding output is; hs[1..60] a random walk, so that neighbouring layers look alike
as real ones do); and what the "target" predicts: the last layer's output is set so that the target's greedy choice
after each token is what the random draft predicts at step 0 when fed taps [0, 4, 32] — the wiring this draft is
made to have been "trained for" — while its config declares [0, 3, 31] (the seed's capture): the layer taps of its
training data one off. Only step 0 is made to agree, so the draft's later steps are random and the α_k profile
under the best wiring reads NO_TTT; the point of the case is the search's cost at this scale and that it finds the
wiring, not a realistic profile.

Writes bench/results/wiring-search-kimi-<UTC>.json: the time and peak resident memory (the child process's
ru_maxrss) of `doctor --measure-wiring --layer-states`, of the wiring search alone (tracemalloc's peak of Python-side
allocations is not torch's; ru_maxrss is what counts), and what doctor said.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kimi_draft_side import KIMI, build_draft, build_target  # noqa: E402

from eaglescope.detective.wiring import save_layer_states  # noqa: E402
from eaglescope.models.draft import load_draft  # noqa: E402
from eaglescope.models.targets.head import EMBEDDING_NAMES, HEAD_NAMES  # noqa: E402
from eaglescope.models.targets.loading import load_tensors  # noqa: E402
from eaglescope.train.ttt import ttt_unroll  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DECLARED = (0, 3, 31)  # what build_draft writes (the seed's capture): what vLLM and SGLang feed it
TRAINED = (0, 4, 32)  # what the synthetic target's choices are made to agree with
DRAFT_VOCAB = 32000
REQUESTS = 2


def add_final_norm(target: Path, H: int, seed: int = 3) -> None:
    """The final norm's weight, in its own shard (the head-only directory keeps it beside embedding and lm_head)."""
    g = torch.Generator().manual_seed(seed)
    shard = "model-norm.safetensors"
    save_file({"model.norm.weight": (1.0 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16)}, str(target / shard))
    index = json.loads((target / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (target / "model.safetensors.index.json").write_text(json.dumps(index))


@torch.inference_mode()
def write_states(target: Path, draft: Path, out: Path, tokens: int, seed: int = 4) -> None:
    """REQUESTS files of per-layer states: hs[0] the tokens' embedding, hs[1..L-1] a random walk, hs[L] (the last
    layer's output) set so that lm_head(norm(hs[L])) at t+1 picks the draft's step-0 choice at t under TRAINED."""
    L, H = KIMI["num_hidden_layers"], KIMI["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    found = load_tensors(target, {"embedding": EMBEDDING_NAMES, "lm_head": HEAD_NAMES})
    emb, head = found["embedding"], found["lm_head"]
    loaded = load_draft(draft, L, dtype=torch.bfloat16)
    d = loaded.model
    d.embed_tokens.weight = torch.nn.Parameter(emb, requires_grad=False)  # shared, not copied: 2.3 GB
    out.mkdir(parents=True)
    T = tokens // REQUESTS
    for r in range(REQUESTS):
        ids = torch.randint(0, KIMI["vocab_size"], (T,), generator=g)
        hs = torch.empty(T, L + 1, H, dtype=torch.bfloat16)
        hs[:, 0] = emb[ids]
        x = torch.randn(T, H, generator=g)
        for i in range(1, L):
            x = x + 0.35 * torch.randn(T, H, generator=g)  # neighbouring layers alike, far ones not
            hs[:, i] = x.to(torch.bfloat16)
        aux = torch.cat([hs[:, i] for i in TRAINED], -1)[None]  # [1, T, 3H]
        logits = ttt_unroll(d, ids[None], aux, 1).logits[0][0]  # [T, Vd]
        choice = d.to_target_ids(logits.argmax(-1))  # the draft's step-0 choice at row t: the target's at t+1
        want = torch.cat([ids[:1], choice[:-1]])
        hs[:, L] = (head[want].float() * 8.0).to(torch.bfloat16)
        save_layer_states(out / f"request-{r:03d}.safetensors", ids, hs)
    del loaded, d


def run_cli(argv: list[str], log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    with log.with_suffix(".out").open("w") as out, log.with_suffix(".err").open("w") as err:
        proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc not in (0, 1):
        raise SystemExit(f"{argv[:3]} exited {rc}: {log.with_suffix('.err').read_text()[-2000:]}")
    cpu = round(usage.ru_utime + usage.ru_stime, 1)
    peak = round(usage.ru_maxrss / 2**20, 2)
    return {"rc": rc, "seconds": round(seconds, 1), "cpu_seconds": cpu, "peak_rss_gb": peak,
            "stdout": log.with_suffix(".out").read_text()}  # fmt: skip


SEARCH_ONLY = """
import json, resource, sys, time, tracemalloc, torch
from eaglescope.detective.wiring import Wiring, load_head_parts, record_from_files, search_wiring
from eaglescope.models.draft import load_draft
target, draft, states, tokens, L = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
tracemalloc.start()
t0 = time.perf_counter()
parts = load_head_parts(target)
record = record_from_files(states, parts, L, tokens)
loaded = load_draft(draft, L, dtype=torch.bfloat16)
loaded.model.embed_tokens.weight = torch.nn.Parameter(parts.embedding, requires_grad=False)
del parts
t1 = time.perf_counter()
ws = search_wiring(loaded.model, record, Wiring(tuple(loaded.contract.taps.layers)), steps=5)
t2 = time.perf_counter()
traced = tracemalloc.get_traced_memory()[1] / 2**30
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"load_seconds": round(t1 - t0, 1), "search_seconds": round(t2 - t1, 1),
                  "wirings_scored": len(ws.scored), "best": ws.best.wiring.describe(L), "best_acc0": ws.best.acc0,
                  "served_acc0": ws.served.acc0, "tracemalloc_peak_gb": round(traced, 3),
                  "peak_rss_gb": round(rss, 2)}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="where the JSON goes")
    ap.add_argument("--tokens", type=int, default=128, help="tokens the wiring is measured on")
    ap.add_argument("--dtype", default="bfloat16", help="doctor's --dtype")
    ap.add_argument("--keep", type=Path, default=None, help="build here and keep it (or reuse an earlier build)")
    ap.add_argument("--search-alone", action="store_true", help="also run the search alone in its own process "
                    "(tracemalloc's peak; doubles the run)")  # fmt: skip
    args = ap.parse_args(argv)
    L = KIMI["num_hidden_layers"]
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="wiring-kimi-") as tmpd:
        root = args.keep or Path(tmpd)
        target, draft, states = root / "target", root / "draft", root / "states"
        t0 = time.perf_counter()
        if not states.exists():
            build_target(target, KIMI)
            add_final_norm(target, KIMI["hidden_size"])
            build_draft(draft, KIMI, DRAFT_VOCAB)
            write_states(target, draft, states, args.tokens)
        built = time.perf_counter() - t0
        build_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        search = None
        if args.search_alone:
            search = run_cli(["-c", SEARCH_ONLY, str(target), str(draft), str(states), str(args.tokens), str(L)],
                             root / "search")  # fmt: skip
            search |= json.loads(search.pop("stdout").strip().splitlines()[-1])
            print(f"search: {search}", file=sys.stderr)
        cli = ["-m", "eaglescope.cli", "doctor", "--target", str(target), "--draft", str(draft), "--measure-wiring",
               "--layer-states", str(states), "--wiring-tokens", str(args.tokens), "--engine", "vllm",
               "--device", "cpu", "--dtype", args.dtype, "--json"]  # fmt: skip
        doctor = run_cli(cli, root / "doctor")
        report = json.loads(doctor.pop("stdout"))
        wiring = report["context"].get("wiring") or {}
        codes = [f["code"] for f in report["findings"]]
        print(f"doctor: {codes} ({doctor['seconds']} s, peak RSS {doctor['peak_rss_gb']} GB)", file=sys.stderr)
    result = {
        "what": "eaglescope doctor --measure-wiring --layer-states on a Kimi-K2.5-shaped target with its layers absent "
        "(synthetic weights and states: see the script's docstring)",
        "commit": rev.strip(),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_average": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
        },  # fmt: skip
        "shape": {k: KIMI[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size", "q_lora_rank", "kv_lora_rank")}
        | {
            "draft_arch": "mla",
            "draft_vocab": DRAFT_VOCAB,
            "tokens": args.tokens,
            "requests": REQUESTS,
            "dtype": args.dtype,
            "declared_taps": list(DECLARED),
            "made_to_agree_under": list(TRAINED),
        },  # fmt: skip
        "build_seconds": round(built, 1),
        "build_peak_rss_gb": round(build_rss, 2),
        "disk_gb": round(disk / 2**30, 2),
        "search": search,
        "doctor": doctor
        | {
            "codes": codes,
            "wiring_line": wiring.get("line"),
            "verdict": wiring.get("verdict"),
            "search_seconds": wiring.get("search_seconds"),
            "engines": wiring.get("engines"),
            "wirings_scored": wiring.get("wirings_scored"),
            "profile_alpha": (wiring.get("profile") or {}).get("alpha"),
        },  # fmt: skip
        "found_trained_wiring": (wiring.get("trained_for") or {}).get("wiring", {}).get("taps") == list(TRAINED),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M")
        (args.out / f"wiring-search-kimi-{stamp}.json").write_text(text + "\n")
    return 0 if result["found_trained_wiring"] else 1


if __name__ == "__main__":
    sys.exit(main())
