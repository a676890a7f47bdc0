"""The TTT unroll's flex attention (train/attention.py) is the dense masked attention it replaces on a GPU: the same
draft logits at every step (flex uncompiled on the CPU, forward only: torch has no flex backward on the CPU; the
gradients and a trained draft's held-out acc_k are compared on the GPU, tests/gpu/test_train_attention.py), the block
mask allowing exactly ttt_mask's pairs, and where training chooses it."""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint

from eaglescope.train import attention
from eaglescope.train.ttt import ttt_mask, ttt_unroll

# uncompiled flex on the CPU says it materialises the scores: that is the reference path these tests want
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("attn") / "target", seed=5)


# T = 11 and 130, 300: shorter than one 128-block, and segment edges inside blocks (T not a multiple of 128)
@pytest.mark.parametrize("B,T,K", [(3, 11, 4), (2, 130, 3), (1, 300, 7)])
def test_flex_unroll_gives_the_dense_logits_at_every_step(target, B, T, K):
    draft, _ = make_draft(target, draft_vocab_size=40, seed=2)
    assert draft.config.num_heads != draft.config.num_kv_heads  # grouped-query heads: enable_gqa is exercised
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, 96, (B, T), generator=g)
    aux = torch.randn(B, T, draft.fc.in_features, generator=g)
    with torch.no_grad():
        dense = ttt_unroll(draft, ids, aux, K, "dense")
        flex = ttt_unroll(draft, ids, aux, K, "flex")
    for k in range(K):
        torch.testing.assert_close(flex.logits[k], dense.logits[k], rtol=0, atol=1e-5, msg=f"step {k}")
        torch.testing.assert_close(flex.hidden_out[k], dense.hidden_out[k], rtol=0, atol=1e-5, msg=f"step {k}")
    # a wrong mask would show: the step-k logits depend on the later steps' keys (k ≥ 1 differs from causal alone)
    assert (dense.logits[K - 1] - dense.logits[0]).abs().max() > 1e-2


@pytest.mark.parametrize("T,k", [(5, 0), (5, 3), (130, 2)])
def test_the_block_mask_allows_exactly_the_ttt_mask_pairs(T, k):
    S = (k + 1) * T
    bm = attention.ttt_block_mask(T, S, torch.device("cpu"))
    q = torch.arange(T)[:, None].expand(T, S)
    kv = torch.arange(S)[None, :].expand(T, S)
    allowed = bm.mask_mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
    assert torch.equal(allowed, ttt_mask(T, k, "cpu")[0, 0])
    # every block holding an allowed pair is computed (dense form of the block mask, 128-blocks, padded)
    blocks = bm.to_dense()[0, 0].bool()
    Bq, Bk = bm.BLOCK_SIZE
    needed = torch.zeros_like(blocks)
    for i, j in ttt_mask(T, k, "cpu")[0, 0].nonzero().tolist():
        needed[i // Bq, j // Bk] = True
    assert torch.equal(blocks | needed, blocks)


def test_training_takes_flex_on_a_gpu_for_llama_attention_and_long_batches_only(target, tmp_path):
    llama, _ = make_draft(target, draft_vocab_size=40)
    mla, _ = make_draft(make_checkpoint("deepseek_v3", tmp_path / "mla"), draft_vocab_size=40, arch="mla")
    assert attention.default_attention(llama, torch.device("cpu")) == "dense"
    assert attention.default_attention(llama, torch.device("cuda")) == "auto"
    assert attention.default_attention(mla, torch.device("cuda")) == "dense"
    # auto: flex for long batches only, where the dense rectangle costs more than flex's compilations
    n = attention.FLEX_MIN_LENGTH
    assert [attention.resolve("auto", T) for T in (11, n - 1, n, 4 * n)] == ["dense", "dense", "flex", "flex"]
    assert attention.resolve("flex", 11) == "flex" and attention.resolve("dense", 4 * n) == "dense"


def test_decoding_attention_is_restored_after_a_flex_unroll(target):
    draft, _ = make_draft(target, draft_vocab_size=40)
    attn = draft.midlayer.self_attn
    before = attn.attention_impl
    with torch.no_grad():
        ttt_unroll(draft, torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 6, draft.fc.in_features), 2, "flex")
    assert attn.attention_impl == before == "sdpa"
    with pytest.raises(ValueError, match="not one of"):
        ttt_unroll(draft, torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 6, draft.fc.in_features), 2, "sparse")
