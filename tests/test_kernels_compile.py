"""The fused verify's product kernel compiled for an H100/H200 (sm_90) on this CPU, by Triton's own compiler, at every
epilogue, with and without swapped tiles and split K, with a row tile unlike the weight tile; the few-row attention
kernel at every row block and split count it launches with; the draft children's log-softmax + top-k at every chunk
the roofline times; a tree level's inputs and the tree's start at the benchmarks' trees.

Why: Triton's interpreter (which the other CPU tests run the kernels under) executes a kernel's Python line by line
and never type-checks it, so a kernel can pass every CPU test and still fail to compile on the GPU: the swapped
tiles' accumulator kept its [BN, BM] shape where the split combine redefines it as [BM, BN], which only a GPU run
found (bench/results/gpu-tests-20261205T1012-fused-kernels-h100.txt). Triton's compiler runs without a GPU when told
the target, so this checks here what the GPU would refuse. In a subprocess: the suite's conftest sets
TRITON_INTERPRET=1, under which kernels are not compilable objects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# each script below ends with `failed`: {configuration: the compiler's last line} for every one that did not compile
HEADER = r"""
import itertools, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

failed = {}


def check(name, fn, signature, const, **options):
    const = {"PDL": False, **const}  # every kernel's launch says whether it waits on the previous one
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in const}}, constexprs=const)
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:
        failed[name] = str(e).strip().splitlines()[-1][:300]
"""

SCRIPT = r"""
from eaglescope.fast.fused_verify import _rows_gemm_kernel

pointers = {n: "*bf16" for n in ("x", "w", "b", "y", "cos", "sin", "kc", "vc")}
signature = {**pointers, "slots": "*i64", "part": "*fp32", "count": "*i32",
             **{n: "i32" for n in ("T", "N", "n_heads", "n_kv", "S")}}
modes = ("plain", "residual", "gate_up", "qkv")
for mode, swap, splits, bm in itertools.product(modes, (False, True), (1, 2), (16, 64)):
    const = dict(K=4096, K_SLICE=4096 // splits, SPLITS=splits, MODE=mode, PAIR=mode in ("gate_up", "qkv"),
                 HAS_BIAS=mode != "residual", EVEN_K=True, D=128, BM=bm, BN=64, BK=64, SWAP=swap)
    check(f"{mode} swap={swap} splits={splits} BM={bm}", _rows_gemm_kernel, signature, const, num_warps=4,
          num_stages=3)
"""

ATTENTION_SCRIPT = r"""
from eaglescope.fast.fused_decode import _attend_rows_kernel

pointers = {n: "*bf16" for n in ("q", "kc", "vc", "y")}
signature = {**pointers, "mask": "*i1", "part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32", "count": "*i32",
             **{n: "i32" for n in ("S", "NS", "T", "H", "rep")}, "scale": "fp32",
             **{n: "i32" for n in ("sq_t", "sq_h", "sm_t", "sy_t", "sy_h")}}
for br, ns_p2 in itertools.product((16, 32, 64), (1, 8, 64)):  # as fused_attention launches: CH splits a load
    const = dict(D=128, KB=64, BR=br, NS_P2=ns_p2, CH=max(1, min(64 // br, ns_p2)))
    check(f"BR={br} NS_P2={ns_p2}", _attend_rows_kernel, signature, const, num_warps=4, num_stages=3)
"""

TOP_K_SCRIPT = r"""
from eaglescope.fast.fused_draft import _log_softmax_top_k_kernel, top_k_warps

signature = {"x": "*bf16", "vals": "*fp32", "ids": "*i64", "part_max": "*fp32", "part_sum": "*fp32",
             "part_val": "*fp32", "part_id": "*i32", "count": "*i32", "V": "i32", "stride": "i32"}
for chunk, k in itertools.product((2048, 8192, 32768), (4, 10)):  # a 32k draft vocabulary in 16, 4 or 1 programs
    splits = triton.cdiv(32000, chunk)
    const = dict(K=k, CHUNK=chunk, SPLITS=splits, SP2=triton.next_power_of_2(splits),
                 CAND=triton.next_power_of_2(splits * k))
    check(f"chunk={chunk} k={k}", _log_softmax_top_k_kernel, signature, const, num_warps=top_k_warps(chunk))
"""

LEVEL_INPUTS_SCRIPT = r"""
from eaglescope.fast.fused_draft import _level_inputs_kernel

i64 = lambda *names: {n: "*i64" for n in names}
signature = {**i64("tokens", "parents", "lineage", "slot_of"), "ctx_mask": "*u8", **i64("frontier", "prev_front"),
             "prev_out": "*bf16", "out_stride": "i32", **i64("root_position", "level", "d2t"), "embedding": "*bf16",
             **i64("tok_out", "pos_out"), "emb_out": "*bf16", "hid_out": "*bf16", "slots_out": "*i64",
             "mask_out": "*u8", "tree_base": "i32", "S": "i32"}
for top_k, depth in ((4, 6), (10, 7)):  # the protocol's tuned tree and the official one
    const = dict(M=top_k, MP2=triton.next_power_of_2(top_k), TOP_K=top_k, COLS=depth + 1,
                 CP2=triton.next_power_of_2(depth + 1), H=4096, HP2=4096, BLOCK_S=1024)
    check(f"top_k={top_k} depth={depth}", _level_inputs_kernel, signature, const, num_warps=4)

from eaglescope.fast.fused_draft import _tree_start_kernel

signature = {**i64("root"), "h_root": "*bf16", **i64("context", "tokens", "parents", "depths"), "scores": "*fp32",
             **i64("lineage", "next_id", "slot_of"), "ctx_mask": "*u8", "prev_front": "*i64", "prev_out": "*bf16",
             **{n: "i32" for n in ("CAP", "CELLS", "S", "NO_SLOT")}}
for top_k in (4, 10):
    check(f"tree start top_k={top_k}", _tree_start_kernel, signature, dict(M=top_k, H=4096, HP2=4096, BLOCK=1024),
          num_warps=4)

from eaglescope.fast.fused_draft import FINALIZE_MAX_NODES, FINALIZE_WARPS, _finalize_kernel

signature = {**i64("tokens", "parents", "depths"), "scores": "*fp32", **i64("lineage", "d2t", "tok_out", "par_out",
             "dep_out"), "score_out": "*fp32", "src_out": "*i64", "mask_out": "*u8", "N": "i32", "KEEP": "i32"}
for nodes, cols in ((85, 7), (FINALIZE_MAX_NODES, 8)):  # the protocol's tuned tree (6, 4), the kernel's widest
    check(f"finalize {nodes} nodes", _finalize_kernel, signature,
          dict(COLS=cols, NP2=triton.next_power_of_2(nodes)), num_warps=FINALIZE_WARPS)
"""

# programmatic dependent launch (fast/fused_decode.py PDL): with PDL on, a kernel of each file, and of each kind of
# launch the round makes (a product, a row kernel, the attention, the children), waits on the previous kernel first
PDL_SCRIPT = r"""
from eaglescope.fast.fused_decode import _attend_flash_kernel, _gemv_kernel
from eaglescope.fast.fused_verify import _rows_rmsnorm_kernel, _rows_rope_cache_kernel, _rows_silu_mul_kernel

i32 = lambda *names: {n: "i32" for n in names}
kernels = {
    "gemv": (_gemv_kernel, {**{n: "*bf16" for n in ("x", "nw", "w", "b", "y")}, **i32("N"), "eps": "fp32"},
             dict(K=4096, NORM=True, HAS_BIAS=False, RESIDUAL=False, BN=4, BK=512, KP2=4096)),
    "flash": (_attend_flash_kernel, {**{n: "*bf16" for n in ("q", "kc", "vc")}, "mask": "*i1", "y": "*bf16",
                                     "limit": "*i32", "part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32",
                                     "count": "*i32", **i32("S", "T", "H", "rep"), "scale": "fp32",
                                     **i32("sq_t", "sq_h", "sm_t", "sy_t", "sy_h")},
              dict(D=128, KB=128, BR=16, SPLITS=1)),
    "rmsnorm": (_rows_rmsnorm_kernel, {**{n: "*bf16" for n in ("x", "r", "nw", "y")}, "eps": "fp32",
                                       **i32("part_stride"), "keep": "*bf16", **i32("keep_stride")},
                dict(K=4096, KP2=4096, ADD=True, PARTS=2, KEEP=True)),
    "rope": (_rows_rope_cache_kernel, {**{n: "*bf16" for n in ("qkv", "cos", "sin", "q", "kc", "vc")},
                                       "slots": "*i64", **i32("n_heads", "n_kv", "S"), "bias": "*bf16",
                                       **i32("part_stride")}, dict(D=128, PARTS=2, HAS_BIAS=True)),
    "silu": (_rows_silu_mul_kernel, {"gate_up": "*bf16", "act": "*bf16", **i32("F")}, dict(BLOCK=1024)),
}
for name, (fn, signature, const) in kernels.items():
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in {**const, "PDL": 1}}},
                    constexprs={**const, "PDL": True})
    try:
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True}).asm["ptx"]
        if "griddepcontrol.wait" not in ptx or "griddepcontrol.launch_dependents" not in ptx:
            failed[name] = "no griddepcontrol in its PTX"
    except Exception as e:
        failed[name] = str(e).strip().splitlines()[-1][:300]
"""


def _compile_failures(script: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud (it warns otherwise)
    script = HEADER + script + "\nprint(json.dumps({'failed': failed}))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["failed"]


STREAM_SCRIPT = r"""
from triton.compiler import ASTSource
from eaglescope.fast.stream_mm import STREAM_LAUNCH, WARPS, _stream_mm_kernel

# every default launch at the rows it serves (the verify's 24 and up to 32, the draft's 1-7): TMA loads, wgmma
# products, and shared memory an H100/H200 SM has (227 KB)
for side, rows in (("verify", (24, 32)), ("draft", (4, 7))):
    for (name, (bn, bk, splits, stages)), bm in itertools.product(STREAM_LAUNCH[side].items(), (16, 32)):
        if bm < rows[0] and side == "verify":
            continue
        sig = {"w_desc": f"tensordesc<bf16[{bn},{bk}]>", "x_desc": f"tensordesc<bf16[{bm},{bk}]>",
               "y": "*fp32" if splits > 1 else "*bf16", "T": "i32", "N": "i32"}
        const = dict(K_SLICE=4096 // splits, BN=bn, BM=bm, BK=bk, STAGES=stages, UPCAST=False)
        src = ASTSource(fn=_stream_mm_kernel, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        where = f"{side} {name} BM={bm}"
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=WARPS, num_stages=stages))
        except Exception as e:
            failed[where] = str(e).strip().splitlines()[-1][:300]
            continue
        ptx = k.asm["ptx"]
        if "cp.async.bulk.tensor" not in ptx or "wgmma" not in ptx or k.metadata.shared > 232448:
            failed[where] = f"tma {'cp.async.bulk.tensor' in ptx}, wgmma {'wgmma' in ptx}, shared {k.metadata.shared}"
"""


def test_the_stream_product_kernel_compiles_for_sm90_at_its_launches():
    """stream_mm's default launches: weight tiles by TMA, products on wgmma, within an SM's shared memory."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    assert _compile_failures(STREAM_SCRIPT) == {}


def test_the_product_kernel_compiles_for_sm90_in_every_configuration():
    assert _compile_failures(SCRIPT) == {}


def test_the_few_row_attention_kernel_compiles_for_sm90_at_every_row_block():
    assert _compile_failures(ATTENTION_SCRIPT) == {}


def test_the_draft_childrens_kernel_compiles_for_sm90_at_every_chunk():
    assert _compile_failures(TOP_K_SCRIPT) == {}


def test_a_tree_levels_inputs_and_the_trees_start_compile_for_sm90_at_the_benchmarks_trees():
    assert _compile_failures(LEVEL_INPUTS_SCRIPT) == {}


def test_the_kernels_wait_on_the_previous_one_when_launched_with_pdl():
    assert _compile_failures(PDL_SCRIPT) == {}
