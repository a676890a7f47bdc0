"""bench/fused_decode_check.py --sweep-verify-mix: the descent over the verify's products (cuBLAS or the Triton
kernel's blocks, cuBLASLt on or off) on a real FusedVerify, with the verify's time given by a cost table in place of
a GPU: it must end on the cheapest mix, keep a failing tile out, and leave the verify as it found it."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import fused_decode_check as fdc  # noqa: E402
from models import make_checkpoint  # noqa: E402

from eaglescope.fast import FastTarget  # noqa: E402
from eaglescope.fast import invariant as inv  # noqa: E402
from eaglescope.fast.fused_verify import FusedVerify  # noqa: E402
from eaglescope.models.targets import load_target  # noqa: E402
from eaglescope.models.targets.llama import fuse_projections  # noqa: E402

pytestmark = pytest.mark.skipif(not inv.available("cpu"), reason="needs TRITON_INTERPRET=1 on a CPU-only machine")

PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")


@pytest.fixture(scope="module")
def verify(tmp_path_factory):
    ckpt = make_checkpoint("llama", tmp_path_factory.mktemp("mix"), num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1)  # fmt: skip
    model = fuse_projections(load_target(ckpt, device="cpu", dtype=torch.float32).model)
    return FusedVerify(model, FastTarget(model, size=16).cache)


def _cost(seed: int):
    """An additive cost per product: a price for each (library, blocks) state, one tile that fails to compile."""
    g = torch.Generator().manual_seed(seed)
    price: dict = {}

    def of(key) -> float:
        if key not in price:
            price[key] = float(torch.rand((), generator=g)) + 0.1
        return price[key]

    def verify_ms(ft, ctx, vocab, sizes):
        fv = ft.fused_rows
        if fv.blocks["o"][-1] == 1 and "o" not in fv.cublas:
            raise RuntimeError("out of shared memory")  # a swapped o tile that does not compile
        total = sum(
            of((name, "cublaslt" if name in fv.cublaslt else "cublas"))
            if name in fv.cublas
            else of((name, tuple(fv.blocks[name])))
            for name in PRODUCTS
        )
        return {1: 1.0, sizes[-1]: total}

    return of, verify_ms


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_descent_ends_on_the_cheapest_mix_and_puts_the_verify_back(verify, monkeypatch, seed):
    of, fake = _cost(seed)
    monkeypatch.setattr(fdc, "verify_ms", fake)
    before = verify.cublas, verify.cublaslt, dict(verify.blocks)
    res: dict = {}
    fdc.sweep_verify_mix(SimpleNamespace(fused_rows=verify, device=torch.device("cpu")), 8, 100, 4, False, res,
                         lambda: None)  # fmt: skip
    out = res["verify_mix_sweep_4"]
    assert (verify.cublas, verify.cublaslt, verify.blocks) == before
    # every state the descent could reach, priced the same way: the cheapest total is the one it reports
    D = verify.args.head_dim
    options = {}
    for name in PRODUCTS:
        opts = [(name, tuple(b)) for b in fdc.mix_candidates(name, D, False) if not (name == "o" and b[-1] == 1)]
        opts.append((name, tuple(before[2][name])) if name == "lm_head" else (name, "cublas"))
        if name in ("o", "gate_up", "down"):
            opts.append((name, "cublaslt"))
        options[name] = opts
    cheapest = min(sum(of(k) for k in combo) for combo in itertools.product(*options.values()))
    assert out["best_ms"] == pytest.approx(cheapest, abs=1e-4)
    assert out["best_ms_again"] == pytest.approx(cheapest, abs=1e-4)
    chosen = sum(
        of((n, "cublaslt" if n in out["best"]["cublaslt"] else "cublas"))
        if n in out["best"]["cublas"]
        else of((n, tuple(out["best"]["blocks"][n])))
        for n in PRODUCTS
    )
    assert chosen == pytest.approx(cheapest)
    assert not any(b[-1] == 1 for n, b in out["best"]["blocks"].items() if n == "o" and n not in out["best"]["cublas"])
    assert any(isinstance(v, str) and "shared memory" in v for v in out["ms"].values())
    assert set(out["best"]["cublaslt"]) <= set(out["best"]["cublas"])
