"""What `doctor` says: a Finding (one named cause with evidence and a fix) and the registry of stable codes.

Codes are part of the --json interface: never rename one, only add. Each finding says how it is supported
(SUPPORT: what kind of evidence names it), never a probability: doctor has no population of real incidents on which a
probability could be calibrated (docs/doctor-calibration.md counts how often each code and each kind of support was
right on faults made in engines doctor did not write). ``rank`` orders findings: by an internal ranking weight (the
kind of support and how cleanly the evidence separates the cause from the clean path and from the other causes),
then by where in the pipeline the finding first shows (an earlier stage explains the later ones).
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
    # Measured wiring (doctor --measure-wiring: detective/wiring.py).
    "TRAINED_WIRING_MISMATCH": "the draft predicts the target far better on other features than the engine feeds it "
    "(other taps, order, final state or token pairing): measured from its teacher-forced acceptance under each",
    "WIRING_UNEXPLAINED": "the served wiring is clearly not what the draft was trained on, but the best candidate "
    "wirings are too close to tell which one it was",
    # Training data against serving (doctor --training-data).
    "DATA_TAP_MISMATCH": "the training data holds other target layers than the served config declares (and the "
    "engine feeds the draft)",
    "DATA_SHIFT": "the training features stored at position t are the target's state at another position",
    "DATA_FINAL_NORM": "the training data's final state is normed where the trainer normalises it again, or raw where "
    "the trainer applies the lm_head to it directly",
    "DATA_UNMATCHED": "a training-data segment equals no hidden state of this target for the same tokens",
}

# How a finding is supported: what a reader can check, strongest kind first.
SUPPORT: dict[str, str] = {
    "declared": "the files say so: a checkpoint's config, the draft's contract or vocabulary map, read as written",
    "reproduced": "re-running the golden path with this mistake reproduces the trace at its first divergent stage, "
    "and the clean path does not",
    "fitted": "a general form of the mistake, fitted to the observation, reproduces it where no specific one did",
    "measured": "acceptance measured on both sides (served, teacher-forced, training) with separated intervals",
    "suggested": "a weaker pattern: one source of acceptance only, or a label (the contract's TTT length) that "
    "the behaviour fits",
    "unexplained": "the trace diverges from the golden replay and no named mistake reproduces it",
}


@dataclass(frozen=True)
class CodeGuide:
    """What a reader of a finding needs beyond its one-line meaning (CODES)."""

    evidence: str  # which check names the code, and from what input
    fix: str  # the usual fix; each finding's own `fix` says it for the case at hand


_CONVENTION_FIX = (
    "check the tap contract against the engine's layer-id convention: `eaglescope inspect DRAFT` shows what SGLang "
    "and vLLM will capture, and `eaglescope export --to ENGINE` writes ids that engine reads as the trained taps"
)

# code -> what evidence names it and the usual fix. docs/doctor-codes.md is generated from CODES and this table
# (python -m eaglescope.detective.codes_doc); tests/test_doctor_codes_doc.py fails when the two differ, or when a
# code has no entry here.
GUIDE: dict[str, CodeGuide] = {
    "TAP_OFF_BY_ONE": CodeGuide(
        "trace: each target.aux segment equals the golden replay's tap (or the engine's own per-layer fingerprint) at "
        "most one layer from the contract's; static: the served config's layer ids make the engine capture such "
        "taps, and no engine's convention reads those ids as the trained taps",
        _CONVENTION_FIX + " (SGLang adds +1 to explicit ids, vLLM does not)",
    ),
    "TAP_WRONG_LAYER": CodeGuide(
        "trace: a target.aux segment equals another layer's hidden state, or the target's final normed state; "
        "static: the served layer ids make the engine capture layers more than one away from the trained taps",
        _CONVENTION_FIX,
    ),
    "TRAINED_WIRING_MISMATCH": CodeGuide(
        "doctor --measure-wiring: the draft scored teacher-forced (acc_0..acc_k, training's own TTT unroll) on the "
        "target's per-layer states under candidate wirings (tap layers, segment order, embedding, raw or normed "
        "final state, token pairing); the best beats every wiring that keeps the served choice, beyond chance",
        "serve the draft with the wiring it was trained for (the finding names it), or retrain it on the features "
        "the engine feeds",
    ),
    "WIRING_UNEXPLAINED": CodeGuide(
        "doctor --measure-wiring: the served wiring scores clearly below the best candidate, but the best is not "
        "told apart from another candidate",
        "measure on more tokens (--wiring-tokens), or ask whoever trained the draft which layers and pairing its "
        "data held",
    ),
    "DATA_TAP_MISMATCH": CodeGuide(
        "doctor --training-data: each stored training segment matched against every layer's state of the target for "
        "the same tokens (relative error), set against the layer ids the draft's config declares",
        "regenerate the hidden states at the served ids and retrain, or declare the ids the data holds before serving",
    ),
    "DATA_SHIFT": CodeGuide(
        "doctor --training-data: the stored features match the target's states one position away from their tokens",
        "store each position's features with its own token; the trainer pairs them with the next token itself",
    ),
    "DATA_FINAL_NORM": CodeGuide(
        "doctor --training-data: the stored final state matches the normed (or raw) final state where the data's "
        "trainer expects the other (speculators: before the norm; SpecForge and eaglescope: after it)",
        "store the final state its trainer expects and retrain",
    ),
    "DATA_UNMATCHED": CodeGuide(
        "doctor --training-data: a stored segment equals no hidden state of this target for the same tokens",
        "check that the data was generated by this target (same weights, same tokenizer) and read back intact",
    ),
    "TAP_ORDER": CodeGuide(
        "trace: every target.aux segment equals one of the contract's taps, but not in the contract's order",
        "concatenate the taps from low to high layer, as the draft was trained",
    ),
    "TAP_EMBEDDING": CodeGuide(
        "trace: a target.aux segment is the embedding output (tap 0) where the contract has a layer, or a layer's "
        "input where the contract has the embedding",
        _CONVENTION_FIX,
    ),
    "TAP_NORMED": CodeGuide(
        "trace: a target.aux segment equals the RMS-normed input of a layer (a full replay, or the trace's "
        "target.layer.<i>.normed fingerprints) instead of the raw residual stream",
        "capture the hidden state entering the layer, before its input_layernorm",
    ),
    "FC_SKIPPED": CodeGuide(
        "trace: draft.fc.out or the first step's hidden_in equals the raw concatenated taps (or one raw tap) the "
        "fc projection should have read; with per-layer fingerprints, target.aux equal to the final normed state "
        "(EAGLE-2 wiring)",
        "apply fc to the concatenated taps before the first draft step",
    ),
    "FC_REPEATED": CodeGuide(
        "trace: draft.fc.out, or a later step's hidden_in, equals fc applied to features that were already projected",
        "apply fc once, to the target's concatenated taps only, at step 0",
    ),
    "FEEDBACK_TARGET_FEATURES": CodeGuide(
        "trace: draft.step<k>.hidden_in for k > 0 equals the root's fc output or a raw tap of the target, not the "
        "previous step's hidden_out",
        "after step 0, feed the draft its own pre-norm output, not the target's hidden states",
    ),
    "FEEDBACK_POSTNORM": CodeGuide(
        "trace: draft.step<k>.hidden_in for k > 0 equals the previous step's output after the draft's final norm",
        "feed the next step the pre-norm output (unless the draft was trained with norm_output: then EAGLE31_NORM)",
    ),
    "STALE_ACCEPTED": CodeGuide(
        "trace: next.hidden_in holds every tree position, the first rows in tree order, or the previous round's "
        "features, where the replay keeps the root and the accepted nodes",
        "feed hidden_states[accepted_indices] (root + accepted nodes) to the next draft pass",
    ),
    "POSITION_OFFSET": CodeGuide(
        "trace: re-running the golden draft with its RoPE positions shifted by d reproduces the traced hidden_out "
        "(or draft.step<k>.positions differ from the committed cache's by d)",
        "draft step k uses position (feature position + k), continuing the committed cache",
    ),
    "SHIFT_OFF_BY_ONE": CodeGuide(
        "trace: the first step's token inputs pair each feature with another token than the next one, or the "
        "features handed to the next round are those of the emitted tokens' own positions",
        "pair the features at position t with the embedding of token t+1",
    ),
    "EMBEDDING_MISMATCH": CodeGuide(
        "static: the draft saves an embedding that differs from the target's (vLLM drafts with a saved one); "
        "trace: draft.step<k>.embed_in differs from the target's embedding while the engine embeds each token alike "
        "wherever it recurs",
        "ship no embedding (the target's is shared), or the target's own: eaglescope export --target TARGET",
    ),
    "VOCAB_MAP": CodeGuide(
        "static: d2t/t2d missing, identity on a reduced vocabulary, invalid, or not the size of lm_head; trace: the "
        "draft's tokens reached the target through a wrong map (d2t not applied, applied twice, read a row off)",
        "map draft ids with target_id = draft_id + d2t[draft_id] and ship d2t/t2d with the checkpoint (eaglescope "
        "train writes them)",
    ),
    "LM_HEAD_MAP_MISALIGNED": CodeGuide(
        "trace: the draft's own ranking, read through another valid vocabulary map, reproduces the traced tokens; "
        "each draft id seen always went to one target id",
        "serve the d2t/t2d the draft was trained with, not a regenerated hot-token map; if the map must change, "
        "retrain lm_head with it",
    ),
    "DRAFT_FINAL_NORM_SKIPPED": CodeGuide(
        "trace: the draft's tokens are reproduced by lm_head applied to the layer's output without the final norm",
        "apply the draft's norm (norm.weight) before lm_head",
    ),
    "EAGLE31_NORM": CodeGuide(
        "trace: hidden_in or fc.out is reproduced only with an EAGLE 3.1 norm skipped, added, or read in the other "
        "meaning (norm_output as 'norm before lm_head', an older SpecForge's)",
        "serve the EAGLE 3.1 options as config.json states them, with an engine version that implements them",
    ),
    "EAGLE31_IGNORED": CodeGuide(
        "static: the weights hold an EAGLE 3.1 norm that config.json does not set (or the reverse), or the named "
        "engine does not implement one of the draft's options; trace: logits not multiplied by logit_scale",
        "set the option as trained (eaglescope export writes it where vLLM and SGLang read it), or serve with an "
        "engine version that implements it",
    ),
    "DRAFT_ARCH_MISMATCH": CodeGuide(
        "static: config.json names a Llama-attention draft layer and the weights are MLA's, or the reverse",
        "serve the checkpoint with the config it was trained with (export it again with eaglescope export)",
    ),
    "ENGINE_TAP_CONVENTION": CodeGuide(
        "static: the engine reads the checkpoint's layer ids (or their absence) as other taps than the trained "
        "ones, and the ids are another engine's convention for the trained taps",
        "eaglescope export --draft DRAFT --to ENGINE --out DIR writes ids that engine reads as the trained taps",
    ),
    "TEMPLATE_MISMATCH": CodeGuide(
        "static: the chat template's sha256 recorded in the draft's contract differs from the target's (or the "
        "target has none)",
        "re-render (eaglescope prepare) and retrain with the serving template, or serve with the trained one",
    ),
    "CONTRACT_MISMATCH": CodeGuide(
        "static: the target's fingerprint (layers, hidden and vocabulary size, architecture, tokenizer hash) differs "
        "from the one in the draft's contract, or the draft's fc is not as wide as its taps on this target",
        "serve the draft with the target it was trained on, or retrain it on this target",
    ),
    "NO_TTT": CodeGuide(
        "behaviour: α_1 healthy and α_k for k >= 2 collapsing, in what is served and in teacher-forced acc_k on "
        "--data or training's held-out split (a contract with TTT length 1 adds weight)",
        "retrain with training-time test (eaglescope train --ttt-length 7)",
    ),
    "SERVING_MISMATCH": CodeGuide(
        "behaviour: served acceptance (eaglescope's decoder, --engine-log or a trace's verify decisions) far below "
        "what the teacher-forced draft accepts at the same positions",
        "record a trace of the serving engine (eaglescope capture) and run eaglescope doctor --trace to find the stage",
    ),
    "UNDERTRAINED": CodeGuide(
        "behaviour: acceptance low from the first position on, on every side measured (served, teacher-forced, "
        "training's held-out)",
        "train longer or on more data regenerated by the target (eaglescope prepare --regenerate); pass --data to "
        "tell an undertrained draft from a serving problem",
    ),
    "OVERFIT_OR_OTHER_TRAFFIC": CodeGuide(
        "behaviour: teacher-forced τ on --data far below training's held-out τ, beyond --data's own spread (few of "
        "--data's answer tokens being the target's own greedy choice says it is other traffic)",
        "train on data from the traffic you serve (eaglescope prepare --regenerate on it), or pass --data that is "
        "that traffic",
    ),
    "DIVERGENCE_UNEXPLAINED": CodeGuide(
        "trace: the first stage where the trace and the golden replay differ, when no named hypothesis, re-run "
        "through the golden path, reproduces it; the finding names the stage, round and differing rows",
        "compare the engine's code for that stage with eaglescope's; the stages the trace lacks upstream of it are "
        "listed, and recording them narrows the search",
    ),
    "TRACE_INCOMPLETE": CodeGuide(
        "trace: its manifest says the request did not finish (the engine raised, the process exited), or it holds "
        "no decode round",
        "find why the engine stopped (its log has the error), fix it and capture again; a request must run past "
        "its prefill for its draft to be judged",
    ),
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
    weight: float = 1.0  # internal ranking weight, 0..1: orders findings, is not a probability and is not shown
    round: int | None = None  # trace round where it first shows
    support: str | None = None  # a key of SUPPORT; by default from the stage (static: declared, trace: reproduced)

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}; add it to CODES")
        self.weight = float(min(max(self.weight, 0.0), 1.0))
        if self.support is None:
            self.support = _default_support(self.code, self.stage)
        if self.support not in SUPPORT:
            raise ValueError(f"unknown support {self.support!r}; one of {', '.join(SUPPORT)}")

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["weight"]
        d["evidence"] = _jsonable(self.evidence)
        d["meaning"] = CODES[self.code]
        return d


def _default_support(code: str, stage: str | None) -> str:
    if code == "DIVERGENCE_UNEXPLAINED":
        return "unexplained"
    if stage == "static" or code == "TRACE_INCOMPLETE":  # TRACE_INCOMPLETE: what the trace itself says
        return "declared"
    if stage == "behaviour":
        return "measured"
    return "reproduced"


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
    """Most likely first: ranking weight descending, then earliest trace stage, then earliest round."""
    return sorted(
        findings,
        key=lambda f: (-f.weight, stage_rank(f.stage), f.round if f.round is not None else -1),
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
