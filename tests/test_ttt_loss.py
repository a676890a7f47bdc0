"""Which positions training supervises: the loss mask shifts with the prediction (ttt.LOSS_MASK_SHIFT)."""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint

from eaglescope.train.ttt import LOSS_MASK_SHIFT, STEP_WEIGHT, ttt_loss, ttt_unroll


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    d = make_checkpoint("llama", tmp_path_factory.mktemp("t"), seed=3)
    return make_draft(d, draft_vocab_size=96, seed=1)[0]


def supervised_positions(draft, T: int, j: int, K: int) -> list[list[int]]:
    """For a loss mask that marks only token j, the positions t whose logits get a gradient at each step."""
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (1, T))
    aux = torch.randn(1, T, draft.fc.in_features)
    unrolled = ttt_unroll(draft, ids, aux, K)
    for lg in unrolled.logits:
        lg.retain_grad()
    target_logits = torch.randn(1, T, 96)
    mask = torch.zeros(1, T, dtype=torch.long)
    mask[0, j] = 1
    res = ttt_loss(draft, unrolled, target_logits, mask)
    res.loss.backward()
    return [lg.grad[0].abs().sum(-1).nonzero().flatten().tolist() for lg in unrolled.logits], res


def test_step_k_at_position_t_is_supervised_iff_token_t_plus_k_plus_2_is(draft):
    assert LOSS_MASK_SHIFT == "shifted"
    T, K = 12, 4
    for j in range(T):
        positions, res = supervised_positions(draft, T, j, K)
        for k in range(K):
            want = [j - k - 2] if j - k - 2 >= 0 else []
            assert positions[k] == want, (j, k)
            assert res.step_count[k] == len(want)


def test_steps_are_weighted_by_point_eight_to_the_k(draft):
    torch.manual_seed(1)
    T, K = 10, 3
    ids = torch.randint(0, 96, (2, T))
    aux = torch.randn(2, T, draft.fc.in_features)
    un = ttt_unroll(draft, ids, aux, K)
    res = ttt_loss(draft, un, torch.randn(2, T, 96), torch.ones(2, T, dtype=torch.long))
    expected = sum(STEP_WEIGHT**k * res.step_loss[k] for k in range(K))
    assert float(res.loss.detach()) == pytest.approx(expected, rel=1e-5)


def test_positions_whose_target_argmax_is_outside_the_draft_vocab_are_not_trained(tmp_path):
    d = make_checkpoint("llama", tmp_path / "t", seed=4)
    small, _ = make_draft(d, draft_vocab_size=40, seed=2)
    T = 9
    ids = torch.randint(0, 96, (1, T))
    aux = torch.randn(1, T, small.fc.in_features)
    un = ttt_unroll(small, ids, aux, 1)
    un.logits[0].retain_grad()
    target_logits = torch.full((1, T, 96), -10.0)
    out_of_vocab = int((~small.t2d).nonzero()[0])
    in_vocab = int(small.t2d.nonzero()[0])
    target_logits[0, :, in_vocab] = 5.0
    target_logits[0, 4, out_of_vocab] = 20.0  # the teacher at position 4 prefers a token the draft cannot emit
    res = ttt_loss(small, un, target_logits, torch.ones(1, T, dtype=torch.long))
    res.loss.backward()
    trained = un.logits[0].grad[0].abs().sum(-1).nonzero().flatten().tolist()
    assert 3 not in trained  # step 0 at t=3 learns from the teacher at t+1 = 4: skipped
    assert trained == [t for t in range(T - 2) if t != 3]
