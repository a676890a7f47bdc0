"""Each of this project's `sgl_kernel` stand-ins (tests/sglang/stand_ins/sgl_kernel) computes what SGLang's own
version of the op computes: SGLang 0.5.23's Triton kernels (run by Triton's interpreter on the CPU) for the cache,
tree and verify ops, its torch-native attention backend for decode and causal extend attention, masked SDPA for
tree-verify attention. The comparison runs in the SGLang environment (kernel_check.py); this test reads its result.
These tests are what stand behind every tests/sglang result: SGLang's C++ CPU kernels themselves are not exercised."""

from __future__ import annotations

import json
import subprocess

import pytest
from sglang_support import HERE, sglang_env

OPS = [
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_draft_decode_metadata_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "copy_all_layer_kv_cache_cpu",
    "weak_ref_tensor",
    "decode_attention_cpu",
    "extend_attention_cpu",
]


@pytest.fixture(scope="module")
def checked(tmp_path_factory, sglang_python: str) -> dict:
    out = tmp_path_factory.mktemp("kernels") / "kernels.json"
    p = subprocess.run([sglang_python, str(HERE / "kernel_check.py"), str(out)], capture_output=True, text=True,
                       env=sglang_env(), timeout=600)  # fmt: skip
    assert p.returncode == 0 and out.exists(), p.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_reference_comparison_ran(checked):
    errors = {k: v["mismatches"] for k, v in checked.items() if k.startswith("error:")}
    assert not errors, errors
    assert sorted(checked) == sorted(OPS)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "op" in metafunc.fixturenames:
        metafunc.parametrize("op", OPS)


def test_stand_in_equals_sglangs_own_op(checked, op):
    r = checked.get(op)
    assert r is not None, f"{op} was not checked"
    assert r["cases"] >= 12 and r["mismatches"] == [], r
    if "max_abs_diff" in r:  # attention: float32, a different summation order than SDPA's
        assert r["max_abs_diff"] < 1e-5
