"""`eaglescope doctor`: why does this draft accept so little? A ranked list of named causes.

    static     always: contract vs target fingerprint, engine tap conventions, vocab map, embedding, template
    trace      with --trace: the trace against eaglescope's golden replay, stage by stage (diagnose/): a full
               replay when the target's layers are on disk, else a draft-side replay from the trace's own capture
               (draft_replay.py), which cannot name causes in the capture itself; context["replay"] says which ran
    behaviour  with --data and/or --engine-log / --metrics-url: served α_k (eaglescope's own decoder on prompts
               from --data, the engine's log, or a running server's /metrics counters) against teacher-forced α_k
               predicted on --data and training's acc_k

Exit status: 0 healthy (no findings), 1 findings, 2 bad input (one line on stderr).
--json prints one object: {"healthy": bool, "findings": [{code, stage, verdict, evidence, fix, support,
round, meaning}, ...most likely first], "context": {...}, "codes": {code: meaning}}.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path

import torch

from eaglescope.config import DEFAULT_DEPTH
from eaglescope.data.chat import read_conversations
from eaglescope.data.shards import PreparedData
from eaglescope.decode.speculative import target_embedding
from eaglescope.detective.acceptance import Acceptance, traffic
from eaglescope.detective.acceptance_sources import (
    from_engine,
    from_trace,
    load_samples,
    predict_on_data,
    prompt_of,
    read_training_metrics,
    serve_with_decoder,
)
from eaglescope.detective.behaviour import AGREEMENT_MIN, diagnose_behaviour
from eaglescope.detective.diagnose import diagnose_trace
from eaglescope.detective.draft_replay import (
    DRAFT_SIDE,
    ReplayMode,
    check_capture_width,
    choose_replay,
    load_recorded_target,
)
from eaglescope.detective.engine_logs import read_engine_log
from eaglescope.detective.findings import CODES, DoctorReport, Finding, rank
from eaglescope.detective.layer_taps import MODE as LAYER_MODE
from eaglescope.detective.layer_taps import aux_in_full, check_taps, taps_line, unchecked_note
from eaglescope.detective.replay import tree_attention, tree_shape
from eaglescope.detective.report import first_divergent_stage
from eaglescope.detective.serving_metrics import read_metrics_url
from eaglescope.detective.static import DEFAULT_ENGINES, contract_taps, static_checks
from eaglescope.detective.wiring import format_wiring, measure, state_files
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import load_draft
from eaglescope.models.targets import load_target, parse_device, parse_dtype
from eaglescope.models.targets.head import read_fingerprint
from eaglescope.models.targets.loading import check_dir, fingerprint_of, read_config
from eaglescope.trace import TREE_COLUMN, TraceError, load_trace

log = logging.getLogger(__name__)


def _load_models(target_dir, draft_dir, device, dtype, backend):
    """(target with the draft's taps set, LoadedDraft with an embedding), as eaglescope's decoder serves them."""
    device = parse_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, device)
    target = load_target(target_dir, device=device, dtype=dt, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an inferred contract is reported by the static checks
        loaded = load_draft(draft_dir, target.num_layers, device=device, dtype=dt)
    if not loaded.has_embedding:
        loaded.model.load_target_embedding(target_embedding(target).detach())
    target.set_taps(loaded.contract.taps)
    return target, loaded


def _load_draft_side(target_dir, draft_dir, trace, device, dtype):
    """(the trace's target played back, LoadedDraft with the target's embedding) for a draft-side replay."""
    device = parse_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, device)
    num_layers = read_fingerprint(target_dir)[1].num_layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_draft(draft_dir, num_layers, device=device, dtype=dt)
    # the target's embedding read straight into the draft's table: one copy of a table that may be gigabytes
    target = load_recorded_target(target_dir, trace, loaded.model.embed_tokens.weight, device, dt)
    target.set_taps(loaded.contract.taps)
    return target, loaded


def _capture_unusable(mode: ReplayMode, why: str, rnd: int) -> Finding:
    """The capture has another width than the draft's fc reads: a target-side fault this mode cannot name."""
    return Finding(
        "DIVERGENCE_UNEXPLAINED",
        "target.aux",
        f"{why}; which hidden state it holds cannot be told by a draft-side replay",
        {"missing": mode.missing()},
        f"record the concatenation of exactly the contract's taps; to name what was captured, give {mode.missing()[0]} "
        f"or record {mode.missing()[1]}",
        0.5,
        rnd,
    )


def run_doctor(
    target_dir: str | Path,
    draft_dir: str | Path,
    data: str | Path | None = None,
    trace: str | Path | None = None,
    engine_log: str | Path | None = None,
    prompts: int = 8,
    max_new_tokens: int = 64,
    device: str | None = None,
    dtype=None,
    backend: str = "auto",
    depth: int = DEFAULT_DEPTH,
    eval_samples: int = 32,
    engines: tuple[str, ...] | None = None,
    progress: bool = False,
    replay: str = "auto",
    metrics_url: str | None = None,
    measure_wiring: bool = False,
    layer_states: str | Path | None = None,
    wiring_tokens: int = 256,
) -> DoctorReport:
    """Every check the inputs allow → DoctorReport (findings most likely first; healthy = no findings). `replay`:
    auto (a full replay when the target's layers are on disk, else draft-side), full, or draft-side. `progress`
    reports each stage through logging. `measure_wiring`: which features the draft was trained on, measured
    (wiring.py) from `layer_states` (recorded by the engine; the target's layers are not loaded) or a target
    forward over `data`."""

    say = _say if progress else lambda _msg: None

    if prompts < 1 or max_new_tokens < 1 or depth < 1 or eval_samples < 1:
        raise EagleScopeError("--prompts, --max-new-tokens, --depth and --eval-samples must be >= 1")
    loaded_trace, served_engine = _read_inputs(target_dir, draft_dir, data, trace, engine_log, metrics_url)
    if layer_states is not None and not measure_wiring:
        raise EagleScopeError("--layer-states is read by --measure-wiring: pass both")
    if measure_wiring and layer_states is None and data is None:
        raise EagleScopeError("--measure-wiring needs --data (the target runs here) or --layer-states DIR (recorded by "
                              "the engine)")  # fmt: skip
    if layer_states is not None:
        state_files(layer_states)
    mode = choose_replay(target_dir, replay) if loaded_trace is not None else None
    draft_side = mode is not None and mode.mode == DRAFT_SIDE
    engines = engines or _engines_to_check(served_engine, loaded_trace)

    say("static checks")
    # SGLang's own report or trace says SGLang served this target: its ids are read by the rule of the target's family
    sglang_said = (served_engine is not None and served_engine.engine == "sglang") or (
        loaded_trace is not None and str(loaded_trace.producer).startswith("sglang-")
    )
    served_by_sglang = sglang_said and engines == ("sglang",)
    findings, static_ctx = static_checks(target_dir, draft_dir, engines, sglang_rule_of_target=served_by_sglang)
    notes: list[str] = []
    named = {"target": target_dir, "draft": draft_dir, "data": data, "trace": trace, "engine_log": engine_log,
             "metrics_url": metrics_url}  # fmt: skip
    inputs = {k: None if v is None else str(v) for k, v in named.items()} | {"engines_checked": list(engines)}
    context: dict = {"inputs": inputs, "static": static_ctx, "notes": notes}
    if mode is not None:
        context["replay"] = mode.to_dict()

    target = loaded = None
    taps_found: list = []
    if draft_side:  # the replay takes the capture as recorded: the taps are checked against per-layer states instead
        say(f"checking the taps of trace {trace} against its own per-layer states (fingerprints only)")
        taps_found = _taps_from_fingerprints(target_dir, draft_dir, loaded_trace, context, notes)
        findings += taps_found
    if trace is not None or data is not None:
        try:
            if draft_side:
                say(f"{mode.mode} ({mode.why}): loading the target's embedding and the draft")
                target, loaded = _load_draft_side(target_dir, draft_dir, loaded_trace, device, dtype)
            else:
                say("loading target and draft")
                target, loaded = _load_models(target_dir, draft_dir, device, dtype, backend)
        except EagleScopeError as e:
            if not findings:  # nothing explains why it does not load: that is the user's input problem
                raise
            notes.append(f"the draft does not load ({e}); the static findings explain why, runtime checks skipped")

    if loaded is not None and trace is not None and _replayable(mode, loaded_trace, target, loaded, taps_found,
                                                                findings, context):  # fmt: skip
        say(f"comparing trace {trace} with the golden {mode.mode}")
        findings += _trace_findings(target, loaded, loaded_trace, trace, draft_dir, static_ctx, context,
                                    alone=data is None and served_engine is None)  # fmt: skip

    if measure_wiring:
        say("measuring the wiring the draft was trained for (teacher-forced acceptance under candidate wirings)")
        have = (target, loaded) if loaded is not None and not draft_side else None
        models = (lambda: have) if have else (lambda: _load_models(target_dir, draft_dir, device, dtype, backend))
        wired, context["wiring"] = measure(target_dir, draft_dir, static_ctx, engines, data, layer_states,
                                           wiring_tokens, device, dtype, models)  # fmt: skip
        findings += wired
    else:
        wired = []
    if draft_side and data is not None:
        notes.append("--data was not used: teacher-forced acceptance runs the target, whose layers a draft-side replay "
                     "does not have")  # fmt: skip
        target = loaded = data = None
    if data is not None or served_engine is not None:
        findings += _behaviour(target, loaded, draft_dir, data, served_engine, static_ctx, findings, prompts,
                               max_new_tokens, depth, eval_samples, say, context, notes)  # fmt: skip
    ranked = rank(_one_per_code(findings, wired, context.get("wiring")) if measure_wiring else findings)
    return DoctorReport(healthy=not ranked, findings=ranked, context=context)


def _one_per_code(findings: list[Finding], wired: list[Finding], wiring: dict | None) -> list[Finding]:
    """The measured wiring's NO_TTT / UNDERTRAINED beside --data's own: the higher-ranked of each code is kept. Where
    the draft was measured to be served another wiring than it was trained for, --data's own judge the draft under
    the served wiring, where every step fails for that reason: only the wiring's (judged under the best) are kept."""
    mismatch = wiring is not None and wiring.get("verdict") == "mismatch"
    best: dict[str, Finding] = {}
    out = []
    for f in findings:
        if f.code in ("NO_TTT", "UNDERTRAINED"):
            if mismatch and not any(f is w for w in wired):
                continue
            if f.code not in best or f.weight > best[f.code].weight:
                best[f.code] = f
        else:
            out.append(f)
    return out + list(best.values())


def _say(msg: str) -> None:
    log.info("doctor: %s", msg)


def _read_inputs(target_dir, draft_dir, data, trace, engine_log, metrics_url=None):
    """(the loaded trace or None, the read engine log or None); every input error is raised here, before the first
    progress line and minutes of loading."""
    loaded_trace = None
    if trace is not None:
        try:
            loaded_trace = load_trace(trace)
        except TraceError as e:
            raise EagleScopeError(f"cannot read trace {trace}: {e}") from None
    if data is not None and not Path(data).exists():
        raise EagleScopeError(f"--data {data} does not exist")
    if engine_log is not None and metrics_url is not None:
        raise EagleScopeError("--engine-log and --metrics-url both say what was served: pass one")
    served_engine = read_engine_log(engine_log) if engine_log is not None else None
    if metrics_url is not None:  # the server's own counters since its start: exact, where a log has rounded rates
        served_engine = read_metrics_url(metrics_url)
    for path, what in ((target_dir, "target"), (draft_dir, "draft")):
        read_config(check_dir(path, what))
    if data is not None:
        check_data(Path(data))
    return loaded_trace, served_engine


def _engines_to_check(served_engine, loaded_trace) -> tuple[str, ...]:
    """The engines whose tap conventions are checked when none was asked for: the one known to have served."""
    if served_engine is not None:
        return (served_engine.engine,)
    if loaded_trace is not None and str(loaded_trace.producer).startswith(("vllm-", "sglang-")):
        return (str(loaded_trace.producer).split("-", 1)[0],)  # eaglescope capture's traces: the engine is known
    return DEFAULT_ENGINES


def _replayable(mode, loaded_trace, target, loaded, taps_found, findings, context) -> bool:
    """Whether the trace can be played back against the loaded models. A draft-side replay needs target.aux in full
    and of the width the draft's fc reads; when it is not, the reason goes into context (or findings)."""
    if mode.mode != DRAFT_SIDE:
        return True
    if not aux_in_full(loaded_trace) and context["layer_taps"]["checked"]:
        # nothing to play the draft back from, but the taps were checked: the fingerprints-only mode alone
        context["replay"] |= {"mode": LAYER_MODE, "why": f"{mode.why} and the trace's target.aux is fingerprinted"}
        context["notes"].append("the draft side was not replayed: a draft-side replay needs target.aux in full "
                                "(record it with full=True), or --target with its layers")  # fmt: skip
        return False
    unusable = check_capture_width(loaded_trace, loaded.contract.taps.count, target.hidden_size)
    if unusable is not None and not taps_found:  # else the per-layer states already said what it holds
        findings.append(_capture_unusable(mode, *unusable))
    return unusable is None


def _tree_attention_note(trace) -> str | None:
    """What the replay followed when the engine's draft tree steps attend their top-k column, not their ancestors
    (meta draft_tree_attention: SGLang's layout), in a tree deep enough for it to matter: the engine's behaviour, said
    as a fact, not a finding of the draft's."""
    depth, top_k, _ = tree_shape(trace.meta, trace)
    if tree_attention(trace.meta) != TREE_COLUMN or top_k < 2 or depth < 3:
        return None
    return ("the engine's draft tree steps attend their own top-k column's earlier rows, not their ancestors (the "
            "trace's draft_tree_attention: column, SGLang's layout), and the replay computed them so: from depth 3 a "
            "row whose parent sits in another column drafts from a context the draft was not trained on, which can "
            "cost acceptance; this is the engine's behaviour, not a fault of the draft")  # fmt: skip


def _trace_findings(target, loaded, loaded_trace, trace, draft_dir, static_ctx, context, alone: bool) -> list:
    """The trace against its golden replay (diagnose/); context gains what the comparison found."""
    found, ctx = diagnose_trace(target, loaded, trace)
    context.update(ctx)
    if (note := _tree_attention_note(loaded_trace)) is not None:
        context["notes"].append(note)
    if found or not alone:
        return found
    # The trace replays clean, so the wiring is right; its own verify decisions are then what was served. Without a
    # teacher-forced reference (`alone`: no --data, no --engine-log) only NO_TTT can be told from them (the
    # contract's TTT length corroborates it); the other behavioural causes need --data or --engine-log.
    served_trace = from_trace(loaded_trace)
    if served_trace is None:
        return found
    ttt = static_ctx.get("contract", {}).get("ttt_length")
    training = read_training_metrics(draft_dir)
    verdict = diagnose_behaviour(served_trace, None, training, ttt)
    context["acceptance"] = {
        "served": served_trace.to_dict(),
        "predicted": None,
        "training": training.to_dict() if training else None,
        "ttt_length": ttt,
        "depth": len(served_trace.alpha),
    }
    return [x for x in verdict.findings if x.code == "NO_TTT"]


def _taps_from_fingerprints(target_dir, draft_dir, trace, context: dict, notes: list[str]) -> list:
    """The fingerprints-only check (detective/layer_taps.py) beside a draft-side replay: the prefill's taps against the
    engine's own per-layer states, with no target forward. context["layer_taps"] says what it checked; the codes it
    covers leave context["replay"]["cannot_name"]."""
    fp = fingerprint_of(Path(target_dir), read_config(Path(target_dir)))
    findings, ctx = check_taps(trace, contract_taps(draft_dir, fp.num_layers), fp.hidden_size)
    context["layer_taps"] = ctx
    if ctx["checked"]:
        replay = context["replay"]
        replay["cannot_name"] = [c for c in replay["cannot_name"] if c not in ctx["can_name"]]
        replay["missing"] = [] if not replay["cannot_name"] else replay["missing"]
    elif ctx["recorded"] is not None:  # per-layer states there, but nothing of round 0 to match them with
        notes.append(unchecked_note(ctx))
    return findings


def _behaviour(target, loaded, draft_dir, data, served_engine, static_ctx, findings, prompts, max_new_tokens, depth,
               eval_samples, say, context, notes) -> list:  # fmt: skip
    """Served acceptance against what a correct server gets on the same positions, and --data against training
    (behaviour.py): the findings, with context["acceptance"] and the notes filled in."""
    served: Acceptance | None = from_engine(served_engine) if served_engine is not None else None
    expected = predicted = traffic_check = agreement = None
    if data is not None and loaded is not None:
        # an engine drafts as deep as its log says (vLLM's per-position rates); the simulation must reach as deep
        engine_depth = len(served.alpha) if served is not None and served.alpha else None
        eval_depth = max(depth, engine_depth or 0)
        samples = load_samples(data, getattr(target, "tokenizer", None), max(eval_samples, prompts))
        say(f"teacher-forced acceptance on {min(eval_samples, len(samples))} samples of {data}")
        pred = predict_on_data(target, loaded.model, samples[:eval_samples], eval_depth)
        predicted, agreement = pred.predicted, pred.agreement
        if served is None:
            ps = [p for p in (prompt_of(i, m) for i, m in samples) if p][:prompts]
            if not ps:
                notes.append("no sample of --data has a prompt before its first assistant token; not served")
            else:
                say(f"serving {len(ps)} prompts with eaglescope's decoder (chain of {depth})")
                run = serve_with_decoder(target, loaded.model, ps, max_new_tokens, depth)
                served, expected = run.acceptance, run.expected
                context["paired_rounds_agree"] = run.agree
        else:
            expected = pred.rounds
            traffic_check = traffic(served_engine.prompt_mean, served_engine.requests, pred.prompt_lengths)
        if agreement is not None and agreement < AGREEMENT_MIN:
            notes.append(
                f"only {agreement:.0%} of --data's answer tokens are the target's own greedy choice: it is not text "
                "this target writes, so acceptance measured on it is not what serving sees (regenerate it: "
                "eaglescope prepare --regenerate)"
            )
    training = read_training_metrics(draft_dir)
    ttt = static_ctx.get("contract", {}).get("ttt_length")
    verdict = diagnose_behaviour(served, predicted, training, ttt, expected, traffic_check, agreement)
    behaviour = verdict.findings
    notes += verdict.notes
    if findings and predicted is None and training is None:
        # With nothing teacher-forced to compare with, UNDERTRAINED only says "served acceptance is low"; when a
        # static or trace finding already explains that, naming undertraining as a cause too would mislead.
        behaviour = [x for x in behaviour if x.code != "UNDERTRAINED"]
    context["acceptance"] = {
        "served": served.to_dict() if served else None,
        "expected": expected.to_dict() if expected else None,
        "predicted": predicted.to_dict() if predicted else None,
        "training": training.to_dict() if training else None,
        "ttt_length": ttt,
        "depth": depth,
        "comparisons": verdict.comparisons,
        "traffic": traffic_check,
        "agreement": agreement,
    }
    if served_engine is not None:
        context["acceptance"]["engine_log"] = served_engine.to_dict()
    return behaviour


# -- output ----------------------------------------------------------------------------------------------------
def _fmt_alpha(xs) -> str:
    if not xs:
        return "-"
    return " ".join("-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}" for x in xs)


def _fmt_counts(xs) -> str:
    return " ".join("-" if x is None else f"{x:.0f}" for x in xs)


def contract_line(static: dict) -> str | None:
    """The training contract as doctor read it, labelled INFERRED when config.json has no eaglescope section (the
    taps are then the engines' reading of its ids, not a record of training)."""
    c = static.get("contract")
    if not c:
        return None
    taps = static.get("taps")
    if c.get("inferred"):
        return (f"contract   INFERRED from the {c.get('inferred_from') or 'engine default'} (config.json has no "
                f"eaglescope section): taps {taps}; the real training taps and TTT length are unknown")  # fmt: skip
    return f"contract   recorded: taps {taps}, TTT length {c.get('ttt_length')}"


def format_report(report: DoctorReport) -> str:
    lines = []
    draft_side = (report.context.get("replay") or {}).get("mode") == DRAFT_SIDE
    if report.healthy:
        lines.append("healthy: no findings" + (" (on the draft side: see the replay line)" if draft_side else ""))
    else:
        top = report.findings[0]
        lines.append(f"NOT HEALTHY: {len(report.findings)} finding(s); most likely {top.code}")
    for i, f in enumerate(report.findings, 1):
        where = f.stage + (f" (round {f.round})" if f.round is not None else "") if f.stage else "-"
        lines.append(f"{i}. {f.code}  [{where}, {f.support}]")
        lines.append(f"   {f.verdict}")
        lines.append(f"   fix: {f.fix}")
    if (c := contract_line(report.context.get("static") or {})) is not None:
        lines.append(c)
    if (r := report.context.get("replay")) is not None:
        taps = report.context.get("layer_taps") or {}
        if taps.get("checked"):  # the taps were named from per-layer states: the replay's own caveat does not hold
            lines += [f"replay     {r['mode']}: {r['why']}", taps_line(taps)]
        else:
            lines.append(ReplayMode(r["mode"], r["why"], r["layers_on_disk"], r["num_layers"]).line())
    acc = report.context.get("acceptance")
    if acc:
        for key in ("served", "expected", "predicted", "training"):
            a = acc.get(key)
            if a:
                tau = a.get("accept_length")
                t = f"τ {tau:.2f}" if isinstance(tau, (int, float)) else "τ -"
                if a.get("accept_length_interval"):
                    lo, hi = a["accept_length_interval"]
                    t += f" [{lo:.2f}, {hi:.2f}]"
                line = f"{key:<10} {a['source']}: {t}, α_k [{_fmt_alpha(a.get('alpha'))}]"
                if a.get("reached"):
                    line += f" over [{_fmt_counts(a['reached'])}] reached"
                lines.append(line)
    if (w := report.context.get("wiring")) is not None:
        lines += format_wiring(w)
    if fds := first_divergent_stage(report.context):
        lines.append(f"first divergent stage: {fds}")
    lines += [f"note: {n}" for n in report.context.get("notes", [])]
    return "\n".join(lines)


def report_json(report: DoctorReport) -> str:
    return json.dumps(report.to_dict() | {"codes": CODES}, indent=2, allow_nan=False)


def check_data(data: Path) -> None:
    """--data is read minutes into the run; a broken file is the user's input and is refused at once."""
    if data.is_dir():
        PreparedData.open(data, verify=False)
    else:
        if not any(True for _ in read_conversations(data)):
            raise EagleScopeError(f"--data {data} holds no conversations")
