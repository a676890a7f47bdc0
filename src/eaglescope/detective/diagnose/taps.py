"""Causes in the taps: which hidden states the capture (target.aux) holds, against the contract's."""

from __future__ import annotations

import math

import torch

from eaglescope import trace as T
from eaglescope.detective.diagnose.evidence import Cmp, Evidence
from eaglescope.detective.diagnose.judge import judge, split_segments, tensor_hypothesis, unexplained_finding
from eaglescope.detective.findings import Finding
from eaglescope.detective.replay import REPLAY_FINAL


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
        segs = split_segments(aux, len(contract), ev.H)
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
        "margin": max(0.0, min(seps)) if seps else None,
    }
    weight = 0.5 + 0.45 * evidence["margin"] if seps else 0.5
    return _classify_taps(where, expected, found, evidence, rnd, weight)


def handed_taps(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
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
    segs = split_segments(observed, ev.taps.count, ev.H)
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
        h = tensor_hypothesis
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


_FIX_CONVENTION = (
    "check the tap contract and the engine's layer-id convention (eaglescope inspect shows what SGLang and vLLM "
    "capture)"
)


def _classify_taps(
    stage: str, expected: list[int], found: list[str | None], evidence: dict, rnd: int, weight: float
) -> Finding:
    """Name the capture mistake from what each segment holds (found: "hs<i>", "normed<i>", "final" or None)."""
    named = _tap_mistake(stage, expected, found)
    if named is None:
        return unexplained_finding(
            stage,
            rnd,
            f"{stage} matches no hidden state of the target (segments found: {found})",
            evidence,
            "compare the engine's capture code with the contract",
        )
    code, verdict, fix = named
    return Finding(code, stage, verdict, evidence, fix, weight, rnd)


def _tap_mistake(stage: str, expected: list[int], found: list[str | None]) -> tuple[str, str, str] | None:
    """(code, verdict, fix) of the capture mistake the segments show; None when none fits."""
    what = "segment" if stage == T.TARGET_AUX else "tap"
    raw = [int(f[2:]) if f and f.startswith("hs") else None for f in found]
    normed = [(j, int(f[6:])) for j, f in enumerate(found) if f and f.startswith("normed")]
    if normed:
        j, layer = normed[0]
        where = "" if layer == expected[j] else f" (and of layer {layer}, not {expected[j]})"
        verdict = f"{what} {j} of {stage} is the RMS-normed input of layer {layer}{where}, not the raw residual stream"
        return "TAP_NORMED", verdict, "capture the hidden state entering the layer (before input_layernorm)"
    if "final" in found:
        j = found.index("final")
        verdict = f"{what} {j} of {stage} is the target's final normed state, not tap {expected[j]}"
        return "TAP_WRONG_LAYER", verdict, _FIX_CONVENTION
    if None not in raw and sorted(raw) == sorted(expected) and raw != expected:
        verdict = f"{stage} holds the right taps in the order {raw} instead of {expected}"
        return "TAP_ORDER", verdict, "concatenate taps from low to high layer"
    emb = [j for j, (r, e) in enumerate(zip(raw, expected)) if r is not None and (r == 0) != (e == 0)]
    if emb:
        j = emb[0]
        held = "the embedding output" if raw[j] == 0 else f"layer {raw[j]}'s input"
        return (
            "TAP_EMBEDDING",
            f"{what} {j} of {stage} is {held}; the contract expects tap {expected[j]}",
            _FIX_CONVENTION,
        )
    if None not in raw and all(abs(r - e) <= 1 for r, e in zip(raw, expected)):
        deltas = ", ".join(f"{d:+d}" for d in sorted({r - e for r, e in zip(raw, expected) if r != e}))
        verdict = f"{stage} holds taps {raw} instead of {expected} (off by {deltas})"
        return "TAP_OFF_BY_ONE", verdict, _FIX_CONVENTION + "; SGLang adds +1 to explicit ids"
    if None not in raw:
        return "TAP_WRONG_LAYER", f"{stage} holds taps {raw} instead of {expected}", _FIX_CONVENTION
    return None
