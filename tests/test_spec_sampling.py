"""Speculative sampling is lossless: its first tokens follow the target's own distribution exactly.

An 8-token vocabulary makes the exact law of the first three generated tokens enumerable from the
target's logits (1 + 8 + 64 forwards). Thousands of seeded speculative runs are compared with it by
a chi-square test, for an EAGLE-3 chain, an EAGLE-2 tree (deterministic top-k drafts, q = 1) and a
sampled draft LM (the q-ratio path). Every seed is fixed, so the verdicts are reproducible; the
negative controls show that the same test, on the same draws, rejects a law that is slightly off.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint
from scipy.stats import chisquare

from eaglescope.decode.loop import generate_speculative
from eaglescope.decode.sampling import process_logits
from eaglescope.decode.speculative import DraftLMProposer, Eagle3Proposer, target_embedding
from eaglescope.decode.vanilla import SamplingConfig, generate_vanilla
from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract

V = 8
N_TOKENS = 3
PROMPT = [1, 5, 7]
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
TAPS = TapContract((0, 1), 2)
P_PASS = 1e-4  # fixed seeds: the verdict never changes run to run; this is the false-alarm rate over seed choices


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_checkpoint("llama", tmp_path_factory.mktemp("t8"), seed=0, **SMALL)
    t = load_target(path, device="cpu", dtype=torch.float32, taps=TAPS)
    t.path = path
    return t


@pytest.fixture(scope="module")
def draft(target):
    d, _ = make_draft(target.path, taps=TAPS, draft_vocab_size=6, seed=3)
    d.load_target_embedding(target_embedding(target))
    return d


@pytest.fixture(scope="module")
def draft_lm(tmp_path_factory):
    path = make_checkpoint("qwen2", tmp_path_factory.mktemp("lm8"), seed=11, **SMALL)
    return load_target(path, device="cpu", dtype=torch.float32)


def exact_law(target, temperature: float, top_k=None, top_p=None) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS generated tokens) by enumerating every prefix through the target."""
    law: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == N_TOKENS:
            law[prefix] = mass
            return
        target.reset(len(PROMPT) + N_TOKENS)
        logits = target.forward(torch.tensor(PROMPT + list(prefix))).logits[-1]
        probs = process_logits(logits.double(), temperature, top_k, top_p).tolist()
        for tok, p in enumerate(probs):
            if p > 0:
                walk(prefix + (tok,), mass * p)

    walk((), 1.0)
    return law


def chi2_pvalue(counts: Counter, law: dict[tuple, float], n: int, min_expected: float = 5.0) -> float:
    """Goodness of fit over the law's cells; cells expected < min_expected are pooled into one."""
    impossible = {k: c for k, c in counts.items() if law.get(k, 0.0) == 0.0}
    assert not impossible, f"draws outside the target's support: {impossible}"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell, p in law.items():
        if n * p >= min_expected:
            obs.append(counts.get(cell, 0))
            exp.append(n * p)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += n * p
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    assert len(obs) >= 5, "too few cells for a meaningful test"
    scale = sum(obs) / sum(exp)  # float round-off only: the law sums to 1
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def marginal(law_or_counts, pos: int):
    out: dict = Counter() if isinstance(law_or_counts, Counter) else {}
    for cell, v in law_or_counts.items():
        out[(cell[pos],)] = out.get((cell[pos],), 0) + v
    return out


def draw(target, make_proposer, n: int, sampling: dict, seed0: int) -> tuple[Counter, Counter]:
    """n speculative runs; counts of the first N_TOKENS tokens and of accepted lengths per round."""
    seqs, accepted = Counter(), Counter()
    for i in range(n):
        cfg = SamplingConfig(seed=seed0 + i, **sampling)
        res = generate_speculative(target, make_proposer(cfg), PROMPT, N_TOKENS, cfg, stop_ids=[])
        assert len(res.token_ids) == N_TOKENS
        seqs[tuple(res.token_ids)] += 1
        accepted.update(res.stats.accepted)
    return seqs, accepted


def check_lossless(target, counts: Counter, accepted: Counter, n: int, **sampling) -> None:
    law = exact_law(target, **sampling)
    p_joint = chi2_pvalue(counts, law, n)
    p_last = chi2_pvalue(marginal(counts, N_TOKENS - 1), marginal(law, N_TOKENS - 1), n)
    assert p_joint > P_PASS and p_last > P_PASS, (p_joint, p_last)
    # The verify paths under test really ran: drafts were both accepted and rejected.
    assert accepted[0] > 0 and sum(c for a, c in accepted.items() if a > 0) > 0.05 * n, accepted


N = 2000


@pytest.fixture(scope="module")
def chain_draws(target, draft):
    prop = Eagle3Proposer(draft, 2, 1, 3, max_len=16)  # reused: start() resets its state every run
    return draw(target, lambda cfg: prop, N, {"temperature": 1.0}, seed0=0)


def test_eagle3_chain_sampling_matches_target_law(target, chain_draws):
    check_lossless(target, *chain_draws, N, temperature=1.0)


def test_eagle3_tree_sampling_matches_target_law(target, draft):
    prop = Eagle3Proposer(draft, 2, 3, 7, max_len=16)
    counts, accepted = draw(target, lambda cfg: prop, 1500, {"temperature": 1.0}, seed0=10_000)
    check_lossless(target, counts, accepted, 1500, temperature=1.0)


def test_eagle3_tree_with_top_k_top_p_matches_processed_law(target, draft):
    sampling = {"temperature": 0.9, "top_k": 5, "top_p": 0.8}
    prop = Eagle3Proposer(draft, 3, 2, 6, max_len=16)
    counts, accepted = draw(target, lambda cfg: prop, 1200, sampling, seed0=20_000)
    check_lossless(target, counts, accepted, 1200, **sampling)
    # top-k 5 of 8 removes tokens: every draw stayed inside the truncated support (checked in chi2_pvalue),
    # and the truncation really bit, so that check had something to catch.
    assert len(exact_law(target, **sampling)) < V**N_TOKENS


def test_draft_lm_sampled_chain_matches_target_law(target, draft_lm):
    # The draft LM samples its chain from q; verification uses the min(1, p/q) ratio and the max(p - q, 0) residual.
    # It also guards the draft's own randomness: seeded like the verifier, the draft LM's generator replayed the
    # verifier's stream, and this test rejected the output law with p ~ 1e-127.
    counts, accepted = draw(
        target, lambda cfg: DraftLMProposer(draft_lm, 2, cfg, max_len=16), 1500, {"temperature": 1.0}, seed0=30_000
    )
    check_lossless(target, counts, accepted, 1500, temperature=1.0)


def test_vanilla_sampling_matches_target_law(target):
    """The reference itself: plain sampling passes the same test (so the test is not tuned to speculation)."""
    counts = Counter()
    for i in range(1000):
        res = generate_vanilla(target, PROMPT, N_TOKENS, SamplingConfig(1.0, seed=40_000 + i), stop_ids=[])
        counts[tuple(res.token_ids)] += 1
    assert chi2_pvalue(counts, exact_law(target, 1.0), 1000) > P_PASS


@pytest.mark.parametrize("wrong_temperature", [0.8, 1.25])
def test_negative_control_temperature_mismatch_is_rejected(target, chain_draws, wrong_temperature):
    """The same draws against a law that is only slightly off: the test has the power to say no."""
    counts, _ = chain_draws
    assert chi2_pvalue(counts, exact_law(target, wrong_temperature), N) < 1e-6


def test_negative_control_unverified_draft_is_rejected(target, draft):
    """Emitting the draft's guesses unchecked (a biased sampler) is caught by the same test."""
    prop = Eagle3Proposer(draft, 2, 1, 3, max_len=16)
    law = exact_law(target, 1.0)
    counts = Counter()
    gen = torch.Generator().manual_seed(0)
    target.reset(len(PROMPT) + N_TOKENS + 3)
    prefill = target.forward(torch.tensor(PROMPT))
    target.commit()
    first_probs = process_logits(prefill.logits[-1], 1.0)
    firsts = torch.multinomial(first_probs, N, replacement=True, generator=gen).tolist()
    by_first = {}
    for first in set(firsts):  # the draft chain is deterministic given the first token
        target.reset(len(PROMPT) + N_TOKENS + 3)
        out = target.forward(torch.tensor(PROMPT))
        target.commit()
        prop.start(PROMPT, out, first)
        by_first[first] = tuple([first, *prop.propose(PROMPT + [first], len(PROMPT)).tokens[1:].tolist()])
    for first in firsts:
        counts[by_first[first]] += 1
    assert chi2_pvalue(counts, law, N) < 1e-6


def test_all_cells_enumerated(target):
    law = exact_law(target, 1.0)
    assert len(law) == V**N_TOKENS
    assert abs(sum(law.values()) - 1.0) < 1e-6  # float32 softmax rows
    assert set(law) == set(itertools.product(range(V), repeat=N_TOKENS))
