import json
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglescope.decode.stats import SpecStats, alpha_from_unconditional, predicted_accept_length
from eaglescope.decode.tree import DraftTree
from eaglescope.decode.verify import verify_greedy
from eaglescope.errors import EagleScopeError


def stats_of(accepted, depth=4):
    s = SpecStats()
    for a in accepted:
        s.record_round(depth, a)
    return s


def test_accept_length_counts_the_bonus_token():
    s = stats_of([0, 4, 2, 2])
    assert s.rounds == 4
    assert s.emitted_tokens == 12
    assert s.accept_length == pytest.approx(3.0)  # (1 + 5 + 3 + 3) / 4


def test_conditional_and_unconditional_acceptance_by_hand():
    s = stats_of([0, 4, 2, 2])
    # position 1: 3 of 4 rounds; position 2: 3 of the 3 that reached it; 3: 1 of 3; 4: 1 of 1
    assert s.alpha == pytest.approx([3 / 4, 1.0, 1 / 3, 1.0])
    assert s.accepted_per_position == pytest.approx([3 / 4, 3 / 4, 1 / 4, 1 / 4])
    assert s.histogram == [1, 0, 2, 0, 1]
    assert s.acceptance_rate == pytest.approx(8 / 16)
    # with a fixed depth, the conditional α reproduce τ exactly and convert to/from unconditional
    assert predicted_accept_length(s.alpha) == pytest.approx(s.accept_length)
    assert alpha_from_unconditional(s.accepted_per_position) == pytest.approx(s.alpha)


def test_alpha_only_counts_rounds_that_drafted_that_deep():
    s = SpecStats()
    s.record_round(1, 1)  # a 1-token chain fully accepted says nothing about position 2
    s.record_round(3, 3)
    s.record_round(3, 1)
    assert s.alpha == pytest.approx([1.0, 1 / 2, 1.0])
    assert s.accepted_per_position == pytest.approx([1.0, 1 / 3, 1 / 3])


def test_record_round_accepts_trees_and_depth_counts():
    s = SpecStats()
    tree = DraftTree.from_parents([1, 2, 3, 4, 5], [-1, 0, 0, 1, 3])
    s.record_round(tree, 2)
    s.record_round([10, 10, 0], 1)  # drafted 2 deep, 20 nodes
    s.record_round(None, 0, max_depth=5)
    assert s.drafted_depth == [3, 2, 5]
    assert s.drafted_tokens == [4, 20, 0]
    assert s.depth == 5 and s.histogram == [1, 1, 1, 0, 0, 0]
    with pytest.raises(EagleScopeError):
        s.record_round(tree, 4)  # cannot accept deeper than drafted


def test_merge_equals_recording_everything_in_one():
    a, b = stats_of([1, 2, 3]), stats_of([0, 4])
    assert a.merge(b).to_dict() == stats_of([1, 2, 3, 0, 4]).to_dict()


def test_to_dict_is_json_and_empty_stats_are_safe():
    empty = SpecStats()
    d = empty.to_dict()
    assert d["rounds"] == 0 and d["accept_length"] is None and d["alpha"] == []
    assert math.isnan(empty.accept_length)
    s = SpecStats()
    s.record_round(3, 0)
    d = json.loads(json.dumps(s.to_dict(), allow_nan=False))
    assert d["alpha"] == [0.0, None, None]  # nothing ever reached positions 2 and 3
    assert d["accept_length"] == 1.0


def test_predicted_accept_length_examples():
    assert predicted_accept_length([]) == 1.0
    assert predicted_accept_length([0.0, 1.0, 1.0]) == 1.0
    assert predicted_accept_length([0.5, 0.0, float("nan")]) == 1.5
    assert predicted_accept_length([1.0] * 7) == 8.0
    assert predicted_accept_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert predicted_accept_length([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert alpha_from_unconditional([0.8, 0.4, 0.1]) == pytest.approx([0.8, 0.5, 0.25])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), st.integers(0, 2**31))
def test_simulated_rounds_recover_alpha_and_tau(alpha, seed):
    """Rounds drawn from known α: α estimates and 1 + ΣΠα agree with the measured τ."""
    rng = random.Random(seed)
    s = SpecStats()
    for _ in range(200):
        n = 0
        while n < len(alpha) and rng.random() < alpha[n]:
            n += 1
        s.record_round(len(alpha), n)
    assert predicted_accept_length(s.alpha) == pytest.approx(s.accept_length)
    # unconditional rates are products of the conditional ones
    run = 1.0
    for a, u in zip(s.alpha, s.accepted_per_position, strict=True):
        if math.isnan(a):
            assert u == 0.0
            break
        run *= a
        assert u == pytest.approx(run)


def test_stats_from_real_verify_rounds():
    """Feed VerifyResults of a greedy verifier: τ equals emitted tokens per round."""
    s = SpecStats()
    emitted = 0
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tree = DraftTree.chain(torch.randint(0, 3, (5,), generator=g))
        res = verify_greedy(tree, torch.randn(5, 3, generator=g))
        s.record_round(tree, len(res.accepted))
        emitted += len(res.tokens)
    assert s.emitted_tokens == emitted
    assert s.accept_length == pytest.approx(emitted / 20)
