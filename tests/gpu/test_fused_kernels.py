"""The fused decode, verify and draft kernels (fast/fused_decode.py, fast/fused_verify.py, fast/fused_draft.py) built
for the GPU, with the blocks tuned at 8B (1024-4096-wide K tiles, which the CPU tests' small blocks never take) and
the verify's cuBLAS and cuBLASLt products. The path `generate --fast --no-batch-invariant` runs on a GPU.

An 8B-wide, two-layer Llama in float32: a one-token step and a 24- and a 64-row verify against the model's own
modules (logits, taps, cache writes, within float32's reordering bound), then greedy decoding through the kernels
against vanilla greedy; an 8B-wide draft layer's catch-up and tree level on the fused draft kernels against its
modules, and speculative decoding through all three against vanilla greedy. The CPU tests run the same kernels under
Triton's interpreter at tiny widths."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from drafts import check_finalize, check_level_inputs, check_tree_start, make_draft
from models import LLAMA_8B, make_checkpoint
from tolerance import assert_draft_step_matches_modules, assert_step_matches_modules

from eaglescope.decode.speculative import draft_slot_cache, target_embedding
from eaglescope.decode.tree import TreeBuilder, expand_level, tree_capacity
from eaglescope.decode.vanilla import generate_vanilla
from eaglescope.fast import FastEagle, FastTarget, FastVanilla, tuning
from eaglescope.fast.fused_decode import (
    DEFAULT_BLOCKS,
    FLASH_LAUNCH,
    FusedDecode,
    attention_limit,
    attention_scratch,
    fused_attention,
)
from eaglescope.fast.fused_draft import FusedDraftStep, expand_level_fused, log_softmax_top_k
from eaglescope.fast.fused_verify import CUBLASLT_PRODUCTS, FusedVerify
from eaglescope.fast.run import fast_runner
from eaglescope.fast.stream_mm import STREAM_LAUNCH, stream_mm
from eaglescope.models.targets import load_target
from eaglescope.models.targets.llama import fuse_projections
from eaglescope.taps import TapContract

DEVICE = torch.device("cuda")
S = 200  # cache slots: four 64-slot attention splits
# stream_mm launches for float32 tiles (twice bf16's shared memory a stage): every product of the 8B widths
FLOAT32_STREAM = {"qkv": (64, 64, 2, 2), "o": (64, 64, 4, 2), "gate_up": (64, 64, 1, 2), "down": (64, 64, 4, 2),
                  "lm_head": (64, 64, 1, 2)}  # fmt: skip


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """Two layers of Llama-3-8B's widths (hidden 4096, ffn 14336, 32/8 heads of 128), a 4096-token vocabulary."""
    dims = {**LLAMA_8B, "num_hidden_layers": 2, "vocab_size": 4096, "max_position_embeddings": 256}
    return make_checkpoint("llama", tmp_path_factory.mktemp("wide"), seed=11, **dims)


@pytest.fixture(scope="module")
def wide(wide_dir):
    return load_target(wide_dir, device=DEVICE, dtype=torch.float32)


@pytest.fixture(scope="module")
def wide_draft(wide_dir, wide):
    """An EAGLE-3 draft of the same widths over taps 0 and 1, random norms, a 2048-token draft vocabulary."""
    draft, _ = make_draft(wide_dir, taps=TapContract((0, 1), 2), draft_vocab_size=2048, seed=3, random_norms=True)
    draft.load_target_embedding(target_embedding(wide))
    return fuse_projections(draft.to(DEVICE))


def _fresh(wide) -> tuple[torch.nn.Module, FastTarget]:
    model = fuse_projections(copy.deepcopy(wide.model))
    ft = FastTarget(model, size=S, taps=(0, 1), float32_logits=True)
    ft.prefill(torch.arange(3, 40, device=DEVICE))
    return model, ft


def _against_modules(ft, run, toks, pos, mask, slots, layers: int) -> None:
    # the products here sum 4096-14336 terms where the CPU tests' sum 64-128: a reordered float32 sum drifts with
    # the square root of its length (~11x longer), so the bound is 16x theirs, still ~10^4 below a wiring mistake
    assert_step_matches_modules(ft, run, toks, pos, mask, slots, depth=16 * (layers + 1))


def test_one_token_step_with_the_8b_blocks_matches_the_modules(wide):
    model, ft = _fresh(wide)
    fd = FusedDecode(model, ft.cache, taps=(0, 1))
    assert fd.blocks == DEFAULT_BLOCKS and max(b[1] for b in fd.blocks.values()) == 4096
    # a tree-like row: the prompt, one earlier node in another split, and its own slot
    mask = torch.zeros(1, S, dtype=torch.bool, device=DEVICE)
    mask[0, :37] = True
    mask[0, [90, 150]] = True
    ft.cache.k[:, :, :, 80:100].normal_()
    ft.cache.v[:, :, :, 80:100].normal_()
    tok, pos, slot = (torch.tensor([v], device=DEVICE) for v in (33, 38, 150))
    _against_modules(ft, lambda t, p, m, s: fd(t, p, m[0], s), tok, pos, mask, slot, len(model.model.layers))


@pytest.mark.parametrize("T", [24, 64])
@pytest.mark.parametrize(
    "cublaslt,defer,k_splits",
    [
        (CUBLASLT_PRODUCTS, False, {}),
        ((), False, {}),
        (CUBLASLT_PRODUCTS, True, {}),
        (CUBLASLT_PRODUCTS, True, {"qkv": 4, "o": 2, "down": 4}),
    ],
)
def test_verify_rows_on_cublas_and_cublaslt_match_the_modules(wide, T, cublaslt, defer, k_splits):
    """A chain of T rows after the prompt, on the default (flash) attention; until 9b630c3 these ran the split-slot
    grouped kernel at 24 rows and attention as products at 64 (gpu-tests-20261204T1914.txt). `defer`: o's and down's
    residual adds in the next norm kernel; `k_splits`: products as float32 partials over slices of K, summed by the
    RoPE kernel or the next norm kernel (bmm's out_dtype; not yet run on a GPU at its commit)."""
    model, ft = _fresh(wide)
    fv = FusedVerify(model, ft.cache, taps=(0, 1), cublaslt=cublaslt, defer_residual=defer)
    fv.k_splits.update(k_splits)
    slots = 37 + torch.arange(T, device=DEVICE)
    mask = torch.arange(S, device=DEVICE)[None, :] <= slots[:, None]
    toks = torch.randint(0, 4096, (T,), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(T))
    was = torch.backends.cuda.preferred_blas_library()
    _against_modules(ft, fv, toks, slots, mask, slots, len(model.model.layers))
    assert torch.backends.cuda.preferred_blas_library() == was  # the library choice is put back


@pytest.mark.parametrize("T", [8, 24, 64])
def test_verify_rows_on_swapped_triton_tiles_match_the_modules(wide, T):
    """Every product on _rows_gemm_kernel with SWAP (the weight tile as the tensor-core product's M side, the rows
    on its N side), split over K where the 8B widths call for it, each epilogue (RoPE and cache writes, residual,
    SiLU·up, the lm_head's plain store): the candidates fused_decode_check.py --sweep-verify-mix times at 24 rows."""
    model, ft = _fresh(wide)
    swapped = {name: (64, 64, 4, 3, 1) for name in ("qkv", "o", "gate_up", "down", "lm_head")}
    fv = FusedVerify(model, ft.cache, taps=(0, 1), blocks=swapped, cublas=())
    slots = 37 + torch.arange(T, device=DEVICE)
    mask = torch.arange(S, device=DEVICE)[None, :] <= slots[:, None]
    toks = torch.randint(0, 4096, (T,), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(T))
    _against_modules(ft, fv, toks, slots, mask, slots, len(model.model.layers))
    assert not fv.count.any()  # every split product's counters back at zero


@pytest.mark.parametrize("T", [24, 64])
@pytest.mark.parametrize("splits", [2, 3])
def test_verify_rows_on_split_flash_attention_match_the_modules(wide, T, splits):
    """Flash attention's walk in interleaved splits, the last to finish combining (programs really run side by side
    here, unlike under the interpreter): the default mix, flash attention on 32-slot blocks (FLASH_LAUNCH's 128 would
    put the 61 or 101 slots below the limit in one block, leaving every split but the first with nothing to walk)
    split 2 or 3 ways, so the 2-4 blocks are shared unevenly; twice over the same counters."""
    model, ft = _fresh(wide)
    fv = FusedVerify(model, ft.cache, taps=(0, 1))
    fv.flash_launch = (FLASH_LAUNCH[0], 32) + FLASH_LAUNCH[2:4] + (splits,)
    slots = 37 + torch.arange(T, device=DEVICE)
    mask = torch.arange(S, device=DEVICE)[None, :] <= slots[:, None]
    toks = torch.randint(0, 4096, (T,), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(T))
    empty = ft.cache.k.clone(), ft.cache.v.clone()
    for _ in range(2):
        ft.cache.k.copy_(empty[0])
        ft.cache.v.copy_(empty[1])
        _against_modules(ft, fv, toks, slots, mask, slots, len(model.model.layers))
    assert not fv._flash_part[3].any()


@pytest.mark.parametrize("T,S_", [(1, 200), (24, 480), (64, 40000)])
def test_attention_limit_kernel_is_one_past_the_highest_allowed_slot(T, S_):
    """The verify's flash attention bound, in the kernel the GPU compiles (its slot blocks folded by atomics; 157 of
    them for 40000 slots), against torch's definition, for a causal chain and a mask whose highest slot is one row's."""
    slots = 100 + torch.arange(T, device=DEVICE)
    mask = torch.arange(S_, device=DEVICE)[None, :] <= slots[:, None]
    assert int(attention_limit(mask)) == 100 + T
    mask[T // 2, S_ - 3] = True
    assert int(attention_limit(mask)) == S_ - 2
    assert int(attention_limit(torch.zeros(T, S_, dtype=torch.bool, device=DEVICE))) == 0


@pytest.mark.parametrize("T", [4, 7, 16])
def test_few_row_attention_over_a_long_cache_combines_every_split(T):
    """The draft's attention (the split-slot kernel for a few rows) at 8B's heads over a 4096-slot cache: 64 splits
    running at once, the last to finish combining them a few at a time (4, 2 or 1 a load for 4, 7 and 16 rows' row
    blocks), twice over the same counters, against float32 attention over the masked slots."""
    g = torch.Generator(DEVICE).manual_seed(T)
    Hkv, rep, D, S_ = 8, 4, 128, 4096
    q = torch.randn(T, Hkv * rep, D, device=DEVICE, generator=g)
    k, v = (torch.randn(Hkv, S_, D, device=DEVICE, generator=g) for _ in range(2))
    mask = torch.rand(T, S_, device=DEVICE, generator=g) < 0.05
    mask[:, 3000 + torch.arange(T, device=DEVICE)] = torch.eye(T, dtype=torch.bool, device=DEVICE)
    scores = torch.einsum("thd,hsd->ths", q, k.repeat_interleave(rep, 0)) * D**-0.5
    want = torch.einsum("ths,hsd->thd", scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1),
                        v.repeat_interleave(rep, 0))  # fmt: skip
    scratch = attention_scratch(T, Hkv * rep, D, S_, DEVICE)
    for _ in range(2):
        got = fused_attention(q, k, v, mask, scratch=scratch)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not scratch[3].any()


def test_greedy_through_the_fused_kernels_is_vanilla_greedy(wide):
    """One-token steps as CUDA graphs on the fused decode kernels: vanilla greedy's tokens."""
    prompt, n = [5, 17, 300, 41, 2048, 9], 12
    ref = generate_vanilla(wide, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(copy.deepcopy(wide.model), S, fuse=True, float32_logits=True, fused_decode=True)
    assert ft.fused is not None
    assert FastVanilla(ft, n).generate(prompt).tokens == ref


@pytest.mark.parametrize("T", [4, 7])
@pytest.mark.parametrize("k_splits,stream", [({}, None), ({"o": 2, "down": 2}, None), ({}, "float32")])
def test_draft_layer_on_the_fused_kernels_matches_the_modules(wide_draft, T, k_splits, stream):
    """A tree level's 4 rows and a catch-up's 7 at scattered slots (context, one earlier node, their own): the
    output, the head's logits over the final norm and the draft-cache writes against the modules' step; o and down
    as one product each or as float32 partials over K's halves (bmm's out_dtype) that the next norm kernel sums, or
    every product and the head on stream_mm (its float32 launches)."""
    draft = wide_draft
    cache = draft_slot_cache(draft, S)
    g = torch.Generator(DEVICE).manual_seed(T)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    slots = 150 + torch.arange(T, device=DEVICE)
    mask = torch.zeros(T, S, dtype=torch.bool, device=DEVICE)
    mask[:, :37] = True
    mask[torch.arange(T, device=DEVICE), slots] = True
    mask[1:, 90] = True
    positions = torch.full((T,), 40, device=DEVICE)
    H = draft.config.hidden_size
    embeds = torch.randn(T, H, device=DEVICE, generator=g)
    hidden = torch.randn(T, H, device=DEVICE, generator=g) * 3
    launches = FLOAT32_STREAM if stream else None
    fused = FusedDraftStep(draft, cache, rows=T, stream=launches)
    assert fused.stream == (launches or {})  # float32: no default launches
    fused.k_splits.update(k_splits)
    assert_draft_step_matches_modules(fused, draft, embeds, hidden, positions, slots, mask, unit=16)


@pytest.mark.parametrize("m,V,k", [(1, 32000, 4), (4, 32000, 4), (10, 32000, 10), (4, 65536, 8), (4, 128256, 4)])
def test_log_softmax_top_k_at_draft_vocabularies_is_torchs(m, V, k):
    """A tree level's children from bf16 logits in the kernel the GPU compiles (16 to 63 programs a row running at
    once, the last to finish merging): torch's log-softmax values, best first, distinct columns that hold them (bf16
    logits tie), the row counters back at zero; and distinct columns when half a row ties at its maximum."""
    g = torch.Generator(DEVICE).manual_seed(V + k)
    x = (torch.randn(m, V, device=DEVICE, generator=g) * 4).to(torch.bfloat16)
    lp = torch.log_softmax(x.float(), dim=-1)
    count = torch.zeros(m, device=DEVICE, dtype=torch.int32)
    for _ in range(3):  # again on the counters the previous launch left
        vals, ids = log_softmax_top_k(x, k, count)
        assert not count.any()
        torch.testing.assert_close(vals, lp.topk(k, dim=-1).values, rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(lp.gather(1, ids), vals, rtol=1e-6, atol=2e-6)
        assert all(len(set(r)) == k for r in ids.tolist())
    x[:, ::2] = x.max()  # half of every row ties at its maximum
    vals, ids = log_softmax_top_k(x, k)
    assert all(len(set(r)) == k for r in ids.tolist()) and bool((ids % 2 == 0).all())
    torch.testing.assert_close(vals, torch.log_softmax(x.float(), -1).gather(1, ids), rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("depth,top_k", [(6, 4), (7, 10)])
def test_expand_level_in_one_launch_at_the_benchmarks_trees(depth, top_k):
    """The protocol's (6, 4) tree and the official (7, 10) one (100 candidates a level in one warp) grown through
    the one-launch expansion and through decode/tree.py's from the same children: the same builder after every level
    and a frontier of the same cumulative log-probs at distinct ids (bf16 logits tie often: torch's top-k orders tied
    candidates its own way), the same ids where nothing ties."""
    g = torch.Generator(DEVICE).manual_seed(depth)
    builders = [TreeBuilder(7, top_k, DEVICE, levels=depth, vocab=32000, expand_fn=fn)
                for fn in (expand_level, expand_level_fused)]  # fmt: skip
    frontier = torch.zeros(1, dtype=torch.long, device=DEVICE)
    for _ in range(depth):
        logits = torch.randn(frontier.shape[0], 32000, device=DEVICE, generator=g).to(torch.bfloat16)
        children = log_softmax_top_k(logits, top_k)
        start = int(builders[0].next_id)
        ref, got = (b.expand(frontier, children) for b in builders)
        for name in ("tokens", "parents", "depths", "scores", "lineage", "next_id"):
            assert torch.equal(getattr(builders[1], name), getattr(builders[0], name)), name
        scores = builders[0].scores
        assert torch.equal(scores[got], scores[ref]) and len(set(got.tolist())) == got.shape[0]
        level = scores[start : int(builders[0].next_id)]
        if level.unique().shape[0] == level.shape[0]:  # no two candidates of the level tie
            assert torch.equal(got, ref)
        frontier = ref


@pytest.mark.parametrize("side", ["verify", "draft"])
def test_stream_products_at_the_8b_shapes_in_bf16(side):
    """Each default launch (STREAM_LAUNCH) at the 8B product it was measured for, the verify's 24 rows or the draft
    level's 4, in bf16 as the benchmarks run it: the partials summed (or the one split's output) within bf16's
    rounding of a float64 product, and one split's output rounded once (the same bits as rounding the float32 sum)."""
    rows = 24 if side == "verify" else 4
    shapes = {"qkv": (6144, 8192 if side == "draft" else 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336), "lm_head": (32000 if side == "draft" else 128256, 4096)}  # fmt: skip
    g = torch.Generator(DEVICE).manual_seed(rows)
    for name, launch in STREAM_LAUNCH[side].items():
        N, K = shapes[name]
        x = torch.randn(rows, K, device=DEVICE, generator=g).bfloat16()
        w = (torch.randn(N, K, device=DEVICE, generator=g) * K**-0.5).bfloat16()
        y = stream_mm(x, w, launch)
        got = y.double().sum(0) if launch[2] > 1 else y.double()
        want = x.double() @ w.double().T
        bound = 2.0**-8 * want.abs() + K * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
        assert ((got - want).abs() <= bound + 1e-6).all(), name


@pytest.mark.parametrize("T", [24, 64])
def test_verify_rows_on_stream_products_match_the_modules(wide, T):
    """q/k/v, o, gate/up, down and the lm_head on stream_mm (TMA-fed weight tiles; q/k/v as partials the RoPE kernel
    sums, o and down as partials the next norm sums), in float32 at the 8B widths: the modules' logits, taps and cache
    writes."""
    model, ft = _fresh(wide)
    fv = FusedVerify(model, ft.cache, taps=(0, 1), stream=FLOAT32_STREAM)
    assert fv.settings(T).stream == FLOAT32_STREAM
    slots = 37 + torch.arange(T, device=DEVICE)
    mask = torch.arange(S, device=DEVICE)[None, :] <= slots[:, None]
    toks = torch.randint(0, 4096, (T,), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(T))
    _against_modules(ft, fv, toks, slots, mask, slots, len(model.model.layers))


def test_bf16_verifies_stream_by_default_up_to_32_rows(wide, monkeypatch):
    """In bf16 on this GPU the fused verify runs its four layer products on stream_mm at 24 rows and none at 64 (the
    launches were measured at 24), and the 24-row logits agree with the same verify on the libraries' products to
    bf16's rounding."""
    import eaglescope.fast.fused_verify as fvm

    model = fuse_projections(copy.deepcopy(wide.model)).bfloat16()
    ft = FastTarget(model, size=S, taps=(0, 1))
    ft.prefill(torch.arange(3, 40, device=DEVICE))
    calls = []
    real = fvm.stream_mm
    monkeypatch.setattr(fvm, "stream_mm", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    fv = FusedVerify(model, ft.cache, taps=(0, 1))
    assert fv.stream == STREAM_LAUNCH["verify"]
    out = {}
    for T in (24, 64):
        slots = 37 + torch.arange(T, device=DEVICE)
        mask = torch.arange(S, device=DEVICE)[None, :] <= slots[:, None]
        toks = torch.randint(0, 4096, (T,), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(T))
        calls.clear()
        out[T] = fv(toks, slots, mask, slots)[0].float().clone()
        assert len(calls) == (4 * len(model.model.layers) if T == 24 else 0)
    lib = FusedVerify(model, ft.cache, taps=(0, 1), stream={})
    slots = 37 + torch.arange(24, device=DEVICE)
    mask = torch.arange(S, device=DEVICE)[None, :] <= slots[:, None]
    toks = torch.randint(0, 4096, (24,), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(24))
    want = lib(toks, slots, mask, slots)[0].float()
    assert (out[24] - want).abs().max() <= 0.05 * want.abs().max()


def test_speculative_decoding_on_stream_products_is_vanilla_greedy(wide, wide_draft, monkeypatch):
    """Every verify and draft product on stream_mm (its launches for float32 tiles in place of the bf16 defaults),
    each round one CUDA graph holding the TMA descriptors: vanilla greedy's tokens."""
    import eaglescope.fast.fused_draft as fdm
    import eaglescope.fast.fused_verify as fvm

    launches = {"verify": FLOAT32_STREAM, "draft": FLOAT32_STREAM}
    monkeypatch.setattr(fvm, "default_stream", lambda kind, w: dict(launches[kind]))
    monkeypatch.setattr(fdm, "default_stream", lambda kind, w: dict(launches[kind]))
    calls = []
    real = fdm.stream_mm
    monkeypatch.setattr(fdm, "stream_mm", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    prompt, n = [5, 17, 300, 41, 2048, 9], 16
    ref = generate_vanilla(wide, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(copy.deepcopy(wide.model), S, taps=(0, 1), fuse=True, float32_logits=True, fused_decode=True,
                    fused_verify=True)  # fmt: skip
    fe = FastEagle(ft, wide_draft, 3, 3, 8, max_len=len(prompt) + n + 2, fused_draft=True)
    assert ft.fused_rows.stream == FLOAT32_STREAM and fe.fused_layer.stream == launches["draft"]
    assert fe.generate(prompt, n).tokens == ref
    assert (64, 64, 1, 2) in calls  # the draft's head ran on stream_mm


def test_speculative_decoding_through_the_fused_target_and_draft_is_vanilla_greedy(wide, wide_draft):
    """Target steps and verifies and the draft layer all on fused kernels, each round one CUDA graph, the prompt
    prefilled as a captured chunk of the fused verify: vanilla greedy's tokens."""
    prompt, n = [5, 17, 300, 41, 2048, 9], 16
    ref = generate_vanilla(wide, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(copy.deepcopy(wide.model), S, taps=(0, 1), fuse=True, float32_logits=True, fused_decode=True,
                    fused_verify=True)  # fmt: skip
    fe = FastEagle(ft, wide_draft, 3, 3, 8, max_len=len(prompt) + n + 2, fused_draft=True)
    assert fe.use_graph and fe.fused_layer is not None
    assert fe.generate(prompt, n).tokens == ref
    assert ft._chunk is not None and ft._chunk.graph is not None  # the prompt went through the captured prefill


def test_a_tree_levels_inputs_in_one_launch_are_the_composed_ones_at_8b_widths(wide, wide_draft, monkeypatch):
    """The one-launch level inputs compiled for this GPU (FusedDraftStep.level_inputs) against the composed
    Eagle3Proposer.level_inputs at every level of an uncaptured decode (4096-wide rows, a 2048-token draft vocabulary
    mapped to the target's): equal tensors and slot_of writes; the decode is vanilla greedy."""
    checked = check_level_inputs(monkeypatch)
    prompt, n = [5, 17, 300, 41, 2048, 9], 16
    ref = generate_vanilla(wide, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(copy.deepcopy(wide.model), S, taps=(0, 1), fuse=True, float32_logits=True, fused_decode=True,
                    fused_verify=True)  # fmt: skip
    fe = FastEagle(ft, wide_draft, 4, 4, 12, max_len=len(prompt) + n + 2, fused_draft=True, use_graph=False)
    assert fe.generate(prompt, n).tokens == ref
    assert set(checked) == {1, 2, 3}


@pytest.mark.parametrize("depth,top_k", [(6, 4), (7, 10)])
def test_a_trees_start_in_one_launch_is_the_composed_one_at_8b_widths(wide, wide_draft, depth, top_k):
    """The one-launch tree start compiled for this GPU (FusedDraftStep.tree_start) at the benchmarks' trees: the
    composed Eagle3Proposer.tree_start's tensors, exactly, also over buffers a round has filled."""
    ft = FastTarget(copy.deepcopy(wide.model), S, taps=(0, 1), fuse=True, float32_logits=True, fused_decode=True,
                    fused_verify=True)  # fmt: skip
    fe = FastEagle(ft, wide_draft, depth, top_k, 24, max_len=30, fused_draft=True)
    assert fe.proposer.pieces.tree_start == fe.fused.tree_start
    check_tree_start(fe, tree_capacity(top_k, depth, wide_draft.config.draft_vocab_size), seed=depth)


@pytest.mark.parametrize("levels,top_k,scores", [(6, 4, "distinct"), (6, 4, "ties"), (6, 4, "nan"), (4, 6, "ties")])
def test_a_trees_finalize_in_one_launch_is_the_composed_one_at_8b_widths(wide, wide_draft, levels, top_k, scores):
    """The one-launch finalize compiled for this GPU (FusedDraftStep.finalize) over builders grown at the draft's
    vocabulary: the composed Eagle3Proposer.finalize's tensors, exactly, for the protocol's tree (85 nodes, 24 kept)
    and a 115-node one keeping every node."""
    ft = FastTarget(copy.deepcopy(wide.model), S, taps=(0, 1), fuse=True, float32_logits=True, fused_decode=True,
                    fused_verify=True)  # fmt: skip
    fe = FastEagle(ft, wide_draft, 6, 4, 24, max_len=30, fused_draft=True)
    assert fe.proposer.pieces.finalize == fe.fused.finalize
    vocab = wide_draft.config.draft_vocab_size
    for total in (24, 200):
        assert check_finalize(fe, top_k, levels, vocab, seed=levels + total, scores=scores, total=total)


def test_the_cli_prefills_vanilla_as_it_prefills_eagle3(wide, wide_draft):
    """`--no-batch-invariant` (fast/run.py fast_runner): vanilla's target runs the fused verify for its prompt as
    EAGLE-3's does, so both methods of a paired bench replay the captured prefill (a 50-token prompt and 16 new
    tokens: vanilla's cache of 67 slots holds the chunk's 64 rows); both outputs are vanilla greedy."""
    prompt, n = [(i * 131) % 4000 + 5 for i in range(50)], 16
    ref = generate_vanilla(wide, prompt, n, stop_ids=[]).token_ids
    for draft, shape in ((None, None), (wide_draft, (3, 3, 8))):
        target = copy.copy(wide)
        target.model, target.taps = copy.deepcopy(wide.model), TapContract((0, 1), 2)
        runner, info = fast_runner(target, draft, shape, len(prompt) + n, batch_invariant=False)
        assert info["fused_decode"] and info["fused_verify"], info
        assert runner.generate(prompt, n).tokens == ref
        assert runner.t._chunk is not None and runner.t._chunk.graph is not None, draft is None


def test_speculative_decoding_under_a_tuning_file_is_vanilla_greedy(wide, wide_draft, tmp_path, monkeypatch):
    """A tuning file as the engine reads it ($EAGLESCOPE_TUNING): the verify's q/k/v, gate/up and lm_head on swapped
    Triton tiles, o and down on cuBLAS in K's halves, flash attention on 32-slot blocks in 2 splits, the draft
    level's o and down in halves; each round one CUDA graph: vanilla greedy's tokens."""
    swapped = [64, 64, 4, 3, 1]
    doc = {"verify": [{"max_rows": 64, "cublas": ["o", "down"], "cublaslt": ["down"], "k_splits": {"o": 2, "down": 2},
                       "blocks": {n: swapped for n in ("qkv", "gate_up", "lm_head")},
                       "flash_launch": [FLASH_LAUNCH[0], 32, *FLASH_LAUNCH[2:4], 2]}],
           "draft": {"k_splits": {"o": 2, "down": 2}}}  # fmt: skip
    (tmp_path / "tuning.json").write_text(json.dumps(doc))
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "tuning.json"))
    prompt, n = [5, 17, 300, 41, 2048, 9], 16
    ref = generate_vanilla(wide, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(copy.deepcopy(wide.model), S, taps=(0, 1), fuse=True, float32_logits=True, fused_decode=True,
                    fused_verify=True)  # fmt: skip
    fe = FastEagle(ft, wide_draft, 3, 3, 8, max_len=len(prompt) + n + 2, fused_draft=True)
    assert ft.fused_rows.settings(8).cublas == ("o", "down") and fe.fused_layer.k_splits == {"o": 2, "down": 2}
    assert fe.use_graph and fe.generate(prompt, n).tokens == ref


def test_this_gpus_tuning_file_is_found_by_its_name(tmp_path, monkeypatch):
    """fast/tuned/<the name torch reports for this GPU>.json, read without $EAGLESCOPE_TUNING."""
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.delenv(tuning.ENV, raising=False)
    name = torch.cuda.get_device_name(DEVICE)
    assert tuning.tuning_for(DEVICE) is tuning.BUILT_IN
    path = tuning.device_file(name)
    assert path.parent == tmp_path and " " not in path.name
    path.write_text(json.dumps({"device": name, "draft": {"k_splits": {"down": 2}}}))
    found = tuning.tuning_for(DEVICE)
    assert found.path == str(path) and found.draft_k_splits == {"down": 2}
