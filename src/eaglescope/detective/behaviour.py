"""Behavioural checks: served acceptance against what a correct server would get, with counts and intervals.

Sources of conditional α_k (FIELD.md §5), each an `Acceptance` that keeps its counts (rounds or positions that
reached position k, and how many of them accepted it):
  served     eaglescope's own decoder on prompts from --data (greedy chain), an SGLang/vLLM log, or a trace
  expected   what a correct server gets ON THE SAME POSITIONS: the teacher-forced draft at the very rounds the
             decoder served (its root positions, in its output), or serving simulated on --data's text for an
             engine log (round roots chosen as a greedy server chooses them: after each round's accepted tokens)
  predicted  teacher-forced TTT unroll on --data, every supervised position (train.metrics' acc_k, α_k)
  training   acc_k / α_k that training wrote into the draft directory (training_metrics.json)

Why "expected" and not "predicted" is the reference for the server: TTT step k at position t computes exactly what
decoding computes at chain depth k+1 for the prefix ending at t (tests/test_ttt_equality.py), so at a served round's
root the teacher-forced hits ARE the served decisions. Averaged over every position instead, the same draft looks
better than any server sees it: a round starts only after a rejection, i.e. in the hard places, while every position
of an easy run counts as a root of its own. On the demo that bias alone made a correct server look like 0.5-0.6x of
"predicted" (issue 18).

Statistics. α_k carries a 95% Wilson interval over the rounds that reached k. τ's interval comes from a cluster
bootstrap over prompts/samples (rounds of one prompt are not independent) where the source has at least MIN_GROUPS
of them: τ ± t(G-1) × the bootstrap's standard error; otherwise (an engine's totals, training's counts, one trace)
it is the τ of every α_k at its Wilson bound with a Bonferroni z over the K positions (all K intervals hold together
with ≥ 95%, and τ is monotone in each α_k). Rounds within a request are taken as independent there, as the engine's
totals cannot say otherwise.

Findings:
  NO_TTT             step 1 healthy, later steps collapse in the teacher-forced numbers: the draft never learned to
                     read its own features (trained with TTT length 1). The cleanest evidence is teacher-forced
                     acc_k: step k sees the ground-truth tokens, so the only thing that differs from step 1 is that
                     its features are the draft's own output instead of fc(target taps).
  SERVING_MISMATCH   served τ below expected τ on the same positions: the intervals separate AND the gap is more
                     than precision or sampling explains (served < SERVING_RATIO × expected).
  OVERFIT_OR_OTHER_TRAFFIC  the draft on --data is far below what training measured (intervals separate, below
                     OVERFIT_RATIO): it fits its training set only, or --data is other traffic than it was trained for.
  UNDERTRAINED       α_1 low everywhere, predicted and served: data or capacity.
Notes (not findings): --data too small to judge a gap; the engine's traffic and --data differ (then the gap is not
blamed on the server).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import torch

from eaglescope import trace as T
from eaglescope.config import DEFAULT_DEPTH
from eaglescope.data.chat import read_conversations, render
from eaglescope.data.shards import PreparedData
from eaglescope.decode.loop import generate_speculative
from eaglescope.decode.speculative import Eagle3Proposer
from eaglescope.decode.stats import SpecStats, alpha_from_unconditional, predicted_accept_length
from eaglescope.detective.findings import Finding
from eaglescope.errors import EagleScopeError
from eaglescope.train.metrics import Batch, hit_counts, step_hits
from eaglescope.train.ttt import draft_vocab_ids, teacher_of, ttt_unroll

# α_1 at least this means the first draft step learned something, so a collapse after it is informative
# (below it "nothing works" explains everything: UNDERTRAINED).
ALPHA1_MIN = 0.3
# Collapse of conditional α: mean α_{2..K} below this fraction of α_1. A TTT-trained draft keeps α_k near α_1
# (paper Fig. 5: within ~0.8-1.1×); a draft that never saw its own features drops to a small fraction after step 1.
COLLAPSE_RATIO = 0.5
# Collapse of teacher-forced acc_k: mean acc_{2..K} below this fraction of acc_1. Under TTT acc_k decays slowly
# (EAGLE-3/SpecForge logs: acc_7 ≈ 0.85-0.95 × acc_1, and ~0.95× on eaglescope's tiny test targets); without
# TTT step 2 onwards reads features it never saw in training and acc drops to ≤ 0.6× within a few steps.
ACC_COLLAPSE_RATIO = 0.7
# Served τ below this fraction of the expected τ on the same positions, with separated intervals, is a serving
# fault. The comparison has no selection bias left (see the module docstring): a correct server matches it within
# its interval, up to precision (bf16 serving against a float32 replay moves τ by a few percent). Every wiring
# fault in the catalogue cuts τ to ≤ 0.6× (served τ 1.1-1.8 against 3+ in issue 18 and tests/vllm), so 0.8 leaves
# room on both sides.
SERVING_RATIO = 0.8
# Against training's numbers alone (no --data) the reference counts every position as a round start and comes from
# the training data: optimistic by up to ~2× on a correct server (the demo: 0.5-0.6×). Only a gap beyond that is
# named, at low confidence.
TRAINING_SERVING_RATIO = 0.45
# Teacher-forced τ on --data below this fraction of training's held-out τ (same depth, same units, separated
# intervals): the held-out split and new data of the same traffic differ by chance, which the intervals cover,
# and by a drift of ~10%; a drop of 30% or more is another distribution, or a draft that memorised its data.
OVERFIT_RATIO = 0.7
# "Low everywhere": α_1 below this on both sides, or a served τ below LOW_TAU with nothing to compare.
LOW_ALPHA1 = 0.3
LOW_TAU = 1.5
# α_k is evidence only when at least this many rounds (or positions) reached position k.
MIN_REACHED = 10
# A cluster bootstrap needs clusters: with fewer prompts/samples than this the Bonferroni-Wilson box is used (t's
# expansion in _t is also accurate from 4 degrees of freedom on).
MIN_GROUPS = 5
BOOTSTRAP_RESAMPLES = 400
# Two-sided 95%.
LEVEL = 0.95
# Mean prompt length of the served traffic and of --data more than this factor apart: other traffic. The mean over
# a few dozen requests of one workload moves by far less; another template, task or client moves it by several×.
TRAFFIC_RATIO = 2.0
# Requests (and --data samples) needed before the prompt lengths are compared at all.
MIN_TRAFFIC_REQUESTS = 8
# --data whose supervised tokens agree with the target's own greedy choice less often than this is not text the
# target writes: rounds simulated on it are not what a server sees (prepare --regenerate makes it ~1).
AGREEMENT_MIN = 0.5
# Training's acc_k file, written next to the draft's weights.
TRAINING_METRICS = "training_metrics.json"


# -- intervals --------------------------------------------------------------------------------------------------
def _z(level: float = LEVEL) -> float:
    return NormalDist().inv_cdf(0.5 + level / 2)


def _t(nu: int, level: float = LEVEL) -> float:
    """Student's t quantile (two-sided `level`) for ν degrees of freedom, by its Cornish-Fisher expansion around the
    normal one (within 0.3% of the exact value from ν = 4 on; scipy is no dependency)."""
    z = _z(level)
    return (
        z
        + (z**3 + z) / (4 * nu)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * nu**3)
    )


def wilson(k: float, n: float, z: float | None = None) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (95% unless `z`); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    z = _z() if z is None else z
    p = min(max(k / n, 0.0), 1.0)
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    # at k = 0 (k = n) the lower (upper) root is exactly 0 (1); rounding would leave it a hair inside
    return (0.0 if k <= 0 else max(0.0, centre - half)), (1.0 if k >= n else min(1.0, centre + half))


def _alpha_of(reached: Sequence[float], accepted: Sequence[float]) -> list[float]:
    return [a / r if r else math.nan for a, r in zip(accepted, reached, strict=False)]


def _tau_of(alpha: Sequence[float], depth: int) -> float:
    """τ of a chain `depth` deep; an undefined α ends the chain there (nothing reached further)."""
    defined = []
    for x in alpha[:depth]:
        if math.isnan(x):
            break
        defined.append(x)
    return predicted_accept_length(defined)


def _round_counts(accepted: Sequence[int], depths: Sequence[int], K: int) -> tuple[list[int], list[int]]:
    """(reached, accepted) per position k = 1..K over rounds: reached_k = rounds that drafted ≥ k deep and accepted
    the k-1 before it; accepted_k = those that accepted k too (decode.stats' conditional α_k, as counts)."""
    reached = [sum(1 for a, d in zip(accepted, depths, strict=True) if d >= k and a >= k - 1) for k in range(1, K + 1)]
    acc = [sum(1 for a, d in zip(accepted, depths, strict=True) if d >= k and a >= k) for k in range(1, K + 1)]
    return reached, acc


@dataclass
class Acceptance:
    source: str  # "eaglescope decoder", "vllm metrics", "teacher-forced on data", "training", ...
    alpha: list[float]  # conditional α_1..α_K; nan = undefined (nothing reached k, or not reported)
    accept_length: float | None  # τ (bonus included): measured when served, predicted from α otherwise
    acc: list[float] | None = None  # teacher-forced unconditional acc_k (training/predicted only)
    reached: list[float] | None = None  # rounds/positions that reached position k
    accepted: list[float] | None = None  # of those, how many accepted position k
    # per prompt/sample (reached, accepted): what τ's cluster bootstrap resamples; not part of to_dict
    groups: list[tuple[list[int], list[int]]] | None = field(default=None, repr=False)
    rounds: int | None = None  # verify rounds (or simulated rounds, or positions) behind the numbers

    @classmethod
    def from_groups(cls, source: str, groups: list[tuple[list[int], list[int]]], rounds: int | None = None,
                    tau: float | None = None, acc: list[float] | None = None) -> Acceptance:  # fmt: skip
        K = max((len(r) for r, _ in groups), default=0)
        reached = [sum(r[k] for r, _ in groups if k < len(r)) for k in range(K)]
        accepted = [sum(a[k] for _, a in groups if k < len(a)) for k in range(K)]
        alpha = _alpha_of(reached, accepted)
        return cls(source, alpha, _tau_of(alpha, K) if tau is None else tau, acc, reached, accepted, groups, rounds)

    @classmethod
    def from_rounds(cls, source: str, per_group: list[list[int]], depth: int) -> Acceptance:
        """Rounds that each drafted `depth` deep, as accepted lengths grouped by prompt (or sample)."""
        groups = [_round_counts(g, [depth] * len(g), depth) for g in per_group]
        n = sum(len(g) for g in per_group)
        tau = sum(a + 1 for g in per_group for a in g) / n if n else math.nan
        return cls.from_groups(source, groups, n, tau)

    @property
    def has_counts(self) -> bool:
        return bool(self.reached) and self.accepted is not None

    def tau(self, depth: int | None = None) -> float | None:
        """τ of a chain `depth` deep (its own τ when depth is None or it has no per-position α)."""
        if depth is None or not self.alpha or all(math.isnan(_nan(x)) for x in self.alpha):
            return self.accept_length
        if self.has_counts:
            return _tau_of(_alpha_of(self.reached, self.accepted), depth)
        return _tau_of(effective_alpha(self), depth)

    def tau_interval(self, depth: int | None = None) -> tuple[float, float] | None:
        """95% interval of τ at `depth` (module docstring); None when the source has no counts."""
        if not self.has_counts:
            return None
        depth = depth or len(self.reached)
        if self.groups is not None and len(self.groups) >= MIN_GROUPS:
            # Cluster bootstrap of τ's standard error, scaled by t over G-1 degrees of freedom: with a handful of
            # prompts the plain percentile interval covers 84-90% instead of 95% (measured on chains of known α).
            rng = random.Random(0)  # the same report for the same inputs
            n, taus = len(self.groups), []
            for _ in range(BOOTSTRAP_RESAMPLES):
                pick = [self.groups[rng.randrange(n)] for _ in range(n)]
                r = [sum(g[0][k] for g in pick if k < len(g[0])) for k in range(depth)]
                a = [sum(g[1][k] for g in pick if k < len(g[1])) for k in range(depth)]
                taus.append(_tau_of(_alpha_of(r, a), depth))
            mean = sum(taus) / len(taus)
            sd = math.sqrt(sum((x - mean) ** 2 for x in taus) / (len(taus) - 1))
            tau = _tau_of(_alpha_of(self.reached, self.accepted), depth)
            half = _t(n - 1) * sd * math.sqrt(n / (n - 1))
            return max(1.0, tau - half), min(depth + 1.0, tau + half)
        z = NormalDist().inv_cdf(1 - (1 - LEVEL) / (2 * max(depth, 1)))  # Bonferroni over the K positions
        bounds = [wilson(a, r, z) if r else (math.nan, math.nan) for r, a in zip(self.reached, self.accepted,
                                                                                 strict=False)][:depth]  # fmt: skip
        return _tau_of([b[0] for b in bounds], depth), _tau_of([b[1] for b in bounds], depth)

    def position(self, k: int) -> dict | None:
        """α_k (k from 0) with its count and Wilson interval; None where the source has no counts there."""
        if not self.has_counts or k >= len(self.reached):
            return None
        n, a = self.reached[k], self.accepted[k]
        lo, hi = wilson(a, n)
        return {"alpha": a / n if n else None, "n": n, "lo": lo, "hi": hi}

    def to_dict(self) -> dict:
        def clean(xs):
            return None if xs is None else [None if (x is None or math.isnan(x)) else float(x) for x in xs]

        interval = self.tau_interval()
        return {
            "source": self.source,
            "alpha": clean(self.alpha),
            "accept_length": self.accept_length,
            "accept_length_interval": list(interval) if interval else None,
            "acc": clean(self.acc),
            "reached": self.reached,
            "accepted": self.accepted,
            "rounds": self.rounds,
            "groups": None if self.groups is None else len(self.groups),
        }


def _nan(x) -> float:
    return math.nan if x is None else float(x)


def effective_alpha(a: Acceptance) -> list[float]:
    """α with evidence only: thinly supported positions → nan; undefined positions after a 0 → 0 (nothing
    got past the zero, which is itself the strongest collapse)."""
    out, dead = [], False
    for k, x in enumerate(a.alpha):
        x = _nan(x)
        if a.reached is not None and k < len(a.reached) and a.reached[k] < MIN_REACHED and not dead:
            x = math.nan
        if math.isnan(x) and dead:
            x = 0.0
        if x == 0.0:
            dead = True
        out.append(x)
    return out


def _collapse_of(values: list[float], ratio: float, name: str) -> dict | None:
    if not values or math.isnan(values[0]) or values[0] < ALPHA1_MIN:
        return None
    later = [x for x in values[1:] if not math.isnan(x)]
    if not later:
        return None
    mean_later = sum(later) / len(later)
    if mean_later >= ratio * values[0]:
        return None
    return {"metric": name, "first": values[0], "mean_later": mean_later, "ratio": mean_later / values[0]}


def collapse(a: Acceptance | None) -> dict | None:
    """Evidence of "step 1 healthy, later steps collapse" in one source; None when it does not show (or cannot).
    Teacher-forced acc_k when the source has it (≥ 2 steps), else conditional α_k."""
    if a is None:
        return None
    if a.acc is not None and len(a.acc) >= 2:
        return _collapse_of([_nan(x) for x in a.acc], ACC_COLLAPSE_RATIO, "acc")
    return _collapse_of(effective_alpha(a), COLLAPSE_RATIO, "alpha")


def informative(a: Acceptance | None) -> bool:
    """Whether a teacher-forced source can show a collapse at all (it measured at least two steps)."""
    if a is None:
        return False
    vals = a.acc if a.acc is not None else a.alpha
    return sum(1 for x in vals if not math.isnan(_nan(x))) >= 2


def _fmt(alpha: Sequence[float]) -> str:
    return "[" + ", ".join("-" if math.isnan(x) else f"{x:.2f}" for x in alpha) + "]"


def _fmt_tau(t: float | None, i: tuple[float, float] | None) -> str:
    if t is None or math.isnan(t):
        return "-"
    return f"{t:.2f}" + (f" [{i[0]:.2f}, {i[1]:.2f}]" if i else "")


# -- comparing two sources --------------------------------------------------------------------------------------
def compare(low: Acceptance, high: Acceptance, depth: int | None, ratio: float) -> dict:
    """Is `low` below `high` by more than chance (τ intervals separate) and by more than `ratio`?

    Returns {depth, tau: [low, high], interval: [low, high], ratio, separated, large, judgeable, positions: [{k,
    low, high, separated}]}: `judgeable` is False when `high` rests on fewer than MIN_REACHED rounds at position 1,
    or when the gap is large but the intervals still overlap (the data cannot tell it from chance)."""
    t_low, t_high = low.tau(depth), high.tau(depth)
    i_low, i_high = low.tau_interval(depth), high.tau_interval(depth)
    out: dict = {"low": low.source, "high": high.source, "depth": depth, "tau": [t_low, t_high],
                 "interval": [list(i_low) if i_low else None, list(i_high) if i_high else None]}  # fmt: skip
    if t_low is None or t_high is None or math.isnan(t_low) or math.isnan(t_high):
        return out | {"separated": False, "large": False, "judgeable": False, "ratio": None, "positions": []}
    # a source without an interval (an SGLang log's τ) is taken at its value
    separated = (i_low[1] if i_low else t_low) < (i_high[0] if i_high else t_high)
    large = t_low < ratio * t_high
    thin = high.has_counts and (high.reached[0] if high.reached else 0) < MIN_REACHED
    positions = []
    for k in range(depth or max(len(low.alpha), len(high.alpha))):
        a, b = low.position(k), high.position(k)
        sep = bool(a and b and a["n"] >= MIN_REACHED and b["n"] >= MIN_REACHED and a["hi"] < b["lo"])
        positions.append({"k": k + 1, "low": a, "high": b, "separated": sep})
    return out | {
        "ratio": t_low / t_high if t_high else None,
        "separated": separated,
        "large": large,
        "judgeable": not thin and (separated or not large),
        "positions": positions,
    }


def traffic(engine_prompt_mean: float | None, engine_requests: float | None, data_prompts: Sequence[int]) -> dict:
    """The served traffic against --data by mean prompt length: {"same": True/False/None (unknown), ...}."""
    out: dict = {"served_prompt_mean": engine_prompt_mean, "served_requests": engine_requests,
                 "data_prompt_mean": sum(data_prompts) / len(data_prompts) if data_prompts else None,
                 "data_samples": len(data_prompts), "same": None}  # fmt: skip
    if (engine_prompt_mean is None or not engine_requests or engine_requests < MIN_TRAFFIC_REQUESTS
            or len(data_prompts) < MIN_TRAFFIC_REQUESTS or not out["data_prompt_mean"]):  # fmt: skip
        return out
    r = engine_prompt_mean / out["data_prompt_mean"]
    out["ratio"] = r
    out["same"] = 1 / TRAFFIC_RATIO <= r <= TRAFFIC_RATIO
    return out


# -- the rules --------------------------------------------------------------------------------------------------
@dataclass
class Behaviour:
    findings: list[Finding]
    notes: list[str]
    comparisons: dict  # "serving" (served vs expected or training), "training" (predicted vs training)


def diagnose_behaviour(
    served: Acceptance | None,
    predicted: Acceptance | None,
    training: Acceptance | None = None,
    ttt_length: int | None = None,
    expected: Acceptance | None = None,
    traffic_check: dict | None = None,
    agreement: float | None = None,
) -> Behaviour:
    """NO_TTT / SERVING_MISMATCH / OVERFIT_OR_OTHER_TRAFFIC / UNDERTRAINED from whichever sources exist (rules in
    the module docstring). `expected`: what a correct server gets on the served positions (decoder) or on --data's
    text (engine log); `traffic_check`: behaviour.traffic's verdict on an engine's traffic against --data;
    `agreement`: the share of --data's supervised tokens that are the target's own greedy choice."""
    findings: list[Finding] = []
    notes: list[str] = []
    comparisons: dict = {}
    teacher = predicted or training  # teacher-forced evidence: data beats the training log
    c_served, c_pred, c_train = collapse(served), collapse(predicted), collapse(training)
    c_teacher = c_pred if informative(predicted) else c_train
    served_alpha = served is not None and any(not math.isnan(_nan(x)) for x in served.alpha)
    evidence: dict = {
        "ttt_length": ttt_length,
        "served": served.to_dict() if served else None,
        "expected": expected.to_dict() if expected else None,
        "predicted": predicted.to_dict() if predicted else None,
        "training": training.to_dict() if training else None,
    }

    # NO_TTT: the collapse shows in the teacher-forced numbers (so it is the draft, not the server).
    no_ttt = None
    if c_teacher is not None:
        no_ttt = 0.6 + (0.1 if c_served else 0.0) + (0.1 if c_pred and c_train else 0.0)
    elif not informative(predicted) and not informative(training) and ttt_length == 1 and served is not None:
        # Nothing teacher-forced to look at: the contract's word and a low or collapsing served acceptance.
        tau = served.accept_length
        if c_served is not None or (tau is not None and tau < LOW_TAU):
            no_ttt = 0.4
    if no_ttt is not None:
        if ttt_length == 1:
            no_ttt += 0.2  # the contract says so: the strongest single piece of evidence
        elif ttt_length is not None and ttt_length > 1:
            no_ttt -= 0.25  # trained with TTT: the collapse needs another explanation too
        src = c_teacher or c_served
        parts = []
        if src is not None:
            parts.append(
                f"{src['metric']}_1 = {src['first']:.2f} but later steps average {src['mean_later']:.2f} "
                f"({src['ratio']:.0%} of step 1)"
            )
        if teacher is not None and teacher.acc is not None:
            parts.append(f"{teacher.source} acc_k {_fmt([_nan(x) for x in teacher.acc])}")
        if served_alpha:
            parts.append(f"served α_k {_fmt(effective_alpha(served))}")
        if served is not None and served.accept_length is not None:
            parts.append(f"served τ {served.accept_length:.2f}")
        if ttt_length == 1:
            parts.append("trained with TTT length 1")
        findings.append(
            Finding(
                "NO_TTT",
                "behaviour",
                "; ".join(parts) + ": the draft cannot read its own features after step 1",
                evidence | {"collapse_served": c_served, "collapse_predicted": c_pred, "collapse_training": c_train},
                "retrain with training-time test (eaglescope train --ttt-length 7)",
                no_ttt,
            )
        )

    # OVERFIT_OR_OTHER_TRAFFIC: the draft on --data, in training's own units, far below what training measured.
    if predicted is not None and training is not None and predicted.has_counts:
        depth = min(len(predicted.alpha), len(training.alpha)) or None
        cmp = compare(predicted, training, depth, OVERFIT_RATIO)
        comparisons["training"] = cmp
        if cmp["separated"] and cmp["large"] and c_teacher is None:
            off_policy = agreement is not None and agreement < AGREEMENT_MIN
            why = (
                f"; only {agreement:.0%} of --data's answer tokens are the target's own greedy choice, so --data is "
                "not text this target writes (regenerate it: eaglescope prepare --regenerate)"
                if off_policy
                else ""
            )
            findings.append(
                Finding(
                    "OVERFIT_OR_OTHER_TRAFFIC",
                    "behaviour",
                    f"{predicted.source} τ {_fmt_tau(*_tau_pair(predicted, depth))} at depth {depth} against "
                    f"training's held-out τ {_fmt_tau(*_tau_pair(training, depth))}: the draft fits its training "
                    f"data only, or --data is other traffic than it was trained for{why}",
                    evidence | {"comparison": cmp, "agreement": agreement},
                    "train on data from the traffic you serve (eaglescope prepare --regenerate on it), or pass --data "
                    "that is that traffic",
                    0.6 if off_policy else 0.75,
                )
            )
        elif cmp["large"] and not cmp["separated"]:
            notes.append(
                f"--data is too small to judge the gap to training: {predicted.source} τ "
                f"{_fmt_tau(*_tau_pair(predicted, depth))} vs training τ {_fmt_tau(*_tau_pair(training, depth))}"
            )

    # SERVING_MISMATCH: the same positions, served by the engine and by a correct server.
    reference = expected if expected is not None else (training if predicted is None else None)
    if served is not None and reference is not None:
        late = c_served is not None and c_teacher is None
        f, n, comparisons["serving"] = _serving(served, reference, expected is not None, late, traffic_check,
                                                agreement, evidence)  # fmt: skip
        findings += f
        notes += n

    # UNDERTRAINED: low at the first position already, on every side that was measured.
    if not findings:
        a1_teacher = effective_alpha(teacher)[0] if teacher is not None and teacher.alpha else math.nan
        a1_served = effective_alpha(served)[0] if served_alpha else math.nan
        served_low = served is None or (
            (not math.isnan(a1_served) and a1_served < LOW_ALPHA1)
            or (math.isnan(a1_served) and (served.accept_length or 0) < LOW_TAU)
        )
        if teacher is not None and not math.isnan(a1_teacher) and a1_teacher < LOW_ALPHA1 and served_low:
            findings.append(
                Finding(
                    "UNDERTRAINED",
                    "behaviour",
                    f"acceptance is low from the first position on: {teacher.source} α_1 = {a1_teacher:.2f}"
                    + (f", served α_1 = {a1_served:.2f}" if not math.isnan(a1_served) else ""),
                    evidence,
                    "train longer or on more data regenerated by the target (prepare --regenerate)",
                    0.8,
                )
            )
        elif teacher is None and served is not None and served_low:
            tau = served.accept_length
            findings.append(
                Finding(
                    "UNDERTRAINED",
                    "behaviour",
                    f"served τ {tau:.2f} is low and there is nothing to compare it with"
                    if tau is not None
                    else "served acceptance is low and there is nothing to compare it with",
                    evidence,
                    "pass --data to tell an undertrained draft from a serving problem",
                    0.3,
                )
            )
    return Behaviour(findings, notes, comparisons)


def _tau_pair(a: Acceptance, depth: int | None) -> tuple[float | None, tuple[float, float] | None]:
    return a.tau(depth), a.tau_interval(depth)


def _rounds(a: Acceptance) -> str:
    n = a.rounds if a.rounds is not None else (a.reached[0] if a.reached else None)
    return "?" if n is None else f"{n:.0f}"


def _serving(
    served: Acceptance,
    reference: Acceptance,
    same_positions: bool,
    late_collapse: bool,
    traffic_check: dict | None,
    agreement: float | None,
    evidence: dict,
) -> tuple[list[Finding], list[str], dict]:
    """SERVING_MISMATCH, or the note that says why it cannot be judged (diagnose_behaviour's third rule).
    `late_collapse`: served α collapses after step 1 while the teacher-forced numbers do not."""
    served_alpha = any(not math.isnan(_nan(x)) for x in served.alpha)
    depth = len(served.alpha) if served_alpha else len(reference.alpha) or None
    ratio = SERVING_RATIO if same_positions else TRAINING_SERVING_RATIO
    cmp = compare(served, reference, depth, ratio)
    t_s, t_r = cmp["tau"]
    if t_s is None or t_r is None:
        return [], [], cmp
    # Later positions only: the served α_k separate from the reference's at k ≥ 2 and nowhere before: the draft's
    # own features are fed back wrongly (feedback), not the taps every step reads.
    later = [p for p in cmp["positions"] if p["separated"]]
    late_only = late_collapse and bool(later) and all(p["k"] >= 2 for p in later)
    shown = (
        f"served τ {_fmt_tau(t_s, _tuple(cmp['interval'][0]))} over {_rounds(served)} rounds against "
        f"{_fmt_tau(t_r, _tuple(cmp['interval'][1]))} from {reference.source} ({_rounds(reference)})"
    )
    if traffic_check is not None and traffic_check.get("same") is False:
        # Another workload's acceptance is no measure of this server on --data: no cause can be named from it.
        note = (
            f"the served traffic is not --data's (mean prompt {traffic_check['served_prompt_mean']:.0f} tokens "
            f"served, {traffic_check['data_prompt_mean']:.0f} in --data): {shown} says nothing about the server; "
            "pass --data from the served traffic"
        )
        return [], [note], cmp
    if not (late_only or (cmp["separated"] and cmp["large"])):
        if cmp["large"] or not cmp["judgeable"]:
            return [], [f"too few rounds to judge the server: {shown} overlap; pass more --data or --prompts"], cmp
        return [], [], cmp
    if same_positions and reference.source.startswith("teacher-forced at"):
        conf, qualifier = 0.9, "the same rounds"
    elif same_positions:
        known = traffic_check is not None and traffic_check.get("same") is True
        on_policy = agreement is None or agreement >= AGREEMENT_MIN
        conf = 0.85 if known and on_policy else 0.6
        qualifier = "rounds simulated on --data"
        if not known:
            qualifier += ", which the log gives no way to compare with the served traffic"
        elif not on_policy:
            qualifier += f", text of which only {agreement:.0%} is the target's own greedy choice"
    else:
        conf, qualifier = 0.5, "training's held-out numbers: every position a round start, training's own data"
    where = "draft.step1.hidden_in" if late_only else "target.aux"  # later steps only: feedback; all: the features
    hint = (
        "only positions ≥2 fall short when served: draft steps k>0 are fed the wrong features "
        "(FEEDBACK_TARGET_FEATURES, FEEDBACK_POSTNORM)"
        if late_only
        else "check engine tap ids, the vocabulary map, the embedding and the chat template"
    )
    extra = {"served_tau": t_s, "predicted_tau": t_r, "depth": depth, "comparison": cmp, "traffic": traffic_check,
             "agreement": agreement}  # fmt: skip
    fix = "record a trace of the serving engine and run eaglescope doctor --trace to find the stage"
    return [Finding("SERVING_MISMATCH", where, f"{shown}; {qualifier}: {hint}", evidence | extra, fix, conf)], [], cmp


def _tuple(x) -> tuple[float, float] | None:
    return None if x is None else (x[0], x[1])


# -- sources -------------------------------------------------------------------------------------------------
def from_engine(e) -> Acceptance:
    """An EngineAcceptance (engine_logs) as an Acceptance, with per-position counts where the engine gives them
    (vLLM: drafts and accepted tokens per position), so thinly reached positions weigh as little as they should."""
    counts = e.position_counts()
    if counts is None:
        return Acceptance(e.source, list(e.alpha or []), e.accept_length, rounds=None)
    reached, accepted = counts
    return Acceptance(e.source, _alpha_of(reached, accepted), e.accept_length, None, reached, accepted, None,
                      int(round(e.drafts)) if e.drafts else None)  # fmt: skip


def from_trace(trace) -> Acceptance | None:
    """What a trace's verify decisions say was served: τ and conditional α_k over its rounds (None without any).

    Like an engine's numbers this is what the engine served; a short trace's deep positions are thin evidence
    (its counts say how thin), which is why doctor uses it only for NO_TTT, a cause the contract's TTT length must
    corroborate."""
    acc, depths = [], []
    for rnd in trace.rounds():
        if rnd == 0 or (T.VERIFY_PARENTS, rnd) not in trace or (T.VERIFY_ACCEPTED, rnd) not in trace:
            continue
        parents = [int(p) for p in trace.get(T.VERIFY_PARENTS, rnd).flatten().tolist()]
        depth = [0] * len(parents)
        for i, p in enumerate(parents):  # parents precede children
            depth[i] = depth[p] + 1 if p >= 0 else 0
        acc.append(int(trace.get(T.VERIFY_ACCEPTED, rnd).numel()))
        depths.append(max(depth, default=0))
    if not acc:
        return None
    engine = str(trace.producer).split("-", 1)[0].split(" ", 1)[0] or "engine"
    stats = SpecStats()
    for a, d in zip(acc, depths, strict=True):
        stats.record_round(None, a, max_depth=d)
    reached, accepted = _round_counts(acc, depths, max(depths))
    return Acceptance.from_groups(f"{engine} trace", [(reached, accepted)], len(acc), stats.accept_length)


def _find_acc(obj) -> dict | None:
    """The dict holding acc_k in a training metrics file: top level, a known section, or a history's last."""
    if isinstance(obj, dict):
        if isinstance(obj.get("acc"), list):
            return obj
        for key in ("final", "eval", "held_out", "heldout", "valid", "validation", "metrics", "train"):
            if key in obj and (found := _find_acc(obj[key])) is not None:
                return found
        for key in ("history", "evals", "log"):
            if isinstance(obj.get(key), list) and obj[key]:
                return _find_acc(obj[key][-1])
    if isinstance(obj, list) and obj:
        return _find_acc(obj[-1])
    return None


def read_training_metrics(draft_dir: Path | str) -> Acceptance | None:
    """acc_k / α_k (and their counts, when training wrote them) from the draft directory's training_metrics.json;
    None when absent or unreadable."""
    path = Path(draft_dir) / TRAINING_METRICS
    if not path.is_file():
        return None
    try:
        found = _find_acc(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if found is None:
        return None
    acc = [_nan(x) for x in found["acc"]]
    # acc_k is unconditional; prefer the conditional α training measured, else estimate it from acc alone.
    alpha = [_nan(x) for x in found["alpha"]] if isinstance(found.get("alpha"), list) else alpha_from_unconditional(acc)
    reached = found.get("reached") if isinstance(found.get("reached"), list) else None
    accepted = found.get("accepted") if isinstance(found.get("accepted"), list) and reached is not None else None
    tau = predicted_accept_length([x for x in alpha if not math.isnan(x)])
    return Acceptance("training", alpha, tau, acc, reached, accepted, None, reached[0] if reached else None)


# -- data ----------------------------------------------------------------------------------------------------
def load_samples(data: Path | str, tokenizer, limit: int, max_length: int = 1024) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) pairs from a prepared directory or a JSONL of conversations (rendered with the
    target's own template, as serving renders them)."""
    data = Path(data)
    out: list[tuple[list[int], list[int]]] = []
    if data.is_dir():
        pd = PreparedData.open(data, verify=False)
        for i in range(min(limit, len(pd))):
            s = pd.sample(i)
            out.append((s["input_ids"][:max_length].tolist(), s["loss_mask"][:max_length].tolist()))
    elif data.is_file():
        if tokenizer is None:
            raise EagleScopeError("--data is a JSONL of conversations but the target has no tokenizer to render it")
        for conv in read_conversations(data):
            r = render(conv, tokenizer, max_length)
            if r is not None:
                out.append((r.input_ids, r.loss_mask))
            if len(out) >= limit:
                break
    else:
        raise EagleScopeError(f"--data {str(data)!r} is neither a prepared directory nor a JSONL file")
    out = [(ids, mask) for ids, mask in out if any(mask)]
    if not out:
        raise EagleScopeError(f"--data {str(data)!r} holds no sample with supervised (assistant) tokens")
    return out


def prompt_of(ids: list[int], mask: list[int]) -> list[int] | None:
    """The prompt of a rendered sample: everything before the first supervised token."""
    first = next((i for i, m in enumerate(mask) if m), None)
    return ids[:first] if first else None


@torch.inference_mode()
def teacher_hits(target, draft, ids: list[int], mask: list[int], depth: int) -> tuple[torch.Tensor, torch.Tensor, int,
                                                                                      int]:  # fmt: skip
    """One sample through the target and a `depth`-step TTT unroll: (hits [T, K], supervised [T, K], supervised
    tokens that are the target's own greedy choice, supervised tokens). Row t, step k: the draft's step-k argmax
    at position t equals the target's next token at t+k+1 (train.metrics.step_hits' alignment)."""
    dev = draft.fc.weight.device
    x = torch.tensor([ids], device=target.device)
    out = target.hidden_states(x)
    batch = Batch(
        input_ids=x.to(dev),
        loss_mask=torch.tensor([mask], device=dev),
        valid=torch.ones_like(x, device=dev),
        aux=out.aux.to(device=dev, dtype=draft.fc.weight.dtype),
        teacher=teacher_of(draft_vocab_ids(draft), out.logits.to(device=dev, dtype=torch.float32)),
    )
    unrolled = ttt_unroll(draft, batch.input_ids, batch.aux, depth)
    hits, sup = step_hits(draft, unrolled.logits, batch)
    greedy = batch.teacher.argmax[0, :-1]
    m = batch.loss_mask[0, 1:].bool()
    agree = int((greedy == batch.input_ids[0, 1:])[m].sum())
    return hits[0].cpu(), sup[0].cpu(), agree, int(m.sum())


def chain_at(hits: torch.Tensor, sup: torch.Tensor, row: int) -> int | None:
    """Tokens a greedy chain rooted at teacher-forced `row` accepts: its leading hits. None when the chain runs out
    of supervised text before its first miss (the text cannot say how far it would have gone)."""
    K = hits.shape[1]
    if row < 0 or row >= hits.shape[0]:
        return None
    for k in range(K):
        if not bool(sup[row, k]):
            return None
        if not bool(hits[row, k]):
            return k
    return K


def simulate_rounds(hits: torch.Tensor, sup: torch.Tensor, mask: list[int]) -> list[int]:
    """Greedy chain serving on a sample's own text: each supervised span is an answer whose first token the
    target emits after prefill (committed n = span start + 1, so the first root is row n - 2); every round then
    commits its accepted tokens and the bonus. Returns the accepted length of each round until the text runs out."""
    out: list[int] = []
    i = 0
    while i < len(mask):
        if not mask[i]:
            i += 1
            continue
        start = i
        while i < len(mask) and mask[i]:
            i += 1
        row = start - 1
        while row < i - 1:
            a = chain_at(hits, sup, row)
            if a is None:
                break
            out.append(a)
            row += a + 1
    return out


@dataclass
class DataPrediction:
    predicted: Acceptance  # teacher-forced on --data, every supervised position (acc_k, α_k)
    rounds: Acceptance  # serving simulated on --data's text (what a correct engine gets on it)
    agreement: float | None  # share of supervised tokens that are the target's own greedy choice
    prompt_lengths: list[int] = field(default_factory=list)


@torch.inference_mode()
def predict_on_data(target, draft, samples, depth: int = DEFAULT_DEPTH) -> DataPrediction:
    """Teacher-forced acc_k and α_k of a `depth`-step TTT unroll over the samples, and greedy chain serving
    simulated on the same text (both with their counts per sample)."""
    groups, rounds, hits_k, sup_k = [], [], [0] * depth, [0] * depth
    agree = total = 0
    for ids, mask in samples:
        hits, sup, a, n = teacher_hits(target, draft, ids, mask, depth)
        c = hit_counts(hits, sup)
        groups.append((c["reached"], c["accepted"]))
        hits_k = [x + y for x, y in zip(hits_k, c["hits"], strict=True)]
        sup_k = [x + y for x, y in zip(sup_k, c["supervised"], strict=True)]
        rounds.append(simulate_rounds(hits, sup, mask))
        agree, total = agree + a, total + n
    acc = _alpha_of(sup_k, hits_k)
    positions = sum(g[0][0] for g in groups)
    predicted = Acceptance.from_groups("teacher-forced on data", groups, positions, acc=acc)
    simulated = Acceptance.from_rounds("rounds simulated on data", rounds, depth)
    prompts = [len(p) for p in (prompt_of(i, m) for i, m in samples) if p]
    return DataPrediction(predicted, simulated, agree / total if total else None, prompts)


@dataclass
class Served:
    acceptance: Acceptance  # what the decoder served, over the rounds `expected` could score too
    expected: Acceptance  # the teacher-forced draft at those very rounds
    agree: float  # share of those rounds where the two accepted the same number of tokens


@torch.inference_mode()
def serve_with_decoder(target, draft, prompts, max_new_tokens: int, depth: int = DEFAULT_DEPTH) -> Served:
    """eaglescope's own greedy chain decoder over the prompts, and the teacher-forced draft at each served round's
    root in the served text: the same positions. A round whose chain runs past the output is left out of both."""
    served_rounds: list[list[int]] = []
    expected_rounds: list[list[int]] = []
    for p in prompts:
        max_len = len(p) + max_new_tokens + 1
        proposer = Eagle3Proposer(draft, depth, 1, depth + 1, max_len)
        res = generate_speculative(target, proposer, p, max_new_tokens)
        seq = list(p) + list(res.token_ids)
        if not res.stats.rounds or len(seq) < len(p) + 2:
            continue
        mask = [0] * len(p) + [1] * (len(seq) - len(p))
        hits, sup, _, _ = teacher_hits(target, draft, seq, mask, depth)
        n = len(p) + 1  # committed after prefill: the prompt and the target's first token
        s, e = [], []
        for a in res.stats.accepted:
            x = chain_at(hits, sup, n - 2)  # step 0 at row t predicts token t + 2: the round's first draft token
            if x is not None:
                s.append(a)
                e.append(x)
            n += a + 1
        served_rounds.append(s)
        expected_rounds.append(e)
    pairs = [(a, b) for s, e in zip(served_rounds, expected_rounds, strict=True) for a, b in zip(s, e, strict=True)]
    if not pairs:
        raise EagleScopeError("the decoder ran no speculative round (every prompt ended at once): use longer outputs")
    return Served(
        Acceptance.from_rounds("eaglescope decoder", served_rounds, depth),
        Acceptance.from_rounds("teacher-forced at the served rounds", expected_rounds, depth),
        sum(a == b for a, b in pairs) / len(pairs),
    )
