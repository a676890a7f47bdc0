"""Verification is lossless: the emitted tokens are distributed exactly as vanilla sampling's.

The target is a Markov chain over a 5-token vocabulary (its logits depend only on the last token),
so the exact law of the first two emitted tokens is known in closed form and a chi-square test
compares it with thousands of speculative rounds. Broken verifiers fail the same test.
"""

import pytest
import torch
from scipy.stats import chisquare

from eaglescope.decode.sampling import process_logits, sample
from eaglescope.decode.tree import DraftTree, TreeBuilder
from eaglescope.decode.verify import VerifyResult, verify_greedy, verify_sampling
from eaglescope.errors import EagleScopeError

V = 5
ROOT = 1
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(7)) * 0.8  # target logits given last token
DRAFT_Q = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(8)) * 1.5, -1)  # q(next | last)


# ---------------------------------------------------------------- process_logits / sample


def test_process_logits_order_temperature_topk_topp():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    torch.testing.assert_close(process_logits(logits, 1.0), torch.softmax(logits, -1))
    torch.testing.assert_close(process_logits(logits, 2.0), torch.softmax(logits / 2, -1))
    assert process_logits(logits, 0.0).tolist() == [[0, 0, 0, 0, 1]]
    top3 = process_logits(logits, 1.0, top_k=3)
    torch.testing.assert_close(top3, torch.softmax(torch.tensor([[-1e9, -1e9, 2.0, 3, 4]]), -1))
    # softmax([2,3,4]) = [.090, .245, .665]: p=0.6 keeps {4}; p=0.7 keeps {4,3}; p=0.95 keeps all three
    assert (process_logits(logits, 1.0, 3, 0.6) > 0).tolist() == [[False, False, False, False, True]]
    assert (process_logits(logits, 1.0, 3, 0.7) > 0).tolist() == [[False, False, False, True, True]]
    assert (process_logits(logits, 1.0, 3, 0.95) > 0).sum() == 3
    # temperature before top-p: a high temperature flattens, so nucleus 0.8 needs more tokens
    assert (process_logits(logits, 1.0, None, 0.8) > 0).sum() == 2
    assert (process_logits(logits, 5.0, None, 0.8) > 0).sum() == 4
    # the top token always survives, even with a tiny p
    assert process_logits(logits, 1.0, None, 1e-6).tolist() == [[0, 0, 0, 0, 1]]
    for t, k, p in [(0.7, 2, 0.9), (1.3, None, 0.5), (1.0, 4, None)]:
        torch.testing.assert_close(process_logits(torch.randn(3, 4, V), t, k, p).sum(-1), torch.ones(3, 4))


def full_vocab_reference(logits, temperature, top_k, top_p):
    """The textbook recipe on the whole vocabulary: mask below the k-th logit, softmax, nucleus by full sort."""
    logits = logits / temperature
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[..., -1:], float("-inf"))
    probs = logits.softmax(-1)
    if top_p:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop[..., 0] = False
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, None, None), (0.7, 50, 0.9), (1.3, None, 0.5), (0.5, 200, 0.3)]
)
def test_process_logits_matches_full_vocab_reference(temperature, top_k, top_p):
    logits = torch.randn(7, 1000, generator=torch.Generator().manual_seed(2)) * 3
    expected = full_vocab_reference(logits, temperature, top_k, top_p)
    torch.testing.assert_close(process_logits(logits, temperature, top_k, top_p), expected)


def test_process_logits_rejects_bad_settings():
    for kwargs in [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)]:
        with pytest.raises(EagleScopeError):
            process_logits(torch.zeros(1, V), **{"temperature": 1.0, **kwargs})


def test_sample_follows_probs():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(20000, V), g)
    counts = torch.bincount(draws, minlength=V)
    assert counts[4] == 0
    assert chisquare(counts[:4].double().numpy(), (probs[:4] * 20000).double().numpy()).pvalue > 1e-3


# ---------------------------------------------------------------- greedy


def tree_of(tokens, parents):
    return DraftTree.from_parents(tokens, parents, scores=-torch.arange(len(tokens), dtype=torch.float))


def logits_with_argmax(best):
    """Target logits whose argmax at node i is best[i]."""
    out = torch.zeros(len(best), V)
    out[torch.arange(len(best)), torch.tensor(best)] = 3.0
    return out


def test_greedy_always_accepted_chain():
    tree = DraftTree.chain([ROOT, 2, 3, 4])
    res = verify_greedy(tree, logits_with_argmax([2, 3, 4, 0]))
    assert res == VerifyResult(accepted=[1, 2, 3], bonus=0, tokens=[2, 3, 4, 0])


def test_greedy_never_accepted():
    tree = tree_of([ROOT, 2, 3, 4], [-1, 0, 0, 1])
    res = verify_greedy(tree, logits_with_argmax([0, 4, 4, 4]))
    assert res == VerifyResult(accepted=[], bonus=0, tokens=[0])
    assert res.last_node == 0 and res.path == [0]


def test_greedy_sometimes_accepted_takes_matching_branch():
    #        0(root)
    #      /    |    \
    #    1:2   2:3   3:3(dup)
    #     |     |  \
    #   4:0   5:1  6:4
    #               |
    #              7:0
    tree = tree_of([ROOT, 2, 3, 3, 0, 1, 4, 0], [-1, 0, 0, 0, 1, 2, 2, 6])
    # argmax: root->3, node2->4, node6->2 (node 7 holds 0: rejected)
    res = verify_greedy(tree, logits_with_argmax([3, 0, 4, 0, 0, 0, 2, 0]))
    assert res.accepted == [2, 6] and res.bonus == 2 and res.tokens == [3, 4, 2]
    assert res.last_node == 6


def test_greedy_duplicate_siblings_take_the_deepest_match():
    # root children 2 (leaf) and 2 (with child 3): both match, the second goes deeper
    tree = tree_of([ROOT, 2, 2, 3], [-1, 0, 0, 2])
    res = verify_greedy(tree, logits_with_argmax([2, 3, 3, 4]))
    assert res.accepted == [2, 3] and res.tokens == [2, 3, 4]


def test_sampling_at_temperature_zero_is_greedy():
    tree = tree_of([ROOT, 2, 3, 3, 0, 1, 4, 0], [-1, 0, 0, 0, 1, 2, 2, 6])
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1))
    assert verify_sampling(tree, logits, temperature=0.0) == verify_greedy(tree, logits)


def test_verify_rejects_mismatched_logits():
    with pytest.raises(EagleScopeError):
        verify_greedy(DraftTree.chain([1, 2]), torch.zeros(3, V))


# ---------------------------------------------------------------- losslessness by chi-square


def target_probs_given(last, temperature=1.0, top_k=None, top_p=None):
    return process_logits(TABLE[last], temperature, top_k, top_p)


def exact_pair_law(**settings):
    first = target_probs_given(ROOT, **settings).double()
    return torch.stack([first[a] * target_probs_given(a, **settings).double() for a in range(V)])  # [V, V]


def random_topk_tree(root, g):
    """A deterministic (q=1) draft tree with 3 root children and 2 grandchildren each; duplicates likely."""
    parents = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
    tokens = [root] + torch.randint(0, V, (9,), generator=g).tolist()
    scores = torch.cat([torch.zeros(1), -torch.rand(9, generator=g) - torch.tensor(parents[1:]).clamp(max=1)])
    return DraftTree.from_parents(tokens, parents, scores)


def fixed_duplicate_tree(root, g):
    """Root children 2, 2, 0, 2 (duplicates on the likeliest tokens), a chain below the first."""
    return DraftTree.from_parents([root, 2, 2, 0, 2, 3, 3], [-1, 0, 0, 0, 0, 1, 5], [0, -1, -1.1, -1.2, -1.3, -2, -3])


def sampled_chain(root, g, depth=3):
    tokens, rows = [root], []
    for _ in range(depth):
        rows.append(DRAFT_Q[tokens[-1]])
        tokens.append(int(torch.multinomial(rows[-1], 1, generator=g)))
    return DraftTree.chain(tokens, torch.stack(rows))


def sampled_siblings(root, g):
    """SpecInfer-style: 3 i.i.d. draws from q at the root, one sampled child under each."""
    tokens, parents, rows = [root], [-1], [DRAFT_Q[root]]
    for _ in range(3):
        tokens.append(int(torch.multinomial(DRAFT_Q[root], 1, generator=g)))
        parents.append(0)
        rows.append(DRAFT_Q[tokens[-1]])
    for parent in (1, 2, 3):
        tokens.append(int(torch.multinomial(DRAFT_Q[tokens[parent]], 1, generator=g)))
        parents.append(parent)
        rows.append(torch.zeros(V))
    return DraftTree.from_parents(tokens, parents, draft_probs=torch.stack(rows))


def first_two_tokens(verifier, make_tree, settings, n, seed):
    """Run rounds of speculative decoding from ROOT; return counts [V, V] of the first two emitted tokens."""
    g_verify = torch.Generator().manual_seed(seed)
    g_draft = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(V, V, dtype=torch.long)
    for _ in range(n):
        tree = make_tree(ROOT, g_draft)
        out = verifier(tree, TABLE[tree.tokens], generator=g_verify, **settings).tokens
        if len(out) < 2:  # the second token comes from the next round, rooted at the bonus token
            tree = make_tree(out[0], g_draft)
            out = out + verifier(tree, TABLE[tree.tokens], generator=g_verify, **settings).tokens
        counts[out[0], out[1]] += 1
    return counts


def chi2_pvalue(counts, law):
    counts, law = counts.flatten().double(), law.flatten()
    assert counts[law == 0].sum() == 0, "emitted a token the target gives probability 0"
    support = law > 0
    expected = law[support] / law[support].sum() * counts.sum()
    assert expected.min() >= 5, "test setup: too few expected counts for chi-square"
    return chisquare(counts[support].numpy(), expected.numpy()).pvalue


N_PAIRS = 3000

LOSSLESS_CASES = {
    "topk_tree": (random_topk_tree, dict(temperature=1.0)),
    "duplicate_siblings": (fixed_duplicate_tree, dict(temperature=1.0)),
    "topk_tree_with_top_k_top_p": (random_topk_tree, dict(temperature=0.8, top_k=4, top_p=0.9)),
    "sampled_chain": (sampled_chain, dict(temperature=1.0)),
    "sampled_iid_siblings": (sampled_siblings, dict(temperature=1.0)),
}


@pytest.mark.parametrize("case", list(LOSSLESS_CASES))
def test_verify_sampling_is_lossless_for_first_two_tokens(case):
    make_tree, settings = LOSSLESS_CASES[case]
    counts = first_two_tokens(verify_sampling, make_tree, settings, N_PAIRS, seed=11)
    law = exact_pair_law(**settings)
    assert chi2_pvalue(counts, law) > 1e-3
    # and the marginal of the first token alone
    assert chi2_pvalue(counts.sum(1, keepdim=True), law.sum(1, keepdim=True)) > 1e-3


# Broken verifiers: each makes one classic mistake; the same check must catch it.


def accept_first_path(tree, logits, temperature, generator, top_k=None, top_p=None):
    """Bug: accepts the best child at every level without looking at the target."""
    kids, cur, accepted = tree.children_lists(), 0, []
    while kids[cur]:
        cur = kids[cur][0]
        accepted.append(cur)
    bonus = int(sample(process_logits(logits[cur], temperature, top_k, top_p), generator))
    return VerifyResult(accepted, bonus, tree.tokens[accepted].tolist() + [bonus])


def no_residual_siblings(tree, logits, temperature, generator, top_k=None, top_p=None):
    """Bug: tries siblings with the full p each time and, after all reject, samples from p (no residual)."""
    p = process_logits(logits, temperature, top_k, top_p)
    kids, tokens, cur, accepted = tree.children_lists(), tree.tokens.tolist(), 0, []
    while True:
        nxt = next((c for c in kids[cur] if float(torch.rand((), generator=generator)) < p[cur, tokens[c]]), None)
        if nxt is None:
            break
        accepted.append(nxt)
        cur = nxt
    bonus = int(sample(p[cur], generator))
    return VerifyResult(accepted, bonus, [tokens[c] for c in accepted] + [bonus])


def resample_from_p_on_reject(tree, logits, temperature, generator, top_k=None, top_p=None):
    """Bug: a sampled chain that, on rejection, draws from p instead of norm(max(p - q, 0))."""
    p = process_logits(logits, temperature, top_k, top_p)
    q, tokens, cur, accepted = tree.draft_probs, tree.tokens.tolist(), 0, []
    for c in range(1, tree.num_nodes):
        if float(torch.rand((), generator=generator)) * q[cur, tokens[c]] >= p[cur, tokens[c]]:
            break
        accepted.append(c)
        cur = c
    bonus = int(sample(p[cur], generator))
    return VerifyResult(accepted, bonus, [tokens[c] for c in accepted] + [bonus])


BROKEN_CASES = {
    "accept_always_topk_tree": (accept_first_path, random_topk_tree),
    "accept_always_chain": (accept_first_path, sampled_chain),
    "no_residual_duplicate_siblings": (no_residual_siblings, fixed_duplicate_tree),
    "resample_from_p_chain": (resample_from_p_on_reject, sampled_chain),
}


@pytest.mark.parametrize("case", list(BROKEN_CASES))
def test_chi_square_catches_broken_verifiers(case):
    verifier, make_tree = BROKEN_CASES[case]
    counts = first_two_tokens(verifier, make_tree, dict(temperature=1.0), N_PAIRS, seed=11)
    assert chi2_pvalue(counts, exact_pair_law(temperature=1.0)) < 1e-6


def test_builder_tree_verifies_losslessly_at_first_token():
    """End to end on a TreeBuilder tree (q = 1, siblings in score order): first token ~ target."""
    g_verify = torch.Generator().manual_seed(3)
    counts = torch.zeros(V, dtype=torch.long)
    b = TreeBuilder(ROOT, 3, "cpu", levels=2, vocab=V)
    frontier = b.expand(torch.tensor([0]), DRAFT_Q[ROOT].log()[None])
    frontier = b.expand(frontier, DRAFT_Q[b.tokens[frontier]].log())
    tree = b.finalize(8, check=True)
    logits = TABLE[tree.tokens]
    for _ in range(4000):
        counts[verify_sampling(tree, logits, generator=g_verify).tokens[0]] += 1
    assert chi2_pvalue(counts[:, None], target_probs_given(ROOT).double()[:, None]) > 1e-3


def test_sampled_chain_from_the_target_itself_is_always_accepted():
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        tokens, rows = [ROOT], []
        for _ in range(4):
            rows.append(target_probs_given(tokens[-1]))
            tokens.append(int(torch.multinomial(rows[-1], 1, generator=g)))
        tree = DraftTree.chain(tokens, torch.stack(rows))
        res = verify_sampling(tree, TABLE[tree.tokens], generator=g)
        assert res.accepted == [1, 2, 3, 4] and res.tokens[:4] == tokens[1:]


def test_tokens_outside_top_k_are_never_accepted():
    g = torch.Generator().manual_seed(6)
    banned = int(TABLE[ROOT].argmin())
    tree = DraftTree.from_parents([ROOT, banned, banned], [-1, 0, 1])
    for _ in range(300):
        res = verify_sampling(tree, TABLE[tree.tokens], temperature=1.0, top_k=V - 1, generator=g)
        assert res.accepted == [] and res.bonus != banned
