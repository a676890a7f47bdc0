"""The batch-invariant kernels on a GPU, at the shapes of the benchmark's 197M target (random bf16 weights).

    PYTHONPATH=src python3 bench/invariant_check.py --out DIR

Measures, for the default kernels (cuBLAS, SDPA) and the batch-invariant ones (fast/invariant.py):
- how many rows of a product / of the model's logits change when the same row is computed inside a bigger call;
- whether a chain verified inside a tree at scattered slots gives bit-identical logits to one-token steps;
- each kernel's error against the float32 reference;
- the decode step and the verify of 24 / 60 tokens as CUDA graphs (ms), so the cost of invariance is known.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from run_bench import graphed_ms, lm_args, sizes, to_infer  # noqa: E402

from eaglescope.decode.tree import DraftTree  # noqa: E402
from eaglescope.fast import FastTarget  # noqa: E402
from eaglescope.fast import invariant as inv  # noqa: E402
from eaglescope.fast.engine import use_batch_invariant  # noqa: E402
from eaglescope.models.targets.llama import LlamaArgs, LlamaModel, RMSNorm, RopeSpec, attend  # noqa: E402
from eaglescope.pretrain import init_weights  # noqa: E402


def kernel_errors(device, dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(60, 1024, device=device, dtype=dtype, generator=g)
    w = torch.randn(1536, 1024, device=device, dtype=dtype, generator=g) * 0.03
    ref = x.float() @ w.float().t()
    res = {"linear_max_abs_err": float((inv.invariant_linear(x, w).float() - ref).abs().max())}
    res["cublas_linear_max_abs_err"] = float((F.linear(x, w).float() - ref).abs().max())
    one = torch.stack([inv.invariant_linear(x[i : i + 1], w)[0] for i in range(60)])
    res["invariant_linear_rows_changed_by_batching"] = int((one != inv.invariant_linear(x, w)).any(1).sum())
    one = torch.stack([F.linear(x[i : i + 1], w)[0] for i in range(60)])
    res["cublas_linear_rows_changed_by_batching"] = int((one != F.linear(x, w)).any(1).sum())
    norm = RMSNorm(1024, 1e-6).to(device, dtype)
    res["rms_norm_max_abs_err"] = float(
        (inv.invariant_rms_norm(x, norm.weight, 1e-6).float() - norm(x).float()).abs().max()
    )
    q = torch.randn(1, 16, 24, 64, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, 4, 700, 64, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, 4, 700, 64, device=device, dtype=dtype, generator=g)
    mask = torch.rand(24, 700, device=device, generator=g) < 0.5
    mask[:, 0] = True
    ref = attend(q.float(), k.float(), v.float(), mask[None, None])
    res["attention_max_abs_err"] = float(
        (inv.invariant_attention(q, k, v, inv.KeyIndex.from_mask(mask)).float() - ref).abs().max()
    )
    res["sdpa_attention_max_abs_err"] = float((attend(q, k, v, mask[None, None]).float() - ref).abs().max())
    return res


def chain_in_tree(ft: FastTarget, prompt: torch.Tensor, chain: torch.Tensor, vocab: int) -> dict:
    """Logits of a chain decoded token by token vs the same chain verified as nodes of a 60-node tree."""
    dev, P, n = ft.device, prompt.numel(), chain.numel()
    slots_all = torch.arange(ft.size, device=dev)
    ft.prefill(prompt)
    steps = []
    for j in range(n):
        pos = torch.tensor([P + j], device=dev)
        steps.append(ft.run(chain[j : j + 1], pos, (slots_all <= pos)[None, :], pos)[0][0])
    # tree: node 0 = chain[0]; chain[j] sits at node 1 + 6*(j-1) + (j % 6), the rest are distractors
    N = 60
    parents, depth, tokens = [-1], [0], [int(chain[0])]
    chain_node = [0]
    gen = torch.Generator().manual_seed(1)
    for j in range(1, n):
        for s in range(6):
            parents.append(chain_node[-1])
            depth.append(j)
            is_chain = s == j % 6
            tokens.append(int(chain[j]) if is_chain else int(torch.randint(0, vocab, (1,), generator=gen)))
            if is_chain:
                chain_node.append(len(tokens) - 1)
    while len(tokens) < N:
        parents.append(0)
        depth.append(1)
        tokens.append(int(torch.randint(0, vocab, (1,), generator=gen)))
    ft.prefill(prompt)
    vmask = torch.zeros(N, ft.size, dtype=torch.bool)
    vmask[:, :P] = True
    vmask[:, P : P + N] = DraftTree.from_parents(tokens, parents).ancestor_mask()
    logits, _ = ft.run(
        torch.tensor(tokens, device=dev),
        P + torch.tensor(depth, device=dev),
        vmask.to(dev),
        P + torch.arange(N, device=dev),
    )
    same = [bool(torch.equal(logits[c], steps[j])) for j, c in enumerate(chain_node)]
    gap = max(float((logits[c] - steps[j]).abs().max()) for j, c in enumerate(chain_node))
    argmax_same = [int(logits[c].argmax()) == int(steps[j].argmax()) for j, c in enumerate(chain_node)]
    return {
        "chain_tokens": n,
        "bit_identical": sum(same),
        "max_abs_logit_diff": gap,
        "argmax_identical": sum(argmax_same),
    }


def timings(ft: FastTarget, device, vocab: int) -> dict:
    out = {}
    S = ft.size
    slots_all = torch.arange(S, device=device)
    for T in (1, 24, 60):
        toks = torch.randint(0, vocab, (T,), device=device)
        start = ft.size - 64
        slots = start + torch.arange(T, device=device)
        mask = (slots_all[None, :] < start) | ((slots_all[None, :] >= start) & (slots_all[None, :] <= slots[:, None]))
        with torch.inference_mode():
            step = lambda t=toks, s=slots, m=mask: ft.run(t, s, m, s)  # noqa: E731
            out[str(T)] = round(graphed_ms(step, device, reps=50), 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="tiny model, float32, any device (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--llama8b", action="store_true", help="Llama-3.1-8B dimensions instead of the 197M target")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = sizes(args.smoke)
    if args.llama8b:
        a = LlamaArgs("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 8192, RopeSpec(500000.0))
        with torch.device("meta"):
            base = LlamaModel(a)
        base = base.to_empty(device=device).to(dtype)
        base.register_buffer("inv_freq", a.rope.inv_freq(a.head_dim, a.max_position_embeddings).to(device), False)
        with torch.no_grad():
            for prm in base.parameters():
                prm.normal_(0, 0.02) if prm.dim() > 1 else prm.fill_(1.0)
        V = a.vocab_size
    else:
        pc = lm_args(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["kv"], cfg["ffn"])
        torch.manual_seed(0)
        base = LlamaModel(pc.args())
        init_weights(base, pc.num_layers, 0)
        base = to_infer(base.to(device), dtype)
        V = cfg["vocab"]
    res = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": os.environ.get("EAGLESCOPE_COMMIT", "unknown"),
        "kernels": kernel_errors(device, dtype),
        "model": "llama-3.1-8b shape" if args.llama8b else f"bench target shape (smoke={args.smoke})",
    }
    print(json.dumps(res, indent=1), flush=True)
    P, size = (20, 96) if args.smoke else (380, 512)  # the interpreter runs the smoke model slowly
    prompt = torch.randint(0, V, (P,), generator=torch.Generator().manual_seed(2)).to(device)
    chain = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(3)).to(device)
    for name in ("default", "batch_invariant", "batch_invariant_unsliced"):
        # the 8B model is swapped in place and back (two copies would be 32 GB)
        model = base if args.llama8b else copy.deepcopy(base)
        ft = FastTarget(model, size, fuse=True, float32_logits=True, batch_invariant=name != "default")
        if name.endswith("unsliced"):  # without K-sliced products (their gain: invariant-check-8b-20261129T125130.json)
            use_batch_invariant(model, enable=False)
            use_batch_invariant(model, sliced=False)
        with torch.inference_mode():
            res[name] = {"chain_in_tree": chain_in_tree(ft, prompt, chain, V)}
        res[name]["graphed_ms_by_rows"] = timings(ft, device, V)
        print(name, json.dumps(res[name]), flush=True)
        if name != "default":
            use_batch_invariant(model, enable=False)
        del ft
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = res["date"].replace(":", "").replace("-", "")[:15]
    path = out / f"invariant-check-{'8b-' if args.llama8b else ''}{stamp}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
