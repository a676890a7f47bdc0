"""Skinny products (a few rows against a layer's weight) at the 8B target's and its draft's shapes, per library.

    PYTHONPATH=src python3 bench/skinny_products.py --out DIR [--rows-verify 24] [--rows-draft 4] [--budget 240]

Why: a round at 8B is the 24-row verify and six 4-row draft levels, and both are weight streams. cuBLAS reads the
big products (gate/up, the heads) near the copy bandwidth but the narrow ones (q/k/v: 96 column tiles of 64 for 132
SMs; o; down) well under it, so the round's time is not all weight reads. This times, for
each product, every way the fast path can run it or might: cuBLAS, cuBLASLt, `split_k_mm` (float32 partials over K
for the next kernel to sum, where one does), the target's 128k head also on the fused verify's own
`_rows_gemm_kernel`, and fast.stream_mm (weight tiles by TMA, the tensor-memory accelerator: one thread asks
for a whole tile, so the SM's warps do not spend their issue slots on addresses), swept over its tile, split and
pipeline depth; its defaults (STREAM_LAUNCH) are this sweep's winners.
Each candidate runs over a stack of distinct weight copies, far more bytes than L2 holds,
captured as one CUDA graph, so its time is the stream's, as inside a layer loop. Outputs are checked against a
float32 product of the same operands before any time counts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_bench import LLAMA_8B_DIMS, copy_bandwidth_gbs, graphed_ms, random_target  # noqa: E402

from eaglescope.fast.engine import FastTarget  # noqa: E402
from eaglescope.fast.fused_decode import triton  # noqa: E402
from eaglescope.fast.fused_verify import FusedVerify, blas_library, split_k_mm  # noqa: E402
from eaglescope.fast.stream_mm import SUMMED, stream_mm  # noqa: E402
from eaglescope.fast.tuning import tuning_for  # noqa: E402

log = logging.getLogger("skinny_products")

# (name, N, K) of one layer's products; the draft's q/k/v read its [embedding, feature] rows of 2H
TARGET_PRODUCTS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                   ("lm_head", 128256, 4096))  # fmt: skip
DRAFT_PRODUCTS = (("qkv", 6144, 8192), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                  ("lm_head", 32000, 4096))  # fmt: skip
STACK_BYTES = 2 << 30  # per product: ~40x an H100's or H200's L2
SMS = 132


def tma_configs(name: str, N: int, K: int) -> list[tuple[int, int, int, int]]:
    """stream_mm launches (BN, BK, splits, stages) worth timing: at least one wave of programs, K slices whole tiles;
    one slice for a product no kernel after it sums (SUMMED), whatever its count of column tiles."""
    out = []
    for bn in (64, 128):
        for bk in (64, 128, 256):
            if bn * bk > 128 * 128:
                continue
            tiles = -(-N // bn)
            for splits in (1, 2, 3, 4, 6, 7, 8, 12, 14, 16) if name in SUMMED else (1,):
                if K % (splits * bk) or tiles * splits < SMS or (name in SUMMED and tiles * splits > 8 * SMS):
                    continue
                for stages in (3, 6):
                    out.append((bn, bk, splits, stages))
    return out


def _verify_head(x: torch.Tensor):
    """The fused verify's lm_head product of x's rows with no stream_mm, as this GPU's tuning file sets it (its
    _rows_gemm_kernel blocks), on a one-layer target of the 8B widths: w, out → out."""
    T = x.shape[0]
    model = random_target(dict(LLAMA_8B_DIMS, layers=1), torch.device("cuda"), torch.bfloat16)
    fv = FusedVerify(model, FastTarget(model, 64).cache, by_rows=tuning_for(torch.device("cuda")).verify, stream={})
    s = fv.settings(T)
    assert "lm_head" not in s.stream

    def one(w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        fv._product("lm_head", s, fv.normed, w, None, out, T, w.shape[0])
        return out

    fv.normed[:T].copy_(x)
    return one


def _summed(y: torch.Tensor) -> torch.Tensor:
    return y.float().sum(0) if y.dim() == 3 else y.float()


def time_product(name: str, N: int, K: int, T: int, copy_gbs: float, deadline: float) -> dict:
    dev, dt_ = torch.device("cuda"), torch.bfloat16
    copies = max(4, STACK_BYTES // (N * K * 2))
    ws = [torch.randn(N, K, device=dev, dtype=dt_) * K**-0.5 for _ in range(copies)]
    x = torch.randn(T, K, device=dev, dtype=dt_)
    ref = x.float() @ ws[0].float().t()
    nbytes = N * K * 2

    def timed(label: str, one, make_out) -> dict:
        outs = [make_out() for _ in range(copies)]
        got = _summed(one(ws[0], outs[0]))
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if not err < 2e-2:
            return {"label": label, "error": f"max relative error {err:.3g}"}

        def stack():
            for w, o in zip(ws, outs, strict=True):
                one(w, o)

        ms = graphed_ms(stack, dev, reps=20) / copies
        return {"label": label, "us": round(ms * 1e3, 2), "of_copy": round(nbytes / ms / 1e6 / copy_gbs, 4)}

    rows = []
    for lib in ("cublas", "cublaslt"):

        def one(w, o, lib=lib):
            with blas_library(lib):
                return torch.mm(x, w.t(), out=o)

        rows.append(timed(lib, one, lambda: torch.empty(T, N, device=dev, dtype=dt_)))
    for splits in (2, 4):
        if K % splits == 0 and name in SUMMED:  # partials only where a kernel after the product sums them
            rows.append(timed(f"split_k_mm {splits}", lambda w, o, s=splits: split_k_mm(x, w, s), lambda: None))
    if name == "lm_head" and N == LLAMA_8B_DIMS["vocab"]:  # the verify's head: what the fused verify runs today
        rows.append(
            timed("rows_gemm (fused verify)", _verify_head(x), lambda: torch.empty(T, N, device=dev, dtype=dt_))
        )
    for bn, bk, splits, stages in tma_configs(name, N, K):
        if time.monotonic() > deadline:
            rows.append({"label": "tma", "error": "budget spent"})
            break

        def one(w, o, launch=(bn, bk, splits, stages)):
            return stream_mm(x, w, launch, o if launch[2] == 1 else None)

        try:
            row = timed(f"tma {bn}x{bk} splits {splits} stages {stages}", one,
                        lambda s=splits: torch.empty(T, N, device=dev, dtype=dt_) if s == 1 else None)  # fmt: skip
        except Exception as e:  # a config Triton cannot build on this device is a row, not the end of the sweep
            row = {"label": f"tma {bn}x{bk} splits {splits} stages {stages}", "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
    ws.clear()
    torch.cuda.empty_cache()
    timed_rows = [r for r in rows if "us" in r]
    best = min(timed_rows, key=lambda r: r["us"]) if timed_rows else None
    libs = [r for r in timed_rows if not r["label"].startswith("tma")]
    tma = [r for r in timed_rows if r["label"].startswith("tma")]
    return {
        "product": name, "N": N, "K": K, "rows": T, "bytes": nbytes, "copies": copies,
        "best": best, "best_library": min(libs, key=lambda r: r["us"]) if libs else None,
        "best_tma": min(tma, key=lambda r: r["us"]) if tma else None, "candidates": rows,
    }  # fmt: skip


def _line(r: dict) -> str:
    def cell(c: dict | None) -> str:
        return f"{c['label']:34} {c['us']:8.2f} us {100 * c['of_copy']:5.1f}%" if c else f"{'-':34}"

    return f"{r['side']:6} {r['product']:8} rows {r['rows']:3}  {cell(r['best_library'])}   {cell(r['best_tma'])}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows-verify", type=int, nargs="*", default=[24])
    p.add_argument("--rows-draft", type=int, nargs="*", default=[4])
    p.add_argument("--budget", type=float, default=240.0, help="seconds for the TMA sweeps, all products together")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", stream=sys.stderr)
    if not torch.cuda.is_available() or triton is None:
        print("skinny_products: needs a CUDA device and Triton", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(1 << 28, dev, torch.bfloat16)
    jobs = [("target", T, *s) for T in args.rows_verify for s in TARGET_PRODUCTS]
    jobs += [("draft", T, *s) for T in args.rows_draft for s in DRAFT_PRODUCTS]
    start = time.monotonic()
    results = []
    for i, (side, T, name, N, K) in enumerate(jobs):
        # each product gets an equal share of what is left of the budget
        deadline = time.monotonic() + (args.budget - (time.monotonic() - start)) / (len(jobs) - i)
        r = {"side": side, **time_product(name, N, K, T, copy_gbs, deadline)}
        results.append(r)
        log.info("%s", _line(r))
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "commit": os.environ.get("EAGLESCOPE_COMMIT", "unknown"),
        "copy_bandwidth_gbs": copy_gbs, "products": results,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"skinny-products-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(out, indent=1))
    for r in results:
        print(_line(r))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
