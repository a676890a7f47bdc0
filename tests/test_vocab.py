import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglescope.errors import EagleScopeError
from eaglescope.models.vocab import (
    build_draft_vocab,
    count_tokens,
    draft_to_target,
    target_to_draft,
    validate_vocab_map,
)


@st.composite
def counts_and_n(draw):
    vocab = draw(st.integers(1, 64))
    counts = draw(st.lists(st.integers(0, 5), min_size=vocab, max_size=vocab))
    n = draw(st.integers(1, vocab))
    return torch.tensor(counts, dtype=torch.int64), n


def test_top_n_by_count_sorted_by_id_with_offsets():
    counts = torch.tensor([0, 9, 3, 7, 0, 7, 1, 0])
    d2t, t2d = build_draft_vocab(counts, 3)
    # 9 (id 1), then the tie 7/7 (ids 3, 5): sorted by id → [1, 3, 5]; d2t stores offsets.
    assert d2t.tolist() == [1, 3 - 1, 5 - 2]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.nonzero().flatten().tolist() == [1, 3, 5]


def test_ties_go_to_lower_id():
    d2t, _ = build_draft_vocab(torch.tensor([2, 5, 5, 5, 1]), 2)
    assert draft_to_target(torch.arange(2), d2t).tolist() == [1, 2]


def test_too_few_seen_tokens_fill_with_lowest_unseen_ids():
    counts = torch.tensor([0, 0, 4, 0, 0, 0, 2, 0])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert draft_to_target(torch.arange(4), d2t).tolist() == [0, 1, 2, 6]


def test_full_size_is_identity_and_oversize_is_an_error():
    d2t, t2d = build_draft_vocab(torch.tensor([3, 0, 1, 2]), 4)
    assert d2t.tolist() == [0, 0, 0, 0] and t2d.all()
    with pytest.raises(EagleScopeError, match="draft vocab size 5"):
        build_draft_vocab(torch.tensor([3, 0, 1, 2]), 5)
    with pytest.raises(EagleScopeError):
        build_draft_vocab(torch.tensor([3.0, 0.0]), 1)
    with pytest.raises(EagleScopeError):
        build_draft_vocab(torch.tensor([3, -1]), 1)


def test_count_tokens_counts_only_supervised_tokens():
    seqs = [([5, 1, 2, 2], [0, 1, 1, 0]), ([2, 3], [1, 1]), ([4], [0])]
    assert count_tokens(seqs, 6).tolist() == [0, 1, 2, 1, 0, 0]
    with pytest.raises(EagleScopeError, match="sequence 0"):
        count_tokens([([1, 2], [1])], 6)
    with pytest.raises(EagleScopeError, match="out of range"):
        count_tokens([([7], [1])], 6)
    # an out-of-range id that is not supervised is not counted, and not an error either
    assert count_tokens([([7, 1], [0, 1])], 6).sum() == 1


@settings(max_examples=200, deadline=None)
@given(counts_and_n())
def test_map_invariants(cn):
    counts, n = cn
    d2t, t2d = build_draft_vocab(counts, n)
    validate_vocab_map(d2t, t2d, counts.numel(), n)
    target = draft_to_target(torch.arange(n), d2t)
    assert (target[1:] > target[:-1]).all()
    assert (d2t == target - torch.arange(n)).all()
    # every chosen token is at least as frequent as every unchosen one
    if n < counts.numel():
        assert counts[t2d].min() >= counts[~t2d].max()
    # round trips: draft → target → draft is the identity; target → draft → target on in-vocab ids
    back, ok = target_to_draft(target, t2d)
    assert ok.all() and back.tolist() == list(range(n))
    all_ids = torch.arange(counts.numel())
    draft, in_vocab = target_to_draft(all_ids, t2d)
    assert (in_vocab == t2d).all()
    assert (draft[~in_vocab] == -1).all()
    assert (draft_to_target(draft[in_vocab], d2t) == all_ids[in_vocab]).all()


@settings(max_examples=200, deadline=None)
@given(counts_and_n(), st.data())
def test_validation_catches_corrupted_maps(cn, data):
    counts, n = cn
    vocab = counts.numel()
    d2t, t2d = build_draft_vocab(counts, n)
    kind = data.draw(st.sampled_from(["d2t_dtype", "t2d_dtype", "shape", "absolute_ids", "swap", "t2d_flip"]))
    if kind == "d2t_dtype":
        d2t = d2t.to(torch.int32)
    elif kind == "t2d_dtype":
        t2d = t2d.to(torch.int64)
    elif kind == "shape":
        d2t = torch.cat([d2t, d2t[-1:]])
    elif kind == "absolute_ids":
        # a map written as absolute target ids instead of offsets (the same map when n == 1: then shift it out)
        absolute = d2t + torch.arange(n)
        d2t = absolute if n > 1 else d2t + vocab
    elif kind == "swap":
        if n < 2:
            d2t = d2t - 1 - d2t[0]  # first target id becomes -1: out of range
        else:
            target = d2t + torch.arange(n)
            target[[0, 1]] = target[[1, 0]]
            d2t = target - torch.arange(n)
    elif kind == "t2d_flip":
        i = data.draw(st.integers(0, vocab - 1))
        t2d = t2d.clone()
        t2d[i] = ~t2d[i]
    with pytest.raises(EagleScopeError):
        validate_vocab_map(d2t, t2d, vocab, n)


def test_validation_catches_mask_disagreeing_with_same_count():
    d2t, t2d = build_draft_vocab(torch.tensor([5, 4, 0, 0]), 2)  # ids 0, 1
    moved = t2d.clone()
    moved[1], moved[3] = False, True  # still 2 ids marked, but the wrong ones
    with pytest.raises(EagleScopeError, match="disagrees"):
        validate_vocab_map(d2t, moved, 4, 2)
