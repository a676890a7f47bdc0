"""stream_mm (fast/stream_mm.py), under Triton's interpreter: few-row products from TMA-fed weight tiles against a
float64 product, as one split or as float32 partials over K, and the fused verify and draft level running their
products on it against the models' own modules; what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from drafts import make_draft  # noqa: E402
from models import WIDE_HEADS, make_checkpoint  # noqa: E402
from tolerance import assert_draft_step_matches_modules, assert_step_matches_modules  # noqa: E402

from eaglescope.decode.speculative import draft_slot_cache  # noqa: E402
from eaglescope.fast import FastTarget  # noqa: E402
from eaglescope.fast import invariant as inv  # noqa: E402
from eaglescope.fast.fused_draft import FusedDraftStep  # noqa: E402
from eaglescope.fast.fused_verify import CUBLAS_PRODUCTS, STREAM_PRODUCTS, FusedVerify  # noqa: E402
from eaglescope.fast.stream_mm import STREAM_LAUNCH, stream_available, stream_fits, stream_mm  # noqa: E402
from eaglescope.models.draft import Eagle3Draft  # noqa: E402
from eaglescope.models.targets import load_target  # noqa: E402
from eaglescope.models.targets.llama import fuse_projections  # noqa: E402

pytestmark = pytest.mark.skipif(not inv.available("cpu"), reason="needs TRITON_INTERPRET=1 on a CPU-only machine")
pytest.importorskip("triton.tools.tensor_descriptor")

# every product of the tiny models on stream_mm, the summed ones cut over K
LAYER_STREAM = {"qkv": (16, 16, 2, 2), "o": (16, 16, 4, 2), "gate_up": (16, 32, 1, 2), "down": (32, 16, 2, 3)}
VERIFY_STREAM = {**LAYER_STREAM, "lm_head": (16, 16, 1, 2)}
DRAFT_STREAM = VERIFY_STREAM


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 40),
    n=st.integers(1, 100),
    k_tiles=st.integers(1, 6),
    bn=st.sampled_from([16, 32]),
    bk=st.sampled_from([16, 32]),
    splits=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 99),
)
def test_products_match_float64(T, n, k_tiles, bn, bk, splits, seed):
    """Partial column tiles (n), rows fewer than the tile's (TMA's zero fill) or more than 16, K in whole BK steps
    cut into `splits` slices: one split's output, or the partials summed in order, within float32's accumulation
    bound of the float64 product; each partial alone is its own slice's product."""
    K = k_tiles * splits * bk
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(T, K, generator=g), torch.randn(n, K, generator=g)
    launch = (bn, bk, splits, 2)
    assert stream_fits(x, w, launch)
    y = stream_mm(x, w, launch)
    x64, w64 = x.double(), w.double()
    bound = K * 2.0**-24 * (x64.abs() @ w64.abs().T) + 1e-6
    if splits == 1:
        assert y.shape == (T, n) and y.dtype == x.dtype
        got = y.double()
    else:
        assert y.shape == (splits, T, n) and y.dtype == torch.float32
        s = K // splits
        last = x64[:, -s:] @ w64[:, -s:].T
        assert ((y[-1].double() - last).abs() <= bound).all()
        got = y.double().sum(0)
    assert ((got - x64 @ w64.T).abs() <= bound).all()


def test_half_precision_rounds_once():
    """bf16 operands: the float32 accumulation rounded once to bf16, as a library product rounds it."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(48, 64, generator=g).bfloat16()
    y = stream_mm(x, w, (16, 32, 1, 2))
    assert y.dtype == torch.bfloat16
    want = (x.double() @ w.double().T).bfloat16()
    assert (y.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2.0**-8


def test_half_precision_into_float32_is_not_rounded_to_half():
    """bf16 operands into a float32 output (a Float32Logits head's logits): the float32 accumulation kept, not
    rounded to bf16 on the way (its error is float32's, 2^-8 would be bf16's)."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(48, 64, generator=g).bfloat16()
    y = stream_mm(x, w, (16, 32, 1, 2), torch.empty(5, 48))
    assert y.dtype == torch.float32
    want = x.double() @ w.double().T
    bound = 64 * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - want).abs() <= bound).all()
    assert ((y.double() - want.bfloat16().double()).abs() > 0).any()  # it is not bf16's rounding of the product


def test_what_it_refuses():
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    assert not stream_fits(x, w, (16, 48, 1, 2))  # 64 is no whole number of 48-wide steps
    assert not stream_fits(x, w, (16, 16, 3, 2))  # nor of three slices
    assert not stream_fits(torch.randn(300, 64), w, (16, 16, 1, 2))  # more rows than a TMA box holds
    assert not stream_fits(x.double(), w, (16, 16, 1, 2))
    assert not stream_fits(torch.randn(4, 65)[:, :64], w, (16, 16, 1, 2))  # rows 260 bytes apart: not 16-aligned
    with pytest.raises(ValueError, match="cannot run"):
        stream_mm(x, w, (16, 48, 1, 2))
    assert not stream_available("cpu")  # no default under the interpreter: only where asked


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_verify_step_on_stream_products_matches_the_modules(family, tmp_path):
    """The fused verify with q/k/v, o, gate/up, down and the lm_head on stream_mm (q/k/v, o and down as partials
    that the RoPE and norm kernels sum): the modules' logits, taps and cache writes. qwen2's q/k/v has a bias, so
    it stays on the library product (the case is there to show that the fallback still matches)."""
    ckpt = make_checkpoint(family, tmp_path, seed=3, num_hidden_layers=3, **WIDE_HEADS)
    model = fuse_projections(copy.deepcopy(load_target(ckpt, device="cpu", dtype=torch.float32).model))
    ft = FastTarget(model, size=150, taps=(0, 2), float32_logits=True)
    fv = FusedVerify(model, ft.cache, taps=(0, 2), attention="flash", cublas=CUBLAS_PRODUCTS, stream=VERIFY_STREAM)
    assert fv.settings(5).stream == VERIFY_STREAM
    calls = []
    import eaglescope.fast.fused_verify as fvm

    real = fvm.stream_mm
    fvm.stream_mm = lambda x, w, launch, out=None: calls.append(launch) or real(x, w, launch, out)
    try:
        P, T = 6, 5
        ft.prefill(torch.arange(3, 3 + P))
        slots, pos = torch.tensor([P, P + 1, 70, 71, 131]), torch.tensor([P, P + 1, P + 1, P + 2, P + 3])
        mask = torch.zeros(T, 150, dtype=torch.bool)
        mask[:, :P] = True
        mask[torch.arange(T), slots] = True
        mask[1, P] = mask[3, 70] = True
        assert_step_matches_modules(ft, fv, torch.tensor([11, 60, 2, 33, 8]), pos, mask, slots, 4)
    finally:
        fvm.stream_mm = real
    per_layer = 3 if family == "qwen2" else 4  # qwen2's q/k/v (bias) on the library
    assert len(calls) == per_layer * len(model.model.layers) + 1  # and the lm_head
    assert calls[-1] == VERIFY_STREAM["lm_head"]


def test_stream_launches_are_checked(tmp_path):
    ckpt = make_checkpoint("llama", tmp_path, num_hidden_layers=1, **WIDE_HEADS)
    model = fuse_projections(load_target(ckpt, device="cpu", dtype=torch.float32).model)
    cache = FastTarget(model, size=16).cache
    with pytest.raises(ValueError, match="no kernel after it to sum"):
        FusedVerify(model, cache, stream={"gate_up": (16, 16, 2, 2)})
    with pytest.raises(ValueError, match="no kernel after it to sum"):
        FusedVerify(model, cache, stream={"lm_head": (16, 16, 2, 2)})  # logits are the verify's last product
    with pytest.raises(ValueError, match="runs the products"):
        FusedVerify(model, cache, stream={"embed": (16, 16, 1, 2)})
    with pytest.raises(ValueError, match=r"\(BN, BK, splits, stages\)"):
        FusedVerify(model, cache, stream={"o": (16, 16, 2)})
    assert FusedVerify(model, cache).stream == {}  # the CPU: no default
    assert set(STREAM_LAUNCH["verify"]) <= set(STREAM_PRODUCTS)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("sd"), seed=5, num_hidden_layers=7)


@pytest.mark.parametrize("logit_scale", [1.0, 0.7])
def test_draft_step_on_stream_products_matches_the_modules(target_dir, logit_scale):
    """The fused draft level with every product and the head on stream_mm: a catch-up of 5 rows and a tree level
    of 4 against the draft's own step, logits (with its logit_scale) and cache writes."""
    draft, _ = make_draft(target_dir, draft_vocab_size=48, seed=9, random_norms=True)
    draft = fuse_projections(draft)
    draft.config.logit_scale = logit_scale
    S = 40
    cache = draft_slot_cache(draft, S)
    cache.k.normal_(generator=torch.Generator().manual_seed(1))
    cache.v.normal_(generator=torch.Generator().manual_seed(2))
    fused = FusedDraftStep(draft, cache, rows=5, stream=DRAFT_STREAM)
    H, g = draft.config.hidden_size, torch.Generator().manual_seed(0)
    tree_mask = torch.zeros(4, S, dtype=torch.bool)
    tree_mask[:, :12] = True
    tree_mask[torch.arange(4), 30 + torch.arange(4)] = True
    catch = 7 + torch.arange(5)
    calls = [(5, catch, catch, torch.arange(S)[None, :] <= catch[:, None]),
             (4, torch.full((4,), 13), 30 + torch.arange(4), tree_mask)]  # fmt: skip
    for rows, positions, slots, mask in calls:
        embeds, hidden = torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g) * 3
        assert_draft_step_matches_modules(fused, draft, embeds, hidden, positions, slots, mask)
    normed = torch.randn(3, H, generator=g)
    assert fused.head(normed).data_ptr() == fused.logits_out.data_ptr()  # the head ran on stream_mm


def test_a_head_of_its_own_runs_its_own(target_dir):
    """A draft whose head is not Eagle3Draft's (a fault under test, a subclass) keeps it: the fused level's head does
    not stand in for it."""
    draft, _ = make_draft(target_dir, draft_vocab_size=48, seed=9)
    draft = fuse_projections(draft)

    class Doubled(Eagle3Draft):
        def head(self, normed):
            return 2 * super().head(normed)

    normed = torch.randn(2, draft.config.hidden_size, generator=torch.Generator().manual_seed(2))
    fused = FusedDraftStep(draft, draft_slot_cache(draft, 40), rows=4, stream=DRAFT_STREAM)
    plain = fused.head(normed).clone()
    draft.__class__ = Doubled
    torch.testing.assert_close(fused.head(normed), 2 * plain)
    draft.__class__ = Eagle3Draft
    draft.head = lambda x: -Eagle3Draft.head(draft, x)  # patched on the instance
    torch.testing.assert_close(fused.head(normed), -plain)
