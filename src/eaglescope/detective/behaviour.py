"""Behavioural checks, the rules: served acceptance against what a correct server would get.

Sources of conditional α_k (docs/field.md §5; acceptance_sources.py), each an `Acceptance` (acceptance.py, with the
statistics) that keeps its counts (rounds or positions that reached position k, and how many of them accepted it):
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
"predicted".

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

import math
from dataclasses import dataclass

from eaglescope.detective.acceptance import (
    Acceptance,
    as_float,
    collapse,
    compare,
    effective_alpha,
    format_alpha,
    format_tau,
    informative,
)
from eaglescope.detective.findings import Finding

# Served τ below this fraction of the expected τ on the same positions, with separated intervals, is a serving
# fault. The comparison has no selection bias left (see the module docstring): a correct server matches it within
# its interval, up to precision (bf16 serving against a float32 replay moves τ by a few percent). Every wiring
# fault in the catalogue cuts τ to ≤ 0.6× (served τ 1.1-1.8 against 3+ in tests/engines and tests/vllm), so 0.8 leaves
# room on both sides.
SERVING_RATIO = 0.8
# Against training's numbers alone (no --data) the reference counts every position as a round start and comes from
# the training data: optimistic by up to ~2× on a correct server (the demo: 0.5-0.6×). Only a gap beyond that is
# named, as a suggestion.
TRAINING_SERVING_RATIO = 0.45
# Teacher-forced τ on --data below this fraction of training's held-out τ (same depth, same units, separated
# intervals): the held-out split and new data of the same traffic differ by chance, which the intervals cover,
# and by a drift of ~10%; a drop of 30% or more is another distribution, or a draft that memorised its data.
OVERFIT_RATIO = 0.7
# "Low everywhere": α_1 below this on both sides, or a served τ below LOW_TAU with nothing to compare.
LOW_ALPHA1 = 0.3
LOW_TAU = 1.5
# --data whose supervised tokens agree with the target's own greedy choice less often than this is not text the
# target writes: rounds simulated on it are not what a server sees (prepare --regenerate makes it ~1).
AGREEMENT_MIN = 0.5


# -- the rules --------------------------------------------------------------------------------------------------
@dataclass
class Behaviour:
    findings: list[Finding]
    notes: list[str]
    comparisons: dict  # "serving" (served vs expected or training), "training" (predicted vs training)


@dataclass
class _Evidence:
    """The sources one diagnosis reads, with what every rule derives from them once."""

    served: Acceptance | None
    predicted: Acceptance | None
    training: Acceptance | None
    expected: Acceptance | None
    ttt_length: int | None
    agreement: float | None

    def __post_init__(self) -> None:
        self.teacher = self.predicted or self.training  # teacher-forced evidence: data beats the training log
        self.c_served, self.c_pred, self.c_train = (
            collapse(self.served),
            collapse(self.predicted),
            collapse(self.training),
        )
        self.c_teacher = self.c_pred if informative(self.predicted) else self.c_train
        self.served_alpha = self.served is not None and any(not math.isnan(as_float(x)) for x in self.served.alpha)
        self.shown = {
            "ttt_length": self.ttt_length,
            **{k: a.to_dict() if a else None for k, a in self.sources().items()},
        }

    def sources(self) -> dict[str, Acceptance | None]:
        return {
            "served": self.served,
            "expected": self.expected,
            "predicted": self.predicted,
            "training": self.training,
        }


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
    text (engine log); `traffic_check`: acceptance.traffic's verdict on an engine's traffic against --data;
    `agreement`: the share of --data's supervised tokens that are the target's own greedy choice."""
    ev = _Evidence(served, predicted, training, expected, ttt_length, agreement)
    findings: list[Finding] = _no_ttt(ev)
    notes: list[str] = []
    comparisons: dict = {}
    if predicted is not None and training is not None and predicted.has_counts:
        f, n, comparisons["training"] = _overfit(ev)
        findings += f
        notes += n
    # SERVING_MISMATCH: the same positions, served by the engine and by a correct server.
    reference = expected if expected is not None else (training if predicted is None else None)
    if served is not None and reference is not None:
        late = ev.c_served is not None and ev.c_teacher is None
        f, n, comparisons["serving"] = _serving(served, reference, expected is not None, late, traffic_check,
                                                agreement, ev.shown)  # fmt: skip
        findings += f
        notes += n
    if not findings:
        findings = _undertrained(ev)
    return Behaviour(findings, notes, comparisons)


def _no_ttt(ev: _Evidence) -> list[Finding]:
    """NO_TTT: the collapse shows in the teacher-forced numbers (so it is the draft, not the server)."""
    served, ttt_length = ev.served, ev.ttt_length
    weight = None
    if ev.c_teacher is not None:
        weight = 0.6 + (0.1 if ev.c_served else 0.0) + (0.1 if ev.c_pred and ev.c_train else 0.0)
    elif not informative(ev.predicted) and not informative(ev.training) and ttt_length == 1 and served is not None:
        # Nothing teacher-forced to look at: the contract's word and a low or collapsing served acceptance.
        tau = served.accept_length
        if ev.c_served is not None or (tau is not None and tau < LOW_TAU):
            weight = 0.4
    if weight is None:
        return []
    if ttt_length == 1:
        weight += 0.2  # the contract says so: the strongest single piece of evidence
    elif ttt_length is not None and ttt_length > 1:
        weight -= 0.25  # trained with TTT: the collapse needs another explanation too
    src = ev.c_teacher or ev.c_served
    parts = []
    if src is not None:
        parts.append(
            f"{src['metric']}_1 = {src['first']:.2f} but later steps average {src['mean_later']:.2f} "
            f"({src['ratio']:.0%} of step 1)"
        )
    if ev.teacher is not None and ev.teacher.acc is not None:
        parts.append(f"{ev.teacher.source} acc_k {format_alpha([as_float(x) for x in ev.teacher.acc])}")
    if ev.served_alpha:
        parts.append(f"served α_k {format_alpha(effective_alpha(served))}")
    if served is not None and served.accept_length is not None:
        parts.append(f"served τ {served.accept_length:.2f}")
    if ttt_length == 1:
        parts.append("trained with TTT length 1")
    collapses = {"collapse_served": ev.c_served, "collapse_predicted": ev.c_pred, "collapse_training": ev.c_train}
    return [
        Finding(
            "NO_TTT",
            "behaviour",
            "; ".join(parts) + ": the draft cannot read its own features after step 1",
            ev.shown | collapses,
            "retrain with training-time test (eaglescope train --ttt-length 7)",
            weight,
            support="measured" if ev.c_teacher is not None else "suggested",
        )
    ]


def _overfit(ev: _Evidence) -> tuple[list[Finding], list[str], dict]:
    """OVERFIT_OR_OTHER_TRAFFIC: the draft on --data, in training's own units, far below what training measured."""
    predicted, training, agreement = ev.predicted, ev.training, ev.agreement
    depth = min(len(predicted.alpha), len(training.alpha)) or None
    cmp = compare(predicted, training, depth, OVERFIT_RATIO)
    pred_tau, train_tau = format_tau(*_tau_pair(predicted, depth)), format_tau(*_tau_pair(training, depth))
    if cmp["large"] and not cmp["separated"]:
        note = f"--data is too small to judge the gap to training: {predicted.source} τ {pred_tau} vs training τ "
        note += train_tau
        return [], [note], cmp
    if not (cmp["separated"] and cmp["large"] and ev.c_teacher is None):
        return [], [], cmp
    off_policy = agreement is not None and agreement < AGREEMENT_MIN
    why = (
        f"; only {agreement:.0%} of --data's answer tokens are the target's own greedy choice, so --data is "
        "not text this target writes (regenerate it: eaglescope prepare --regenerate)"
        if off_policy
        else ""
    )
    finding = Finding(
        "OVERFIT_OR_OTHER_TRAFFIC",
        "behaviour",
        f"{predicted.source} τ {pred_tau} at depth {depth} against training's held-out τ {train_tau}: the draft fits "
        f"its training data only, or --data is other traffic than it was trained for{why}",
        ev.shown | {"comparison": cmp, "agreement": agreement},
        "train on data from the traffic you serve (eaglescope prepare --regenerate on it), or pass --data "
        "that is that traffic",
        0.6 if off_policy else 0.75,
    )
    return [finding], [], cmp


def _undertrained(ev: _Evidence) -> list[Finding]:
    """UNDERTRAINED: low at the first position already, on every side that was measured."""
    teacher, served = ev.teacher, ev.served
    a1_teacher = effective_alpha(teacher)[0] if teacher is not None and teacher.alpha else math.nan
    a1_served = effective_alpha(served)[0] if ev.served_alpha else math.nan
    served_low = served is None or (
        (not math.isnan(a1_served) and a1_served < LOW_ALPHA1)
        or (math.isnan(a1_served) and (served.accept_length or 0) < LOW_TAU)
    )
    if teacher is not None and not math.isnan(a1_teacher) and a1_teacher < LOW_ALPHA1 and served_low:
        verdict = f"acceptance is low from the first position on: {teacher.source} α_1 = {a1_teacher:.2f}" + (
            f", served α_1 = {a1_served:.2f}" if not math.isnan(a1_served) else ""
        )
        fix = "train longer or on more data regenerated by the target (prepare --regenerate)"
        return [Finding("UNDERTRAINED", "behaviour", verdict, ev.shown, fix, 0.8)]
    if teacher is None and served is not None and served_low:
        tau = served.accept_length
        verdict = (
            f"served τ {tau:.2f} is low and there is nothing to compare it with"
            if tau is not None
            else "served acceptance is low and there is nothing to compare it with"
        )
        fix = "pass --data to tell an undertrained draft from a serving problem"
        return [Finding("UNDERTRAINED", "behaviour", verdict, ev.shown, fix, 0.3, support="suggested")]
    return []


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
    served_alpha = any(not math.isnan(as_float(x)) for x in served.alpha)
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
        f"served τ {format_tau(t_s, _tuple(cmp['interval'][0]))} over {_rounds(served)} rounds against "
        f"{format_tau(t_r, _tuple(cmp['interval'][1]))} from {reference.source} ({_rounds(reference)})"
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
    support = "measured" if conf >= 0.85 else "suggested"  # the same rounds, or simulated on the served traffic
    finding = Finding("SERVING_MISMATCH", where, f"{shown}; {qualifier}: {hint}", evidence | extra, fix, conf,
                      support=support)  # fmt: skip
    return [finding], [], cmp


def _tuple(x) -> tuple[float, float] | None:
    return None if x is None else (x[0], x[1])
