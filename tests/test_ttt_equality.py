"""The test this project exists for: training's TTT step k == decoding's draft at chain depth k+1."""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft
from hypothesis import given, settings
from hypothesis import strategies as st
from models import make_checkpoint
from tolerance import assert_close_float32

from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract
from eaglescope.train.ttt import ttt_unroll


class RecordingProposer(Eagle3Proposer):
    """Keeps the draft log-probs of every expansion level (depth 1, 2, …)."""

    def _logprobs(self, hidden_out):
        lp = super()._logprobs(hidden_out)
        self.seen.append(lp)
        return lp


EAGLE31 = {"norm_before_fc": True, "fc_norm": True, "norm_output": True}
# (target family, taps, draft architecture, EAGLE 3.1 options): every draft architecture and option
SETUPS = [
    ("llama", None, "llama", {}),
    ("qwen3", (0, 3, 6), "llama", {}),
    ("llama", None, "llama", EAGLE31),
    ("llama", (1, 4, 6), "llama", {"norm_output": True}),
    ("deepseek_v3", None, "mla", {}),
    ("deepseek_v3", (0, 3, 6), "mla", {"fc_norm": True, "norm_output": True}),
]


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    out = []
    for i, (family, taps, arch, options) in enumerate(SETUPS):
        d = make_checkpoint(family, tmp_path_factory.mktemp(family), seed=10 + i)
        # norm_output hands the next step a normalised vector, which amplifies float32 reordering between the
        # batched unroll and the decoder ~100x (seen: 4.7e-4 in float32, 1.1e-7 in float64 on the same draft), so
        # those setups compare in float64, where a wiring difference still shows as a large error
        # (transformers' DeepSeek MoE has no float64 kernel: that target stays float32, its draft goes float64)
        dtype = torch.float64 if options.get("norm_output") else torch.float32
        target = load_target(d, device="cpu", dtype=torch.float32 if family == "deepseek_v3" else dtype)
        contract_taps = TapContract(taps, target.num_layers) if taps else None
        draft, contract = make_draft(d, taps=contract_taps, draft_vocab_size=40, seed=i, scale=3.0, arch=arch,
                                     random_norms=bool(options), **options)  # fmt: skip
        draft = draft.to(dtype)
        draft.load_target_embedding(target_embedding(target))
        target.set_taps(contract.taps)
        out.append((target, draft))
    return out


def decode_chain_logprobs(target, draft, prompt: list[int], root: int, depth: int, with_aux: bool = False):
    """Draft log-probs at depths 1..depth of a greedy chain, and the chain's tokens (target ids); `with_aux`: also
    the prompt's features the decoder handed the draft."""
    prop = RecordingProposer(draft, depth, 1, depth + 1, max_len=len(prompt) + depth + 4)
    prop.seen = []
    target.reset(len(prompt) + depth + 4)
    prefill = target.forward(torch.tensor(prompt))
    target.commit()
    prop.start(prompt, prefill, root)
    tree = prop.propose(prompt + [root], len(prompt))
    out = torch.cat(prop.seen), tree.tokens[1:].tolist()
    return (*out, prefill.aux) if with_aux else out


@settings(max_examples=40, deadline=None)
@given(
    which=st.integers(0, len(SETUPS) - 1), n=st.integers(1, 14), depth=st.integers(1, 7), seed=st.integers(0, 10_000)
)
def test_ttt_step_logits_equal_decoding_chain_logits(setups, which, n, depth, seed):
    check_equal(setups, which, n, depth, seed)


@pytest.mark.parametrize(
    "which", range(len(SETUPS)), ids=[f"{s[0]}-{s[2]}-{'+'.join(s[3]) or 'eagle3'}" for s in SETUPS]
)
def test_every_architecture_and_option_trains_as_it_decodes(setups, which):
    check_equal(setups, which, 9, 6, which)


def check_equal(setups, which: int, n: int, depth: int, seed: int) -> None:
    target, draft = setups[which]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, target.vocab_size, (n,), generator=g).tolist()
    root = int(torch.randint(0, target.vocab_size, (1,), generator=g))
    dec_lp, chain, prefill_aux = decode_chain_logprobs(target, draft, prompt, root, depth, with_aux=True)
    # The same sequence seen by training: prompt, root, then the tokens the draft itself chose,
    # so that step k's ground-truth input token is the token decoding fed at depth k+1.
    seq = torch.tensor([prompt + [root] + chain])
    aux = target.hidden_states(seq).aux.clone()
    # Position t reads the features of positions 0..t only; giving it the very tensors the decoder had leaves the
    # draft's two code paths as the only difference (not the target's two forwards, which a norm_output draft
    # amplifies past float32's resolution).
    aux[0, :n] = prefill_aux
    with torch.no_grad():
        unrolled = ttt_unroll(draft, seq, aux.to(draft.fc.weight.dtype), depth)
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
    assert_close_float32(torch.log_softmax(unrolled.logits[0][0, t], -1), dec_lp[0], depth=3)  # fc, layer, head
    assert not torch.allclose(torch.log_softmax(unrolled.logits[2][0, t], -1), dec_lp[2], atol=1e-3)
