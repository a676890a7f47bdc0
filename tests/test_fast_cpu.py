"""The static-shape backend run eagerly on the CPU. Both backends drive the one round (decode/round.py, the draft
side in Eagle3Proposer): these tests prove the static one runs it exactly as the reference one does, with the static
backend's own parts (slot caches, padded catch-up, the KV keep by moving slots, queued rounds, compiled pieces)."""

from __future__ import annotations

import shutil

import pytest
import torch
from drafts import make_draft
from hypothesis import given, settings
from hypothesis import strategies as st
from models import make_checkpoint
from tolerance import assert_close_float32

from eaglescope.decode.loop import generate_speculative
from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.decode.tree import DraftTree
from eaglescope.decode.vanilla import generate_vanilla
from eaglescope.decode.verify import verify_greedy
from eaglescope.fast import FastEagle, FastTarget, FastVanilla, accept_greedy
from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract


@st.composite
def trees_and_logits(draw):
    n = draw(st.integers(1, 14))
    V = 4  # a tiny vocabulary, so drafted tokens often equal the argmax and paths get accepted
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, V - 1)) for _ in range(n)]
    best = [draw(st.integers(0, V - 1)) for _ in range(n)]
    return tokens, parents, best, V


def _deepest_matching_path(tokens, parents, best) -> list[int]:
    """Greedy acceptance by enumeration: every node's root path, kept when each token is the target's argmax at its
    parent; the deepest wins, the first in node order among equals."""
    winner: list[int] = [0]
    for node in range(1, len(tokens)):
        path = [node]
        while parents[path[-1]] > 0:
            path.append(parents[path[-1]])
        path = [0, *path[::-1]]
        if all(tokens[c] == best[p] for p, c in zip(path, path[1:])) and len(path) > len(winner):
            winner = path
    return winner


@settings(max_examples=200, deadline=None)
@given(trees_and_logits())
def test_accept_greedy_is_the_deepest_matching_path(case):
    """The one greedy acceptance (both backends, verify_greedy on the host) against enumerating every root path, on
    trees in any node order (parents precede children only)."""
    tokens, parents, best, V = case
    tree = DraftTree.from_parents(tokens, parents)
    want = _deepest_matching_path(tokens, parents, best)
    a, path, bonus = accept_greedy(
        tree.tokens, tree.parents, tree.depths, tree.ancestor_mask(), torch.tensor(best), max(tree.max_depth, 1)
    )
    assert path[: int(a) + 1].tolist() == want
    assert int(bonus) == best[want[-1]]
    logits = torch.nn.functional.one_hot(torch.tensor(best), V).float()
    ref = verify_greedy(tree, logits)
    assert ref.path == want and ref.tokens == [tokens[c] for c in want[1:]] + [best[want[-1]]]


def test_accept_greedy_force_picks_a_path_of_that_depth():
    tree = DraftTree.from_parents([5, 1, 2, 3, 4], [-1, 0, 0, 1, 3])
    best = torch.tensor([9, 9, 9, 9, 9])  # nothing matches
    a, path, _ = accept_greedy(tree.tokens, tree.parents, tree.depths, tree.ancestor_mask(), best, 3)
    assert int(a) == 0
    a, path, _ = accept_greedy(
        tree.tokens, tree.parents, tree.depths, tree.ancestor_mask(), best, 3, force=torch.tensor([2])
    )
    assert int(a) == 2 and path[:3].tolist() == [0, 1, 3]


def _setup(tmp_path, seed=0):
    ckpt = make_checkpoint("llama", tmp_path / "t", seed=seed)
    tgt = load_target(ckpt, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(ckpt, taps=tgt.taps, seed=seed + 1, scale=1.0)
    draft.load_target_embedding(target_embedding(tgt))
    return tgt, draft


def test_fast_vanilla_equals_reference(tiny):
    tgt, _ = tiny
    prompt = [3, 17, 5, 40, 22, 9]
    ref = generate_vanilla(tgt, prompt, 24, stop_ids=[])
    fast = FastVanilla(FastTarget(tgt.model, size=64), 24).generate(prompt)
    assert fast.tokens == ref.token_ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("fe"))


@pytest.mark.parametrize("shape", [(4, 1, 5), (3, 3, 8), (1, 4, 3)])
def test_fast_eagle_round_equals_reference_loop(tiny, shape):
    tgt, draft = tiny
    torch.manual_seed(shape[2])
    prompt = torch.randint(0, 96, (7,)).tolist()
    n = 24
    ref_prop = Eagle3Proposer(draft, *shape, max_len=len(prompt) + n + 2)
    ref = generate_speculative(tgt, ref_prop, prompt, n, stop_ids=[])
    ft = FastTarget(tgt.model, size=len(prompt) + n + 2 * shape[2] + 8, taps=tgt.taps.layers)
    fast = FastEagle(ft, draft, *shape, max_len=len(prompt) + n + 2).generate(prompt, n)
    assert fast.tokens == ref.token_ids
    # same rounds with the same acceptance (the reference stops mid-round at the budget)
    assert fast.accepted[: len(ref.stats.accepted)] == ref.stats.accepted
    assert fast.tokens == generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids


def test_fast_eagle_replay_forces_acceptance(tiny):
    """Replay mode: the forced acceptance lengths are what the rounds accept (a chain always has the depth)."""
    tgt, draft = tiny
    prompt = [3, 17, 5, 40, 22, 9]
    ft = FastTarget(tgt.model, size=80, taps=tgt.taps.layers)
    fe = FastEagle(ft, draft, 4, 1, 5, max_len=60, replay=True)
    out = fe.generate(prompt, 20, replay=[3, 1, 0, 2])
    assert out.accepted[:4] == [3, 1, 0, 2]
    assert len(out.tokens) == 20


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_projections_match_separate_ones(tmp_path, family):
    """q/k/v and gate/up fused into one matmul each: same logits, taps and draft step (bias, qk-norm included)."""
    from eaglescope.models.targets.llama import fuse_projections

    ckpt = make_checkpoint(family, tmp_path / family, seed=3)
    tgt = load_target(ckpt, device="cpu", dtype=torch.float32)
    taps = TapContract.default(tgt.num_layers).layers
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(11).expand(2, 11)
    ref_logits, ref_aux, _ = tgt.model(ids, pos, None, taps=taps)
    fuse_projections(tgt.model)
    assert tgt.model.model.layers[0].self_attn.qkv_proj is not None
    assert tgt.model.model.layers[0].mlp.gate_up_proj is not None
    logits, aux, _ = tgt.model(ids, pos, None, taps=taps)
    depth = tgt.num_layers + 1
    assert_close_float32(logits, ref_logits, depth, key="logits")
    assert_close_float32(aux, ref_aux, depth, key="aux")

    draft, _ = make_draft(ckpt, seed=4)
    emb, hid = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]

    def run_step(d):
        cache = d.new_cache(1, 8)
        return d.logits(d.step(emb, hid, torch.arange(5)[None], cache, 0, mask))

    ref = run_step(draft)
    fuse_projections(draft)
    assert_close_float32(run_step(draft), ref, depth=2, key="draft logits")


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_fast_eagle_with_fused_weights_equals_vanilla(tmp_path, attention):
    tgt, draft = _setup(tmp_path, seed=5)
    from eaglescope.fast.engine import use_matmul_attention
    from eaglescope.models.targets.llama import fuse_projections

    prompt = [3, 17, 5, 40, 22, 9, 11]
    n = 24
    ref = generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(tgt.model, size=len(prompt) + n + 40, taps=tgt.taps.layers, fuse=True)
    fuse_projections(draft)
    if attention == "matmul":
        use_matmul_attention(tgt.model)
        use_matmul_attention(draft)
        assert FastVanilla(ft, n).generate(prompt).tokens == ref
    fast = FastEagle(ft, draft, 3, 3, 8, max_len=len(prompt) + n + 2).generate(prompt, n)
    assert fast.tokens == ref
    assert sum(fast.accepted) > 0  # a random draft still gets some tokens accepted on this tiny vocabulary


def test_fast_eagle_rounds_queued_ahead_of_the_read_change_nothing(tmp_path):
    """The next round is queued before this one's report is read. A stop in the middle leaves one round run past
    it: the output still ends at the stop, and the next call on the same decoder is vanilla greedy again; with
    room for one more round everywhere (large max_len) or almost nowhere (tight), the tokens are the same."""
    tgt, draft = _setup(tmp_path, seed=5)
    prompt, n = [3, 17, 5, 40, 22, 9, 11], 30
    ref = generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(tgt.model, size=len(prompt) + n + 80, taps=tgt.taps.layers)
    loose = FastEagle(ft, draft, 3, 3, 8, max_len=len(prompt) + n + 30)
    stop = ref[9]
    cut = loose.generate(prompt, n, stop={stop})
    assert cut.tokens == ref[: ref.index(stop) + 1]
    assert loose.generate(prompt, n).tokens == ref
    tight = FastEagle(ft, draft, 3, 3, 8, max_len=len(prompt) + n)
    assert tight.generate(prompt, n).tokens == ref
    with pytest.raises(ValueError, match="exceed max_len"):
        tight.generate(prompt, n + 1)


def test_gemv_linear_matches_linear():
    from eaglescope.fast.layers import GemvLinear

    torch.manual_seed(0)
    for bias in (False, True):
        lin = torch.nn.Linear(48, 20, bias=bias)
        g = GemvLinear(lin)
        for shape in ((1, 1, 48), (1, 48), (2, 3, 48)):
            x = torch.randn(shape)
            assert_close_float32(g(x), lin(x))
    from eaglescope.fast.layers import use_gemv_reductions

    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4, bias=False))
    use_gemv_reductions(seq)
    assert all(isinstance(m, GemvLinear) for m in seq)
    use_gemv_reductions(seq, enable=False)
    assert all(type(m) is torch.nn.Linear for m in seq) and seq(torch.randn(2, 8)).shape == (2, 4)


@pytest.mark.parametrize("depth", [2, 5])
def test_compiled_draft_side_is_seven_graphs_at_any_depth(tiny, depth):
    """`--compile`'s draft side is a few graphs per tree budget, not one per level: the tree's buffers are sized once
    and the level is a tensor, so one compiled tree level runs at every depth and a deeper tree compiles no more (the
    count also fails on a graph break). The compiled rounds decode as the plain ones do (dynamo's eager backend)."""
    from torch._dynamo.utils import counters

    tgt, draft = tiny
    prompt, n = [3, 17, 5, 40, 22, 9], 16

    def run(compiled: bool):
        ft = FastTarget(tgt.model, size=len(prompt) + n + 40, taps=tgt.taps.layers)
        fe = FastEagle(ft, draft, depth, 3, 8, max_len=len(prompt) + n + 2)
        if compiled:
            fe.compile_draft(backend="eager")
        return fe.generate(prompt, n)

    plain = run(False)
    torch._dynamo.reset()
    counters.clear()
    compiled = run(True)
    assert (compiled.tokens, compiled.accepted) == (plain.tokens, plain.accepted)
    # the tree's start, catch-up, the root's log-probs, the tree level, the root's and a level's expansion, the rerank
    assert counters["stats"]["unique_graphs"] == 7
    torch._dynamo.reset()


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_fast_path_equals_vanilla(tmp_path):
    """Everything the GPU benchmark turns on — fused weights, compiled layers, products as reductions, the
    compiled draft side of a round — still decodes exactly like the reference (inductor's CPU backend)."""
    from eaglescope.fast.layers import compile_layers, use_gemv_reductions
    from eaglescope.models.targets.llama import fuse_projections

    torch._dynamo.reset()
    tgt, draft = _setup(tmp_path, seed=5)
    prompt = [3, 17, 5, 40, 22, 9, 11]
    n = 16
    ref = generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids
    ft = FastTarget(tgt.model, size=len(prompt) + n + 40, taps=tgt.taps.layers, fuse=True, compile=True)
    use_gemv_reductions(tgt.model.model.layers)
    assert FastVanilla(ft, n).generate(prompt).tokens == ref
    compile_layers([fuse_projections(draft).midlayer])
    fe = FastEagle(ft, draft, 3, 3, 8, max_len=len(prompt) + n + 2, compile=True)
    out = fe.generate(prompt, n)
    assert fe.compiled  # the compiled round ran (no fallback)
    assert out.tokens == ref
    torch._dynamo.reset()


def test_float32_logits_head_matches_upcast_product():
    from eaglescope.fast.layers import Float32Logits

    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 50, bias=False).to(torch.bfloat16)
    head = Float32Logits(lin)
    x = torch.randn(2, 3, 32).to(torch.bfloat16)
    y = head(x)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 50)
    torch.testing.assert_close(y, x.float() @ lin.weight.float().t(), rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.sampled_from([(4, 4), (4, 2), (6, 1)]), st.integers(1, 12), st.integers(0, 10**6))
def test_matmul_attention_equals_sdpa(T, heads, extra, seed):
    """The decoding form of attention (two products + softmax) against SDPA, grouped-query heads, random masks
    with at least one visible key per query."""
    from eaglescope.models.targets.llama import attend

    H, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    S = T + extra
    q = torch.randn(1, H, T, 16, generator=g)
    k, v = torch.randn(1, Hkv, S, 16, generator=g), torch.randn(1, Hkv, S, 16, generator=g)
    mask = torch.rand(1, 1, T, S, generator=g) < 0.6
    mask[..., 0] = True
    assert_close_float32(attend(q, k, v, mask, "matmul"), attend(q, k, v, mask))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([300, 1024, 16384, 128256, 977]),
    levels=st.integers(2, 6),
    seed=st.integers(0, 999),
)
def test_argmax_rows_is_torch_argmax_ties_included(rows, vocab, levels, seed):
    """Few distinct values, so maxima repeat within and across chunks: the first one wins, as in torch.argmax."""
    from eaglescope.fast.layers import argmax_rows

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, vocab), generator=g).float()
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    y = torch.randn(rows, vocab, generator=g).to(torch.bfloat16)
    assert torch.equal(argmax_rows(y), y.argmax(-1))
