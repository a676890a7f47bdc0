"""How close two float32 computations of the same value must be, when they only sum in a different order.

A fused kernel, a static-shape backend and a module-by-module reference all compute the same products, but each
accumulates them in its own order (another blocking, another CPU's vector width). Reordering a sum of float32 terms
moves the result by a few units in the last place *of the largest partial sums*, not of the result: an element that
lands near zero in a row of values around 100 can carry an error of 1e-5 or more. A fixed absolute tolerance is
therefore wrong at both ends (too tight for large activations, too loose for small ones), and a purely elementwise
relative one is wrong for every element near zero. Tolerances here scale with the reference tensor's magnitude and
with its depth, the number of dependent layers (products, norms, attention) between the inputs and this value,
each of which can pass on and add such an error.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23
# Units in the last place, relative to the tensor's largest magnitude, that one layer of reordered float32 sums may
# move a value. Observed: 5-8 eps per layer for the draft's hidden states (tests/test_fast_trace.py); 32 leaves a
# margin for other CPUs' accumulation orders while staying ~1000x below what a wiring mistake changes.
ULPS_PER_LAYER = 32


def float32_atol(expected: torch.Tensor, depth: int = 1) -> float:
    """The absolute tolerance for a float32 value `depth` layers deep whose reference is `expected`."""
    scale = float(expected.detach().abs().amax()) if expected.numel() else 0.0
    return ULPS_PER_LAYER * EPS32 * max(depth, 1) * max(scale, 1.0)


def assert_close_float32(actual: torch.Tensor, expected: torch.Tensor, depth: int = 1, key: str = "") -> None:
    """assert_close with the tolerance of `float32_atol`, keeping assert_close's own mismatch report (prefixed with
    `key`, the tensor's name, when given)."""
    atol = float32_atol(expected, depth)
    prefix = f"{key}: " if key else ""
    torch.testing.assert_close(
        actual,
        expected,
        rtol=0.0,
        atol=atol,
        msg=lambda m: f"{prefix}{m}\n(float32 tolerance {atol:.3g} = {ULPS_PER_LAYER} eps x depth {depth} x scale)",
    )


def assert_step_matches_modules(ft, run, tokens, positions, mask, slots, depth: int) -> None:
    """`run(tokens, positions, mask, slots)`, a kernel path of the fast.FastTarget `ft`, against `ft._run_eager` (the
    model's own modules) from the same cache: logits, taps and the cache entries the step writes, each held to
    float32's bound at `depth`; the step must write some key."""
    before = (ft.cache.k.clone(), ft.cache.v.clone())
    want, want_aux = ft._run_eager(tokens, positions, mask, slots)
    want_cache = (ft.cache.k.clone(), ft.cache.v.clone())
    ft.cache.k.copy_(before[0])
    ft.cache.v.copy_(before[1])
    got, aux = run(tokens, positions, mask, slots)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close_float32(got, want, depth, key="logits")
    assert_close_float32(aux, want_aux, depth, key="aux")
    assert_close_float32(ft.cache.k, want_cache[0], depth, key="cache.k")
    assert_close_float32(ft.cache.v, want_cache[1], depth, key="cache.v")
    assert not torch.equal(want_cache[0], before[0])


def assert_draft_step_matches_modules(fused, draft, embeds, hidden, positions, slots, mask, unit: int = 1) -> None:
    """`fused` (fast.fused_draft.FusedDraftStep on `draft`'s cache) against the draft's own `step` and `logits` from
    the same cache: the cache entries the call writes (depth 1), what the next step receives (2: the projections,
    then attention and the MLP) and the head's logits over the final norm (3), each depth times `unit` (wider sums
    drift further: tests/gpu); the call must write some key."""
    cache = fused.cache
    before = (cache.k.clone(), cache.v.clone())
    with torch.inference_mode():
        want = draft.step(embeds[None], hidden[None], positions[None], cache, slots, mask[None, None])[0]
        want_logits = draft.logits(want)
    want_cache = (cache.k.clone(), cache.v.clone())
    cache.k.copy_(before[0])
    cache.v.copy_(before[1])
    cos, sin = (x[0, 0] for x in draft.midlayer.rotary(positions[None], embeds.dtype))
    out, normed = fused(embeds, hidden, cos, sin, slots, mask)
    assert_close_float32(out, want, 2 * unit, key="out")
    assert_close_float32(fused.head(normed), want_logits, 3 * unit, key="logits")
    assert_close_float32(cache.k, want_cache[0], unit, key="cache.k")
    assert_close_float32(cache.v, want_cache[1], unit, key="cache.v")
    assert not torch.equal(cache.k, before[0])
