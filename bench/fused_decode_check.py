"""The fused one-token decode kernels (fast/fused_decode.py) at Llama-3.1-8B dimensions, random bf16 weights.

    PYTHONPATH=src python3 bench/fused_decode_check.py --out DIR [--smoke]

1. For each kernel (qkv, o, gate_up, down over all 32 layers; lm_head) times every (BLOCK_N, BLOCK_K, warps) of
   a small grid as one CUDA graph and reports its bandwidth against the copy bandwidth of the same run.
2. With the fastest blocks: the whole step (graph) against the matmul-only stack of the same weights, the copy
   bandwidth, and the compiled-layers step (products as reductions, attention as products: the fastest compiled
   variant in bench/results/bench-roofline-20261129T111036.json).
3. The fused step's logits and cache writes against the model's own modules for the same step.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from run_bench import (  # noqa: E402
    LLAMA_8B_DIMS,
    SMOKE_DIMS,
    _profile_step,
    copy_bandwidth_gbs,
    fused_draft_level,
    graphed_ms,
    kernels,
    random_draft,
    random_target,
    verify_ms,
)

from eaglescope.fast import FastTarget, FastVanilla, SlotCache  # noqa: E402
from eaglescope.fast.engine import set_attention, use_matmul_attention  # noqa: E402
from eaglescope.fast.fused_decode import (  # noqa: E402
    DEFAULT_BLOCKS,
    FLASH_LAUNCH,
    FusedDecode,
    attention_limit,
    flash_scratch,
    fused_attention,
)
from eaglescope.fast.fused_draft import DRAFT_K_SPLITS, fused_draft_supported  # noqa: E402
from eaglescope.fast.fused_verify import (  # noqa: E402
    CUBLAS_PRODUCTS,
    CUBLASLT_PRODUCTS,
    K_SPLITS,
    split_k_mm,
)
from eaglescope.fast.layers import compile_layers, use_gemv_reductions  # noqa: E402
from eaglescope.fast.tuning import load_tuning  # noqa: E402


def grid(smoke: bool) -> list[tuple[int, ...]]:
    """(BLOCK_N, BLOCK_K, warps[, stages]). The one-wave products (q/k/v, o) are latency-bound at 512-wide K tiles
    (73-78% of copy at 8B on an H200): the wide tiles (2048-4096, a whole 8B row in one or two loads) keep more bytes
    in flight per program; the 4-tuples try Triton's software pipelining of the K loop."""
    if smoke:
        return [(2, 32, 1), (4, 64, 2), (2, 64, 1, 2)]
    return [(4, 512, 4), (8, 512, 4), (4, 512, 8), (8, 512, 8), (4, 1024, 8), (2, 1024, 4),
            (4, 512, 4, 3), (8, 512, 8, 3), (4, 1024, 8, 3),
            (1, 2048, 4), (2, 2048, 4), (2, 2048, 8), (4, 2048, 8),
            (1, 4096, 4), (2, 4096, 4), (2, 4096, 8), (4, 4096, 8)]  # fmt: skip


def sweep(fd: FusedDecode, device, ctx: int, smoke: bool, copy_gbs: float) -> dict:
    """Every candidate block shape of every kernel, timed over all layers as one graph → {kernel: [rows]}."""
    m, a = fd.model, fd.args
    L = a.num_layers
    cos, sin = (t.reshape(-1).contiguous() for t in m.rope_for(torch.tensor([[ctx]], device=device)))
    slot = torch.tensor([ctx], device=device)
    mask = (torch.arange(fd.cache.size, device=device) <= ctx)[None]
    logits = torch.empty(1, a.vocab_size, device=device, dtype=torch.float32)
    layers = m.model.layers
    nbytes = {
        "qkv": sum(x.self_attn.qkv_proj.weight.nbytes for x in layers),
        "o": sum(x.self_attn.o_proj.weight.nbytes for x in layers),
        "gate_up": sum(x.mlp.gate_up_proj.weight.nbytes for x in layers),
        "down": sum(x.mlp.down_proj.weight.nbytes for x in layers),
        "lm_head": m.lm_head.weight.nbytes,
    }
    run = {
        "qkv": lambda: [fd.qkv(i, cos, sin, slot) for i in range(L)],
        "o": lambda: [fd.o(i) for i in range(L)],
        "gate_up": lambda: [fd.gate_up(i) for i in range(L)],
        "down": lambda: [fd.down(i) for i in range(L)],
        "lm_head": lambda: fd.lm_head(logits),
    }
    out: dict = {}
    for name, fn in run.items():
        rows = []
        for blocks in grid(smoke):
            if name == "qkv" and (a.head_dim // 2) % blocks[0]:
                continue
            fd.blocks[name] = blocks
            try:
                with torch.inference_mode():
                    ms = graphed_ms(fn, device, reps=10)
            except Exception as e:  # a shape that does not compile (registers, shared memory): skip it
                rows.append({"blocks": blocks, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            gbs = nbytes[name] / ms / 1e6
            rows.append(
                {"blocks": blocks, "ms": round(ms, 4), "gbs": round(gbs, 1), "of_copy": round(gbs / copy_gbs, 4)}
            )
        good = [r for r in rows if "ms" in r]
        best = min(good, key=lambda r: r["ms"])
        fd.blocks[name] = tuple(best["blocks"])
        out[name] = {"best": best, "bytes": nbytes[name], "all": rows}
        print(name, json.dumps(best), flush=True)
    with torch.inference_mode():
        out["attend_all_layers_ms"] = round(graphed_ms(lambda: [fd.attend(i, mask) for i in range(L)], device, 10), 4)
    return out


def sweep_verify(ft: FastTarget, ctx: int, vocab: int, smoke: bool) -> dict:
    """Coordinate descent over the fused verify kernels' blocks: each kernel's candidates timed through the whole
    64-token verify (graph), the best kept before the next kernel is tried."""
    fv = ft.fused_rows
    cublas, fv.cublas = fv.cublas, ()  # the swept kernel runs every product, or the candidates would not run at all
    grid_v = [(32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 8, 5),
              (128, 128, 8, 3), (32, 128, 4, 4)]  # fmt: skip
    T = 4 if smoke else 64
    out: dict = {}
    for name in ("qkv", "o", "gate_up", "down", "lm_head"):
        rows, start = [], fv.blocks[name]
        for blocks in [start] + [b for b in (grid_v[:1] if smoke else grid_v) if b != start]:
            if name == "qkv" and (ft.model.args.head_dim // 2) % blocks[0]:
                continue
            fv.set_blocks(name, blocks)
            try:
                ms = verify_ms(ft, ctx, vocab, sizes=(T,))[T]
            except Exception as e:  # a shape that does not compile (registers, shared memory): skip it
                rows.append({"blocks": blocks, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            rows.append({"blocks": blocks, "verify_ms": round(ms, 4)})
        best = min((r for r in rows if "verify_ms" in r), key=lambda r: r["verify_ms"])
        fv.set_blocks(name, best["blocks"])
        out[name] = {"best": best, "all": rows}
        print("verify sweep", name, json.dumps(best), flush=True)
    fv.cublas = cublas
    return out


def verify_products(fv, device, copy_gbs: float, T: int) -> dict:
    """Each fused verify product alone at T rows (one graph of 32 launches, as per step) against cuBLAS's product of
    the same shape: ms per launch and weight bytes / time as a fraction of copy."""
    a = fv.args
    D, H, ffn, L = a.head_dim, a.hidden_size, a.intermediate_size, len(fv.model.model.layers)
    layer = fv.model.model.layers[0]
    nqkv = (a.num_heads + 2 * a.num_kv_heads) * D
    rows = torch.arange(T, device=device)
    cos, sin = torch.ones(T, D, device=device, dtype=fv.h.dtype), torch.zeros(T, D, device=device, dtype=fv.h.dtype)
    x_h, x_f = torch.randn(T, H, device=device, dtype=fv.h.dtype), torch.randn(T, ffn, device=device, dtype=fv.h.dtype)
    y_h = torch.zeros(T, H, device=device, dtype=fv.h.dtype)
    logits = torch.zeros(T, a.vocab_size, device=device, dtype=torch.float32)
    rope = dict(cos=cos, sin=sin, kc=fv.cache.k[0], vc=fv.cache.v[0], slots=rows)
    base = fv.settings()  # the blocks set on fv, whatever its tuning says for T rows

    def product(name, x, w, y, n, **rope):
        return lambda: fv._product(name, base, x, w, None, y, T, n, **rope)

    cases = {
        "qkv": (layer.self_attn.qkv_proj.weight, x_h,
                product("qkv", x_h, layer.self_attn.qkv_proj.weight, fv.q, nqkv, **rope)),
        "o": (layer.self_attn.o_proj.weight, x_h, product("o", x_h, layer.self_attn.o_proj.weight, y_h, H)),
        "gate_up": (layer.mlp.gate_up_proj.weight, x_h,
                    product("gate_up", x_h, layer.mlp.gate_up_proj.weight, fv.act, ffn)),
        "down": (layer.mlp.down_proj.weight, x_f, product("down", x_f, layer.mlp.down_proj.weight, y_h, H)),
        "lm_head": (fv.model.lm_head.weight, x_h,
                    product("lm_head", x_h, fv.model.lm_head.weight, logits, a.vocab_size)),
    }  # fmt: skip
    out = {}
    for name, (w, x, run) in cases.items():
        reps = 1 if name == "lm_head" else L
        ms = graphed_ms(lambda run=run, reps=reps: [run() for _ in range(reps)], device, 20) / reps
        ref = graphed_ms(lambda w=w, x=x, reps=reps: [F.linear(x, w) for _ in range(reps)], device, 20) / reps
        # cuBLASLt picks its kernels by other heuristics than cublasGemmEx: the skinny products may fare better
        lt = math.nan
        if device.type == "cuda":
            was = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                lt = graphed_ms(lambda w=w, x=x, reps=reps: [F.linear(x, w) for _ in range(reps)], device, 20) / reps
            finally:
                torch.backends.cuda.preferred_blas_library(was)
        of = lambda t, w=w: round(w.nbytes / t / 1e6 / copy_gbs, 4)  # noqa: E731
        out[name] = {"fused_ms": round(ms, 4), "cublas_ms": round(ref, 4), "fused_of_copy": of(ms),
                     "cublas_of_copy": of(ref), "cublaslt_ms": round(lt, 4), "cublaslt_of_copy": of(lt),
                     "blocks": fv.blocks[name]}  # fmt: skip
        print("verify product", name, json.dumps(out[name]), flush=True)
    with torch.inference_mode():
        norm = layer.input_layernorm
        out["rmsnorm_ms"] = round(graphed_ms(lambda: [fv._norm(norm, x_h, T) for _ in range(L)], device, 20) / L, 4)
    return out


def step_ms(ft: FastTarget, prompt: list[int], ctx: int) -> float:
    van = FastVanilla(ft, 64)
    van.generate(prompt, 16)  # captures the graph
    van.pos.fill_(ctx)
    van.i.fill_(1)
    return graphed_ms(van._step, ft.device, reps=50)


def _vs_modules(ft, model, ctx: int, S: int, device) -> dict:
    """The fused step's logits and the cache entries it writes, against the model's own modules for the same step."""
    with torch.inference_mode():
        tok, pos = torch.tensor([7], device=device), torch.tensor([ctx], device=device)
        mask = (torch.arange(S, device=device) <= ctx)[None, :]
        fused_logits, _ = ft.run(tok, pos, mask, pos)
        kf, vf = ft.cache.k[:, :, :, ctx].clone(), ft.cache.v[:, :, :, ctx].clone()
        set_attention(model, "sdpa")  # the reference: the modules as they are
        ref_logits, _ = ft._run_eager(tok, pos, mask, pos)
        kr, vr = ft.cache.k[:, :, :, ctx], ft.cache.v[:, :, :, ctx]
        return {
            "max_abs_logit_diff": float((fused_logits - ref_logits).abs().max()),
            "logit_scale": float(ref_logits.abs().max()),
            "argmax_same": int(fused_logits.argmax()) == int(ref_logits.argmax()),
            "max_abs_k_diff": float((kf - kr).abs().max()),
            "max_abs_v_diff": float((vf - vr).abs().max()),
        }


def _verify_on_modules(ft, model, ctx: int, vocab: int, sizes, compiled: bool, device, res: dict, save) -> None:
    """Verify costs: one token on the fused kernels, T tokens on the modules (compiled layers), with attention as
    products and with the fused attention kernel."""
    for impl in ("matmul", "fused") if compiled else ("matmul",):
        torch._dynamo.reset()
        set_attention(model, impl)
        if device.type == "cuda":
            compile_layers(model.model.layers)
        v = verify_ms(ft, ctx, vocab, sizes=sizes)
        res[f"verify_ms_{impl}_attention"] = {str(t): round(x, 4) for t, x in v.items()}
        res[f"verify_cost_ratio_{impl}_attention"] = {str(t): round(x / v[1], 4) for t, x in v.items()}
        print(f"verify, {impl} attention", json.dumps(res[f"verify_cost_ratio_{impl}_attention"]),
              json.dumps(res[f"verify_ms_{impl}_attention"]), flush=True)  # fmt: skip
        save()


def _fused_verify(
    model, prompt, ctx: int, S: int, sizes, smoke: bool, sweep_blocks: bool, device, res: dict, save,
    try_mixes: bool = True, products: bool = True,
) -> FastTarget | None:  # fmt: skip
    """Verifies on the fused verify kernels (fast/fused_verify.py): T-row tensor-core products, same layout; the
    fastest mix of attention kernel and cuBLAS products (try_mixes; else FusedVerify's default), which the returned
    target keeps (None: not run)."""
    a = model.args
    torch._dynamo.reset()
    try:
        ft3 = FastTarget(model, S, fused_decode=True, fused_verify=True, float32_logits=True)
    except ValueError as e:  # the smoke model's heads are too narrow for the tensor-core tiles
        res["fused_verify"] = f"not run: {e}"
    else:
        # every figure below from the built-in settings (and the mixes and sweeps set on them); the tuning file in
        # effect, if any, timed on its own at the end and kept for --tuning-out
        res["tuning_in_effect"] = {**ft3.tuning.describe(), **ft3.tuning.document()}
        tuned, ft3.fused_rows.by_rows = ft3.fused_rows.by_rows, []
        ft3.prefill(torch.tensor(prompt, device=device))
        with torch.inference_mode():  # the verify kernels against the modules, 24 chain tokens
            T = min(24, S - ctx - 1)
            toks = torch.randint(0, a.vocab_size, (T,), device=device)
            slots = ctx + torch.arange(T, device=device)
            tmask = torch.arange(S, device=device)[None, :] <= slots[:, None]
            got, _ = ft3.run(toks, slots, tmask, slots)
            set_attention(model, "matmul")
            want, _ = ft3._run_eager(toks, slots, tmask, slots)
            # random bf16 weights give near-flat logits: a row's argmax may flip where its top two are closer than
            # bf16's rounding differences; the margin says whether every flip is such a row (correctness is
            # tests/gpu/test_fused_kernels.py's, in float32)
            top2 = want.float().topk(2, -1).values
            flipped = got.argmax(-1) != want.argmax(-1)
            res["fused_verify_vs_modules"] = {
                "max_abs_logit_diff": float((got - want).abs().max()),
                "argmax_same_rows": int((~flipped).sum()),
                "rows": T,
                "largest_top2_margin_of_a_flipped_row": float((top2[:, 0] - top2[:, 1])[flipped].max())
                if bool(flipped.any())
                else 0.0,
            }
        fv = ft3.fused_rows
        if products:  # each product alone against cuBLAS and cuBLASLt
            res["verify_products"] = verify_products(fv, device, res["copy_bandwidth_gbs"], 4 if smoke else 64)
            save()
        if sweep_blocks:
            res["verify_sweep"] = sweep_verify(ft3, ctx, a.vocab_size, smoke)
            res["verify_best_blocks"] = dict(fv.blocks)
            res["verify_products_best"] = verify_products(fv, device, res["copy_bandwidth_gbs"], 4 if smoke else 64)
            save()
        best = None
        no_qkv = tuple(p for p in CUBLAS_PRODUCTS if p != "qkv")
        mixes = (
            (CUBLAS_PRODUCTS, CUBLASLT_PRODUCTS, True),  # o's and down's residual adds in the next norm kernel
            (CUBLAS_PRODUCTS, CUBLASLT_PRODUCTS, False),
            (CUBLAS_PRODUCTS, (), False),
            (no_qkv, CUBLASLT_PRODUCTS, False),
            ((), (), False),
        )
        attentions = ("flash", "fused", "matmul")  # running softmax, split-slot grouped kernel, products
        if not try_mixes:  # the verify's own default only
            mixes, attentions = ((fv.cublas, fv.cublaslt, fv.defer_residual),), (fv.attention,)
        for cublas, lt, defer in mixes:
            for attention in attentions:
                fv.attention, fv.cublas, fv.cublaslt, fv.defer_residual = attention, cublas, lt, defer
                v = verify_ms(ft3, ctx, a.vocab_size, sizes=sizes)
                key = f"{attention}_attention_cublas_{'_'.join(cublas) or 'none'}_cublaslt_{'_'.join(lt) or 'none'}"
                key += "_deferred_residual" if defer else ""
                res[f"verify_ms_fused_verify_{key}"] = {str(t): round(x, 4) for t, x in v.items()}
                print(f"verify, fused verify kernels, {key}", json.dumps({t: round(x / v[1], 4) for t, x in v.items()}),
                      json.dumps(v), flush=True)  # fmt: skip
                if best is None or v[sizes[-2]] < best[1][sizes[-2]]:  # the 64-token verify (smoke: 4)
                    best = ((attention, cublas, lt, defer), v)
                save()
        (fv.attention, fv.cublas, fv.cublaslt, fv.defer_residual), v = best
        attention = f"{fv.attention} attention, cuBLAS for {fv.cublas or 'none'}, cuBLASLt for {fv.cublaslt or 'none'}"
        attention += ", residual adds deferred" if fv.defer_residual else ""
        res["verify_mix"] = {"attention": fv.attention, "cublas": list(fv.cublas), "cublaslt": list(fv.cublaslt),
                             "defer_residual": fv.defer_residual}  # fmt: skip
        res["verify_ms_fused_verify"] = {str(t): round(x, 4) for t, x in v.items()}
        res["verify_cost_ratio_fused_verify"] = {str(t): round(x / v[1], 4) for t, x in v.items()}
        print("verify, fused verify kernels", json.dumps(res["fused_verify_vs_modules"]), attention,
              json.dumps(res["verify_cost_ratio_fused_verify"]), json.dumps(res["verify_ms_fused_verify"]),
              flush=True)  # fmt: skip
        if tuned:  # the tuning file's settings where its entries reach, this mix elsewhere
            fv.by_rows = tuned
            v = verify_ms(ft3, ctx, a.vocab_size, sizes=sizes)
            res["verify_ms_fused_verify_tuned"] = {str(t): round(x, 4) for t, x in v.items()}
            print("verify, fused verify kernels, tuned", json.dumps(res["verify_ms_fused_verify_tuned"]), flush=True)
            fv.by_rows = []
        save()
        return ft3
    return None


def tuning_document(res: dict, result_file: str, command: list[str]) -> dict | None:
    """A fast/tuning.py file from this run: the tuning in effect when it began, each row count's swept product mix
    as its entry, flash attention's launch swept at the least swept row count at or above an entry's max_rows in that
    entry (and an entry for each swept row count where a launch won). A winner is kept only where it beat the start
    in the same run (the mixes: both timed again), so noise does not move a setting; None where nothing was
    swept."""
    swept = [v for k, v in res.items() if k.startswith("verify_mix_sweep_") and isinstance(v, dict)]
    flash, draft = res.get("flash_sweep"), res.get("draft_sweep")
    if not swept and not flash and not draft:
        return None
    doc = res.get("tuning_in_effect", {})
    entries = {e["max_rows"]: dict(e) for e in doc.get("verify", [])}
    for sweep in swept:
        if "best_ms_again" in sweep and sweep["best_ms_again"] < sweep.get("start_ms_again", math.inf):
            entries[sweep["rows"]] = {"max_rows": sweep["rows"], **sweep["best"]}
    winners, swept_rows = flash_winners(flash), sorted(int(T) for T in (flash or {}).get("best_by_rows", {}))
    for T in winners:
        entries.setdefault(T, {"max_rows": T})
    for rows, entry in entries.items():  # each entry: the winner of the least swept row count that covers it
        T = next((t for t in swept_rows if t >= rows), None)
        if T in winners:
            entry["flash_launch"] = list(winners[T])
    out = {"device": res["device"], "source": {"command": " ".join(command), "commit": res["commit"],
           "date": res["date"], "result": result_file}, "verify": [entries[r] for r in sorted(entries)]}  # fmt: skip
    if draft and draft.get("best_ms_again", math.inf) < draft.get("start_ms_again", math.inf):
        out["draft"] = {"k_splits": dict(draft["best"])}
    elif "draft" in doc:
        out["draft"] = doc["draft"]
    return out


def flash_winners(flash: dict | None) -> dict[int, list[int]]:
    """{rows: launch} of --sweep-flash's result where the fastest finalist beat FLASH_LAUNCH in the whole verify at
    that row count (a tie or a loss moves nothing)."""
    if not flash or "best_by_rows" not in flash:
        return {}
    default, whole = "_".join(map(str, flash["default"])), flash["verify_ms"]
    return {int(T): launch for T, launch in flash["best_by_rows"].items()
            if whole["_".join(map(str, launch))][T] < whole[default][T]}  # fmt: skip


def write_tuning(doc: dict, path: Path) -> None:
    """Write a tuning file beside its path, check that fast/tuning.py reads it, then move it into place: a file
    that would not load never replaces one that does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    load_tuning(tmp)
    os.replace(tmp, path)


def flash_launches(smoke: bool) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(rows, slots) blocks per program, then (warps, stages): the two stages of --sweep-flash."""
    if smoke:
        return [(16, 32), (32, 64)], [(4, 3), (2, 1)]
    blocks = [(br, kb) for br in (16, 32, 64) for kb in (32, 64, 128)]
    return blocks, [(w, st) for w in (2, 4, 8) for st in (1, 2, 3, 4)]


def flash_splits(smoke: bool) -> tuple[int, ...]:
    """The splits of the best launch's walk that --sweep-flash tries."""
    return (2, 3, 4) if not smoke else (2,)


def sweep_flash(ft: FastTarget, ctx: int, vocab: int, smoke: bool, res: dict, save) -> None:
    """Flash attention's launch (FLASH_LAUNCH: rows and slots per program, warps, stages, splits) at 24 and 64 rows:
    each candidate over every layer of the verify's cache as one graph, the blocks at the default warps and stages
    first, then warps and stages at the best blocks, then 2-4 splits of the best's walk (each stage's best by the sum
    of its 24- and 64-row times); then the finalists (FLASH_LAUNCH, the best, the best in each split) each timed as
    the whole verify on flash attention, and at each row count the fastest there recorded as `best_by_rows`. The
    verify is left as it was (the other figures are the default's)."""
    fv, dev, S = ft.fused_rows, ft.device, ft.size
    a = fv.args
    L, H, D = a.num_layers, a.num_heads, a.head_dim
    cases = {}
    for T in (24, 64) if not smoke else (4, 8):
        slots = ctx + torch.arange(T, device=dev)
        mask = torch.arange(S, device=dev)[None, :] <= slots[:, None]
        q = torch.randn(T, H, D, device=dev, dtype=fv.q.dtype)
        cases[T] = (q, mask, attention_limit(mask), torch.empty_like(q))

    def layer_us(launch, T) -> float:
        """µs a layer; inf where the launch does not compile (a wide tile at deep pipelining can ask for more shared
        memory than an SM has)."""
        q, mask, limit, out = cases[T]
        scratch = flash_scratch(T, H, D, launch, dev) if len(launch) > 4 else None  # made before the capture

        def f():
            for i in range(L):
                fused_attention(q, fv.cache.k[i, 0], fv.cache.v[i, 0], mask, out, scratch, flash=True, limit=limit,
                                launch=launch)  # fmt: skip

        try:
            with torch.inference_mode():
                return round(graphed_ms(f, dev, 20) / L * 1000, 2)
        except Exception as e:  # triton's OutOfResources and kin: not a candidate here
            print(f"flash launch {launch}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.synchronize() if dev.type == "cuda" else None
            return math.inf

    blocks, configs = flash_launches(smoke)
    timed = {}
    total = lambda launch: sum(timed[launch].values())  # noqa: E731  (24 rows weigh for η, 64 for verify-64)
    for br, kb in blocks:
        launch = (br, kb) + FLASH_LAUNCH[2:4]
        timed[launch] = {T: layer_us(launch, T) for T in cases}
    br, kb = min(((k[0], k[1]) for k in timed), key=lambda b: total(b + FLASH_LAUNCH[2:4]))
    for warps, stages in configs:
        launch = (br, kb, warps, stages)
        if launch not in timed:
            timed[launch] = {T: layer_us(launch, T) for T in cases}
    best = min(timed, key=total)
    for splits in flash_splits(smoke):  # the walk in interleaved splits, combined by the last
        launch = best[:4] + (splits,)
        timed[launch] = {T: layer_us(launch, T) for T in cases}
    best = min(timed, key=total)
    finite = lambda us: {T: (x if math.isfinite(x) else None) for T, x in us.items()}  # noqa: E731
    out = {"us_per_layer": {"_".join(map(str, k)): finite(v) for k, v in timed.items()}, "default": list(FLASH_LAUNCH),
           "best": list(best)}  # fmt: skip
    print("flash launches (rows, slots, warps, stages): µs a layer", json.dumps(out), flush=True)
    # the finalists judged inside the whole verify, at each row count on its own: timed alone, the 32 layers' K/V
    # stay in L2 between repetitions, while in a verify 15 GB of weights pass between one layer's attention and the
    # next, so K/V come from memory, and a launch is judged where it runs (the replayed round's flash attention took
    # 9.05 µs a layer against 6.8 here; on an H200 the split walks lost inside the verify too:
    # fused-decode-check-20261205T150136.json)
    rows = tuple(T for T in cases)
    finalists = list(dict.fromkeys([FLASH_LAUNCH, best[:4]] + [best[:4] + (n,) for n in flash_splits(smoke)]))
    finalists = [f for f in finalists if f == FLASH_LAUNCH or all(math.isfinite(x) for x in timed[f].values())]
    was, fv.attention = fv.attention, "flash"  # whichever attention the mixes above chose
    whole: dict[tuple[int, ...], dict[int, float]] = {}
    for launch in finalists:
        fv.flash_launch = launch
        whole[launch] = verify_ms(ft, ctx, vocab, sizes=(1, *rows))
        print(f"verify, flash launch {launch}", {T: round(x, 4) for T, x in whole[launch].items()}, flush=True)
    fv.flash_launch, fv.attention = FLASH_LAUNCH, was
    out["verify_ms"] = {"_".join(map(str, k)): {str(T): round(x, 4) for T, x in v.items()} for k, v in whole.items()}
    out["best_by_rows"] = {str(T): list(min(whole, key=lambda f, T=T: whole[f][T])) for T in rows}
    res["flash_sweep"] = out
    save()


def sweep_k_split(ft: FastTarget, ctx: int, vocab: int, copy_gbs: float, smoke: bool, res: dict, save) -> None:
    """The verify's q/k/v, o and down on cuBLAS as one product or as float32 partials over 2-8 slices of K
    (split_k_mm; summed by the RoPE kernel, or by the next norm kernel with the residual): each product alone at 24
    and 64 rows (every layer's weights, one graph), then the whole verify for each product's split with the others
    whole, then with each product at its best split (by the 64-row verify), in the same run. The verify is left as
    it was."""
    fv, dev = ft.fused_rows, ft.device
    layers = fv.model.model.layers
    weights = {"qkv": [la.self_attn.qkv_proj.weight for la in layers],
               "o": [la.self_attn.o_proj.weight for la in layers],
               "down": [la.mlp.down_proj.weight for la in layers]}  # fmt: skip
    splits = (1, 2, 4, 8) if not smoke else (1, 2)
    rows = (24, 64) if not smoke else (4, 8)
    out: dict = {"alone_us_per_layer": {}, "alone_of_copy": {}, "default": dict(K_SPLITS)}
    for name, W in weights.items():
        for T in rows:
            x = torch.randn(T, W[0].shape[1], device=dev, dtype=fv.h.dtype)
            for split in splits:

                def f(split=split, x=x, W=W):
                    for w in W:
                        F.linear(x, w) if split == 1 else split_k_mm(x, w, split)

                key = f"{name}_{T}_rows_split_{split}"
                try:
                    with torch.inference_mode():
                        us = graphed_ms(f, dev, 20) / len(W) * 1000
                except Exception as e:  # bmm's out_dtype missing from this torch, and kin: recorded, not fatal
                    out["alone_us_per_layer"][key] = f"{type(e).__name__}: {str(e)[:200]}"
                    print("k split", key, out["alone_us_per_layer"][key], flush=True)
                    continue
                out["alone_us_per_layer"][key] = round(us, 2)
                out["alone_of_copy"][key] = round(W[0].nbytes / (us * 1e-6) / 1e9 / copy_gbs, 4)
                print("k split", key, out["alone_us_per_layer"][key], "µs", out["alone_of_copy"][key], "of copy",
                      flush=True)  # fmt: skip
    sizes = (1,) + rows
    was = dict(fv.k_splits), fv.cublas, fv.defer_residual
    fv.cublas, fv.defer_residual = CUBLAS_PRODUCTS, True  # every split product on cuBLAS, its add deferred

    def verify(key: str, k_splits: dict) -> float:
        fv.k_splits = {**K_SPLITS, **k_splits}
        try:
            v = verify_ms(ft, ctx, vocab, sizes=sizes)
        except Exception as e:
            out[f"verify_{key}"] = f"{type(e).__name__}: {str(e)[:200]}"
            return math.inf
        out[f"verify_ms_{key}"] = {str(t): round(x, 4) for t, x in v.items()}
        out[f"verify_cost_ratio_{key}"] = {str(t): round(x / v[1], 4) for t, x in v.items()}
        print(f"verify, {key}", json.dumps(out[f"verify_cost_ratio_{key}"]), flush=True)
        return v[rows[-1]]

    base = verify("whole", {})
    best = {}
    for name in weights:
        timed = {split: verify(f"{name}_split_{split}", {name: split}) for split in splits[1:]}
        split = min(timed, key=timed.get)
        if timed[split] < base:
            best[name] = split
    out["best"] = {**K_SPLITS, **best}
    if len(best) > 1:
        verify("best", best)
    fv.k_splits, fv.cublas, fv.defer_residual = was
    res["k_split_sweep"] = out
    save()


def mix_candidates(name: str, head_dim: int, smoke: bool) -> list[tuple[int, ...]]:
    """_rows_gemm_kernel blocks (BLOCK_N, BLOCK_K, warps, stages, swap) --sweep-verify-mix tries for a product: the
    64-row sweep's shapes and swapped tiles (the weight rows on the tensor-core product's M side, 64-128 of them as
    cuBLAS's few-row tiles have); q/k/v's BLOCK_N counts row pairs within half a head."""
    if smoke:
        return [(16, 16, 1, 2, 0), (16, 16, 1, 2, 1)]
    grid = [(32, 64, 4, 4, 0), (64, 64, 4, 4, 0), (32, 128, 4, 4, 0), (64, 128, 8, 3, 0),
            (64, 64, 4, 4, 1), (64, 128, 4, 3, 1), (64, 128, 4, 4, 1), (64, 256, 4, 3, 1), (128, 64, 4, 4, 1),
            (128, 128, 8, 3, 1), (32, 128, 4, 4, 1)]  # fmt: skip
    return [b for b in grid if name != "qkv" or (head_dim // 2) % b[0] == 0]


def mix_states(fv, name: str, smoke: bool) -> list[tuple]:
    """Every state --sweep-verify-mix tries for one product, as (cublas, cublaslt, blocks, k split) with the other
    products as fv has them: on cuBLAS through either library (q/k/v's product takes none: FusedVerify runs it as
    torch picks) whole or in 2 of K's slices (q/k/v always, o and down with their adds deferred), or on
    _rows_gemm_kernel at each of mix_candidates' blocks."""
    others = tuple(p for p in fv.cublas if p != name)
    others_lt = tuple(p for p in fv.cublaslt if p != name)
    states = []
    if name in CUBLAS_PRODUCTS:
        order = lambda names: tuple(p for p in CUBLAS_PRODUCTS if p in names)  # noqa: E731
        libraries = (False,) if name == "qkv" else (False, True)
        splits = (1, 2) if name == "qkv" or (name in K_SPLITS and fv.defer_residual) else (1,)
        for lt in libraries:
            for split in splits:
                states.append((order(others + (name,)), order(others_lt + ((name,) if lt else ())),
                               fv.blocks[name], split))  # fmt: skip
    for blocks in mix_candidates(name, fv.args.head_dim, smoke):
        states.append((others, others_lt, tuple(blocks), 1))
    return states


def sweep_verify_mix(ft: FastTarget, ctx: int, vocab: int, T: int, smoke: bool, res: dict, save,
                     flash_launch: tuple[int, ...] | None = None) -> None:  # fmt: skip
    """The T-row verify's products, each in turn (coordinate descent, the best kept before the next): every state
    mix_states names for it (cuBLAS or cuBLASLt, whole or in K's slices; _rows_gemm_kernel's tiles, whose epilogue
    then does the RoPE / SiLU / residual work a kernel of its own does after cuBLAS); every candidate timed as the
    whole verify (one graph) at T rows, flash attention at `flash_launch` (None: the verify's). Records each time,
    the best mix and, in the same run, both it and the starting one timed again; the verify is left as it was."""
    fv = ft.fused_rows
    sizes = (1, T)
    was = fv.cublas, fv.cublaslt, dict(fv.blocks), dict(fv.k_splits), fv.flash_launch
    fv.flash_launch = tuple(flash_launch or fv.flash_launch)

    def same(a: tuple, b: tuple) -> bool:
        return (set(a[0]), set(a[1]), tuple(a[2]), a[3]) == (set(b[0]), set(b[1]), tuple(b[2]), b[3])

    def state(name: str) -> tuple:
        return fv.cublas, fv.cublaslt, fv.blocks[name], fv.k_splits.get(name, 1)

    def put(name: str, st: tuple) -> None:
        fv.cublas, fv.cublaslt = st[:2]
        fv.set_blocks(name, st[2])
        if name in fv.k_splits:
            fv.k_splits[name] = st[3]

    def settings() -> dict:
        return {"cublas": list(fv.cublas), "cublaslt": list(fv.cublaslt),
                "blocks": {k: list(v) for k, v in fv.blocks.items()}, "k_splits": dict(fv.k_splits),
                "flash_launch": list(fv.flash_launch)}  # fmt: skip

    out: dict = {"rows": T, "start": settings(), "ms": {}}
    res[f"verify_mix_sweep_{T}"] = out

    def timed(key: str) -> float:
        try:
            v = verify_ms(ft, ctx, vocab, sizes=sizes)
        except Exception as e:  # a tile that does not compile (shared memory, registers): not a candidate
            out["ms"][key] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.synchronize() if ft.device.type == "cuda" else None
            print("verify mix", key, out["ms"][key], flush=True)
            return math.inf
        out["ms"][key] = round(v[T], 4)
        out.setdefault("step_ms", round(v[1], 4))
        print("verify mix", key, out["ms"][key], "ms", flush=True)
        save()  # a run cut off by its time limit keeps every candidate timed so far
        return v[T]

    best = timed("start")
    out["start_ms"] = out["ms"]["start"]
    for name in ("qkv", "o", "gate_up", "down", "lm_head"):
        keep = state(name)
        for st in mix_states(fv, name, smoke):
            if same(st, keep):
                continue
            put(name, st)
            on = "cublaslt" if name in st[1] else "cublas"
            where = f"{on}_split_{st[3]}" if name in st[0] else f"triton_{'_'.join(map(str, st[2]))}"
            ms = timed(f"{name}_{where}")
            if ms < best:
                best, keep = ms, st
        put(name, keep)
    out["best"] = settings()
    out["best_ms"] = round(best, 4)
    out["best_ms_again"] = timed("best_again")  # the winner timed once more: the descent's spread beside its gain
    fv.cublas, fv.cublaslt, fv.k_splits = was[0], was[1], was[3]
    for name, blocks in was[2].items():
        fv.set_blocks(name, blocks)
    out["start_ms_again"] = timed("start_again")
    fv.flash_launch = was[4]
    print(f"verify mix at {T} rows: start {out['start_ms']} ms, best {out['best_ms']} ms", json.dumps(out["best"]),
          flush=True)  # fmt: skip
    save()


DRAFT_SPLIT_CANDIDATES = ({"o": 2}, {"down": 2}, {"o": 2, "down": 2}, {"down": 4}, {"o": 2, "down": 4})


def sweep_draft(model, rows: tuple[int, ...], ctx: int, S: int, res: dict, save) -> None:
    """The fused draft level's K splits (fast/tuning.py's draft k_splits: o and down as float32 partials that the
    next norm kernel sums, with no split-K reduce kernel): an 8B-shaped draft for `model` with random weights, one
    tree level of each of `rows` frontier rows (the tuned (6, 4, 24) tree's 4 and the official (7, 10, 60) tree's 10)
    for every candidate, the best by the sum; then the best and the default timed again, in the same run."""
    draft = random_draft(model, model.model.embed_tokens.weight.dtype)
    why = fused_draft_supported(draft)
    if why:
        res["draft_sweep"] = {"skipped": why}
        return
    c, dev = draft.config, model.model.embed_tokens.weight.device
    levels = {}
    for K in rows:
        dcache = SlotCache(1, 1, c.num_kv_heads, S, c.head_dim, draft.fc.weight.dtype, dev)
        levels[K] = fused_draft_level(draft, dcache, K, ctx, dict(DRAFT_K_SPLITS))
    out: dict = {"rows": list(rows), "default": dict(DRAFT_K_SPLITS), "ms": {}}
    res["draft_sweep"] = out

    def timed(key: str, k_splits: dict[str, int]) -> float:
        ms = {}
        for K, (fused, level) in levels.items():
            fused.k_splits = {**DRAFT_K_SPLITS, **k_splits}
            try:
                ms[str(K)] = round(graphed_ms(level, dev, reps=50), 4)
            except Exception as e:  # bmm's out_dtype and kin: not a candidate here
                out["ms"][key] = f"{type(e).__name__}: {str(e)[:200]}"
                print("draft level", key, out["ms"][key], flush=True)
                return math.inf
        out["ms"][key] = ms
        print("draft level", key, json.dumps(ms), "ms", flush=True)
        save()
        return sum(ms.values())

    name = lambda k: "_".join(f"{p}_{n}" for p, n in sorted(k.items())) or "whole"  # noqa: E731
    cost = {name(k): (timed(name(k), k), k) for k in ({},) + DRAFT_SPLIT_CANDIDATES}
    best_ms, best = min(cost.values(), key=lambda v: v[0])
    out["best"] = {**DRAFT_K_SPLITS, **best}
    out["best_ms_again"] = timed("best_again", best)
    out["start_ms_again"] = timed("start_again", {})
    print(f"draft level: default {cost['whole'][0]:.4f} ms, best {best_ms:.4f} ms", json.dumps(out["best"]), flush=True)
    save()


def _verify_profile(ft: FastTarget, ctx: int, vocab: int, res: dict) -> None:
    """Where a verify's time goes: for 24 rows (the tuned tree's) and 64, its ms as one graph, the kernels it launches
    and their summed device time (what is left is the gaps between kernels), and the top kernels by time."""
    dev, S = ft.device, ft.size
    out = {}
    for T in (24, 64):
        toks = torch.randint(0, vocab, (T,), device=dev)
        slots = ctx + torch.arange(T, device=dev)
        mask = torch.arange(S, device=dev)[None, :] <= slots[:, None]

        def f(toks=toks, slots=slots, mask=mask):
            ft.run(toks, slots, mask, slots)

        with torch.inference_mode():
            out[str(T)] = {"graph_ms": round(graphed_ms(f, dev, reps=30), 4), **kernels(f), "top": _profile_step(f)}
        print(f"verify profile {T}", json.dumps({k: v for k, v in out[str(T)].items() if k != "top"}), flush=True)
        print(out[str(T)]["top"], flush=True)
    res["verify_profile"] = out


def _compiled_step(model, prompt, ctx: int, S: int, wbytes: int, vocab: int, res: dict) -> None:
    """The compiled-layers step (products as reductions, attention as products) and its verify, in the same run."""
    torch._inductor.config.coordinate_descent_tuning = True
    torch._dynamo.reset()
    use_gemv_reductions(model.model.layers)
    use_matmul_attention(model)
    ft2 = FastTarget(model, S)
    compile_layers(model.model.layers)
    ms2 = step_ms(ft2, prompt, ctx)
    gbs2 = wbytes / ms2 / 1e6
    res["compiled_step"] = {"ms": round(ms2, 4), "gbs": round(gbs2, 1),
                            "of_copy": round(gbs2 / res["copy_bandwidth_gbs"], 4)}  # fmt: skip
    print("compiled step", json.dumps(res["compiled_step"]), flush=True)
    v = verify_ms(ft2, ctx, vocab, sizes=(1, 64))
    res["compiled_verify_ms"] = {str(t): round(x, 4) for t, x in v.items()}
    print("compiled verify", json.dumps(res["compiled_verify_ms"]), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="tiny model, float32 (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled-layers comparison")
    ap.add_argument("--no-sweep", action="store_true", help="the default blocks only")
    ap.add_argument("--no-mixes", action="store_true", help="the fused verify's default mix only (no mix table)")
    ap.add_argument("--sweep-verify", action="store_true", help="also sweep the fused verify kernels' blocks")
    ap.add_argument("--profile-verify", action="store_true", help="kernels and gaps of the 24- and 64-row verify")
    ap.add_argument("--sweep-flash", action="store_true", help="time flash attention's launch alternatives")
    ap.add_argument("--sweep-k-split", action="store_true", help="time q/k/v, o, down as partials over K's slices")
    ap.add_argument(
        "--sweep-verify-mix",
        type=int,
        nargs="*",
        default=[],
        metavar="ROWS",
        help="at each of these row counts, each product on cuBLAS or on the Triton kernel's blocks",
    )
    ap.add_argument(
        "--sweeps-only",
        action="store_true",
        help="skip the modules' verify table and each product alone (the sweeps need neither)",
    )
    ap.add_argument(
        "--sweep-draft", action="store_true", help="the fused draft level's o and down whole or in K's slices"
    )
    ap.add_argument("--tuning-out", metavar="PATH", help="write the sweeps' winners as a fast/tuning.py file here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    model = random_target(SMOKE_DIMS if args.smoke else LLAMA_8B_DIMS, device, dtype)
    a = model.args
    res: dict = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": os.environ.get("EAGLESCOPE_COMMIT", "unknown"),
        "shape": SMOKE_DIMS if args.smoke else LLAMA_8B_DIMS,
        "default_blocks": DEFAULT_BLOCKS,
    }
    res["copy_bandwidth_gbs"] = copy_bandwidth_gbs((1 << 20) if args.smoke else (1 << 30), device, dtype)
    wbytes = sum(p.nbytes for n, p in model.named_parameters() if "embed_tokens" not in n)
    res["weight_bytes"] = wbytes
    mats = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ins = {w.shape[1]: torch.randn(1, w.shape[1], device=device, dtype=dtype) for w in mats}
    res["matmul_stack_ms"] = round(graphed_ms(lambda: [F.linear(ins[w.shape[1]], w) for w in mats], device, 30), 4)
    print(json.dumps(res), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = res["date"].replace(":", "").replace("-", "")[:15]
    path = out / f"fused-decode-check-{stamp}.json"
    save = lambda: path.write_text(json.dumps(res, indent=2) + "\n")  # noqa: E731  (after each stage)

    P, ctx, S = (8, 12, 40) if args.smoke else (64, 192, 480)
    prompt = torch.randint(0, a.vocab_size, (P,), generator=torch.Generator().manual_seed(1)).tolist()
    ft = FastTarget(model, S, fused_decode=True, float32_logits=True)
    ft.prefill(torch.tensor(prompt, device=device))
    if not args.no_sweep:
        res["sweep"] = sweep(ft.fused, device, ctx, args.smoke, res["copy_bandwidth_gbs"])
        res["best_blocks"] = dict(ft.fused.blocks)
        save()

    # the whole step with the best blocks
    ms = step_ms(ft, prompt, ctx)
    gbs = wbytes / ms / 1e6
    res["fused_step"] = {"ms": round(ms, 4), "gbs": round(gbs, 1), "of_copy": round(gbs / res["copy_bandwidth_gbs"], 4)}
    res["matmul_stack_of_copy"] = round(wbytes / res["matmul_stack_ms"] / 1e6 / res["copy_bandwidth_gbs"], 4)
    print("fused step", json.dumps(res["fused_step"]), flush=True)

    res["vs_modules"] = _vs_modules(ft, model, ctx, S, device)
    print("vs modules", json.dumps(res["vs_modules"]), flush=True)
    save()

    sizes = (1, 8, 16, 24, 32, 64, 128) if not args.smoke else (1, 4, 8)
    if args.sweeps_only:  # a device call's minutes go to the sweeps
        sizes = (1, 24, 64, 128) if not args.smoke else (1, 4, 8)  # the mixes are chosen at sizes[-2]
    else:
        _verify_on_modules(ft, model, ctx, a.vocab_size, sizes, not args.no_compiled, device, res, save)

    ft3 = _fused_verify(model, prompt, ctx, S, sizes, args.smoke, args.sweep_verify, device, res, save,
                        try_mixes=not args.no_mixes, products=not args.sweeps_only)  # fmt: skip

    def tune() -> None:  # after every sweep: a run cut off by its time limit keeps the tuning of what it finished
        doc = tuning_document(res, path.name, sys.argv) if args.tuning_out else None
        if doc is not None:
            write_tuning(doc, Path(args.tuning_out))
            res["tuning_out"] = {"path": args.tuning_out, "file": doc}
            print("wrote tuning", args.tuning_out, flush=True)
            save()

    flash = None
    if args.sweep_flash and ft3 is not None:
        sweep_flash(ft3, ctx, a.vocab_size, args.smoke, res, save)
        flash = flash_winners(res["flash_sweep"])  # the product mixes below are swept with them
        tune()
    if args.sweep_k_split and ft3 is not None:
        sweep_k_split(ft3, ctx, a.vocab_size, res["copy_bandwidth_gbs"], args.smoke, res, save)
    for rows in args.sweep_verify_mix if ft3 is not None else ():
        sweep_verify_mix(ft3, ctx, a.vocab_size, rows, args.smoke, res, save,
                         flash_launch=(flash or {}).get(rows))  # fmt: skip
        tune()
    if args.sweep_draft:
        del ft3  # the draft's level is timed alone
        ft3 = None
        sweep_draft(model, (4, 10) if not args.smoke else (2, 3), ctx, S, res, save)
        tune()
    if args.profile_verify and ft3 is not None:
        _verify_profile(ft3, ctx, a.vocab_size, res)
        save()
        # the same mix with the residual adds the other way: where deferring them gains or loses, kernel by kernel
        fv = ft3.fused_rows
        fv.defer_residual = not fv.defer_residual
        mix = res["verify_profile"]
        _verify_profile(ft3, ctx, a.vocab_size, res)
        res["verify_profile_residual_" + ("deferred" if fv.defer_residual else "beta_1")] = res["verify_profile"]
        res["verify_profile"] = mix
        fv.defer_residual = not fv.defer_residual
        save()
    del ft3

    if not args.no_compiled and device.type == "cuda":  # the best compiled variant, measured in the same run
        _compiled_step(model, prompt, ctx, S, wbytes, a.vocab_size, res)

    save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
