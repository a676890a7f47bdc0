import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglescope.decode.tree import EAGLE_DEFAULT_TREE, DraftTree, TreeBuilder, top_k_rows
from eaglescope.errors import EagleScopeError


@st.composite
def parent_arrays(draw, max_nodes=24):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@settings(max_examples=80, deadline=None)
@given(parent_arrays(), st.integers(0, 1000))
def test_mask_positions_paths_match_brute_force(parents, offset):
    n = len(parents)
    tree = DraftTree.from_parents(torch.arange(n) % 7, parents)
    mask = tree.ancestor_mask()
    for i in range(n):
        anc = ancestors(parents, i)
        assert {j for j in range(n) if mask[i, j]} == anc
        assert int(tree.positions(offset)[i]) == offset + len(anc) - 1
    assert tree.max_depth == int(tree.depths.max())
    paths = tree.paths()
    leaves = [i for i in range(n) if i not in parents]
    assert [p[-1] for p in paths] == leaves
    for path in paths:
        assert path[0] == 0
        assert all(parents[b] == a for a, b in zip(path, path[1:], strict=False))
    assert set().union(*map(set, paths)) == set(range(n))
    for i in range(n):
        assert tree.children(i) == [c for c in range(n) if parents[c] == i]


def test_validate_rejects_bad_trees():
    with pytest.raises(EagleScopeError):
        DraftTree.from_parents([1, 2, 3], [-1, 2, 0])  # parent after child
    good = DraftTree.from_parents([1, 2, 3], [-1, 0, 1])
    bad = DraftTree(good.tokens, good.parents, torch.tensor([0, 1, 1]), good.scores)
    with pytest.raises(EagleScopeError):
        bad.validate()
    with pytest.raises(EagleScopeError):
        DraftTree(good.tokens, torch.tensor([0, 0, 1]), good.depths, good.scores).validate()


def test_chain_scores_and_probs():
    q = torch.full((3, 4), 0.25)
    tree = DraftTree.chain([5, 1, 2], draft_probs=q[:2])
    assert tree.parents.tolist() == [-1, 0, 1] and tree.depths.tolist() == [0, 1, 2]
    assert tree.draft_probs.shape == (3, 4)
    torch.testing.assert_close(tree.scores, torch.tensor([0.0, 1, 2]) * torch.tensor(0.25).log())
    assert tree.paths() == [[0, 1, 2]]


def logprob_row(path, vocab):
    """Draft log-probs as a deterministic function of the token path (so frontier order is irrelevant)."""
    seed = int.from_bytes(hashlib.sha256(repr(path).encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g, dtype=torch.float64).mul(2).log_softmax(-1)


def reference_eagle2(root, vocab, top_k, depth, total):
    """Brute-force EAGLE-2 over token paths, in plain Python."""
    scores = {(root,): 0.0}
    frontier = [(root,)]
    for _ in range(depth):
        new = []
        for path in frontier:
            row = logprob_row(path, vocab).tolist()
            for tok in sorted(range(vocab), key=lambda t: -row[t])[:top_k]:
                scores[path + (tok,)] = scores[path] + row[tok]
                new.append(path + (tok,))
        frontier = sorted(new, key=lambda p: -scores[p])[:top_k]
    cands = sorted((p for p in scores if len(p) > 1), key=lambda p: -scores[p])
    return {(root,)} | set(cands[: total - 1])


def builder_paths(builder, ids):
    tok, par = builder.tokens.tolist(), builder.parents.tolist()
    out = []
    for i in ids:
        path = []
        while i >= 0:
            path.append(tok[i])
            i = par[i]
        out.append(tuple(path[::-1]))
    return out


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 9), st.integers(1, 5), st.integers(1, 5), st.integers(1, 40), st.sampled_from([4, 9, 16]))
def test_tree_builder_matches_brute_force_eagle2(root, top_k, depth, total, vocab):
    b = TreeBuilder(root, top_k, "cpu", levels=depth, vocab=vocab)
    frontier = torch.tensor([0])
    for _ in range(depth):
        rows = torch.stack([logprob_row(p, vocab) for p in builder_paths(b, frontier.tolist())])
        frontier = b.expand(frontier, rows)
        # frontier is best-first and its scores are the best among the newest level
        fs = b.scores[frontier]
        assert bool((fs[:-1] >= fs[1:]).all())
    par = b.parents.tolist()
    mask = b.ancestor_mask(torch.arange(b.num_nodes))  # the draft's own tree attention while expanding
    for i in range(b.num_nodes):
        assert set(mask[i].nonzero().flatten().tolist()) == ancestors(par, i)
    tree = b.finalize(total, check=True)  # check: also compares the precomputed mask with a walk
    ref = reference_eagle2(root, vocab, top_k, depth, total)
    got = builder_paths(b, tree.source.tolist())
    assert len(got) == tree.num_nodes == len(ref) == min(total, b.num_nodes)
    assert set(got) == ref
    # tree tokens/depths/scores agree with the builder rows they came from; parents precede children
    assert tree.tokens.tolist() == [p[-1] for p in got]
    assert tree.depths.tolist() == [len(p) - 1 for p in got]
    assert all(tree.parents[i] < i for i in range(1, tree.num_nodes))
    for i in range(1, tree.num_nodes):
        assert got[int(tree.parents[i])] == got[i][:-1]  # connected: the parent's path is a prefix
    # order: by depth, then score descending
    key = list(zip(tree.depths.tolist(), (-tree.scores).tolist(), strict=True))
    assert key == sorted(key)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6),
    st.sampled_from([2048, 32000, 128 * 37, 300 * 7]),
    st.integers(1, 12),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_top_k_rows_is_topk(m, vocab, k, seed, coarse):
    """The two-pass top-k gives torch.topk's values, best first, at indices that hold them (coarse values make ties,
    where the indices may differ but must still be distinct and hold the same values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, vocab, generator=g)
    if coarse:
        x = (x * 2).round() / 2
    vals, ids = top_k_rows(x, k)
    ref_vals, ref_ids = x.topk(k, dim=-1)
    assert vals.shape == ids.shape == (m, k)
    assert torch.equal(vals, ref_vals)
    assert torch.equal(x.gather(1, ids), vals)
    assert all(len(set(r)) == k for r in ids.tolist())
    if not coarse:  # no ties among the top (random floats): the very same indices
        assert torch.equal(ids, ref_ids)
    vals3, ids3 = top_k_rows(x[None], k)
    assert torch.equal(vals3[0], vals) and torch.equal(ids3[0], ids)


def test_finalize_stays_connected_on_score_ties():
    # certain children (log-prob 0) tie with their parents; the shallower must win the tie
    b = TreeBuilder(0, 2, "cpu", levels=3, vocab=4)
    lp = torch.full((1, 4), float("-inf"))
    lp[0, 1] = 0.0
    lp[0, 2] = -1.0
    f = b.expand(torch.tensor([0]), lp)
    certain = torch.full((2, 4), float("-inf"))
    certain[:, 3] = 0.0
    certain[:, 0] = -5.0
    f = b.expand(f, certain)
    b.expand(f, certain)
    for total in range(1, b.num_nodes + 1):
        tree = b.finalize(total, check=True)  # would raise if a kept node lost its parent
        assert tree.num_nodes == total


def test_finalize_stays_connected_under_a_nan_draft_row():
    """A draft row of NaN log-probs (a broken draft) gives its children NaN scores under a parent with a number:
    ranked as -inf they are kept last, after their parent, so every total still finalizes to a connected tree."""
    b = TreeBuilder(0, 2, "cpu", levels=3, vocab=4)
    f = b.expand(torch.tensor([0]), torch.tensor([[-0.1, -3.0, -2.0, -4.0]]))
    f = b.expand(f, torch.tensor([[float("nan")] * 4, [-0.5, -1.0, -2.0, -3.0]]))
    b.expand(f, torch.log_softmax(torch.arange(8.0).reshape(2, 4), -1))
    nan_nodes = b.scores[: b.num_nodes].isnan()
    assert nan_nodes.any() and not nan_nodes[b.parents[: b.num_nodes][nan_nodes]].all()  # a parent with a number
    for total in range(1, b.num_nodes + 1):
        tree = b.finalize(total, check=True)  # would raise if a kept node lost its parent
        assert tree.num_nodes == total
        kept_nan = tree.scores.isnan()
        if kept_nan.any():  # only once every node with a number is in
            assert int((~kept_nan).sum()) == int((~nan_nodes).sum())


def test_eagle_default_tree_shape():
    depth, top_k, total = EAGLE_DEFAULT_TREE
    assert (depth, top_k, total) == (7, 10, 60)
    g = torch.Generator().manual_seed(0)
    b = TreeBuilder(1, top_k, "cpu", levels=depth, vocab=100)
    frontier = torch.tensor([0])
    for _ in range(depth):
        frontier = b.expand(frontier, torch.randn(len(frontier), 100, generator=g).log_softmax(-1))
        assert len(frontier) == top_k
    assert b.num_nodes == 1 + top_k + (depth - 1) * top_k * top_k
    tree = b.finalize(total, check=True)
    assert tree.num_nodes == total and tree.max_depth <= depth
    mask = b.ancestor_mask(tree.source)
    assert mask.shape == (total, b.num_nodes)
    assert mask.sum(1).tolist() == (tree.depths + 1).tolist()
