"""Conditional acceptance α_k with its counts and 95% intervals, and how two sources of it compare.

Statistics. α_k carries a 95% Wilson interval over the rounds that reached k. τ's interval comes from a cluster
bootstrap over prompts/samples (rounds of one prompt are not independent) where the source has at least MIN_GROUPS
of them: τ ± t(G-1) × the bootstrap's standard error; otherwise (an engine's totals, training's counts, one trace)
it is the τ of every α_k at its Wilson bound with a Bonferroni z over the K positions (all K intervals hold together
with ≥ 95%, and τ is monotone in each α_k). Rounds within a request are taken as independent there, as the engine's
totals cannot say otherwise.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from eaglescope.decode.stats import predicted_accept_length

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


def alpha_of(reached: Sequence[float], accepted: Sequence[float]) -> list[float]:
    return [a / r if r else math.nan for a, r in zip(accepted, reached, strict=False)]


def _tau_of(alpha: Sequence[float], depth: int) -> float:
    """τ of a chain `depth` deep; an undefined α ends the chain there (nothing reached further)."""
    defined = []
    for x in alpha[:depth]:
        if math.isnan(x):
            break
        defined.append(x)
    return predicted_accept_length(defined)


def round_counts(accepted: Sequence[int], depths: Sequence[int], K: int) -> tuple[list[int], list[int]]:
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
        alpha = alpha_of(reached, accepted)
        return cls(source, alpha, _tau_of(alpha, K) if tau is None else tau, acc, reached, accepted, groups, rounds)

    @classmethod
    def from_rounds(cls, source: str, per_group: list[list[int]], depth: int) -> Acceptance:
        """Rounds that each drafted `depth` deep, as accepted lengths grouped by prompt (or sample)."""
        groups = [round_counts(g, [depth] * len(g), depth) for g in per_group]
        n = sum(len(g) for g in per_group)
        tau = sum(a + 1 for g in per_group for a in g) / n if n else math.nan
        return cls.from_groups(source, groups, n, tau)

    @property
    def has_counts(self) -> bool:
        return bool(self.reached) and self.accepted is not None

    def tau(self, depth: int | None = None) -> float | None:
        """τ of a chain `depth` deep (its own τ when depth is None or it has no per-position α)."""
        if depth is None or not self.alpha or all(math.isnan(as_float(x)) for x in self.alpha):
            return self.accept_length
        if self.has_counts:
            return _tau_of(alpha_of(self.reached, self.accepted), depth)
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
                taus.append(_tau_of(alpha_of(r, a), depth))
            mean = sum(taus) / len(taus)
            sd = math.sqrt(sum((x - mean) ** 2 for x in taus) / (len(taus) - 1))
            tau = _tau_of(alpha_of(self.reached, self.accepted), depth)
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


def as_float(x) -> float:
    return math.nan if x is None else float(x)


def effective_alpha(a: Acceptance) -> list[float]:
    """α with evidence only: thinly supported positions → nan; undefined positions after a 0 → 0 (nothing
    got past the zero, which is itself the strongest collapse)."""
    out, dead = [], False
    for k, x in enumerate(a.alpha):
        x = as_float(x)
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
        return _collapse_of([as_float(x) for x in a.acc], ACC_COLLAPSE_RATIO, "acc")
    return _collapse_of(effective_alpha(a), COLLAPSE_RATIO, "alpha")


def informative(a: Acceptance | None) -> bool:
    """Whether a teacher-forced source can show a collapse at all (it measured at least two steps)."""
    if a is None:
        return False
    vals = a.acc if a.acc is not None else a.alpha
    return sum(1 for x in vals if not math.isnan(as_float(x))) >= 2


def format_alpha(alpha: Sequence[float]) -> str:
    return "[" + ", ".join("-" if math.isnan(x) else f"{x:.2f}" for x in alpha) + "]"


def format_tau(t: float | None, i: tuple[float, float] | None) -> str:
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
