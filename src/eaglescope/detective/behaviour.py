"""Behavioural checks: served acceptance against teacher-forced acceptance predicted on data, per position.

Three sources of conditional α_k (FIELD.md §5), each an `Acceptance`:
  served     eaglescope's own decoder on prompts from --data (greedy chain), or an SGLang/vLLM log
  predicted  teacher-forced TTT unroll on --data (train.metrics.evaluate): what a correct server should get
  training   acc_k / α_k that training wrote into the draft directory (training_metrics.json)

and three named explanations (DESIGN.md "Golden replay and diagnosis"):
  NO_TTT            step 1 healthy, later steps collapse in the teacher-forced numbers: the draft never learned
                    to read its own features (trained with TTT length 1). The cleanest evidence is teacher-forced
                    acc_k: step k sees the ground-truth tokens, so the only thing that differs from step 1 is that
                    its features are the draft's own output instead of fc(target taps). Conditional α_k mixes in
                    which positions were reached (only easy runs reach deep), so it is supporting evidence.
  SERVING_MISMATCH  predicted τ ≫ served τ: the draft is fine, the server wires it wrongly
  UNDERTRAINED      α_1 low everywhere, predicted and served: data or capacity
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
from eaglescope.train.metrics import Batch, evaluate

# Chain depth at which eaglescope serves and predicts: SGLang's default num_steps for Llama-family drafts.
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
# Served τ below this fraction of predicted τ is more than the gap between held-out data and live prompts
# (teacher-forced prediction on the target's own outputs tracks greedy serving within ~10-20%).
SERVING_RATIO = 0.6
# "Low everywhere": α_1 below this on both sides, or a served τ below LOW_TAU with nothing to compare.
LOW_ALPHA1 = 0.3
LOW_TAU = 1.5
# α_k is evidence only when at least this many rounds (or positions) reached position k.
MIN_REACHED = 10
# Training's acc_k file, written next to the draft's weights.
TRAINING_METRICS = "training_metrics.json"


@dataclass
class Acceptance:
    source: str  # "eaglescope decoder", "sglang log", "vllm log", "teacher-forced on data", "training"
    alpha: list[float]  # conditional α_1..α_K; nan = undefined (nothing reached k, or not reported)
    accept_length: float | None  # τ (bonus included): measured when served, predicted from α otherwise
    acc: list[float] | None = None  # teacher-forced unconditional acc_k (training/predicted only)
    reached: list[int] | None = None  # rounds/positions that reached position k

    def to_dict(self) -> dict:
        def clean(xs):
            return None if xs is None else [None if (x is None or math.isnan(x)) else float(x) for x in xs]

        return {
            "source": self.source,
            "alpha": clean(self.alpha),
            "accept_length": self.accept_length,
            "acc": clean(self.acc),
            "reached": self.reached,
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


def tau_at(a: Acceptance, depth: int | None) -> float | None:
    """τ of `a` for a chain `depth` deep (its own τ when depth is None or it has no per-position α)."""
    alpha = [x for x in effective_alpha(a)]
    if depth is None or not alpha or all(math.isnan(x) for x in alpha):
        return a.accept_length
    defined = []
    for x in alpha[:depth]:
        if math.isnan(x):
            break
        defined.append(x)
    return predicted_accept_length(defined)


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


def diagnose_behaviour(
    served: Acceptance | None,
    predicted: Acceptance | None,
    training: Acceptance | None = None,
    ttt_length: int | None = None,
) -> list[Finding]:
    """NO_TTT / SERVING_MISMATCH / UNDERTRAINED from whichever sources exist (rules in the module docstring)."""
    findings: list[Finding] = []
    teacher = predicted or training  # teacher-forced evidence: data beats the training log
    c_served, c_pred, c_train = collapse(served), collapse(predicted), collapse(training)
    c_teacher = c_pred if informative(predicted) else c_train
    served_alpha = served is not None and any(not math.isnan(_nan(x)) for x in served.alpha)
    evidence: dict = {
        "ttt_length": ttt_length,
        "served": served.to_dict() if served else None,
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

    # SERVING_MISMATCH: prediction on data says the draft is good; the server gets much less.
    if served is not None and teacher is not None:
        depth = len(served.alpha) if served_alpha else None
        t_served = served.accept_length if served.accept_length is not None else tau_at(served, depth)
        t_pred = tau_at(teacher, depth)
        late_only = c_served is not None and c_teacher is None and informative(predicted)
        if t_served is not None and t_pred is not None and (t_served < SERVING_RATIO * t_pred or late_only):
            conf = 0.9 if predicted is not None else 0.6  # training data may differ from served prompts
            where = (
                "draft.step1.hidden_in" if late_only else "target.aux"
            )  # later steps only: feedback; everywhere: the features the draft reads
            hint = (
                "only positions ≥2 collapse when served: draft steps k>0 are fed the wrong features "
                "(FEEDBACK_TARGET_FEATURES, FEEDBACK_POSTNORM)"
                if late_only
                else "check engine tap ids, the vocabulary map, the embedding and the chat template"
            )
            findings.append(
                Finding(
                    "SERVING_MISMATCH",
                    where,
                    f"served τ {t_served:.2f} vs {teacher.source} τ {t_pred:.2f}: {hint}",
                    evidence | {"served_tau": t_served, "predicted_tau": t_pred, "depth": depth},
                    "record a trace of the serving engine and run eaglescope doctor --trace to find the stage",
                    conf,
                )
            )

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
    return findings


# -- sources -------------------------------------------------------------------------------------------------
def from_engine(e) -> Acceptance:
    """An EngineAcceptance (engine_logs) as an Acceptance."""
    return Acceptance(getattr(e, "source", f"{e.engine} log"), list(e.alpha or []), e.accept_length)


def from_trace(trace) -> Acceptance | None:
    """What a trace's verify decisions say was served: τ and conditional α_k over its rounds (None without any).

    Like an engine log's numbers (from_engine) this is what the engine served, so it carries no `reached`: a
    short trace's deep positions are thin evidence, which is why doctor uses it only for NO_TTT, a cause the
    contract's TTT length must corroborate."""
    stats = SpecStats()
    for rnd in trace.rounds():
        if rnd == 0 or (T.VERIFY_PARENTS, rnd) not in trace or (T.VERIFY_ACCEPTED, rnd) not in trace:
            continue
        parents = [int(p) for p in trace.get(T.VERIFY_PARENTS, rnd).flatten().tolist()]
        depth = [0] * len(parents)
        for i, p in enumerate(parents):  # parents precede children
            depth[i] = depth[p] + 1 if p >= 0 else 0
        accepted = int(trace.get(T.VERIFY_ACCEPTED, rnd).numel())
        stats.record_round(None, accepted, max_depth=max(depth, default=0), num_drafted=len(parents) - 1)
    if not stats.rounds:
        return None
    engine = str(trace.producer).split("-", 1)[0].split(" ", 1)[0] or "engine"
    return Acceptance(f"{engine} trace", stats.alpha, stats.accept_length)


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
    """acc_k / α_k from the draft directory's training_metrics.json; None when absent or unreadable."""
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
    return Acceptance("training", alpha, predicted_accept_length([x for x in alpha if not math.isnan(x)]), acc, reached)


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
def predict_on_data(target, draft, samples, depth: int = DEFAULT_DEPTH) -> Acceptance:
    """Teacher-forced α_k of a `depth`-step TTT unroll over the samples (train.metrics.evaluate)."""
    dev = draft.fc.weight.device

    def batches():
        for ids, mask in samples:
            x = torch.tensor([ids], device=target.device)
            out = target.hidden_states(x)
            yield Batch(
                input_ids=x.to(dev),
                loss_mask=torch.tensor([mask], device=dev),
                valid=torch.ones_like(x, device=dev),
                aux=out.aux.to(device=dev, dtype=draft.fc.weight.dtype),
                target_logits=out.logits.to(device=dev, dtype=torch.float32),
            )

    m = evaluate(draft, batches(), depth)
    alpha = [_nan(x) for x in m["alpha"]]
    return Acceptance("teacher-forced on data", alpha, m["predicted_accept_length"], m["acc"], m["reached"])


@torch.inference_mode()
def serve_with_decoder(target, draft, prompts, max_new_tokens: int, depth: int = DEFAULT_DEPTH) -> Acceptance:
    """Served α_k and τ of eaglescope's own greedy chain decoder over the prompts."""
    stats = SpecStats()
    for p in prompts:
        max_len = len(p) + max_new_tokens + 1
        proposer = Eagle3Proposer(draft, depth, 1, depth + 1, max_len)
        stats.merge(generate_speculative(target, proposer, p, max_new_tokens).stats)
    if not stats.rounds:
        raise EagleScopeError("the decoder ran no speculative round (every prompt ended at once): use longer outputs")
    alpha = stats.alpha
    reached = [
        sum(1 for a, d in zip(stats.accepted, stats.drafted_depth, strict=True) if d >= k and a >= k - 1)
        for k in range(1, len(alpha) + 1)
    ]
    return Acceptance("eaglescope decoder", alpha, stats.accept_length, None, reached)
