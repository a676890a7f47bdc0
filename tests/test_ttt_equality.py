"""The test this project exists for: training's TTT step k == decoding's draft at chain depth k+1."""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft
from hypothesis import given, settings
from hypothesis import strategies as st
from models import make_checkpoint

from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.taps import TapContract
from eaglescope.target import load_target
from eaglescope.train.ttt import ttt_unroll


class RecordingProposer(Eagle3Proposer):
    """Keeps the draft log-probs of every expansion level (depth 1, 2, …)."""

    def _logprobs(self, hidden_out):
        lp = super()._logprobs(hidden_out)
        self.seen.append(lp)
        return lp


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    out = []
    for i, (family, taps) in enumerate([("llama", None), ("qwen3", (0, 3, 6))]):
        d = make_checkpoint(family, tmp_path_factory.mktemp(family), seed=10 + i)
        target = load_target(d, device="cpu")
        contract_taps = TapContract(taps, target.num_layers) if taps else None
        draft, contract = make_draft(d, taps=contract_taps, draft_vocab_size=40, seed=i, scale=3.0)
        draft.load_target_embedding(target_embedding(target))
        target.set_taps(contract.taps)
        out.append((target, draft))
    return out


def decode_chain_logprobs(target, draft, prompt: list[int], root: int, depth: int):
    """Draft log-probs at depths 1..depth of a greedy chain, and the chain's tokens (target ids)."""
    prop = RecordingProposer(draft, depth, 1, depth + 1, max_len=len(prompt) + depth + 4)
    prop.seen = []
    target.reset(len(prompt) + depth + 4)
    prefill = target.forward(torch.tensor(prompt))
    target.commit()
    prop.start(prompt, prefill, root)
    tree = prop.propose(prompt + [root], len(prompt))
    return torch.cat(prop.seen), tree.tokens[1:].tolist()


@settings(max_examples=25, deadline=None)
@given(which=st.integers(0, 1), n=st.integers(1, 14), depth=st.integers(1, 7), seed=st.integers(0, 10_000))
def test_ttt_step_logits_equal_decoding_chain_logits(setups, which, n, depth, seed):
    target, draft = setups[which]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, target.vocab_size, (n,), generator=g).tolist()
    root = int(torch.randint(0, target.vocab_size, (1,), generator=g))
    dec_lp, chain = decode_chain_logprobs(target, draft, prompt, root, depth)
    # The same sequence seen by training: prompt, root, then the tokens the draft itself chose,
    # so that step k's ground-truth input token is the token decoding fed at depth k+1.
    seq = torch.tensor([prompt + [root] + chain])
    aux = target.hidden_states(seq).aux
    with torch.no_grad():
        unrolled = ttt_unroll(draft, seq, aux, depth)
    t = n - 1  # the last prompt position: its features are paired with the root
    for k in range(depth):
        train_lp = torch.log_softmax(unrolled.logits[k][0, t].float(), -1)
        err = (train_lp - dec_lp[k]).abs().max() / dec_lp[k].abs().max()
        assert err <= 1e-4, f"step {k}: relative error {err:.2e}"


def test_equality_test_catches_an_unshifted_rope(setups, monkeypatch):
    """If training forgot the +k RoPE offset, the comparison above must fail (the test can fail)."""
    target, draft = setups[0]
    prompt = list(range(3, 12))
    dec_lp, chain = decode_chain_logprobs(target, draft, prompt, 5, 3)
    seq = torch.tensor([prompt + [5] + chain])
    aux = target.hidden_states(seq).aux
    import eaglescope.train.ttt as ttt

    real_step = draft.step

    def step_without_offset(embeds, hidden, positions, cache, start, mask):
        return real_step(embeds, hidden, torch.arange(positions.shape[1]).expand_as(positions), cache, start, mask)

    monkeypatch.setattr(draft, "step", step_without_offset)
    with torch.no_grad():
        unrolled = ttt.ttt_unroll(draft, seq, aux, 3)
    t = len(prompt) - 1
    assert torch.allclose(torch.log_softmax(unrolled.logits[0][0, t], -1), dec_lp[0], atol=1e-4)
    assert not torch.allclose(torch.log_softmax(unrolled.logits[2][0, t], -1), dec_lp[2], atol=1e-3)
