"""What `doctor` says: a Finding (one named cause with evidence and a fix) and the registry of stable codes.

Codes are part of the --json interface: never rename one, only add. ``rank`` orders findings most likely
first: by confidence, then by where in the pipeline the finding first shows (an earlier stage explains
the later ones).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from eaglescope.trace import STAGE_FAMILIES, parse_stage

# code -> one-line meaning (docs and --json "codes").
CODES: dict[str, str] = {
    # Tap wiring (static or trace).
    "TAP_OFF_BY_ONE": "a target.aux segment holds the tap one layer away from the contract's",
    "TAP_WRONG_LAYER": "a target.aux segment holds a tap from a different layer than the contract's",
    "TAP_ORDER": "the target.aux segments are the right taps in the wrong order",
    "TAP_EMBEDDING": "the embedding output (tap 0) is captured where a layer tap belongs, or missing where it belongs",
    "TAP_NORMED": "a target.aux segment is the RMS-normed tap instead of the raw residual stream",
    # Draft forward (trace).
    "FC_SKIPPED": "the draft's fc projection was not applied to the concatenated target features",
    "FC_REPEATED": "the draft's fc projection was applied twice",
    "FEEDBACK_TARGET_FEATURES": "draft steps k>0 received target features instead of the draft's own hidden_out",
    "FEEDBACK_POSTNORM": "draft steps k>0 received the normed hidden state instead of the pre-norm output",
    "STALE_ACCEPTED": "next-round features were not filtered to the accepted positions",
    "POSITION_OFFSET": "draft positions (RoPE) are offset from the target's",
    "SHIFT_OFF_BY_ONE": "draft inputs pair token t with features of the wrong position (loss mask / shift off by one)",
    "EMBEDDING_MISMATCH": "the draft's token embedding differs from the target's",
    "VOCAB_MAP": "the draft→target vocabulary map (d2t) is missing, identity on a reduced vocabulary, or invalid",
    "LM_HEAD_MAP_MISALIGNED": "the draft's lm_head rows are read through another valid vocabulary map than the one "
    "they were trained with (a regenerated d2t / hot-token map)",
    "DRAFT_FINAL_NORM_SKIPPED": "the draft's lm_head is applied to the layer's output without the draft's final norm",
    "EAGLE31_NORM": "an EAGLE 3.1 norm (norm_before_fc, fc_norm before fc; norm_output after the layer) was skipped, "
    "added, or applied in the other form or meaning than the draft was trained with",
    "EAGLE31_IGNORED": "the serving engine ignores one of the draft's EAGLE 3.1 options (or another layer option)",
    "DRAFT_ARCH_MISMATCH": "the checkpoint's config names another draft layer (Llama attention / MLA) than its weights",
    # Checkpoint / serving (static).
    "ENGINE_TAP_CONVENTION": "the serving engine will capture different layers than the draft was trained on",
    "TEMPLATE_MISMATCH": "the target's chat template differs from the one the draft was trained with",
    "CONTRACT_MISMATCH": "the target's fingerprint differs from the one recorded in the draft's contract",
    # Behaviour (acceptance).
    "NO_TTT": "step 1 is healthy but steps k>=2 collapse (teacher-forced acc_k, served alpha_k): trained without TTT",
    "SERVING_MISMATCH": "teacher-forced acceptance predicts far more than is served: a wiring or serving problem",
    "UNDERTRAINED": "acceptance is low everywhere, predicted and served: data or capacity",
    "OVERFIT_OR_OTHER_TRAFFIC": "acceptance on --data is far below training's held-out: the draft fits only its "
    "training data, or --data is other traffic than it was trained for",
    "DIVERGENCE_UNEXPLAINED": "the trace diverges from the golden replay but no named hypothesis explains it",
    "TRACE_INCOMPLETE": "the trace stops before its request ended (the engine raised, the process exited) or holds "
    "no decode round: what it does not hold cannot be judged healthy",
    # Training data against serving (doctor --training-data).
    "DATA_TAP_MISMATCH": "the training data holds other target layers than the served config declares (and the "
    "engine feeds the draft)",
    "DATA_SHIFT": "the training features stored at position t are the target's state at another position",
    "DATA_FINAL_NORM": "the training data's final state is normed where the trainer normalises it again, or raw where "
    "the trainer applies the lm_head to it directly",
    "DATA_UNMATCHED": "a training-data segment equals no hidden state of this target for the same tokens",
}

# Where a finding can first show, earliest first: "static" before anything that runs, then the trace's stages in
# the order a round makes them, "behaviour" last. A per-layer fingerprint is evidence, never a finding's stage: those
# families rank with "behaviour", as unknown families do.
_STAGE_ORDER = ["static", *(f for f in STAGE_FAMILIES if not f.startswith("target.layer")), "behaviour"]


def stage_rank(stage: str | None) -> tuple[int, int, int]:
    """Sort key of a stage: (round-independent family position, step or tap index, 0)."""
    if stage is None:
        return (len(_STAGE_ORDER), 0, 0)
    family, idx = parse_stage(stage)
    pos = _STAGE_ORDER.index(family) if family in _STAGE_ORDER else len(_STAGE_ORDER) - 1
    return (pos, idx or 0, 0)


@dataclass
class Finding:
    code: str  # stable code, a key of CODES
    stage: str | None  # canonical trace stage where it first shows, or "static"/"behaviour"
    verdict: str  # one line
    evidence: dict  # numbers (JSON-able)
    fix: str  # one line
    confidence: float = 1.0  # ranking key, 0..1
    round: int | None = None  # trace round where it first shows

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}; add it to CODES")
        self.confidence = float(min(max(self.confidence, 0.0), 1.0))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["evidence"] = _jsonable(self.evidence)
        d["meaning"] = CODES[self.code]
        return d


def _jsonable(x):
    # Evidence may carry tensors, numpy scalars or NaN; --json must stay valid JSON.
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return _jsonable(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def rank(findings: list[Finding]) -> list[Finding]:
    """Most likely first: confidence descending, then earliest trace stage, then earliest round."""
    return sorted(
        findings,
        key=lambda f: (-f.confidence, stage_rank(f.stage), f.round if f.round is not None else -1),
    )


@dataclass
class DoctorReport:
    healthy: bool
    findings: list[Finding]
    # Everything else a reader or the HTML report wants: served/predicted acceptance, the per-stage comparison
    # table ("stage_table"), first divergent stage, per-segment norms ("segment_norms"), notes, inputs.
    context: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "healthy": bool(self.healthy),
            "findings": [f.to_dict() for f in self.findings],
            "context": _jsonable(self.context),
        }
