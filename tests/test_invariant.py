"""Batch-invariant kernels (fast/invariant.py), run on the CPU under Triton's interpreter (conftest sets
TRITON_INTERPRET=1 when there is no GPU): they compute the reference results, and a row's result is
bit-identical whatever else shares the call — the property that makes tree verification reproduce
one-token decoding exactly."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from drafts import make_draft  # noqa: E402
from models import attention_case, make_checkpoint  # noqa: E402
from tolerance import assert_close_float32  # noqa: E402

from eaglescope.decode.speculative import target_embedding  # noqa: E402
from eaglescope.decode.tree import DraftTree  # noqa: E402
from eaglescope.decode.vanilla import generate_vanilla  # noqa: E402
from eaglescope.fast import FastEagle, FastTarget, FastVanilla  # noqa: E402
from eaglescope.fast import invariant as inv  # noqa: E402
from eaglescope.models.targets import load_target  # noqa: E402
from eaglescope.models.targets.llama import RMSNorm, attend, fuse_projections  # noqa: E402
from eaglescope.taps import TapContract  # noqa: E402

pytestmark = pytest.mark.skipif(not inv.available("cpu"), reason="needs TRITON_INTERPRET=1 on a CPU-only machine")


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 70), n=st.integers(1, 140), k=st.integers(1, 150), bias=st.booleans(), seed=st.integers(0, 99))
def test_linear_matches_torch_and_rows_are_invariant(m, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = inv.invariant_linear(x, w, b)
    assert_close_float32(y, torch.nn.functional.linear(x, w, b))
    row = seed % m
    # alone, or among m rows spanning several row tiles: the same bits
    assert torch.equal(inv.invariant_linear(x[row : row + 1], w, b)[0], y[row])


def test_k_slices_cut_only_large_products():
    assert inv.k_slices(4096, 14336) == 4 and inv.k_slices(6144, 4096) == 3  # 8B down, q/k/v
    assert inv.k_slices(28672, 4096) == 1  # 8B gate/up: enough column tiles already
    assert inv.k_slices(1024, 2816) == 1  # the 197M benchmark target's down: launch-bound, stays whole


@pytest.mark.parametrize("n, k, bias, slices", [(70, 1100, True, 4), (40, 700, False, 3)])
def test_sliced_reduction_matches_torch_and_rows_are_invariant(n, k, bias, slices):
    """Products cut into K-slices: the fixed-order total is the reference product, and a row alone gets the bits
    it gets among 80 rows (two row tiles)."""
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(80, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = inv.invariant_linear(x, w, b, slices=slices)
    assert_close_float32(y, torch.nn.functional.linear(x, w, b))
    for row in (0, 77):
        assert torch.equal(inv.invariant_linear(x[row : row + 1], w, b, slices=slices)[0], y[row])


def test_supports_needs_a_power_of_two_head_dim():
    assert inv.supports(64, "cpu") and inv.supports(128, "cpu")
    assert not inv.supports(80, "cpu")


def test_rms_norm_matches_module():
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data.normal_()
    x = torch.randn(3, 5, 96)
    torch.testing.assert_close(inv.invariant_rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-6, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 9), S=st.integers(1, 150), rep=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_attention_matches_masked_sdpa(T, S, rep, seed):
    q, k, v, mask = attention_case(T, S, rep, seed, density=0.4)
    out = inv.invariant_attention(q, k, v, inv.KeyIndex.from_mask(mask))
    assert_close_float32(out, attend(q, k, v, mask[None, None]))


def test_attention_row_ignores_where_its_keys_sit():
    """The same keys in the same order, once contiguous and once scattered between masked slots with other rows
    in the call: bit-identical output (a fused kernel's per-block reduction would differ)."""
    torch.manual_seed(1)
    D, n = 32, 150
    keys, vals = torch.randn(n, D), torch.randn(n, D)
    q = torch.randn(1, 1, 1, D)
    S = 400
    spread = torch.sort(torch.randperm(S)[:n]).values
    k, v = torch.randn(1, 1, S, D), torch.randn(1, 1, S, D)
    k[0, 0, spread], v[0, 0, spread] = keys, vals
    mask = torch.zeros(3, S, dtype=torch.bool)
    mask[1, spread] = True
    mask[0, :7] = mask[2, 50:] = True
    scattered = inv.invariant_attention(q.expand(1, 1, 3, D).contiguous(), k, v, inv.KeyIndex.from_mask(mask))
    alone = inv.invariant_attention(
        q, keys[None, None], vals[None, None], inv.KeyIndex.from_mask(torch.ones(1, n, dtype=torch.bool))
    )
    assert torch.equal(scattered[0, 0, 1], alone[0, 0, 0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 7 layers (the fewest the default taps allow): the interpreter runs every kernel program in Python
    ckpt = make_checkpoint("llama", tmp_path_factory.mktemp("inv"), seed=7, num_hidden_layers=7)
    tgt = load_target(ckpt, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(ckpt, taps=tgt.taps, seed=14, scale=1.0)  # a seed whose random draft gets hits
    draft.load_target_embedding(target_embedding(tgt))
    return tgt, draft


def test_verify_rows_are_bit_identical_to_one_token_steps(tiny):
    """A chain verified inside a tree (at scattered tree slots, among sibling rows) gives exactly the logits of
    decoding those tokens one at a time; the default kernels only agree to rounding."""
    tgt, _ = tiny
    prompt = torch.tensor([3, 17, 5, 40, 22, 9])
    chain = torch.tensor([11, 60, 2, 33])
    ft = FastTarget(copy.deepcopy(tgt.model), size=48, float32_logits=True, batch_invariant=True)
    P = prompt.numel()
    # one token at a time
    ft.prefill(prompt)
    slots_all = torch.arange(ft.size)
    steps = []
    for j, tok in enumerate(chain.tolist()):
        pos = torch.tensor([P + j])
        logits, _ = ft.run(torch.tensor([tok]), pos, (slots_all <= pos)[None, :], pos)
        steps.append(logits[0])
    # the same chain as tree nodes 1, 3, 4, 6 among distractors (node 0 = chain[0] is the root)
    tokens = torch.tensor([chain[0], 70, chain[1], 71, 72, chain[2], 73, chain[3]])
    tree = DraftTree.from_parents(tokens, [-1, 0, 0, 1, 2, 2, 5, 5])
    N = tree.num_nodes
    ft.prefill(prompt)
    vmask = torch.zeros(N, ft.size, dtype=torch.bool)
    vmask[:, :P] = True
    vmask[:, P : P + N] = tree.ancestor_mask()
    logits, _ = ft.run(tokens, P + tree.depths, vmask, P + torch.arange(N))
    for j, node in enumerate([0, 2, 5, 7]):
        assert torch.equal(logits[node], steps[j]), f"chain token {j} (tree node {node})"


def test_fast_eagle_on_invariant_kernels_equals_vanilla(tiny):
    tgt, draft = tiny
    model = copy.deepcopy(tgt.model)
    fuse_projections(model)
    ft = FastTarget(model, size=64, taps=tgt.taps.layers, float32_logits=True, batch_invariant=True)
    prompt = [3, 17, 5, 40, 22, 9, 11]
    n = 12
    ref = FastVanilla(ft, n).generate(prompt).tokens
    assert ref == generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids
    fast = FastEagle(ft, draft, 3, 3, 8, max_len=len(prompt) + n + 2).generate(prompt, n)
    assert fast.tokens == ref
    assert sum(fast.accepted) > 0


def test_swap_back_restores_the_modules(tiny):
    from eaglescope.fast.engine import use_batch_invariant

    model = copy.deepcopy(tiny[0].model)
    before = [type(m) for m in model.modules()]
    use_batch_invariant(model)
    assert isinstance(model.lm_head, inv.InvariantLinear)
    assert model.model.layers[0].self_attn.attention_impl is inv.invariant_attention
    use_batch_invariant(model, enable=False)
    assert [type(m) for m in model.modules()] == before
    assert model.model.layers[0].self_attn.attention_impl == "sdpa"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_swapped_model_still_runs_the_reference_path(tmp_path, family):
    """A model on the invariant kernels also serves NativeTarget's masked forward and the causal training-time
    forward (mask None) with the same logits (q/k/v bias: qwen2; q/k norms and head_dim 32: qwen3)."""
    ckpt = make_checkpoint(family, tmp_path / family, seed=2, num_hidden_layers=2)
    tgt = load_target(ckpt, device="cpu", dtype=torch.float32)
    ids = torch.tensor([[3, 17, 5, 40, 22, 9]])
    pos = torch.arange(6)[None]
    ref, _, _ = tgt.model(ids, pos, None)
    from eaglescope.fast.engine import use_batch_invariant

    model = use_batch_invariant(copy.deepcopy(tgt.model))
    depth = len(model.model.layers) + 1
    assert_close_float32(model(ids, pos, None)[0], ref, depth)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    assert_close_float32(model(ids, pos, mask)[0], ref, depth)


_SWEEP = """
import torch
from eaglescope.fast import invariant as inv
bad = []
for seed in range(10):
    for m in (1, 2, 3, 7, 16, 33):
        for n, k in ((1, 2), (3, 5), (8, 16)):
            g = torch.Generator().manual_seed(seed)
            x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
            row = seed % m
            if not torch.equal(inv.invariant_linear(x[row : row + 1], w)[0], inv.invariant_linear(x, w)[row]):
                bad.append((seed, m, n, k))
print(len(bad), bad[:5])
"""


@pytest.mark.skipif(
    "avx2" not in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else True,
    reason="needs an x86 CPU with AVX2 to select OpenBLAS's Haswell kernels",
)
def test_rows_stay_invariant_on_avx2_blas_kernels():
    """numpy's matmul on OpenBLAS's AVX2 (Haswell) sgemm rounds a row by its place in the tile, which once made
    these rows differ in the last bit on AVX2-only CI machines (20 of these 180 cases); the interpreted kernels
    must not depend on it. OPENBLAS_CORETYPE picks those kernels on any x86 machine with AVX2."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OPENBLAS_CORETYPE": "Haswell", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _SWEEP], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "0", out.stdout
