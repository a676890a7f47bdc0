"""The native target's whole-sequence forward (training's online teacher, prepare's stored states) on a GPU: from
CUDNN_MIN_LENGTH tokens on it runs SDPA's cuDNN kernel at a length rounded up to CUDNN_LENGTH_STEP, and gives the
states and logits of the plain forward at the sample's own length (flash), cut back to that length."""

from __future__ import annotations

import pytest
import torch
from models import make_checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from eaglescope.models.targets import load_target
from eaglescope.models.targets.llama import CUDNN_MIN_LENGTH


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # head_dim 128 as the 8B target; cuDNN's kernel takes bf16 only
    d = make_checkpoint(
        "llama",
        tmp_path_factory.mktemp("wsa") / "t",
        vocab_size=1000,
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        num_hidden_layers=8,
        max_position_embeddings=4096,
    )
    return load_target(d, device="cuda", dtype=torch.bfloat16, taps="default", backend="native")


def kernels(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        out = fn()
        torch.cuda.synchronize()
    return out, [e.key for e in p.key_averages()]


@pytest.mark.parametrize("T", [CUDNN_MIN_LENGTH - 24, CUDNN_MIN_LENGTH + 76])
def test_whole_sequence_forward_matches_the_plain_one(target, T):
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, 1000, (3, T), generator=g)
    out, names = kernels(lambda: target.hidden_states(ids, None, logits=True))
    assert out.logits.shape[:2] == out.aux.shape[:2] == out.final_hidden.shape[:2] == (3, T)
    uses_cudnn = any("cudnn" in n and "sdpa" in n for n in names)
    assert uses_cudnn == (T >= CUDNN_MIN_LENGTH), names
    # the plain forward at the sample's own length, on flash (what a GPU ran before)
    with torch.inference_mode(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        positions = torch.arange(T, device="cuda").expand(3, T)
        want = target.model(ids.cuda(), positions, None, None, 0, target.taps.layers, head=True)
    for got, ref in zip((out.logits, out.aux, out.final_hidden), want, strict=True):
        scale = float(ref.float().abs().max())
        # two bf16 attention kernels with their own reduction orders, eight layers: a few bf16 roundings apart
        torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=0.03 * scale)
