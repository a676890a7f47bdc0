"""The walk: the trace's events against the golden replay's in order, the first divergent stage explained."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.detective.diagnose.embeddings import diagnose_embed, diagnose_tokens
from eaglescope.detective.diagnose.evidence import FORCED, NO_SHAPE, Cmp, Evidence
from eaglescope.detective.diagnose.fc import diagnose_fc, eagle31_below_tolerance
from eaglescope.detective.diagnose.feedback import diagnose_feedback
from eaglescope.detective.diagnose.head import diagnose_topk
from eaglescope.detective.diagnose.judge import judge, split_segments, unexplained_finding
from eaglescope.detective.diagnose.positions import diagnose_positions, norm_output_hypothesis, position_hypotheses
from eaglescope.detective.diagnose.stale import diagnose_stale
from eaglescope.detective.diagnose.taps import diagnose_taps
from eaglescope.detective.findings import Finding, rank
from eaglescope.detective.replay import REPLAY_COPIES_TARGET, REPLAY_PREFIX, replay
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import LoadedDraft
from eaglescope.models.targets.base import Target


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
            return NO_SHAPE
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
            c = _compare_event(ev, e, obs, gold) if gold is not None else NO_SHAPE
            table.append({"round": e.round, "stage": e.stage, "part": e.part, "rel_err": c.err, "match": c.match})
            if not c.match and first is None:
                first = (e, obs, c)
        context = {"stage_table": table, "first_divergence": None, "segment_norms": _segment_norms(ev)}
        incomplete = [f] if (f := _incomplete(trace)) is not None else []
        if first is None:
            return rank(eagle31_below_tolerance(ev) + incomplete), context
        e, obs, c = first
        context["first_divergence"] = {"round": e.round, "stage": e.stage, "part": e.part}
        findings = _explain(ev, e, obs, trace_dir, tmp)
        if not findings:
            # an EAGLE 3.1 norm decision inside fc's tolerance may be what later moved a stage past it
            findings = eagle31_below_tolerance(ev) + [_unexplained(ev, e, c)]
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
        hyps = position_hypotheses(ev, rnd, e.stage, None, obs, idx, trace_dir, tmp)
        hyps.append(norm_output_hypothesis(ev, rnd, e.stage, obs, trace_dir, tmp))
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
    return unexplained_finding(
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
        segs = split_segments(x.float(), n, ev.H)
        return [float(s.norm(dim=-1).mean()) for s in segs]

    return {"trace": [norms(obs)], "replay": [norms(gold)], "labels": [f"tap {i}" for i in ev.taps.layers]}
