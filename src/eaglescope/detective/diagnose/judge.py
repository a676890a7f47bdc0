"""Hypotheses are judged by one rule: a named mistake is the cause only when its re-run reproduces the trace
at the first divergent stage while the clean path does not."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from eaglescope import trace as T
from eaglescope.detective.diagnose.evidence import Cmp, Evidence
from eaglescope.detective.findings import Finding


@dataclass
class Hypothesis:
    """One named mistake: `score()` compares what it would have produced at the first divergent stage with what the
    trace holds there (≤ 1: reproduced). Tiers are tried in order, a later one only when no earlier one reproduces:
    0 the specific mistakes, 1 a general form fitted to the observation (what remains when no specific one fits),
    2 the costly ones (a replay each)."""

    code: str
    name: str
    verdict: str
    fix: str
    score: Callable[[], float | None]
    tier: int = 0
    evidence: dict = field(default_factory=dict)
    # A hypothesis that is only what remains once the others are ruled out (nothing to reproduce the tensor from)
    # ranks below one whose tensor was reproduced, and says it was fitted.
    max_weight: float = 0.95


def judge(
    ev: Evidence, stage: str, rnd: int, clean: Cmp, hypotheses: list[Hypothesis], extra: dict | None = None
) -> list[Finding]:
    """The finding of the hypothesis that reproduces the observation best, if any does while the clean path does
    not. Its evidence's `margin` is how far below both the clean path's score and the best other code's score the
    hypothesis's is (1 - best/other: 1 for an exact reproduction against a clear divergence); its ranking weight is
    0.5 + 0.45 x margin, capped for a fitted form."""
    if clean.match:
        return []
    scores: dict[str, float | None] = {}
    hits: list[tuple[float, int, Hypothesis]] = []
    for tier in sorted({h.tier for h in hypotheses}):
        if hits:
            break
        for i, h in enumerate(x for x in hypotheses if x.tier == tier):
            s = h.score()
            scores[h.name] = ev.tried[f"{h.code}: {h.name}"] = s
            if s is not None and s <= 1.0:
                hits.append((s, i, h))
    if not hits:
        return []
    best_score, _, best = min(hits, key=lambda x: (x[0], x[1]))
    others = [s for s, _, h in hits if h.code != best.code]
    # Another form of the same mistake that reproduces the observation as well: the trace cannot tell them apart
    # (e.g. RoPE offsets in two passes that leave every relative position the same), so the finding names both.
    alike = [h for s, _, h in hits if h is not best and h.code == best.code and s <= 2.0 * best_score + 0.05]
    seps = [1.0 - best_score / max(clean.score or math.inf, 1e-12)]
    if others:
        seps.append(1.0 - best_score / max(min(others), 1e-12))
    margin = max(0.0, min(seps))
    weight = min(0.5 + 0.45 * margin, best.max_weight)
    evidence = {
        "reproduced_by": best.name,
        "score": best_score,
        "clean_score": clean.score,
        "clean_error": clean.err,
        "margin": margin,
        "rows": clean.bad_rows[:16],
        "scores": scores,
        **best.evidence,
        **(extra or {}),
    }
    verdict = best.verdict
    if alike:
        evidence["equally_reproduced_by"] = [h.name for h in alike]
        verdict += "; or, reproducing the trace as well: " + "; ".join(h.verdict for h in alike)
        verdict += " (this trace cannot tell them apart)"
    support = "fitted" if best.tier == 1 or best.max_weight < 0.95 else "reproduced"
    return [Finding(best.code, stage, verdict, evidence, best.fix, weight, rnd, support)]


def tensor_hypothesis(ev: Evidence, observed, code, name, verdict, fix, candidate, **evidence) -> Hypothesis:
    return Hypothesis(code, name, verdict, fix, lambda: ev.compare(observed, candidate).score, evidence=evidence)


def split_segments(observed, count: int, H: int) -> list:
    if isinstance(observed, T.Fingerprint):
        return [observed.segment(j) for j in range(count)] if observed.segments == count else []
    if observed.shape[-1] != count * H:
        return []
    return [observed[..., j * H : (j + 1) * H] for j in range(count)]


def unexplained_finding(stage: str, rnd: int, verdict: str, evidence: dict, fix: str) -> Finding:
    return Finding("DIVERGENCE_UNEXPLAINED", stage, verdict, evidence, fix, 0.5, rnd)


def worst_score(scores) -> float | None:
    """The worst score of a hypothesis over several places (None if it could not be computed at one)."""
    scores = list(scores)
    return None if not scores or any(x is None for x in scores) else max(scores)
