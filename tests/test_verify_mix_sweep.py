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
from models import WIDE_HEADS, make_checkpoint  # noqa: E402

from eaglescope.errors import EagleScopeError  # noqa: E402
from eaglescope.fast import FastTarget  # noqa: E402
from eaglescope.fast import invariant as inv  # noqa: E402
from eaglescope.fast.fused_decode import FLASH_LAUNCH  # noqa: E402
from eaglescope.fast.fused_verify import K_SPLITS, MAX_ROWS, FusedVerify  # noqa: E402
from eaglescope.fast.tuning import load_tuning  # noqa: E402
from eaglescope.models.targets import load_target  # noqa: E402
from eaglescope.models.targets.llama import fuse_projections  # noqa: E402

pytestmark = pytest.mark.skipif(not inv.available("cpu"), reason="needs TRITON_INTERPRET=1 on a CPU-only machine")

PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")


@pytest.fixture(scope="module")
def verify(tmp_path_factory):
    ckpt = make_checkpoint("llama", tmp_path_factory.mktemp("mix"), num_hidden_layers=1, **WIDE_HEADS)
    model = fuse_projections(load_target(ckpt, device="cpu", dtype=torch.float32).model)
    return FusedVerify(model, FastTarget(model, size=16).cache)


def _cost(seed: int):
    """An additive cost per product: a price for each (library, K split) or Triton blocks state, one tile that fails
    to compile."""
    g = torch.Generator().manual_seed(seed)
    price: dict = {}

    def of(key) -> float:
        if key not in price:
            price[key] = float(torch.rand((), generator=g)) + 0.1
        return price[key]

    def key_of(fv, name: str, cublas, cublaslt, blocks, k_splits) -> tuple:
        if name in cublas:
            return (name, "cublaslt" if name in cublaslt else "cublas", k_splits.get(name, 1))
        return (name, tuple(blocks[name]))

    def verify_ms(ft, ctx, vocab, sizes):
        fv = ft.fused_rows
        if fv.blocks["o"][-1] == 1 and "o" not in fv.cublas:
            raise RuntimeError("out of shared memory")  # a swapped o tile that does not compile
        total = sum(of(key_of(fv, n, fv.cublas, fv.cublaslt, fv.blocks, fv.k_splits)) for n in PRODUCTS)
        return {1: 1.0, sizes[-1]: total}

    return of, key_of, verify_ms


def _sweep(verify, monkeypatch, seed: int) -> tuple:
    of, key_of, fake = _cost(seed)
    monkeypatch.setattr(fdc, "verify_ms", fake)
    res: dict = {}
    fdc.sweep_verify_mix(SimpleNamespace(fused_rows=verify, device=torch.device("cpu")), 8, 100, 4, False, res,
                         lambda: None)  # fmt: skip
    return of, key_of, res


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_descent_ends_on_the_cheapest_mix_and_puts_the_verify_back(verify, monkeypatch, seed):
    before = verify.cublas, verify.cublaslt, dict(verify.blocks), dict(verify.k_splits), verify.flash_launch
    of, key_of, res = _sweep(verify, monkeypatch, seed)
    out = res["verify_mix_sweep_4"]
    assert (verify.cublas, verify.cublaslt, verify.blocks, verify.k_splits, verify.flash_launch) == before
    # every state the descent could reach, priced the same way: the cheapest total is the one it reports
    D = verify.args.head_dim
    options = {}
    for name in PRODUCTS:
        opts = [(name, tuple(b)) for b in fdc.mix_candidates(name, D, False) if not (name == "o" and b[-1] == 1)]
        if name == "lm_head":
            opts.append((name, tuple(before[2][name])))
        else:
            libraries = ("cublas",) if name == "qkv" else ("cublas", "cublaslt")
            splits = (1, 2) if name in K_SPLITS else (1,)
            opts += [(name, lib, split) for lib in libraries for split in splits]
        options[name] = opts
    cheapest = min(sum(of(k) for k in combo) for combo in itertools.product(*options.values()))
    assert out["best_ms"] == pytest.approx(cheapest, abs=1e-4)
    assert out["best_ms_again"] == pytest.approx(cheapest, abs=1e-4)
    best = out["best"]
    chosen = sum(of(key_of(verify, n, best["cublas"], best["cublaslt"], best["blocks"], best["k_splits"]))
                 for n in PRODUCTS)  # fmt: skip
    assert chosen == pytest.approx(cheapest)
    assert not any(b[-1] == 1 for n, b in best["blocks"].items() if n == "o" and n not in best["cublas"])
    assert any(isinstance(v, str) and "shared memory" in v for v in out["ms"].values())
    assert set(best["cublaslt"]) <= set(best["cublas"])


@pytest.mark.parametrize("seed", [0, 1])
def test_the_sweeps_winner_is_written_as_a_tuning_file_the_verify_runs(verify, monkeypatch, tmp_path, seed):
    """--tuning-out: the 4-row winner (it beat the start when both were timed again) becomes the entry for up to 4
    rows, flash attention's swept launch goes into every entry, the file in effect before keeps its other entries,
    and FusedVerify built from the file runs exactly the winner at 4 rows."""
    _, _, res = _sweep(verify, monkeypatch, seed)
    out = res["verify_mix_sweep_4"]
    assert out["best_ms_again"] < out["start_ms_again"]  # this table's start is never its cheapest
    res |= {
        "device": "cpu",
        "commit": "abc",
        "date": "2026-12-05T00:00:00+00:00",
        "tuning_in_effect": {
            "path": "old.json",
            "verify": [{"max_rows": 4, "cublas": []}, {"max_rows": 16, "k_splits": {"o": 2}}],
            "draft": {"k_splits": {"down": 2}},
        },
        "flash_sweep": _flash_result({4: ([16, 64, 4, 2, 2], 2.0, 2.5), 8: ([16, 64, 4, 2, 2], 3.0, 3.0)}),
    }
    doc = fdc.tuning_document(res, "fused-decode-check-x.json", ["fused_decode_check.py", "--sweep-verify-mix", "4"])
    path = tmp_path / "tuned" / "gpu.json"
    fdc.write_tuning(doc, path)
    tuned = load_tuning(path)
    assert [rows for rows, _ in tuned.verify] == [4, 16] and tuned.draft_k_splits == {"down": 2}
    # the 4-row winner: the 4-row entry's launch; 8 rows tied the default, so the 16-row entry keeps its own
    assert tuned.verify[1][1] == {"k_splits": {"o": 2}}
    assert tuned.source["commit"] == "abc" and tuned.source["result"] == "fused-decode-check-x.json"
    fv = FusedVerify(verify.model, verify.cache, by_rows=tuned.verify)
    s = fv.settings(4)
    best = out["best"]
    assert (set(s.cublas), set(s.cublaslt), s.k_splits) == (set(best["cublas"]), set(best["cublaslt"]),
                                                            best["k_splits"])  # fmt: skip
    assert {k: list(v) for k, v in s.blocks.items()} == best["blocks"] and s.flash_launch == (16, 64, 4, 2, 2)
    assert fv.settings(40).flash_launch == verify.flash_launch and fv.settings(40).cublas == verify.cublas


def _flash_result(by_rows: dict[int, tuple[list[int], float, float]]) -> dict:
    """--sweep-flash's result where, at each row count, `launch` took `ms` in the whole verify and FLASH_LAUNCH
    `default_ms`."""
    default = "_".join(map(str, FLASH_LAUNCH))
    whole: dict = {default: {"1": 1.0}}
    for T, (launch, ms, default_ms) in by_rows.items():
        whole.setdefault("_".join(map(str, launch)), {"1": 1.0})[str(T)] = ms
        whole[default][str(T)] = default_ms
    return {"default": list(FLASH_LAUNCH), "best": list(next(iter(by_rows.values()))[0]), "verify_ms": whole,
            "best_by_rows": {str(T): launch for T, (launch, _, _) in by_rows.items()}}  # fmt: skip


def test_each_row_count_takes_the_flash_launch_that_won_in_its_whole_verify():
    """--sweep-flash judges its finalists inside the whole verify at 24 and 64 rows apart: each winner goes to the
    entries that row count covers (an entry for it made if none), the file's other settings stay, and a row count
    where no finalist beat the default keeps the launch its entries had."""
    res = {
        "device": "cpu",
        "commit": "abc",
        "date": "d",
        "tuning_in_effect": {"verify": [{"max_rows": 8, "cublas": ["o"]}, {"max_rows": 24, "k_splits": {"o": 2}}]},
        "flash_sweep": _flash_result({24: ([16, 128, 8, 2, 3], 4.6, 4.7), 64: ([16, 64, 4, 3], 4.8, 4.7)}),
    }
    doc = fdc.tuning_document(res, "r.json", ["x"])
    assert doc["verify"] == [
        {"max_rows": 8, "cublas": ["o"], "flash_launch": [16, 128, 8, 2, 3]},
        {"max_rows": 24, "k_splits": {"o": 2}, "flash_launch": [16, 128, 8, 2, 3]},
    ]
    res["flash_sweep"] = _flash_result({24: ([16, 128, 8, 2, 3], 4.8, 4.7), 64: ([16, 64, 4, 3], 4.6, 4.7)})
    doc = fdc.tuning_document(res, "r.json", ["x"])
    assert doc["verify"] == [{"max_rows": 8, "cublas": ["o"]}, {"max_rows": 24, "k_splits": {"o": 2}},
                             {"max_rows": MAX_ROWS, "flash_launch": [16, 64, 4, 3]}]  # fmt: skip
    assert fdc.flash_winners(res["flash_sweep"]) == {64: [16, 64, 4, 3]}


def test_no_winner_and_no_faster_launch_leave_the_tuning_as_it_was(tmp_path):
    """A winner that did not beat the start when both were timed again, and a flash launch no faster than the
    default, move nothing; with nothing swept there is no file."""
    res = {
        "device": "cpu",
        "commit": "abc",
        "date": "d",
        "tuning_in_effect": {"verify": [{"max_rows": 8, "cublas": ["o"]}]},
        "verify_mix_sweep_4": {"rows": 4, "best": {"cublas": []}, "best_ms_again": 2.0, "start_ms_again": 2.0},
        "flash_sweep": _flash_result({4: ([16, 64, 4, 2, 2], 2.0, 2.0)}),
    }
    doc = fdc.tuning_document(res, "r.json", ["x"])
    assert doc["verify"] == [{"max_rows": 8, "cublas": ["o"]}]
    assert fdc.tuning_document({"device": "cpu", "commit": "c", "date": "d"}, "r.json", ["x"]) is None
    bad = {"verify": [{"max_rows": 99}]}
    path = tmp_path / "t.json"
    path.write_text("{}")
    with pytest.raises(EagleScopeError):
        fdc.write_tuning(bad, path)
    assert path.read_text() == "{}"  # a file that would not load never replaces one that does


@pytest.mark.parametrize("cheapest", [{"o": 1, "down": 4}, {"o": 2, "down": 1}])
def test_the_draft_sweep_writes_the_cheapest_k_splits(monkeypatch, tmp_path, cheapest):
    """--sweep-draft: every candidate runs the real fused draft level (the interpreter's kernels) with its K splits,
    timed by a cost table over both row counts; the cheapest, if it beats the default when both are timed again,
    becomes the file's draft entry, and FastEagle's FusedDraftStep reads it from there. A tie moves nothing."""
    model = fdc.random_target(fdc.SMOKE_DIMS, torch.device("cpu"), torch.float32)
    levels, real = {}, fdc.fused_draft_level

    def recorded(draft, dcache, K, ctx, k_splits=None):
        fused, level = real(draft, dcache, K, ctx, k_splits)
        levels[level] = fused
        return fused, level

    def cost_of(k_splits: dict) -> float:
        return 1.0 if k_splits == cheapest else 2.0 + 0.1 * k_splits["o"] + 0.01 * k_splits["down"]

    def table_ms(fn, device, reps):
        fn()  # the level runs with these splits: a split that did not divide K would raise here
        return cost_of(levels[fn].k_splits)

    monkeypatch.setattr(fdc, "fused_draft_level", recorded)
    monkeypatch.setattr(fdc, "graphed_ms", table_ms)
    res = {"device": "cpu", "commit": "abc", "date": "d", "tuning_in_effect": {"draft": {"k_splits": {"o": 2}}}}
    fdc.sweep_draft(model, (2, 3), ctx=4, S=16, res=res, save=lambda: None)
    out = res["draft_sweep"]
    assert out["best"] == cheapest and out["best_ms_again"] == 2.0 < out["start_ms_again"]
    assert len(out["ms"]) == len(fdc.DRAFT_SPLIT_CANDIDATES) + 3  # the default, each candidate, both again
    path = tmp_path / "gpu.json"
    fdc.write_tuning(fdc.tuning_document(res, "r.json", ["x"]), path)
    assert load_tuning(path).draft_k_splits == cheapest
    out["best_ms_again"] = out["start_ms_again"]  # timed again, the winner no longer wins: the file's draft stays
    assert fdc.tuning_document(res, "r.json", ["x"])["draft"] == {"k_splits": {"o": 2}}
