"""Causes in fc, the projection of the concatenated taps: skipped, stale, EAGLE 3.1 norms."""

from __future__ import annotations

import torch

from eaglescope import trace as T
from eaglescope.detective.diagnose.evidence import Evidence, on_model
from eaglescope.detective.diagnose.judge import Hypothesis, judge, split_segments, tensor_hypothesis
from eaglescope.detective.diagnose.stale import feature_rules
from eaglescope.detective.findings import Finding


def fc_again(ev: Evidence, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """fc applied to the draft's own H-wide features again, as engines that re-project do it: tiled to fc's width,
    or placed in one tap's segment with the others zero (an H-wide state padded to nH)."""
    d, n = ev.draft, ev.taps.count
    out = {}
    with torch.no_grad():
        w = d.fc.weight
        out["tiled to fc's width"] = on_model(d.project, torch.cat([x] * n, dim=-1), w)
        for j in range(n):
            parts = [x if i == j else torch.zeros_like(x) for i in range(n)]
            out[f"zero-padded to fc's width (in segment {j})"] = on_model(d.project, torch.cat(parts, -1), w)
    return out


def diagnose_fc(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    """fc's output (or step 0's features): fc skipped, fc applied twice, an EAGLE 3.1 norm decision changed, or fc over
    stale features."""
    pending = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    fc_out = ev.g(T.DRAFT_FC_OUT, rnd)
    gold = ev.g(stage, rnd)
    if gold is None:
        return []
    clean = ev.compare(observed, gold)
    hyps: list[Hypothesis] = []
    skip_fix = "apply fc to the concatenated taps before the first draft step"
    if pending is not None:
        pf = pending.float()
        for i, seg in zip(ev.taps.layers, split_segments(pf, ev.taps.count, ev.H)):
            hyps.append(
                tensor_hypothesis(
                    ev,
                    observed,
                    "FC_SKIPPED",
                    f"raw tap {i}",
                    f"{stage} is the target's raw tap {i} without the fc projection",
                    skip_fix,
                    seg,
                )
            )
        hyps.append(
            tensor_hypothesis(
                ev,
                observed,
                "FC_SKIPPED",
                "raw aux",
                f"{stage} is the target's concatenated taps without the fc projection",
                skip_fix,
                pf,
            )
        )
    if fc_out is not None:
        for how, cand in fc_again(ev, fc_out.float()).items():
            hyps.append(
                tensor_hypothesis(
                    ev,
                    observed,
                    "FC_REPEATED",
                    f"fc twice ({how})",
                    f"{stage} equals fc applied to already-projected features ({how})",
                    "apply fc once, to the target's concatenated taps only",
                    cand,
                )
            )
    hyps += _eagle31_hypotheses(ev, rnd, stage, observed)
    hyps += _stale_fc_hypotheses(ev, rnd, stage, observed)
    return judge(ev, stage, rnd, clean, hyps)


def _fc_variants(d, aux: torch.Tensor) -> dict[str, torch.Tensor]:
    """fc over `aux` as an engine that reads the draft's EAGLE 3.1 norms wrongly would compute it (SGLang issue
    32226 / PR 32334: norm_before_fc ignored, accept length ~1.1). Each variant is the draft's own modules with one
    decision changed; a variant that reproduces the observed tensor names the drift."""
    c, out = d.config, {}
    with torch.no_grad():
        x = aux.to(d.fc.weight)  # the variants are the draft's own modules: computed where they live
        segs = x.chunk(c.num_aux, -1)

        def per_segment(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([n(p) for n, p in zip(d.fc_norm, t.chunk(c.num_aux, -1))], -1)

        if d.input_norm is not None:
            out["norm_before_fc skipped"] = x if d.fc_norm is None else per_segment(x)
            # the one RMSNorm over all taps applied per tap segment, its weight cut in tap-wide pieces
            parts = [
                (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + d.input_norm.eps)).to(x.dtype) * w
                for s, w in zip(segs, d.input_norm.weight.chunk(c.num_aux))
            ]
            each = torch.cat(parts, -1)
            out["norm_before_fc applied per tap segment"] = each if d.fc_norm is None else per_segment(each)
        if d.fc_norm is not None:
            out["fc_norm skipped"] = x if d.input_norm is None else d.input_norm(x)
            # one RMSNorm over the whole 3H with the segments' weights side by side, instead of one per segment
            w = torch.cat([n.weight for n in d.fc_norm])
            eps = d.fc_norm[0].eps
            one = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
            out["fc_norm as one norm over all taps"] = one if d.input_norm is None else d.input_norm(one)
        if d.input_norm is None and d.fc_norm is None:
            # a plain EAGLE-3 draft served as if it had 3.1 norms (unit weights: the engine's fresh RMSNorm)
            normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(x.dtype)
            out["a norm_before_fc the draft was not trained with"] = normed
            out["an fc_norm the draft was not trained with"] = torch.cat(
                [(s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(x.dtype)
                 for s in segs], -1)  # fmt: skip
        return {k: d.fc(v).float().cpu() for k, v in out.items()}


def _eagle31_hypotheses(ev: Evidence, rnd: int, stage: str, observed) -> list[Hypothesis]:
    """fc over the trace's own features (else the replay's) with one EAGLE 3.1 norm decision changed."""
    aux = ev.t(T.NEXT_HIDDEN_IN, rnd - 1)
    if aux is None or not isinstance(aux, torch.Tensor):
        aux = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    if aux is None or aux.shape[0] != observed.shape[0]:
        return []
    trained = on_model(ev.draft.project, aux, ev.draft.fc.weight)
    if ev.compare(observed, trained).match:
        return []  # the trained computation over these features explains it: not a norm decision
    c = ev.draft.config
    fix = (
        "serve the draft's EAGLE 3.1 options as its config.json states them (norm_before_fc in eagle_config and "
        "at the top level, fc_norm per tap segment), with an engine version that implements them"
    )
    return [
        tensor_hypothesis(
            ev,
            observed,
            "EAGLE31_NORM",
            name,
            f"{stage} is fc over the target's features with {name}: the draft was trained with "
            f"norm_before_fc={c.norm_before_fc}, fc_norm={c.fc_norm}",
            fix,
            cand,
        )
        for name, cand in _fc_variants(ev.draft, aux.float()).items()
    ]


def _stale_fc_hypotheses(ev: Evidence, rnd: int, stage: str, observed) -> list[Hypothesis]:
    """An engine that records no next.hidden_in shows wrongly selected features first at fc.out."""
    if ev.has(T.NEXT_HIDDEN_IN, rnd - 1) or rnd <= 1:
        return []
    aux = ev.g(T.TARGET_AUX, rnd - 1)
    if aux is None:
        return []
    with torch.no_grad():
        w = ev.draft.fc.weight
        rules = feature_rules(ev, rnd - 1, aux.float(), observed.shape[0])
        return [
            tensor_hypothesis(
                ev,
                observed,
                code,
                name,
                f"the draft's features are fc of the {name}, not of the accepted positions",
                fix,
                on_model(ev.draft.project, rows, w),
            )
            for name, (code, rows, fix) in rules.items()
        ]


# A 3.1 norm decision whose effect on fc's output stays inside the precision tolerance (an input norm whose trained
# weights are close to 1, followed by per-tap norms that remove its scale) changes no stage by more than a correct
# engine may, yet it changes what is served. It is named only when the trace's fc output is clearly off the trained
# computation (at least SUBTOL_FLOOR of the tolerance, far above a same-precision engine's summation-order noise) and
# fc with one norm decision changed reproduces it SUBTOL_RATIO times more closely: both relative to the trace's own
# precision, so a bf16 trace, whose noise is a large part of its tolerance, cannot meet them by chance.
SUBTOL_FLOOR = 0.1
SUBTOL_RATIO = 10.0


def eagle31_below_tolerance(ev: Evidence) -> list[Finding]:
    """EAGLE31_NORM for a trace whose draft.fc.out stays inside the tolerance (no divergence, or a later one no
    hypothesis explains), when the first round that recorded draft.fc.out is reproduced far more closely by fc with
    one EAGLE 3.1 norm decision changed than by fc as the draft was trained (both over the features the trace says it
    handed in)."""
    rounds = sorted({e.round for e in ev.trace.events if e.stage == T.DRAFT_FC_OUT and e.round > 0})
    for rnd in rounds[:1]:
        observed, aux = ev.t(T.DRAFT_FC_OUT, rnd), ev.t(T.NEXT_HIDDEN_IN, rnd - 1)
        if not isinstance(aux, torch.Tensor) or aux.shape[0] != observed.shape[0]:
            return []
        clean = ev.compare(observed, on_model(ev.draft.project, aux, ev.draft.fc.weight))
        tried = {name: ev.compare(observed, cand).score for name, cand in _fc_variants(ev.draft, aux.float()).items()}
        tried = {k: v for k, v in tried.items() if v is not None}
        if clean.score is None or not tried:
            return []
        name, best = min(tried.items(), key=lambda kv: kv[1])
        if clean.score < SUBTOL_FLOOR or best * SUBTOL_RATIO > clean.score:
            return []
        c = ev.draft.config
        verdict = (
            f"{T.DRAFT_FC_OUT} is fc over the target's features with {name}: that reproduces the trace to a relative "
            f"error of {best * ev.tol(observed):.2g}, where fc as trained is off by {clean.err:.3g} (inside the "
            f"{ev.tol(observed):.3g} a correct engine may differ by, so no stage diverges); the draft was trained with "
            f"norm_before_fc={c.norm_before_fc}, fc_norm={c.fc_norm}"
        )
        evidence = {"reproduced_by": name, "score": best, "clean_score": clean.score, "clean_error": clean.err,
                    "scores": tried, "below_tolerance": True, "margin": 1.0 - best / clean.score}  # fmt: skip
        fix = ("serve the draft's EAGLE 3.1 options as its config.json states them (norm_before_fc in eagle_config and "
               "at the top level, fc_norm per tap segment), with an engine version that implements them")  # fmt: skip
        weight = min(0.5 + 0.45 * (1.0 - best / clean.score), 0.75)  # below the ones that reproduce a divergence
        return [Finding("EAGLE31_NORM", T.DRAFT_FC_OUT, verdict, evidence, fix, weight, rnd)]
    return []
