"""Compare a trace with its golden replay; name the cause of the first divergence.

Walk the replay's events in order; the first canonical stage whose trace tensor differs is where
the wiring first goes wrong (later stages inherit the error, so they are not diagnosed). At that
stage each named hypothesis is a *re-run of the golden path with that one mistake*: it builds the
tensor the mistake would have produced there (from the replay's own tensors, or by replaying again
with the mistake in the proposer). A cause is named only if its tensor reproduces the trace's at the
first divergent stage (within tolerance) while the clean path's does not; its confidence comes from
that test (how much closer the mistake gets than the clean path and than the next-best other cause).
A divergence no hypothesis reproduces is reported as DIVERGENCE_UNEXPLAINED at that stage, with the
rows that differ, by how much, and the stages the trace would need to locate it better.

Rows of a tree step are compared by content (the node each row holds, as the replay paired them:
replay.step<k>.trace_rows), so an engine that keeps its frontier in another order is not a divergence.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.decode.speculative import Eagle3Proposer
from eaglescope.detective.findings import Finding, rank
from eaglescope.detective.replay import (
    REPLAY_COPIES_TARGET,
    REPLAY_FINAL,
    REPLAY_PREFIX,
    comparable_rows,
    pairwise_row_errors,
    replay,
    replay_hs,
    replay_rows,
    row_norms,
)
from eaglescope.draft import LoadedDraft
from eaglescope.errors import EagleScopeError
from eaglescope.target.base import Target
from eaglescope.target.layer_states import input_norm


@dataclass(frozen=True)
class Precision:
    """How far a correct engine's values may lie from the replay's: `rel`, the relative error of a hidden state;
    `nats`, the absolute error of a log-prob (relative error is meaningless for log-probs near 0; candidates this
    close may also swap ranks)."""

    rel: float
    nats: float


# By the coarsest float the traced run or the replay computed in. A 32-bit engine against the 32-bit replay differs
# by summation order only (~1e-6; TF32 matmuls ~1e-3). bf16 engines against a float32 replay land around 1e-2 on a
# trained model's activations and up to 0.05 on the test suite's random 8-layer target (tests/engines), and their
# draft log-probs within ~0.1-0.25 nats (logits of a few units, 8-bit mantissas). Wiring mistakes land at 0.3 and
# above, RoPE position mistakes at 0.05-0.1 on the rows they move: a 16-bit trace cannot show those.
PRECISION_32 = Precision(rel=0.02, nats=0.05)
PRECISION_16 = Precision(rel=0.08, nats=0.3)
# Stages the replay copies from the trace (it follows the trace's decisions): never evidence.
FORCED = {T.VERIFY_TOKENS, T.VERIFY_PARENTS, T.VERIFY_ACCEPTED, T.VERIFY_BONUS}
# A fingerprint's error is a Johnson-Lindenstrauss estimate: ||(a-b) P||² / ||a-b||² is χ²(d)/d for d projected
# dimensions (P's entries are N(0, 1/16)). A row is called different only when its estimate exceeds what a row at
# the tolerance reads at this many standard deviations (one clean row in ~10^4 reads above it).
FP_Z = 3.7


def fp_slack(dof: int) -> float:
    """How far above the true error a χ²(dof) projection estimate reads at FP_Z (Wilson-Hilferty's quantile)."""
    c = 2.0 / (9.0 * max(dof, 1))
    return math.sqrt(max(1.0 - c + FP_Z * math.sqrt(c), 1.0) ** 3)


@torch.no_grad()
def on_model(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`fn` (a model's module) over evidence `x`. The evidence (trace and replay tensors, read from disk) stays on
    the host, where every comparison is made; the models live on --device: `x` goes to `like`'s (a weight's) device
    and dtype for the call, and the result comes back as host float32."""
    return fn(x.to(like)).float().cpu()


# -- comparing one observation with one reference ------------------------------------------------------------------
@dataclass
class Cmp:
    """How an observation compares with a reference: `score` is the worst error over its tolerance (≤ 1: the
    same; None: shapes differ), `err` the headline error (relative L2; nats for log-probs; the share of
    unexplained ids for top-k ids), `bad_rows` the rows beyond tolerance and `row_err` every row's error."""

    score: float | None
    err: float | None
    bad_rows: list[int] = field(default_factory=list)
    row_err: list[float] = field(default_factory=list)

    @property
    def match(self) -> bool:
        return self.score is not None and self.score <= 1.0


_NO_SHAPE = Cmp(None, None)


def precision_of(*dtypes: torch.dtype | str | None) -> Precision:
    """The precision of values computed in these dtypes (the coarsest decides; None and non-float dtypes are ignored).
    A trace's log-probs are float32 even from a bf16 engine: its precision is that of its coarsest tensor."""
    names = [str(d).removeprefix("torch.") for d in dtypes if d is not None]
    coarse = any(n in ("bfloat16", "float16", "half") or n.startswith("float8") for n in names)
    return PRECISION_16 if coarse else PRECISION_32


def compare_rows(obs, ref: torch.Tensor, tol: float, absolute: bool = False) -> Cmp:
    """`obs` (tensor or fingerprint) against the reference tensor `ref`, row by row. Relative errors by default;
    `absolute`: absolute differences (log-probs, in nats: a full row's max |diff|, a fingerprint's its L2 norm over
    the row's K values, bounded by K^½ times the max). Row norms are exact even in a fingerprint; the rest is the
    projections' estimate, compared with the tolerance widened by `fp_slack`."""
    if tuple(obs.shape) != tuple(ref.shape):
        return _NO_SHAPE
    a, b = comparable_rows(obs, ref), comparable_rows(ref, obs)
    if a.shape[0] == 0 or a.numel() == 0:
        return Cmp(0.0, 0.0)
    fp = isinstance(obs, T.Fingerprint)
    dof = a.shape[1]
    row_tol = tol * (fp_slack(dof) if fp else 1.0)
    d = a - b
    if absolute:
        width = ref.shape[-1] if ref.dim() else 1
        row_err = d.norm(dim=-1) if fp else d.abs().max(dim=-1).values
        row_tol = row_tol * (math.sqrt(width) if fp else 1.0)
        err = float(row_err.max())
        bad = row_err > row_tol
        score = err / row_tol
    else:
        bn, an = row_norms(ref), row_norms(obs)
        # the denominator is the reference row's exact norm (a fingerprint keeps it): only ||a - b|| is estimated
        row_err = T._rel(d, bn[:, None], dim=-1)
        err = float(T._rel(d, bn))
        ratio_dev = (T._ratio(an, bn) - 1.0).abs()
        bad = (row_err > row_tol) | (ratio_dev > tol)
        all_tol = tol * (fp_slack(dof * a.shape[0]) if fp else 1.0)
        score = max(err / all_tol, float(row_err.max()) / row_tol, float(ratio_dev.max()) / tol)
    return Cmp(score, err, [int(i) for i in torch.nonzero(bad).flatten().tolist()], [float(x) for x in row_err])


@dataclass
class Head:
    """One way of turning a draft step's rows into top-k target ids: log-probs over the draft vocabulary [n, Vd]
    and the map from draft ids to target ids."""

    lp: torch.Tensor
    to_target: Callable[[torch.Tensor], torch.Tensor]
    nats: float  # the log-prob tolerance (Precision.nats)

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        vals, ids = self.lp.topk(min(k, self.lp.shape[-1]), dim=-1)
        return self.to_target(ids), vals

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """The draft id this head maps to each target id (-1 where none does)."""
        table = self.to_target(torch.arange(self.lp.shape[-1])).long()
        hi = int(max(int(table.max()), int(target_ids.max()))) + 1
        inverse = torch.full((hi,), -1, dtype=torch.long)
        mapped = torch.nonzero(table >= 0).flatten().flip(0)  # draft ids the map places (a fitted map may leave some)
        inverse[table[mapped]] = mapped  # written last to first: the first id wins on collisions
        t = target_ids.long()
        return torch.where(t >= 0, inverse[t.clamp_min(0)], torch.full_like(t, -1))

    def compare(self, obs: dict, only: str | None = None) -> Cmp:
        """The trace's top-k parts (`ids` [n, K] in full, `logprobs` [n, K] tensor or fingerprint) against this head
        (`only`: score that part alone). Ids may differ only between candidates this head scores within `nats` (a
        precision tie); log-probs are compared with the head's values of the ids the trace chose."""
        ids, vals = obs.get(T.TOPK_IDS), obs.get(T.TOPK_LOGPROBS)
        shape = tuple((ids if ids is not None else vals).shape)
        if len(shape) != 2 or shape[0] != self.lp.shape[0]:
            return _NO_SHAPE
        mine, mine_vals = self.topk(shape[1])
        if tuple(mine.shape) != shape:
            return _NO_SHAPE
        scores, errs, bad = [], [], set()
        chosen = None
        if ids is not None:
            ids = ids.long()
            obs_d = self.draft_ids(ids)
            diff = ids != mine
            ok = ~diff
            if bool(diff.any()):
                my_d = self.draft_ids(mine)
                valid = obs_d >= 0
                gap = (self.lp.gather(-1, obs_d.clamp_min(0)) - self.lp.gather(-1, my_d.clamp_min(0))).abs()
                ok = ok | (valid & (gap <= self.nats))
                ok = ok & ~_repeats(ids)
            share = float((~ok).double().mean())
            if only in (None, T.TOPK_IDS):
                scores.append(0.0 if share == 0 else 1.0 + share)
                errs.append(share)
                bad |= {int(r) for r in torch.nonzero(~ok.all(dim=-1)).flatten().tolist()}
            if bool((obs_d >= 0).all()):
                chosen = self.lp.gather(-1, obs_d)
        if vals is not None and only in (None, T.TOPK_LOGPROBS):
            c = compare_rows(vals, chosen if chosen is not None else mine_vals, self.nats, absolute=True)
            if c.score is None:
                return _NO_SHAPE
            scores.append(c.score)
            errs.append(c.err)
            bad |= set(c.bad_rows)
        if not scores:
            return _NO_SHAPE
        return Cmp(max(scores), max(errs), sorted(bad))


def _repeats(ids: torch.Tensor) -> torch.Tensor:
    """[n, K] bool: an id that occurs earlier in its row (top-k ids are distinct: a repeat is never a tie)."""
    eq = ids[:, :, None] == ids[:, None, :]
    return torch.tril(eq, diagonal=-1).any(-1)


def golden_value(golden: T.Trace, stage: str, rnd: int, part: str | None = None):
    """A replay's value of `stage` in round `rnd` (None if it has none), a tree step's rows put in the trace's order:
    replay row j holds the node the trace keeps in row replay.step<k>.trace_rows[j]."""
    try:
        v = golden.get(stage, rnd, part=part) if part else golden.get(stage, rnd)
    except KeyError:
        return None
    step = T.parse_stage(stage)[1] if stage.startswith("draft.step") else None
    if not step or not isinstance(v, torch.Tensor):
        return v
    try:
        rows = golden.get(replay_rows(step), rnd).long()
    except KeyError:
        return v
    if rows.numel() != v.shape[0] or not torch.equal(rows.sort().values, torch.arange(rows.numel())):
        return v
    out = torch.empty_like(v)
    out[rows] = v
    return out


# -- the evidence at hand -------------------------------------------------------------------------------------------
class Evidence:
    """Access to the trace, the replay and the models at one (round, stage)."""

    def __init__(self, target: Target, loaded: LoadedDraft, trace: T.Trace, golden: T.Trace, tol: float | None):
        self.target, self.loaded, self.trace, self.golden, self.fixed_tol = target, loaded, trace, golden, tol
        self.draft = loaded.model
        self.taps = loaded.contract.taps
        self.H = target.hidden_size
        self._trace_keys = {(e.stage, e.round, e.part) for e in trace.events}
        floats = {e.dtype for e in trace.events if e.dtype.startswith(("float", "bfloat"))}
        self.precision = precision_of(*floats, trace.meta.get("dtype"), target.dtype)
        self.tried: dict[str, float | None] = {}  # every hypothesis tested ("CODE: name" → its score), for the report

    def has(self, stage: str, rnd: int) -> bool:
        return any((stage, rnd, p) in self._trace_keys for p in (None, T.TOPK_IDS, T.TOPK_LOGPROBS))

    def g(self, stage: str, rnd: int, part: str | None = None):
        """The golden value, its rows in the trace's order (tree steps are paired by content)."""
        return golden_value(self.golden, stage, rnd, part)

    def t(self, stage: str, rnd: int, part: str | None = None):
        try:
            return self.trace.get(stage, rnd, part=part) if part else self.trace.get(stage, rnd)
        except KeyError:
            return None

    def topk_obs(self, stage: str, rnd: int) -> dict:
        return {p: v for p in (T.TOPK_IDS, T.TOPK_LOGPROBS) if (v := self.t(stage, rnd, p)) is not None}

    def compare(self, observed, reference: torch.Tensor) -> Cmp:
        return compare_rows(observed, reference.detach().float().cpu(), self.tol(observed))

    def tol(self, observed) -> float:
        """The relative tolerance for `observed`: the caller's, else the trace's precision."""
        return self.fixed_tol if self.fixed_tol is not None else self.precision.rel

    def best(self, candidates: dict[str, torch.Tensor], observed) -> tuple[str | None, dict[str, float | None]]:
        """Name of the candidate the observation matches (lowest score among matches) and every candidate's score."""
        scores, hits = {}, []
        for name, cand in candidates.items():
            c = self.compare(observed, cand)
            scores[name] = c.score
            if c.match:
                hits.append((c.score, name))
        return (min(hits)[1] if hits else None), scores

    # -- the draft's head ---------------------------------------------------------------------------------------
    def head_rows(self, step: int, rnd: int, n: int, source: T.Trace | None = None) -> torch.Tensor | None:
        """The golden (or `source` replay's) pre-norm outputs of step `step` behind the trace's n top-k rows."""
        h = golden_value(source if source is not None else self.golden, T.draft_hidden_out(step), rnd)
        if h is None:
            return None
        if step == 0 and h.shape[0] != n:
            h = h[-n:]  # only the last row (the root's) proposes; an engine may record every row's top-k
        return h if h.shape[0] == n else None

    @torch.no_grad()
    def head(self, h: torch.Tensor, variant: str | None = None, to_target=None) -> Head:
        """The draft's head over pre-norm outputs `h` [n, H], or with one head mistake (`variant`)."""
        d = self.draft
        x = h.to(d.fc.weight)
        if variant == "final norm skipped":
            y = d.lm_head(x)
            y = y * d.config.logit_scale if d.config.logit_scale != 1.0 else y
        elif variant == "logit_scale not applied":
            y = d.lm_head(x if d.config.norm_output else d.norm(x))
        else:
            y = d.logits(x)
        lp = torch.log_softmax(y.float(), dim=-1).cpu()
        return Head(lp, to_target or (lambda i: d.to_target_ids(i.to(d.d2t.device)).cpu()), self.precision.nats)

    @torch.no_grad()
    def normed(self, i: int, hs: torch.Tensor) -> torch.Tensor | None:
        """Layer i's input RMSNorm applied to hidden state i: what a 'normed tap' captures."""
        norm = input_norm(self.target, i)
        if norm is None:
            return None
        return on_model(norm, hs, norm.weight)

    def hidden_states(self, rnd: int) -> dict[int, torch.Tensor]:
        out = {}
        for i in range(self.target.num_layers):
            h = self.g(replay_hs(i), rnd)
            if h is not None:
                out[i] = h.float()
        return out


# -- hypotheses are judged by one rule -------------------------------------------------------------------------
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
    # is capped lower than one whose tensor was reproduced.
    max_confidence: float = 0.95


def judge(
    ev: Evidence, stage: str, rnd: int, clean: Cmp, hypotheses: list[Hypothesis], extra: dict | None = None
) -> list[Finding]:
    """The finding of the hypothesis that reproduces the observation best, if any does while the clean path does
    not. Confidence 0.5-0.95: 0.5 + 0.45 x how far below both the clean path's score and the best other code's
    score the hypothesis's is (1 - best/other; an exact reproduction against a clear divergence gives 0.95)."""
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
    confidence = min(0.5 + 0.45 * max(0.0, min(seps)), best.max_confidence)
    evidence = {
        "reproduced_by": best.name,
        "score": best_score,
        "clean_score": clean.score,
        "clean_error": clean.err,
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
    return [Finding(best.code, stage, verdict, evidence, best.fix, confidence, rnd)]


def _tensor_hypothesis(ev: Evidence, observed, code, name, verdict, fix, candidate, **evidence) -> Hypothesis:
    return Hypothesis(code, name, verdict, fix, lambda: ev.compare(observed, candidate).score, evidence=evidence)


def _segments(observed, count: int, H: int) -> list:
    if isinstance(observed, T.Fingerprint):
        return [observed.segment(j) for j in range(count)] if observed.segments == count else []
    if observed.shape[-1] != count * H:
        return []
    return [observed[..., j * H : (j + 1) * H] for j in range(count)]


# -- taps --------------------------------------------------------------------------------------------------------
def diagnose_taps(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    """Which hidden state each captured segment holds, judged over the round's whole capture.

    A wrong order or a consistent shift only shows across segments, so the verdict comes from the
    concatenation the draft received (target.aux) when the trace has it, else from the per-tap stages.
    Engines label per-tap stages with the contract's layers even when they capture others.
    """
    contract = list(ev.taps.layers)
    views: list[tuple[str, list[int], list]] = []
    aux = observed if stage == T.TARGET_AUX else ev.t(T.TARGET_AUX, rnd)
    candidates = _tap_candidates(ev, rnd)
    if aux is not None:
        segs = _segments(aux, len(contract), ev.H)
        if segs:
            views.append((T.TARGET_AUX, contract, segs))
        elif stage == T.TARGET_AUX:
            return _aux_of_other_width(ev, rnd, stage, aux, candidates, contract)
    present = [(i, ev.t(T.target_tap(i), rnd)) for i in contract]
    present = [(i, x) for i, x in present if x is not None]
    if present:
        views.append(("taps", [i for i, _ in present], [x for _, x in present]))
    if stage != T.TARGET_AUX and T.parse_stage(stage)[1] not in contract:
        views.append((stage, [T.parse_stage(stage)[1]], [observed]))
    for where, expected, segs in views:
        if (found := _taps_held(ev, rnd, where, expected, segs, candidates)) is not None:
            return [found]
    return []


def _tap_candidates(ev: Evidence, rnd: int, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Every state a capture could have taken in round `rnd` (each hidden state, its layer's normed input, the final
    normed state), at the given rows of the round's target forward (all of them by default)."""
    candidates: dict[str, torch.Tensor] = {}
    for i, h in ev.hidden_states(rnd).items():
        candidates[f"hs{i}"] = h
        n = ev.normed(i, h)
        if n is not None:
            candidates[f"normed{i}"] = n
    final = ev.g(REPLAY_FINAL, rnd)
    if final is not None:  # a fingerprint where the engine recorded it (detective/layer_taps.py)
        candidates["final"] = final if isinstance(final, T.Fingerprint) else final.float()
    return candidates if rows is None else {k: v[rows] for k, v in candidates.items()}


def _taps_held(ev: Evidence, rnd: int, where: str, expected: list[int], segs: list, candidates: dict):
    """The capture mistake the segments `segs` (one per expected tap) show, or None when each holds its tap."""
    found, scores = [], []
    for seg in segs:
        name, s = ev.best(candidates, seg)
        found.append(name)
        scores.append(s)
    if all(f == f"hs{x}" for f, x in zip(found, expected)):
        return None  # this view is right: the divergence is elsewhere (e.g. precision)
    if where == "taps":
        where = next(T.target_tap(x) for f, x in zip(found, expected) if f != f"hs{x}")
    # The reproduction test, per segment that is not the contract's tap: what it holds against the clean tap.
    wrong = [(s.get(f) or 0.0, s.get(f"hs{x}") or math.inf) for f, x, s in zip(found, expected, scores)
             if f is not None and f != f"hs{x}"]  # fmt: skip
    seps = [1.0 - mine / max(clean, 1e-12) for mine, clean in wrong]
    evidence = {
        "stage": where,
        "expected_taps": expected,
        "found": found,
        "score_vs_expected": [s.get(f"hs{x}") for s, x in zip(scores, expected)],
        "reproduced_by": "the segments holding " + ", ".join(str(f) for f in found),
        "score": max((m for m, _ in wrong), default=None),
        "clean_score": min((c for _, c in wrong), default=None),
    }
    confidence = 0.5 + 0.45 * max(0.0, min(seps)) if seps else 0.5
    return _classify_taps(where, expected, found, evidence, rnd, confidence)


def _handed_taps(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    """next.hidden_in as the tap capture of the rows handed on: an engine whose drafter receives only the accepted rows
    (vLLM without its padded drafter batch) concatenates the taps there, and a mistake in that concatenation shows
    first at this stage."""
    acc = ev.g(T.VERIFY_ACCEPTED, rnd)
    if rnd == 0:
        rows = None
    elif acc is None:
        return []
    else:
        rows = torch.tensor([0] + [int(i) for i in acc.flatten().tolist()])
    candidates = _tap_candidates(ev, rnd, rows)
    segs = _segments(observed, ev.taps.count, ev.H)
    if not segs or any(c.shape[0] != observed.shape[0] for c in candidates.values()):
        return []
    found = _taps_held(ev, rnd, stage, list(ev.taps.layers), segs, candidates)
    return [] if found is None else [found]


def _aux_of_other_width(ev: Evidence, rnd: int, stage: str, aux, candidates: dict, contract: list[int]):
    """target.aux of another width than the contract's taps. H wide: the draft received one hidden state, which its fc
    (nH → H) cannot take; an engine that checks widths then skips fc (EAGLE-2 wiring hands on the final normed
    state)."""
    shape = list(aux.shape)
    if shape[-1] == ev.H:
        h = _tensor_hypothesis
        named = {"final": "the target's final normed state (EAGLE-2's wiring)"}
        hyps = [
            h(
                ev,
                aux,
                "FC_SKIPPED",
                what,
                f"{stage} is {what}, {ev.H} wide, not the {len(contract)} taps "
                f"{contract}: the draft's fc ({len(contract)}x{ev.H} → {ev.H}) cannot apply to it and was skipped",
                "capture the contract's taps (the residual stream entering each tap layer), concatenate them and "
                "apply fc: an EAGLE-3 draft does not read the final normed state",
                cand,
            )
            for key, cand in candidates.items()
            if (what := named.get(key) or (f"hidden state {key[2:]} alone" if key.startswith("hs") else None))
        ]
        clean = Cmp(math.inf, None)  # no clean tensor has this width
        found = judge(ev, stage, rnd, clean, hyps)
        if found:
            return found
    return [
        Finding(
            "DIVERGENCE_UNEXPLAINED",
            stage,
            f"{stage} has shape {shape}, the contract needs {len(contract)} taps of width {ev.H}",
            {"shape": shape, "taps": contract},
            "record the concatenation of exactly the contract's taps",
            0.5,
            rnd,
        )
    ]


def _classify_taps(
    stage: str, expected: list[int], found: list[str | None], evidence: dict, rnd: int, confidence: float
) -> Finding:
    """Name the capture mistake from what each segment holds (found: "hs<i>", "normed<i>", "final" or None)."""
    fix_conv = (
        "check the tap contract and the engine's layer-id convention (eaglescope inspect shows what SGLang "
        "and vLLM capture)"
    )
    what = "segment" if stage == T.TARGET_AUX else "tap"
    raw = [int(f[2:]) if f and f.startswith("hs") else None for f in found]
    normed = [(j, int(f[6:])) for j, f in enumerate(found) if f and f.startswith("normed")]
    if normed:
        j, layer = normed[0]
        where = "" if layer == expected[j] else f" (and of layer {layer}, not {expected[j]})"
        return Finding(
            "TAP_NORMED",
            stage,
            f"{what} {j} of {stage} is the RMS-normed input of layer {layer}{where}, not the raw residual stream",
            evidence,
            "capture the hidden state entering the layer (before input_layernorm)",
            confidence,
            rnd,
        )
    if "final" in found:
        j = found.index("final")
        return Finding(
            "TAP_WRONG_LAYER",
            stage,
            f"{what} {j} of {stage} is the target's final normed state, not tap {expected[j]}",
            evidence,
            fix_conv,
            confidence,
            rnd,
        )
    if None not in raw and sorted(raw) == sorted(expected) and raw != expected:
        return Finding(
            "TAP_ORDER",
            stage,
            f"{stage} holds the right taps in the order {raw} instead of {expected}",
            evidence,
            "concatenate taps from low to high layer",
            confidence,
            rnd,
        )
    emb = [j for j, (r, e) in enumerate(zip(raw, expected)) if r is not None and (r == 0) != (e == 0)]
    if emb:
        j = emb[0]
        held = "the embedding output" if raw[j] == 0 else f"layer {raw[j]}'s input"
        return Finding(
            "TAP_EMBEDDING",
            stage,
            f"{what} {j} of {stage} is {held}; the contract expects tap {expected[j]}",
            evidence,
            fix_conv,
            confidence,
            rnd,
        )
    if None not in raw and all(abs(r - e) <= 1 for r, e in zip(raw, expected)):
        deltas = sorted({r - e for r, e in zip(raw, expected) if r != e})
        return Finding(
            "TAP_OFF_BY_ONE",
            stage,
            f"{stage} holds taps {raw} instead of {expected} (off by {', '.join(f'{d:+d}' for d in deltas)})",
            evidence,
            fix_conv + "; SGLang adds +1 to explicit ids",
            confidence,
            rnd,
        )
    if None not in raw:
        return Finding(
            "TAP_WRONG_LAYER",
            stage,
            f"{stage} holds taps {raw} instead of {expected}",
            evidence,
            fix_conv,
            confidence,
            rnd,
        )
    return _unexplained_finding(
        stage,
        rnd,
        f"{stage} matches no hidden state of the target (segments found: {found})",
        evidence,
        "compare the engine's capture code with the contract",
    )


# -- fc -----------------------------------------------------------------------------------------------------------
def _fc_again(ev: Evidence, x: torch.Tensor) -> dict[str, torch.Tensor]:
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
        for i, seg in zip(ev.taps.layers, _segments(pf, ev.taps.count, ev.H)):
            hyps.append(
                _tensor_hypothesis(
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
            _tensor_hypothesis(
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
        for how, cand in _fc_again(ev, fc_out.float()).items():
            hyps.append(
                _tensor_hypothesis(
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
        _tensor_hypothesis(
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
        rules = _feature_rules(ev, rnd - 1, aux.float(), observed.shape[0])
        return [
            _tensor_hypothesis(
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


# -- what is handed to the next round --------------------------------------------------------------------------
_STALE_FIX = "feed hidden_states[accepted_indices] (root + accepted nodes) to the next draft pass"


def _feature_rules(ev: Evidence, rnd: int, aux: torch.Tensor, n: int) -> dict[str, tuple[str, torch.Tensor, str]]:
    """Round `rnd`'s next-round features as wrongly selecting engines compute them: name → (code, rows, fix)."""
    out = {
        "all tree positions": ("STALE_ACCEPTED", aux, _STALE_FIX),
        "first rows in tree order": ("STALE_ACCEPTED", aux[:n], _STALE_FIX),
    }
    acc, parents = ev.g(T.VERIFY_ACCEPTED, rnd), ev.g(T.VERIFY_PARENTS, rnd)
    if acc is not None and parents is not None and aux.shape[0] == parents.numel():
        path = [0] + [int(i) for i in acc.flatten().tolist()]
        kids = [i for i, p in enumerate(parents.tolist()) if p == path[-1]]
        # The features of the emitted tokens' own positions: the root's dropped, each accepted node's kept, and for
        # the bonus token (not in the tree) some row after the path: a child of its last node, or that node again.
        for after in kids + [path[-1]]:
            rows = path[1:] + [after]
            out[f"emitted tokens' own positions (rows {rows})"] = (
                "SHIFT_OFF_BY_ONE",
                aux[torch.tensor(rows)],
                "hand on the features of the root and the accepted nodes (each paired with the token after it), not "
                "those at the emitted tokens' own positions",
            )
    return out


def diagnose_stale(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    aux = ev.g(T.TARGET_AUX, rnd)
    gold = ev.g(T.NEXT_HIDDEN_IN, rnd)
    if aux is None or gold is None:
        return []
    n = observed.shape[0]
    rules = _feature_rules(ev, rnd, aux.float(), n)
    prev = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    if prev is not None:
        rules["previous round's features"] = ("STALE_ACCEPTED", prev.float(), _STALE_FIX)
    hyps = [
        _tensor_hypothesis(
            ev,
            observed,
            code,
            name,
            f"next-round features are the {name}, not the accepted "
            f"positions ({gold.shape[0]} rows expected, {n} given)",
            fix,
            rows,
            rows_expected=gold.shape[0],
            rows_given=n,
        )
        for name, (code, rows, fix) in rules.items()
    ]
    return judge(ev, stage, rnd, ev.compare(observed, gold), hyps) or _handed_taps(ev, rnd, stage, observed)


# -- token embeddings -------------------------------------------------------------------------------------------
def _sequence(ev: Evidence) -> list[int]:
    """The emitted sequence the traced run followed: prompt, first token, then each round's tokens."""
    seq = list(ev.golden.meta.get("prompt_ids", []))
    for rnd in sorted(ev.golden.rounds()):
        bonus = ev.g(T.VERIFY_BONUS, rnd)
        if rnd == 0:
            seq.append(int(bonus.flatten()[0]))
            continue
        acc, toks = ev.g(T.VERIFY_ACCEPTED, rnd), ev.g(T.VERIFY_TOKENS, rnd)
        if acc is None or toks is None or bonus is None:
            break
        seq += [int(toks[i]) for i in acc.flatten().tolist()] + [int(bonus.flatten()[0])]
    return seq


_TABLE_CHUNK = 8192  # rows of the embedding table compared at once: a 163840 x 7168 table is 9.4 GB in float64


def _nearest_rows(emb: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the table row nearest to each row, ||row - that table row|| / ||that table row||), in float64, the
    table read in chunks so that a large vocabulary is never copied whole."""
    x = rows.detach().double().cpu()
    best_d = torch.full((x.shape[0],), math.inf, dtype=torch.float64)
    best_i = torch.zeros(x.shape[0], dtype=torch.long)
    for start in range(0, emb.shape[0], _TABLE_CHUNK):
        part = emb[start : start + _TABLE_CHUNK].detach().double().cpu()
        d, i = torch.cdist(x, part).min(dim=-1)
        closer = d < best_d
        best_d, best_i = torch.where(closer, d, best_d), torch.where(closer, i + start, best_i)
    norms = emb[best_i].detach().double().cpu().norm(dim=-1)
    return best_i, best_d / norms.clamp_min(1e-12)


def _tokens_of(emb: torch.Tensor, rows: torch.Tensor) -> list[int] | None:
    """The token whose embedding each row is (the golden rows are the target's table exactly), or None."""
    idx, rel = _nearest_rows(emb, rows)
    return [int(i) for i in idx.tolist()] if bool((rel <= 1e-3).all()) else None


def diagnose_embed(ev: Evidence, rnd: int, stage: str, observed, step: int) -> list[Finding]:
    gold = ev.g(stage, rnd)
    if gold is None:
        return []
    emb = ev.draft.embed_tokens.weight
    clean = ev.compare(observed, gold)
    hyps: list[Hypothesis] = []
    if step == 0:
        seq = _sequence(ev)
        P = gold.shape[0]
        # pending features sit at positions [start, start+P) and pair with the token after each position
        prompt_len = len(ev.golden.meta.get("prompt_ids", []))
        start = _committed_before(ev, rnd, prompt_len)
        right = [seq[p + 1] if 0 <= p + 1 < len(seq) else 0 for p in range(start, start + P)]
        for name, ids, layout in _shifted_tokens(seq, start, P, right):
            cand = emb[torch.tensor(ids, device=emb.device)].float().cpu()
            hyps.append(
                _tensor_hypothesis(
                    ev, observed, "SHIFT_OFF_BY_ONE", name, _shift_verdict(name, layout, right[-1]), _SHIFT_FIX, cand,
                    bonus_row=layout,
                )
            )  # fmt: skip
    found = judge(ev, stage, rnd, clean, hyps)
    if found:
        return found
    if (other := _other_tokens(emb, gold, observed, ev.tol(observed))) is not None:
        return [_other_tokens_finding(stage, rnd, *other, embedded=True)]
    return judge(ev, stage, rnd, clean, _other_table_hypotheses(ev, rnd, stage, observed, gold))


_SHIFT_FIX = "pair features at position t with the embedding of token t+1"


def _shifted_tokens(seq: list[int], start: int, P: int, right: list[int]):
    """(name, token per row, bonus-row layout) of the step-0 pairings a shift mistake gives for the P rows from
    position `start`: each row's own token or the one two ahead, plainly, and as an engine lays them out that writes
    the round's newest token (the bonus) on the row it samples from after shifting (vLLM's set_inputs_first_pass
    writes next_token_ids at token_indices_to_sample): every row shifted but the last, which stays right."""
    for delta, name in ((0, "the token at the feature's own position"), (2, "the token two ahead")):
        ids = [seq[p + delta] if 0 <= p + delta < len(seq) else 0 for p in range(start, start + P)]
        yield name, ids, False
        if P > 1:
            yield f"{name}, the sampled row keeping the newest token", ids[:-1] + right[-1:], True


def _shift_verdict(name: str, layout: bool, newest: int) -> str:
    if not layout:
        return f"step-0 inputs pair each feature with {name} instead of the next token"
    what = name.removesuffix(", the sampled row keeping the newest token")
    return (
        f"step-0 inputs pair each feature with {what} instead of the next token, except the row the draft samples "
        f"from, which holds the round's newest token ({newest}) as the engine writes it there after the shift "
        "(vLLM's padded drafter batch): the rotation by one before it was skipped or doubled"
    )


def _other_tokens_finding(stage: str, rnd: int, rows: list[int], fed: list[int], want: list[int], embedded: bool):
    held = (
        f"the target's embedding of tokens {fed}, not of {want}: the embedding is right but"
        if embedded
        else (f"tokens {fed}, not {want}:")
    )
    return _unexplained_finding(
        stage,
        rnd,
        f"{stage} rows {rows} are {held} other tokens were fed at those rows (no named hypothesis covers that)",
        {"rows": rows, "fed_tokens": fed, "expected_tokens": want},
        "pair each position's features with the token after it at every row (vLLM 0.32's padded drafter "
        "batch pairs the last row of a prefill chunk with the prompt's last token: disable_padded_drafter_"
        "batch, or prefill unchunked)",
    )


def diagnose_tokens(ev: Evidence, rnd: int, stage: str, observed, step: int) -> list[Finding]:
    """The token ids step 0 read (draft.step0.tokens), compared exactly: a shift mistake, in vLLM's layout or plainly,
    or other tokens at a few rows. A later step's tokens are the previous step's drafts, so a difference there shows
    at that step's top-k first."""
    gold = ev.g(stage, rnd)
    if step != 0 or gold is None or not isinstance(observed, torch.Tensor) or observed.shape != gold.shape:
        return []
    obs, want = [int(x) for x in observed.flatten().tolist()], [int(x) for x in gold.flatten().tolist()]
    seq = _sequence(ev)
    start = _committed_before(ev, rnd, len(ev.golden.meta.get("prompt_ids", [])))
    bad = [i for i, (a, b) in enumerate(zip(obs, want)) if a != b]
    clean = Cmp(2.0, len(bad) / max(len(obs), 1), bad)
    hyps = [
        Hypothesis("SHIFT_OFF_BY_ONE", name, _shift_verdict(name, layout, want[-1]), _SHIFT_FIX,
                   lambda ids=ids: 0.0 if ids == obs else 2.0, evidence={"bonus_row": layout, "rows_read": len(obs)})
        for name, ids, layout in _shifted_tokens(seq, start, len(obs), want)
    ]  # fmt: skip
    found = judge(ev, stage, rnd, clean, hyps)
    if found or len(bad) == len(obs):
        return found
    return [_other_tokens_finding(stage, rnd, bad, [obs[i] for i in bad], [want[i] for i in bad], embedded=False)]


def _other_table_hypotheses(ev: Evidence, rnd: int, stage: str, observed, gold: torch.Tensor) -> list[Hypothesis]:
    """EMBEDDING_MISMATCH reproduced from the trace itself: every row is the engine's embedding of its (right) token as
    the engine embeds that token wherever else it recurs in the trace from this round on (another row, step or round),
    and none is the target's. An engine that embeds with another table (another model, another version of it) passes;
    one whose rows vary for the same token, or that feeds other tokens, does not."""
    emb = ev.draft.embed_tokens.weight
    tokens = _tokens_of(emb, gold) or []
    here = comparable_rows(observed, observed)
    elsewhere: dict[int, list[torch.Tensor]] = {}  # token → the trace's comparable rows of it at other places
    for e in ev.trace.events:
        # before this round the engine's embeddings matched the target's (the divergence starts here)
        if not tokens or T.parse_stage(e.stage)[0] != "draft.embed_in" or e.round < rnd:
            continue
        g = ev.g(e.stage, e.round)
        toks = _tokens_of(emb, g) if g is not None else None
        rows = comparable_rows(ev.trace.load(e), observed)
        if toks is None or rows.shape[1] != here.shape[1]:
            continue
        for i, t in enumerate(toks):
            elsewhere.setdefault(t, []).append((e.stage, e.round, i, rows[i]))
    norms = row_norms(observed)
    errors = [
        float((here[j] - row).norm() / norms[j].clamp_min(1e-30))
        for j, t in enumerate(tokens)
        for where_stage, where_round, i, row in elsewhere.get(t, [])
        if (where_stage, where_round, i) != (stage, rnd, j)
    ]
    checked = sum(1 for j, t in enumerate(tokens) if len(elsewhere.get(t, [])) > 1)
    slack = fp_slack(here.shape[1]) if isinstance(observed, T.Fingerprint) else 1.0

    def score() -> float | None:
        # nothing else in the trace to reproduce these rows from: the hypothesis cannot be tested
        return max(errors) / (ev.tol(observed) * slack) if errors else None

    fix = "use the target's embed_tokens in the draft (do not ship or load another embedding, nor another version's)"
    reproduced = Hypothesis(
        "EMBEDDING_MISMATCH",
        "another embedding table",
        f"{stage} differs from the target's embedding of the same tokens, and the engine embeds each token the same "
        f"way wherever it recurs in the trace ({checked} of {len(tokens)} rows checked against {len(errors)} other "
        "occurrences): another table",
        fix,
        score,
        evidence={"rows_checked": checked, "rows": len(tokens), "occurrences": len(errors)},
    )
    if errors:
        return [reproduced]

    def no_token_of_the_table() -> float | None:
        # no row is any token's row of the target's table (the tokens are not merely other ones)
        nearest = math.inf
        for start in range(0, emb.shape[0], _TABLE_CHUNK):
            err = pairwise_row_errors(observed, emb[start : start + _TABLE_CHUNK].detach().float().cpu())
            if err is None:
                return None
            nearest = min(nearest, float(err.min()))
        return None if nearest <= ev.tol(observed) * slack else 0.0

    return [
        Hypothesis(
            "EMBEDDING_MISMATCH",
            "another embedding table (unconfirmed)",
            f"{stage} differs from the target's embedding of the same tokens and no row is any token's row of the "
            "target's table: another table, by elimination (no token recurs in the trace to confirm that the engine "
            "embeds it the same way each time)",
            fix,
            no_token_of_the_table,
            max_confidence=0.6,
        )
    ]


def _other_tokens(emb: torch.Tensor, gold, observed, tol: float) -> tuple[list[int], list[int], list[int]] | None:
    """(rows, fed token ids, expected token ids) when the rows of `observed` that differ from `gold` are each exactly
    a row of the embedding table (so the table is right and the tokens are not); None otherwise."""
    if not (isinstance(observed, torch.Tensor) and isinstance(gold, torch.Tensor)) or observed.shape != gold.shape:
        return None
    a, b = observed.double().cpu(), gold.double().cpu()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
    rows = [int(i) for i in torch.nonzero(err > tol).flatten().tolist()]
    if not rows or len(rows) == a.shape[0]:  # every row differs: a table or a shift, not a few wrong tokens
        return None

    def lookup(x: torch.Tensor) -> list[int] | None:
        idx, rel = _nearest_rows(emb, x)
        return [int(i) for i in idx.tolist()] if bool((rel <= tol).all()) else None

    fed, want = lookup(a[rows]), lookup(b[rows])
    if fed is None or want is None:
        return None
    return rows, fed, want


def _committed_before(ev: Evidence, rnd: int, prompt_len: int) -> int:
    """First position of round `rnd`'s pending features: the root position of round rnd-1 (0 for round 1)."""
    if rnd <= 1:
        return 0
    pos = prompt_len
    for r in range(1, rnd - 1):
        acc = ev.g(T.VERIFY_ACCEPTED, r)
        pos += 1 + (0 if acc is None else acc.numel())
    return pos


# -- feedback between draft steps -------------------------------------------------------------------------------
def diagnose_feedback(ev: Evidence, rnd: int, stage: str, observed, step: int) -> list[Finding]:
    gold = ev.g(stage, rnd)
    fc_out = ev.g(T.DRAFT_FC_OUT, rnd)
    if gold is None:
        return []
    m = gold.shape[0]
    h = _tensor_hypothesis
    postnorm = on_model(ev.draft.norm, gold, ev.draft.fc.weight)
    hyps = [
        h(
            ev,
            observed,
            "FEEDBACK_POSTNORM",
            "postnorm",
            f"draft step {step} received the normed output of step {step - 1} instead of its pre-norm output",
            "feed the layer's output before the final norm to the next step",
            postnorm,
        )
    ]
    target_fix = "after step 0, feed the draft's own pre-norm output, not the target's hidden states"
    target_verdict = f"draft step {step} received the target's features instead of the draft's own output"
    if fc_out is not None:
        hyps.append(
            h(
                ev,
                observed,
                "FEEDBACK_TARGET_FEATURES",
                "fc of the root's target features",
                target_verdict,
                target_fix,
                fc_out.float()[-1:].expand(m, -1),
            )
        )
        for how, cand in _fc_again(ev, gold.float()).items():
            hyps.append(
                h(
                    ev,
                    observed,
                    "FC_REPEATED",
                    f"fc again ({how})",
                    f"draft step {step} applied fc again to the draft's own output ({how})",
                    "apply fc only to the target's features at step 0",
                    cand,
                )
            )
    pending = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    if pending is not None:
        for i, seg in zip(ev.taps.layers, _segments(pending.float(), ev.taps.count, ev.H)):
            hyps.append(
                h(
                    ev,
                    observed,
                    "FEEDBACK_TARGET_FEATURES",
                    f"raw tap {i} of the root",
                    target_verdict,
                    target_fix,
                    seg[-1:].expand(m, -1),
                )
            )
    return judge(ev, stage, rnd, ev.compare(observed, gold), hyps, {"step": step})


# -- positions ---------------------------------------------------------------------------------------------------
# A hypothesis tested on top-k alone is tested on this many rounds after the first divergent one too.
_TOPK_ROUNDS = 2


class _Offset(Eagle3Proposer):
    """The draft side of the round (the code both backends run) with one position rule shifted by `delta` from trace
    round `from_round` on; the golden replay runs it on the reference backend."""

    delta = 0
    from_round = 1

    def _shift(self) -> int:
        # The replay's recorder is at the round being drafted: a fault that starts late shifts only from there.
        return self.delta if self.rec is not None and self.rec.round >= self.from_round else 0


class _TreeOffset(_Offset):
    def tree_position(self, root_position, level):
        return super().tree_position(root_position, level) + self._shift()


class _CatchUpOffset(_Offset):
    def catch_up_positions(self, start, count):
        return super().catch_up_positions(start, count) + self._shift()


_PASSES = {
    "catch-up": "the catch-up pass (draft step 0, over the positions handed in)",
    "tree": "the tree steps (draft steps k >= 1)",
}
_POSITION_FIX = "draft step k uses position (feature position + k), continuing the committed cache"


def diagnose_positions(ev: Evidence, rnd: int, stage: str, observed, step: int, trace_dir, tmp: Path) -> list[Finding]:
    """The RoPE positions a draft step ran at (draft.step<k>.positions), compared exactly: one offset over every row
    names the pass (step 0's catch-up, or the tree steps) and its sign. The golden path re-run with that offset
    reproduces the positions, and the evidence says whether it also reproduces the step's output (an engine whose
    cache slots moved with its positions computes something else again)."""
    gold = ev.g(stage, rnd)
    if gold is None or not isinstance(observed, torch.Tensor) or observed.shape != gold.shape:
        return []
    deltas = (observed.long().flatten() - gold.long().flatten()).unique()
    if deltas.numel() != 1 or int(deltas[0]) == 0:
        return []
    d, pass_ = int(deltas[0]), "tree" if step > 0 else "catch-up"
    cls = _TreeOffset if step > 0 else _CatchUpOffset
    variant = type(f"{cls.__name__}{d}", (cls,), {"delta": d, "from_round": rnd})
    evidence: dict = {"pass": pass_, "offset": d, "step": step, "positions": observed.flatten().tolist()[:8],
                      "expected": gold.flatten().tolist()[:8]}  # fmt: skip

    def score() -> float | None:
        alt = T.load_trace(replay(ev.target, ev.loaded, trace_dir, tmp / f"pos-{pass_}{d:+d}", proposer_cls=variant,
                                  until_round=rnd))  # fmt: skip
        cand = golden_value(alt, stage, rnd)
        if cand is None or not torch.equal(cand.long(), observed.long()):
            return None
        out, alt_out = ev.t(T.draft_hidden_out(step), rnd), golden_value(alt, T.draft_hidden_out(step), rnd)
        if out is not None and alt_out is not None:
            c = ev.compare(out, alt_out.float())
            evidence["hidden_out_reproduced"], evidence["hidden_out_score"] = c.match, c.score
        return 0.0

    verdict = (
        f"RoPE positions in {_PASSES[pass_]} are offset by {d:+d}: step {step} ran at {evidence['positions']} where "
        f"the contract puts {evidence['expected']} (round {rnd})"
    )
    hyp = Hypothesis("POSITION_OFFSET", f"{pass_} {d:+d}", verdict, _POSITION_FIX, score, evidence=evidence)
    clean = Cmp(2.0, 1.0, list(range(observed.numel())))
    found = judge(ev, stage, rnd, clean, [hyp])
    for f in found:
        if f.evidence.get("hidden_out_reproduced") is False:
            f.verdict += f"; re-run with that offset, step {step}'s output still differs (the engine's cache moved too)"
            f.confidence = min(f.confidence, 0.7)
    return found


def _position_hypotheses(
    ev: Evidence, rnd: int, stage: str, part: str | None, observed, step: int, trace_dir, tmp: Path
) -> list[Hypothesis]:
    """Re-run the replay with the draft's positions shifted; each variant's tensor at the first divergent stage (and
    part: a top-k compares ids and log-probs) is what that offset would have produced there."""
    out = []
    for cls, deltas in ((_TreeOffset, (1, -1, 2)), (_CatchUpOffset, (1, -1))):
        if step == 0 and cls is _TreeOffset:
            continue
        tree = cls is _TreeOffset
        for d in deltas:
            # the first divergent round is where the offset starts (an earlier start would have shown earlier)
            variant = type(f"{cls.__name__}{d}", (cls,), {"delta": d, "from_round": rnd})
            where = _PASSES["tree" if tree else "catch-up"]
            name = f"{'tree' if tree else 'catch-up'} {d:+d}"

            def score(variant=variant, name=name) -> float | None:
                path = tmp / f"pos-{name.replace(' ', '')}"
                last = rnd + _TOPK_ROUNDS if T.parse_stage(stage)[0] == "draft.topk" else rnd
                alt_dir = replay(ev.target, ev.loaded, trace_dir, path, proposer_cls=variant, until_round=last)
                alt = T.load_trace(alt_dir)
                if T.parse_stage(stage)[0] != "draft.topk":
                    cand = golden_value(alt, stage, rnd, part)
                    return None if cand is None else ev.compare(observed, cand.float()).score
                # a few top-k rows say little: the offset must reproduce every later top-k of this and the next rounds
                places = [
                    (e.stage, e.round)
                    for e in ev.trace.events
                    if e.part == T.TOPK_IDS and rnd <= e.round <= last
                    and (e.round > rnd or T.parse_stage(e.stage)[1] >= step)
                ]  # fmt: skip
                scores = []
                for s, r in places:
                    obs = ev.topk_obs(s, r)
                    h = ev.head_rows(T.parse_stage(s)[1], r, obs[T.TOPK_IDS].shape[0], source=alt)
                    scores.append(None if h is None else ev.head(h).compare(obs).score)
                return _worst(scores)

            out.append(
                Hypothesis(
                    "POSITION_OFFSET",
                    name,
                    f"RoPE positions in {where} are offset by {d:+d}",
                    _POSITION_FIX + " (a trace that records draft.step<k>.positions tells the passes apart)",
                    score,
                    tier=2,
                    evidence={"offset": d, "pass": "tree" if tree else "catch-up"},
                )
            )
    return out


def _norm_output_hypothesis(ev: Evidence, rnd: int, stage: str, observed, trace_dir, tmp: Path) -> Hypothesis:
    """Re-run the replay with the draft's norm_output read the other way from round `rnd` on: a norm_output draft
    whose steps hand on their pre-norm output with the norm before lm_head (an older SpecForge's meaning of the
    flag), or a draft without it whose steps hand on the post-norm output (an engine that assumes the flag). The
    logits are the same either way; what the next step receives (hidden_out) is not."""
    d = ev.loaded.model
    c = d.config
    flipped = copy.copy(d)  # the same modules and weights, another config
    object.__setattr__(flipped, "config", dataclasses.replace(c, norm_output=not c.norm_output))
    loaded = dataclasses.replace(ev.loaded, model=flipped)

    def score() -> float | None:
        alt_dir = replay(ev.target, loaded, trace_dir, tmp / "norm-output-flipped", until_round=rnd)
        cand = golden_value(T.load_trace(alt_dir), stage, rnd)
        return None if cand is None else ev.compare(observed, cand.float()).score

    if c.norm_output:
        name = "norm_output read as 'norm before lm_head'"
        verdict = (
            f"{stage} is the draft layer's pre-norm output: the draft was trained with norm_output (the next step "
            "receives the post-norm output) and the engine reads the flag as 'norm before lm_head' (an older "
            "SpecForge's meaning), handing the pre-norm output on"
        )
    else:
        name = "norm_output the draft was not trained with"
        verdict = (
            f"{stage} is the draft layer's post-norm output: the engine hands each step's normed output on as if the "
            "draft had norm_output, and the draft was trained without it"
        )
    fix = (
        "serve norm_output as vLLM, speculators and eaglescope read it: when config.json sets it the next step "
        "receives the post-norm output (lm_head reads it as it is), otherwise the pre-norm output (lm_head reads "
        "norm of it)"
    )
    return Hypothesis("EAGLE31_NORM", name, verdict, fix, score, tier=2, evidence={"norm_output": c.norm_output})


# -- the draft's head: top-k ids and log-probs ------------------------------------------------------------------
def _map_variants(ev: Evidence) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The draft→target id maps of engines that read d2t wrongly (each differs from the checkpoint's map)."""
    d = ev.draft
    d2t = d.d2t.detach().long().cpu()
    n = d2t.shape[0]
    maps: dict[str, Callable] = {
        "d2t not applied (draft ids used as target ids)": lambda i: i.long().cpu(),
        "d2t written as arange(draft_vocab) under the offset convention (target id = 2 x draft id)": lambda i: (
            2 * i.long().cpu()
        ),
        "d2t applied twice": lambda i: i.long().cpu() + 2 * d2t[i.long().cpu()],
        "the map read one row late": lambda i: (i.long().cpu() + 1) % n + d2t[(i.long().cpu() + 1) % n],
        "the map read one row early": lambda i: (i.long().cpu() - 1) % n + d2t[(i.long().cpu() - 1) % n],
    }
    clean = d.to_target_ids(torch.arange(n, device=d.d2t.device)).cpu()
    return {k: f for k, f in maps.items() if not torch.equal(f(torch.arange(n)), clean)}


def _tie_aware_pairs(head: Head, ids: torch.Tensor) -> tuple[list[tuple[int, int]], list[tuple[list[int], list[int]]]]:
    """(draft id, the target id the trace gave it) for each top-k entry, and the entries no single draft id explains.
    Candidates this head scores within its tolerance (a precision tie) may come in either order: within such a group
    both sides are paired in sorted order, which an increasing map preserves. A group that ties with candidates the
    top-k left out is ambiguous: its target ids came from some of those draft ids, which ones is open (returned as
    (the draft ids in the tie, best first; the target ids))."""
    K = ids.shape[1]
    vals, draft = head.lp.topk(min(K + 1, head.lp.shape[-1]), dim=-1)
    pairs, ambiguous = [], []
    for r in range(ids.shape[0]):
        v, d, t = vals[r].tolist(), draft[r].tolist(), ids[r].tolist()
        start = 0
        for j in range(1, K + 1):
            if j < K and v[j - 1] - v[j] <= head.nats:
                continue
            if j == K and K < len(v) and v[K - 1] - v[K] <= head.nats:
                # the group's last member ties with a candidate the top-k left out: every draft id that ties with it
                # (best first; the first `start` are the groups above this one, apart by more than the tolerance)
                tied = (head.lp[r] >= v[K - 1] - head.nats).nonzero().flatten()
                tied = tied[head.lp[r][tied].argsort(descending=True)].tolist()[start:]
                ambiguous.append((tied, t[start:K]))
                break
            pairs += list(zip(sorted(d[start:j]), sorted(t[start:j])))
            start = j
    return pairs, ambiguous


def _increasing(f: dict[int, int]) -> bool:
    order = sorted(f)
    return len(set(f.values())) == len(f) and all(f[a] < f[b] for a, b in zip(order, order[1:]))


def _resolve_ties(f: dict[int, int], ambiguous: list[tuple[list[int], list[int]]]) -> bool:
    """Extend the map `f` (draft id → target id) with the tie groups' entries where the map allows it: a target id
    the map already has must come from a draft id in the tie; each other one from a tied draft id the map has not
    placed, the best-scored ones first, paired in sorted order (an increasing map keeps it). False when a group
    cannot be placed so that the map stays one-to-one and increasing."""
    for tied, targets in ambiguous:
        inverse = {t: d for d, t in f.items()}
        if any(t in inverse and inverse[t] not in tied for t in targets):
            return False
        new = sorted(t for t in targets if t not in inverse)
        free = sorted([d for d in tied if d not in f][: len(new)])
        if len(free) < len(new):
            return False
        f.update(zip(free, new))
        if not _increasing(f):
            return False
    return True


def _relabelling(ev: Evidence, stage: str, rnd: int, head: Head, obs: dict) -> Hypothesis | None:
    """LM_HEAD_MAP_MISALIGNED: the log-probs are the draft's own, but its top-k reach the target as other tokens, and
    consistently so: from this round on, each draft id always becomes the same target id, no two draft ids the same
    one, in the draft ids' order (as a d2t built from another sorted hot-token list maps them: a map regenerated
    after training, or an engine's own token map such as SGLang's --speculative-token-map), inside the target's
    vocabulary."""
    if obs.get(T.TOPK_IDS) is None:
        return None
    step = T.parse_stage(stage)[1]
    seen: dict[int, list[int]] = {}  # draft id → the target ids the trace gave it
    ties: list[tuple[list[int], list[int]]] = []  # entries that one of several tied draft ids explains
    for r in sorted(ev.trace.rounds()):
        o = obs if r == rnd else ev.topk_obs(stage, r)
        ids = o.get(T.TOPK_IDS)
        if r < rnd or ids is None or ids.dim() != 2:
            continue
        h = ev.head_rows(step, r, ids.shape[0])
        if h is None:
            continue
        own = ev.head(h)
        values = own.topk(ids.shape[1])[1]  # the draft's own best values, whichever tokens the map makes of them
        if T.TOPK_LOGPROBS in o and not compare_rows(o[T.TOPK_LOGPROBS], values, own.nats, absolute=True).match:
            continue  # another ranking than the draft's own: no evidence about the map
        pairs, ambiguous = _tie_aware_pairs(own, ids.long())
        for d, t in pairs:
            seen.setdefault(d, []).append(t)
        ties += ambiguous
    f = {d: ts[0] for d, ts in seen.items() if len(set(ts)) == 1}
    vocab = int(getattr(ev.target, "vocab_size", 0) or 0)
    consistent = bool(f) and len(f) == len(seen) and _increasing(f)
    # the tied entries are placed last, where the entries one draft id explains leave room for them
    consistent = consistent and _resolve_ties(f, ties)
    consistent = consistent and all(0 <= t and (not vocab or t < vocab) for t in f.values())

    repeated = sum(len(ts) > 1 for ts in seen.values())

    def to_target(i: torch.Tensor) -> torch.Tensor:
        return torch.tensor([f.get(int(x), -1) for x in i.flatten().tolist()], dtype=torch.long).view(i.shape)

    relabelled = Head(head.lp, to_target, head.nats)
    return Hypothesis(
        "LM_HEAD_MAP_MISALIGNED",
        "another valid vocabulary map",
        f"the draft's own ranking reached the target through another vocabulary map than the checkpoint's d2t "
        f"({len(seen)} draft ids seen, each always mapped to one target id, in order; {len(f) - len(seen)} more placed "
        "among tied candidates): lm_head's rows were trained for "
        "the checkpoint's hot tokens and are read as other tokens",
        "serve the d2t/t2d the draft was trained with (the checkpoint's), not a regenerated hot-token map; if the map "
        "must change, retrain lm_head with it",
        lambda: relabelled.compare(obs).score if consistent else None,
        tier=1,
        evidence={"draft_ids_seen": len(seen), "placed_from_ties": len(f) - len(seen), "seen_more_than_once": repeated},
        # fitted to what was seen: as sure as the draft ids that recurred with the same target id make it
        max_confidence=0.6 + 0.35 * min(1.0, repeated / 5),
    )


def _head_events(ev: Evidence, stage: str, rnd: int) -> list[tuple[dict, torch.Tensor]]:
    """(the trace's top-k parts, the golden step outputs behind them) at the first divergent top-k and at step 0's of
    every round from there on. A head or map mistake acts on every top-k the engine computes; step 0's rows are the
    same in the trace and the replay whatever the trees did (its inputs are the verified features and tokens), so
    they test a hypothesis on more than the few rows of one stage."""
    out, step = [], T.parse_stage(stage)[1]
    places = [(stage, rnd)] + [(T.draft_topk(0), r) for r in sorted(ev.trace.rounds()) if r >= rnd]
    for s, r in dict.fromkeys(places):
        obs = ev.topk_obs(s, r)
        if not obs:
            continue
        h = ev.head_rows(T.parse_stage(s)[1] if s != stage else step, r, next(iter(obs.values())).shape[0])
        if h is not None:
            out.append((obs, h))
    return out


def _worst(scores) -> float | None:
    """The worst score of a hypothesis over several places (None if it could not be computed at one)."""
    scores = list(scores)
    return None if not scores or any(x is None for x in scores) else max(scores)


def diagnose_topk(ev: Evidence, rnd: int, stage: str, trace_dir, tmp: Path) -> list[Finding]:
    """Top-k ids or log-probs differ: the vocabulary map, the head (final norm, logit_scale), or a position offset
    upstream, each re-run over the golden step outputs and compared at this stage (ids and log-probs together) and,
    for the map and the head, at every later step 0 (`_head_events`)."""
    step = T.parse_stage(stage)[1]
    events = _head_events(ev, stage, rnd)
    if not events:
        return []
    obs, h = events[0]
    clean_head = ev.head(h)
    clean = clean_head.compare(obs)
    heads = [(o, ev.head(x)) for o, x in events]
    hyps: list[Hypothesis] = []
    map_fix = "map draft ids with target_id = draft_id + d2t[draft_id]; ship d2t/t2d with the checkpoint"
    for name, f in _map_variants(ev).items():
        hyps.append(
            Hypothesis(
                "VOCAB_MAP",
                name,
                f"draft token ids reached the target through a wrong map: {name}",
                map_fix,
                lambda f=f: _worst(Head(hd.lp, f, hd.nats).compare(o).score for o, hd in heads),
            )
        )
    c = ev.draft.config
    variants = {
        "final norm skipped": (
            "DRAFT_FINAL_NORM_SKIPPED",
            "lm_head applied to the layer's output without the draft's final norm",
            "apply the draft's norm (norm.weight) before lm_head",
        )
    }
    if c.norm_output:
        variants.pop("final norm skipped")  # its step output is already normed: there is no separate final norm
    if c.logit_scale != 1.0:
        variants["logit_scale not applied"] = (
            "EAGLE31_IGNORED",
            f"the draft's logits were not multiplied by its logit_scale ({c.logit_scale:g})",
            "apply logit_scale from the draft's config.json to its logits (an engine version that implements it)",
        )
    for variant, (code, verdict, fix) in variants.items():
        score = lambda v=variant: _worst(ev.head(x, v).compare(o).score for o, x in events)  # noqa: E731
        hyps.append(Hypothesis(code, variant, verdict, fix, score, evidence={"places": len(events)}))
    if (relabel := _relabelling(ev, stage, rnd, clean_head, obs)) is not None:
        hyps.append(relabel)
    hyps += _position_hypotheses(ev, rnd, stage, None, obs, step, trace_dir, tmp)
    return judge(ev, stage, rnd, clean, hyps)


# -- the walk ------------------------------------------------------------------------------------------------------
def _observed_layout(ev: Evidence, e: T.TraceEvent, obs):
    """The golden value of event `e` in the layout the trace recorded it in (None: not comparable)."""
    gold = ev.g(e.stage, e.round, part=e.part)
    family, step = T.parse_stage(e.stage)
    if family == "draft.hidden_in" and step == 0 and gold is not None and obs.shape[-1] != gold.shape[-1]:
        # an engine that fuses fc into the layer records step 0's nH-wide input: the features handed in
        pending = ev.g(T.NEXT_HIDDEN_IN, e.round - 1)
        if pending is not None and tuple(pending.shape) == tuple(obs.shape):
            return pending
    return gold


def _compare_event(ev: Evidence, e: T.TraceEvent, obs, gold) -> Cmp:
    family, step = T.parse_stage(e.stage)
    if family == "draft.topk":
        n = obs.shape[0] if len(obs.shape) else 0
        h = ev.head_rows(step, e.round, n)
        if h is None:
            return _NO_SHAPE
        return ev.head(h).compare(ev.topk_obs(e.stage, e.round), only=e.part)
    if isinstance(gold, torch.Tensor) and not gold.is_floating_point():
        same = isinstance(obs, torch.Tensor) and obs.shape == gold.shape and torch.equal(obs.long(), gold.long())
        return Cmp(0.0, 0.0) if same else Cmp(2.0, 1.0)
    return ev.compare(obs, gold)


def diagnose_trace(
    target: Target,
    loaded: LoadedDraft,
    trace_dir: Path | str,
    golden_dir: Path | str | None = None,
    tol: float | None = None,
) -> tuple[list[Finding], dict]:
    """Findings (most likely first) and context: stage_table, first_divergence, segment_norms. `tol`: the relative
    tolerance of every comparison of hidden states (default: by the trace's precision, `precision_of`)."""
    try:
        trace = T.load_trace(trace_dir)
    except T.TraceError as e:
        raise EagleScopeError(f"cannot read trace {trace_dir}: {e}") from None
    with tempfile.TemporaryDirectory(prefix="eaglescope-replay-") as tmpd:
        tmp = Path(tmpd)
        if golden_dir is None:
            golden_dir = replay(target, loaded, trace_dir, tmp / "golden")
        golden = T.load_trace(golden_dir)
        ev = Evidence(target, loaded, trace, golden, tol)
        table, first = [], None
        trace_keys = {(e.stage, e.round, e.part) for e in trace.events}
        copied = bool(golden.meta.get(REPLAY_COPIES_TARGET))  # a draft-side replay: target.* are the trace's own
        for e in golden.events:
            if e.stage.startswith(REPLAY_PREFIX) or e.stage in FORCED or (e.stage, e.round, e.part) not in trace_keys:
                continue
            if copied and e.stage.startswith("target."):
                continue
            obs = trace.get(e.stage, e.round, part=e.part) if e.part else trace.get(e.stage, e.round)
            gold = _observed_layout(ev, e, obs)
            c = _compare_event(ev, e, obs, gold) if gold is not None else _NO_SHAPE
            table.append({"round": e.round, "stage": e.stage, "part": e.part, "rel_err": c.err, "match": c.match})
            if not c.match and first is None:
                first = (e, obs, c)
        context = {"stage_table": table, "first_divergence": None, "segment_norms": _segment_norms(ev)}
        incomplete = [f] if (f := _incomplete(trace)) is not None else []
        if first is None:
            return incomplete, context
        e, obs, c = first
        context["first_divergence"] = {"round": e.round, "stage": e.stage, "part": e.part}
        findings = _explain(ev, e, obs, trace_dir, tmp)
        if not findings:
            findings = [_unexplained(ev, e, c)]
    return rank(findings + incomplete), context


def _incomplete(trace: T.Trace) -> Finding | None:
    """TRACE_INCOMPLETE when the trace says it stops before its request ended (`meta.complete` false, with the
    producer's own note in `meta.incomplete`), or when it holds no decode round: nothing the draft proposed was
    verified, so nothing of the draft can be judged healthy."""
    meta = trace.meta
    decoded = any(e.stage == T.VERIFY_ACCEPTED and e.round > 0 for e in trace.events)
    if meta.get("complete") is not False and decoded:
        return None
    why = []
    if meta.get("complete") is False:
        why.append(f"it stops before its request ended: {meta.get('incomplete') or 'no reason recorded'}")
    if not decoded:
        why.append("it holds no decode round (nothing the draft proposed was verified)")
    rounds = sorted(trace.rounds())
    return Finding(
        "TRACE_INCOMPLETE",
        None,
        f"the trace is incomplete: {'; and '.join(why)}; what it does not hold cannot be judged healthy "
        f"(rounds recorded: {len(rounds)}, finished: {meta.get('finished')})",
        {
            "complete": meta.get("complete"),
            "incomplete": meta.get("incomplete"),
            "finished": meta.get("finished"),
            "rounds": len(rounds),
            "decode_rounds": decoded,
        },  # fmt: skip
        "find why the engine stopped (its log has the error), fix it, and capture again; a request must run past "
        "its prefill for its draft to be judged",
        0.5,
    )


def _explain(ev: Evidence, e: T.TraceEvent, obs, trace_dir, tmp: Path) -> list[Finding]:
    family, idx = T.parse_stage(e.stage)
    rnd = e.round
    if family in ("target.tap", "target.aux"):
        return diagnose_taps(ev, rnd, e.stage, obs)
    if e.stage == T.NEXT_HIDDEN_IN:
        return diagnose_stale(ev, rnd, e.stage, obs)
    if e.stage == T.DRAFT_FC_OUT or (family == "draft.hidden_in" and idx == 0):
        return diagnose_fc(ev, rnd, e.stage, obs)
    if family == "draft.tokens":
        return diagnose_tokens(ev, rnd, e.stage, obs, idx)
    if family == "draft.positions":
        return diagnose_positions(ev, rnd, e.stage, obs, idx, trace_dir, tmp)
    if family == "draft.embed_in":
        return diagnose_embed(ev, rnd, e.stage, obs, idx)
    if family == "draft.hidden_in":
        return diagnose_feedback(ev, rnd, e.stage, obs, idx)
    if family == "draft.hidden_out":
        gold = ev.g(e.stage, rnd)
        if gold is None:
            return []
        hyps = _position_hypotheses(ev, rnd, e.stage, None, obs, idx, trace_dir, tmp)
        hyps.append(_norm_output_hypothesis(ev, rnd, e.stage, obs, trace_dir, tmp))
        return judge(ev, e.stage, rnd, ev.compare(obs, gold), hyps)
    if family == "draft.topk":
        return diagnose_topk(ev, rnd, e.stage, trace_dir, tmp)
    return []


# Stages upstream of each draft stage, in pipeline order: what a trace needs to say where a divergence starts.
def _upstream(ev: Evidence, e: T.TraceEvent) -> list[str]:
    """Canonical stages of the same round that come before `e` in the replay and that the trace did not record (and
    for a round's first draft stage, the previous round's next.hidden_in)."""
    missing = []
    for g in ev.golden.events:
        if g.round == e.round and (g.stage, g.part) == (e.stage, e.part):
            break
        if g.round != e.round or g.stage in FORCED or g.stage.startswith(REPLAY_PREFIX):
            continue
        if not T.is_canonical(g.stage) or g.stage.startswith("target.tap"):
            continue
        if not ev.has(g.stage, g.round) and g.stage not in missing:
            missing.append(g.stage)
    if e.stage.startswith("draft.") and e.round > 0 and not ev.has(T.NEXT_HIDDEN_IN, e.round - 1):
        missing.insert(0, f"{T.NEXT_HIDDEN_IN} (round {e.round - 1})")
    return missing


def _unexplained_finding(stage: str, rnd: int, verdict: str, evidence: dict, fix: str) -> Finding:
    return Finding("DIVERGENCE_UNEXPLAINED", stage, verdict, evidence, fix, 0.5, rnd)


def _unexplained(ev: Evidence, e: T.TraceEvent, c: Cmp) -> Finding:
    """The first divergence with its evidence: which stage, which rows, by how much, and what the trace lacks."""
    where = e.stage + (f"/{e.part}" if e.part else "")
    rows = c.bad_rows
    unit = "nats" if e.part == T.TOPK_LOGPROBS else "share of ids" if e.part == T.TOPK_IDS else "relative L2"
    total = len(c.row_err) or "?"
    if c.err is None:
        how = "the shapes differ"
    elif rows:
        worst = max((c.row_err[r] for r in rows if r < len(c.row_err)), default=None)
        how = f"rows {rows[:8]}{' …' if len(rows) > 8 else ''} of {total} differ" + (
            f" (worst {worst:.3g})" if worst is not None else ""
        )
        how += f", overall {c.err:.3g} {unit}"
    else:
        how = f"no row alone is beyond tolerance, all {total} together differ by {c.err:.3g} {unit}"
    missing = _upstream(ev, e)
    need = (
        f"; the trace does not record {', '.join(missing)}, so the divergence may start there: record them (full or "
        "fingerprint) to locate it, and to tell a fault in the draft's layer from one in its head"
        if missing
        else ""
    )
    evidence = {
        "stage": e.stage,
        "part": e.part,
        "round": e.round,
        "rel_err": c.err,
        "unit": unit,
        "rows": rows[:32],
        "row_err": [c.row_err[r] for r in rows[:32] if r < len(c.row_err)],
        "rows_total": len(c.row_err) or None,
        "missing_stages": missing,
        "tried": ev.tried,
    }
    closest = min(((v, k) for k, v in ev.tried.items() if v is not None), default=None)
    if closest is not None:
        how += f"; {len(ev.tried)} hypotheses tried, the closest ({closest[1]}) at {closest[0]:.3g}x the tolerance"
    lead = f"the trace first diverges from the golden replay at {where} (round {e.round})"
    small = _below_decision(ev, c)
    if small is not None:
        evidence["below_decision"] = small
        lead = (
            f"a small divergence that changes no decision: every one of the {small['decisions']} draft tokens the "
            f"trace proposed is the replay's own first choice, the closest by {small['margin_nats']:.3g} nats, "
            f"{small['margin_ratio']:.3g}x the largest log-prob difference seen ({small['logprob_diff_nats']:.3g} "
            f"nats); {lead}"
        )
    return _unexplained_finding(
        e.stage,
        e.round,
        f"{lead}: {how}; no named hypothesis reproduces it{need}",
        evidence,
        "compare this stage's inputs and code path with eaglescope's reference",
    )


# A divergence this many times the tolerance or less may be precision (another kernel's summation order, TF32) rather
# than wiring; it is said to change no decision when the draft's choices also leave room for twice its effect.
_SMALL = 5.0


def _below_decision(ev: Evidence, c: Cmp) -> dict | None:
    """For a greedy trace whose first divergence is small (≤ _SMALL x the tolerance): the draft decisions the trace
    recorded, all the replay's own first choice, and their smallest margin (the replay's top-1 log-prob over its
    runner-up), when that margin is more than twice the largest difference between the trace's and the replay's
    log-probs of the chosen tokens, so no decision could have gone the other way. None otherwise."""
    settings = ev.trace.meta.get("settings") or ev.trace.meta.get("decoding") or {}
    if c.score is None or c.score > _SMALL or float(settings.get("temperature") or 0.0) > 0:
        return None
    n, margins, diffs = 0, [], []
    for e in ev.trace.events:
        if e.part != T.TOPK_IDS:
            continue
        obs = ev.topk_obs(e.stage, e.round)
        ids = obs[T.TOPK_IDS].long()
        h = ev.head_rows(T.parse_stage(e.stage)[1], e.round, ids.shape[0])
        if h is None or ids.dim() != 2:
            return None
        head = ev.head(h)
        top, vals = head.topk(2)
        if not torch.equal(ids[:, 0], top[:, 0].long()) or vals.shape[-1] < 2:
            return None
        n += ids.shape[0]
        margins.append(float((vals[:, 0] - vals[:, 1]).min()))
        lp = obs.get(T.TOPK_LOGPROBS)
        if isinstance(lp, torch.Tensor):
            diffs.append(float((lp[:, 0].float() - vals[:, 0]).abs().max()))
    if not n or not diffs:
        return None
    margin, diff = min(margins), max(diffs)
    if margin <= 2.0 * diff:
        return None
    return {"decisions": n, "margin_nats": margin, "logprob_diff_nats": diff,
            "margin_ratio": margin / max(diff, 1e-12)}  # fmt: skip


def _segment_norms(ev: Evidence) -> dict | None:
    """Mean row norm of each target.aux segment in round 0, trace vs replay (for the report's plot)."""
    gold, obs = ev.g(T.TARGET_AUX, 0), ev.t(T.TARGET_AUX, 0)
    if gold is None or obs is None:
        return None
    n = ev.taps.count

    def norms(x) -> list[float]:
        if isinstance(x, T.Fingerprint):
            return [float(v) for v in x.seg_norm.float().mean(0)] if x.segments == n else []
        segs = _segments(x.float(), n, ev.H)
        return [float(s.norm(dim=-1).mean()) for s in segs]

    return {"trace": [norms(obs)], "replay": [norms(gold)], "labels": [f"tap {i}" for i in ev.taps.layers]}
