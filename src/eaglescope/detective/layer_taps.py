"""The taps checked from the engine's own per-layer fingerprints, with no target forward ("fingerprints only").

An engine that records `target.layer.<i>` (every hidden state of its prefill: `TraceRecorder.record_layers`,
`generate --trace-layers`, `capture --layers`) next to `target.aux` lets doctor say which state each segment of
`target.aux` holds by matching the two against each other. Both come from the same forward of the same engine, so
the target's decoder layers are not needed: a target directory holding config.json, the tokenizer, the embedding
and lm_head is enough (the copy `train` accepts; a 1T-parameter target need not be loaded). The naming is
diagnose/taps.py's (`diagnose_taps` → `_classify_taps`); only the candidates differ: the engine's recorded states of
round 0 instead of the golden replay's. doctor runs it where a draft-side replay takes the capture as recorded
(draft_replay.py), beside that replay, or alone when the trace's target.aux is fingerprinted and cannot be played back.

What this can name: TAP_OFF_BY_ONE, TAP_WRONG_LAYER, TAP_ORDER, TAP_EMBEDDING from `target.layer.<0..L-1>`; a
segment holding the final normed state (TAP_WRONG_LAYER, or FC_SKIPPED for an H-wide aux) when `target.layer.<L>`
is recorded; TAP_NORMED only when `target.layer.<i>.normed` are recorded (a fingerprint is a linear projection of the
raw state, and an RMSNorm with its learned weight is not linear in it: the normed state cannot be computed from the
raw state's fingerprint). What it cannot: anything the engine's layer record and its tap capture get wrong alike (it
checks the engine's capture against the engine's own states, not against a correct forward of the target), a fault
in the target's forward itself, and rounds after the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eaglescope import trace as T
from eaglescope.detective.diagnose.evidence import Cmp, Evidence, compare_rows, precision_of
from eaglescope.detective.diagnose.taps import diagnose_taps
from eaglescope.detective.findings import Finding
from eaglescope.detective.replay import REPLAY_FINAL
from eaglescope.taps import TapContract

MODE = "fingerprints only"


@dataclass
class EngineLayers:
    """The states an engine recorded of its prefill (round 0): tensors or fingerprints [T, H]."""

    states: dict[int, torch.Tensor | T.Fingerprint]  # i → hs[i], entering layer i (0: the embedding output)
    final: torch.Tensor | T.Fingerprint | None = None  # hs[L], the final normed state
    normed: dict[int, torch.Tensor | T.Fingerprint] = field(default_factory=dict)  # i → layer i's input RMSNorm

    @property
    def rows(self) -> int:
        return next(iter(self.states.values())).shape[0]

    def recorded(self) -> dict:
        return {"states": sorted(self.states), "final": self.final is not None, "normed": sorted(self.normed)}


def engine_layers(trace: T.Trace, num_layers: int) -> EngineLayers | None:
    """The trace's target.layer.* of round 0, or None when it records none."""

    def get(stage: str):
        try:
            return trace.get(stage, 0)
        except KeyError:
            return None

    states = {i: v for i in range(num_layers) if (v := get(T.target_layer(i))) is not None}
    if not states:
        return None
    normed = {i: v for i in range(num_layers) if (v := get(T.target_layer_normed(i))) is not None}
    return EngineLayers(states, get(T.target_layer(num_layers)), normed)


class LayerEvidence(Evidence):
    """What diagnose_taps reads of an Evidence, from the trace alone: its candidates are the engine's own states of
    the prefill (no target, draft or replay)."""

    def __init__(self, trace: T.Trace, taps: TapContract, hidden_size: int, layers: EngineLayers, tol=None) -> None:
        self.target = self.loaded = self.draft = self.golden = None
        self.trace, self.taps, self.H, self.layers, self.fixed_tol = trace, taps, hidden_size, layers, tol
        self._trace_keys = {(e.stage, e.round, e.part) for e in trace.events}
        floats = {e.dtype for e in trace.events if e.dtype.startswith(("float", "bfloat"))}
        self.precision = precision_of(*floats, trace.meta.get("dtype"))
        self.tried = {}

    def hidden_states(self, rnd: int) -> dict:
        return dict(self.layers.states) if rnd == 0 else {}

    def normed(self, i: int, hs) -> torch.Tensor | T.Fingerprint | None:
        return self.layers.normed.get(i)

    def g(self, stage: str, rnd: int, part: str | None = None):
        return self.layers.final if stage == REPLAY_FINAL and rnd == 0 else None

    def compare(self, observed, reference) -> Cmp:
        if isinstance(reference, T.Fingerprint):
            if isinstance(observed, torch.Tensor):  # a full trace's segment against a fingerprinted layer
                observed = T.fingerprint(observed, 1, reference.seed)
            return compare_rows(observed, reference, self.tol(observed))
        return super().compare(observed, reference)


def _observed(trace: T.Trace, taps: TapContract):
    """(stage, value) of what the draft received in the prefill: target.aux, else the first per-tap stage."""
    for stage in (T.TARGET_AUX, *(T.target_tap(i) for i in taps.layers)):
        try:
            return stage, trace.get(stage, 0)
        except KeyError:
            continue
    return None, None


def check_taps(trace: T.Trace, taps: TapContract, hidden_size: int) -> tuple[list[Finding], dict]:
    """Findings about the taps from the trace's per-layer states alone, and context["layer_taps"]: whether they were
    checked, what the trace records, and why not (`missing`) when they were not."""
    ctx: dict = {"mode": MODE, "checked": False, "missing": None, "recorded": None, "can_name": []}
    layers = engine_layers(trace, taps.num_layers)
    stage, observed = _observed(trace, taps)
    if layers is None:
        ctx["missing"] = "target.layer.<i> (per-layer fingerprints of the prefill)"
        return [], ctx
    ctx["recorded"] = layers.recorded()
    if observed is None:
        ctx["missing"] = "target.aux (or target.tap.<i>) of round 0"
        return [], ctx
    if observed.shape[0] != layers.rows:
        ctx["missing"] = f"a prefill of {layers.rows} rows in {stage} (it has {observed.shape[0]})"
        return [], ctx
    ctx["checked"], ctx["can_name"] = True, can_name(layers)
    ev = LayerEvidence(trace, taps, hidden_size, layers)
    findings = diagnose_taps(ev, 0, stage, observed)
    if not layers.normed:
        for f in findings:
            if f.code == "DIVERGENCE_UNEXPLAINED":
                f.verdict += (
                    "; the trace records no target.layer.<i>.normed, so a normed tap (TAP_NORMED) cannot be told"
                )
    ctx["tried"] = ev.tried
    return findings, ctx


def unchecked_note(ctx: dict) -> str:
    """The note when the trace has per-layer states but they could not be matched with its capture."""
    return (
        f"the trace records per-layer states but lacks {ctx['missing']}: the taps (TAP_*) were not checked from them; "
        "give doctor the full target for a full replay"
    )


def can_name(layers: EngineLayers) -> list[str]:
    """The codes the check can name from what the trace records (see the module docstring)."""
    codes = ["TAP_OFF_BY_ONE", "TAP_WRONG_LAYER", "TAP_ORDER", "TAP_EMBEDDING"]
    if layers.final is not None:
        codes.append("FC_SKIPPED")  # an H-wide target.aux that is the final normed state (EAGLE-2 wiring)
    if layers.normed:
        codes.append("TAP_NORMED")
    return codes


def taps_line(ctx: dict) -> str:
    """The report's line for a check that ran."""
    names = ctx["can_name"]
    missing = [c for c in ("FC_SKIPPED", "TAP_NORMED") if c not in names]
    text = (
        f"taps       {MODE}: target.aux matched against the trace's own per-layer states of the prefill "
        f"(target.layer.<i>), no target forward: {', '.join(names)} can be named"
    )
    if missing:
        text += f"; {' and '.join(missing)} cannot (the trace lacks target.layer.<L> or target.layer.<i>.normed)"
    return text


def aux_in_full(trace: T.Trace) -> bool:
    """Whether every target.aux of the trace is a full tensor (what a draft-side replay plays back)."""
    return all(e.kind == "full" for e in trace.events if e.stage == T.TARGET_AUX)
