"""Fused verify kernels (fast/fused_verify.py), under Triton's interpreter in float32: a T-token step against the
model's own modules (logits, taps, cache writes, split-K products), and speculative decoding through them."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from drafts import make_draft  # noqa: E402
from models import WIDE_HEADS, make_checkpoint  # noqa: E402
from tolerance import assert_close_float32, assert_step_matches_modules  # noqa: E402

from eaglescope.decode.speculative import target_embedding  # noqa: E402
from eaglescope.decode.vanilla import generate_vanilla  # noqa: E402
from eaglescope.fast import FastEagle, FastTarget, FastVanilla  # noqa: E402
from eaglescope.fast import invariant as inv  # noqa: E402
from eaglescope.fast.engine import PREFILL_ROWS  # noqa: E402
from eaglescope.fast.fused_decode import attention_limit  # noqa: E402
from eaglescope.fast.fused_verify import CUBLAS_PRODUCTS, MAX_ROWS, FusedVerify, _attend_products  # noqa: E402
from eaglescope.models.targets import load_target  # noqa: E402
from eaglescope.models.targets.llama import RMSNorm, fuse_projections  # noqa: E402
from eaglescope.taps import TapContract  # noqa: E402

pytestmark = pytest.mark.skipif(not inv.available("cpu"), reason="needs TRITON_INTERPRET=1 on a CPU-only machine")


@pytest.fixture(scope="module")
def tiny_verify(tmp_path_factory):
    ckpt = make_checkpoint("llama", tmp_path_factory.mktemp("fv"), num_hidden_layers=2, **WIDE_HEADS)
    model = fuse_projections(load_target(ckpt, device="cpu", dtype=torch.float32).model)
    return FusedVerify(model, FastTarget(model, size=16).cache)


@settings(max_examples=20, deadline=None)
@given(
    T=st.integers(2, 20),
    n=st.integers(1, 150),
    k=st.integers(16, 300),
    bn=st.sampled_from([16, 32]),
    bk=st.sampled_from([16, 32]),
    bias=st.booleans(),
    name=st.sampled_from(["o", "lm_head", "gate_up"]),
    swap=st.booleans(),
    seed=st.integers(0, 99),
)
@example(T=14, n=134, k=156, bn=16, bk=16, bias=False, name="gate_up", swap=False, seed=29)  # a tolerance too tight
@example(T=20, n=150, k=300, bn=32, bk=16, bias=True, name="gate_up", swap=True, seed=1)  # paired, swapped, split
def test_row_products_match_the_modules(tiny_verify, T, n, k, bn, bk, bias, name, swap, seed):
    """Partial row, column and K tiles, the reduction split over K (up to 4 slices here) and added by the last slice
    of each column tile, then each epilogue: o (residual) y = res + x @ W.T + b; lm_head (plain) y = x @ W.T;
    gate_up y = SiLU(x @ Wg.T + bg) * (x @ Wu.T + bu); each step's tile product as x @ W.T or (swap) as W @ x.T."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if name == "gate_up" else n
    x, w = torch.randn(T, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(rows, generator=g) if bias and name != "lm_head" else None
    res = torch.randn(T, n, generator=g)
    # the reference in float64, held to float32's accumulation bound over k terms (a wrong tile, slice or combine is
    # off by whole terms, far outside it); gate/up carries the bound through SiLU(g) * u
    x64, w64 = x.double(), w.double()
    prod = x64 @ w64.T + (b.double() if b is not None else 0)
    bound = k * 2.0**-24 * (x64.abs() @ w64.abs().T + (b.double().abs() if b is not None else 0))
    if name == "gate_up":
        gate, up = prod[:, :n], prod[:, n:]
        want = torch.nn.functional.silu(gate) * up
        bound = 1.1 * up.abs() * bound[:, :n] + torch.nn.functional.silu(gate).abs() * bound[:, n:]
    else:
        want = res.double() + prod if name == "o" else prod
    y = res.clone()
    tiny_verify.set_blocks(name, (bn, bk, 1, 2, int(swap)))
    tiles, splits, _ = tiny_verify._geometry(name, n, k, tiny_verify.blocks[name])
    tiny_verify._product(name, tiny_verify.settings(), x, w, b, y, T, n)
    excess = (y.double() - want).abs() - bound - 1e-5 * want.abs() - 1e-6
    assert excess.max() <= 0, f"off by {excess.max():.3g} beyond float32's bound"
    assert not tiny_verify.count.any()
    assert splits > 1 or k < 4 * bk * 2 or tiles * 2 > 264  # the split path is exercised


def test_rmsnorm_rows_match_the_module(tiny_verify):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, tiny_verify.args.hidden_size, generator=g) * 3
    rms = RMSNorm(x.shape[1], 1e-6)
    rms.weight.data = torch.randn(x.shape[1], generator=g)
    torch.testing.assert_close(tiny_verify._norm(rms, x, 7)[:7], rms(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "family,attention,cublas,defer,k_splits,swap,flash_splits",
    [
        ("llama", "fused", (), False, {}, 0, 1),
        ("qwen2", "fused", (), False, {}, 0, 1),
        ("qwen2", "fused", CUBLAS_PRODUCTS, False, {}, 0, 1),
        ("llama", "matmul", ("o",), False, {}, 0, 1),
        ("llama", "flash", CUBLAS_PRODUCTS, False, {}, 0, 1),
        ("qwen2", "auto", (), False, {}, 0, 1),
        ("llama", "flash", CUBLAS_PRODUCTS, True, {}, 0, 1),
        ("qwen2", "auto", ("down",), True, {}, 0, 1),
        ("llama", "flash", CUBLAS_PRODUCTS, True, {"qkv": 4, "o": 2, "down": 4}, 0, 1),
        ("qwen2", "flash", CUBLAS_PRODUCTS, True, {"qkv": 2, "down": 2}, 0, 1),
        ("qwen2", "flash", (), False, {}, 1, 1),
        ("llama", "flash", ("o", "down"), True, {}, 1, 1),
        ("llama", "flash", CUBLAS_PRODUCTS, True, {}, 0, 3),
    ],
)
def test_verify_step_matches_the_modules(family, attention, cublas, defer, k_splits, swap, flash_splits, tmp_path):
    """Five tree rows at scattered slots with their own ancestor masks, over three attention splits (or as products);
    the products on the Triton kernel split over K (combined by the last slice; swap: its tiles as weights @ x.T),
    or on cuBLAS with the RoPE / SiLU kernels (qwen2: biases), the residual adds of o and down done at once or
    (defer) by the next norm kernel, the last one by the final norm and the taps taken after it, products as one
    call or as partials over K's slices (k_splits) that the RoPE kernel (q/k/v, with qwen2's bias) or the next norm
    kernel (o, down) sums, flash attention's walk in one program or in interleaved splits (flash_splits): the modules'
    logits, taps and cache writes."""
    ckpt = make_checkpoint(family, tmp_path, seed=3, num_hidden_layers=3, **WIDE_HEADS)
    model = fuse_projections(copy.deepcopy(load_target(ckpt, device="cpu", dtype=torch.float32).model))
    ft = FastTarget(model, size=150, taps=(0, 2), float32_logits=True)
    swapped = {name: (16, 16, 1, 2, 1) for name in ("qkv", "gate_up", "lm_head")}
    fv = FusedVerify(
        model,
        ft.cache,
        taps=(0, 2),
        blocks={"down": (16, 16, 1, 2, swap), "o": (16, 16, 1, 2, swap), **(swapped if swap else {})},
        attention=attention,
        cublas=cublas,
        defer_residual=defer,
    )
    fv.k_splits.update(k_splits)
    if flash_splits > 1:  # 32-slot blocks: the five below the highest allowed slot (131), split unevenly
        fv.flash_launch = (16, 32, 1, 2, flash_splits)
    if attention == "matmul":  # a compiled attention that fails gives way to the plain ops

        def failing(*args):
            raise RuntimeError("inductor failed")

        fv._attend = failing
    P, T = 6, 5
    ft.prefill(torch.arange(3, 3 + P))
    slots, pos = torch.tensor([P, P + 1, 70, 71, 131]), torch.tensor([P, P + 1, P + 1, P + 2, P + 3])
    mask = torch.zeros(T, 150, dtype=torch.bool)
    mask[:, :P] = True
    mask[torch.arange(T), slots] = True
    mask[1, P] = mask[3, 70] = True
    mask[4, [P, P + 1]] = True
    toks = torch.tensor([11, 60, 2, 33, 8])
    depth = len(model.model.layers) + 1  # every layer, then the head
    assert_step_matches_modules(ft, fv, toks, pos, mask, slots, depth)
    assert not fv.count.any()  # split-K counters back to zero for the next call
    assert attention != "matmul" or fv._attend is _attend_products
    assert not FusedVerify.supports_rows(1) and not FusedVerify.supports_rows(MAX_ROWS + 1)


def test_speculative_decoding_through_fused_steps_and_verifies_is_vanilla_greedy(tmp_path, monkeypatch):
    """One target serving both decoders: one-token steps on the fused decode kernels, verifies on the fused verify
    kernels; both give vanilla greedy's tokens. Every round's verify is handed its attention limit (t_len + N): the
    one attention_limit finds in its mask."""
    ckpt = make_checkpoint("llama", tmp_path, seed=7, num_hidden_layers=7, **WIDE_HEADS)
    tgt = load_target(ckpt, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(ckpt, taps=tgt.taps, seed=14, scale=1.0)  # a seed whose random draft gets hits
    draft.load_target_embedding(target_embedding(tgt))
    ft = FastTarget(copy.deepcopy(tgt.model), 64, taps=tgt.taps.layers, fuse=True, fused_decode=True, fused_verify=True)
    prompt, n = [3, 17, 5, 40, 22, 9, 11], 12
    ref = generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids
    assert FastVanilla(ft, n).generate(prompt).tokens == ref
    limits = []
    verify = FusedVerify.__call__

    def handed_limit(self, tokens, positions, mask, slots, limit=None):
        if limit is not None:
            limits.append((int(limit), int(attention_limit(mask))))
        return verify(self, tokens, positions, mask, slots, limit)

    monkeypatch.setattr(FusedVerify, "__call__", handed_limit)
    fast = FastEagle(ft, draft, 3, 3, 8, max_len=len(prompt) + n + 2).generate(prompt, n)
    assert fast.tokens == ref
    assert sum(fast.accepted) > 0
    assert len(limits) == len(fast.accepted) and all(given == found for given, found in limits)


def test_chunked_prefill_matches_the_modules_and_its_padding_is_never_read(tmp_path):
    """graph_prefill: a prompt in PREFILL_ROWS-row chunks of the fused verify (uncaptured on a CPU, the same calls a
    GPU replays) gives the modules' logits, taps and cache entries for each prompt row, padded chunks included; a
    prompt whose padding would not fit the cache prefills on the modules; and greedy decoding after a padded chunk
    (the pad rows' K/V left in the slots after the prompt) is vanilla greedy's, through one-token steps and through
    speculative verifies alike."""
    ckpt = make_checkpoint("llama", tmp_path, seed=7, num_hidden_layers=3, **WIDE_HEADS)
    tgt = load_target(ckpt, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract((0, 1, 2), 3))  # the embedding, then what enters layers 1 and 2
    size = 2 * PREFILL_ROWS + 16
    kw = dict(taps=tgt.taps.layers, fuse=True, fused_decode=True, fused_verify=True)
    chunked = FastTarget(copy.deepcopy(tgt.model), size, graph_prefill=True, **kw)
    modules = FastTarget(copy.deepcopy(tgt.model), size, graph_prefill=False, **kw)
    g = torch.Generator().manual_seed(0)
    for n in (5, PREFILL_ROWS, PREFILL_ROWS + 6):
        prompt = torch.randint(0, tgt.model.args.vocab_size, (n,), generator=g)
        for ft in (chunked, modules):
            ft.cache.k.zero_()
            ft.cache.v.zero_()
        got, want = chunked.prefill(prompt), modules.prefill(prompt)
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        depth = len(tgt.model.model.layers) + 1
        assert_close_float32(got[0], want[0], depth, key=f"logits of {n}")
        assert_close_float32(got[1], want[1], depth, key=f"taps of {n}")
        for name in ("k", "v"):
            ours, theirs = getattr(chunked.cache, name), getattr(modules.cache, name)
            assert_close_float32(ours[..., :n, :], theirs[..., :n, :], depth, key=f"cache.{name} of {n}")
            end = -(-n // PREFILL_ROWS) * PREFILL_ROWS
            assert not ours[..., end:, :].any()  # nothing past the last chunk
    assert chunked._chunk is not None and modules._chunk is None
    small = FastTarget(copy.deepcopy(tgt.model), PREFILL_ROWS + 8, graph_prefill=True, **kw)
    prompt = torch.arange(3, 3 + PREFILL_ROWS + 2)  # its second chunk's padding would pass the cache's end
    torch.testing.assert_close(small.prefill(prompt), small._run_eager(prompt, *_causal(small, prompt)), rtol=0, atol=0)
    assert small._chunk is None

    draft, _ = make_draft(ckpt, taps=tgt.taps, seed=14, scale=1.0)
    draft.load_target_embedding(target_embedding(tgt))
    prompt, new = torch.randint(0, tgt.model.args.vocab_size, (PREFILL_ROWS + 6,), generator=g).tolist(), 10
    ref = generate_vanilla(tgt, prompt, new, stop_ids=[]).token_ids
    assert FastVanilla(chunked, new).generate(prompt).tokens == ref
    fast = FastEagle(chunked, draft, 3, 3, 8, max_len=len(prompt) + new + 2).generate(prompt, new)
    assert fast.tokens == ref


def _causal(ft, prompt):
    slots = torch.arange(prompt.shape[0])
    return slots, torch.arange(ft.size)[None, :] <= slots[:, None], slots


def test_cublaslt_only_for_products_left_to_cublas(tiny_verify):
    fv = FusedVerify(tiny_verify.model, tiny_verify.cache, cublas=("o", "down"))
    assert fv.cublaslt == ("down",)  # the default, for the products cuBLAS runs
    with pytest.raises(ValueError, match="cuBLASLt runs products left to cuBLAS"):
        FusedVerify(tiny_verify.model, tiny_verify.cache, cublas=("o",), cublaslt=("down",))


def test_narrow_heads_are_refused(tmp_path):
    model = load_target(make_checkpoint("llama", tmp_path, num_hidden_layers=2), device="cpu").model  # head_dim 16
    with pytest.raises(ValueError, match="head_dim >= 32"):
        FastTarget(model, size=16, fuse=True, fused_verify=True)
