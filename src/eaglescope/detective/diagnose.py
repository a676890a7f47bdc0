"""Compare a trace with its golden replay; name the cause of the first divergence.

Walk the replay's events in order; the first canonical stage whose trace tensor differs is where
the wiring first goes wrong (later stages inherit the error, so they are not diagnosed). At that
stage, each named hypothesis builds the tensor a specific mistake would have produced, from the
replay's own tensors, and asks whether the trace matches it. Hypotheses that match become
findings; a divergence that none explains is reported as such, with its numbers.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.decode.speculative import Eagle3Proposer
from eaglescope.detective.findings import Finding, rank
from eaglescope.detective.replay import REPLAY_HS, replay, replay_hs
from eaglescope.draft import LoadedDraft
from eaglescope.errors import EagleScopeError
from eaglescope.target.base import Target

# Relative L2 error under which two tensors count as the same. bf16 engines against a float32
# replay land around 1e-2 on activations; wiring mistakes land at 0.3 and above.
DEFAULT_TOL = 0.05
# Stages the replay copies from the trace (it follows the trace's decisions): never evidence.
FORCED = {T.VERIFY_TOKENS, T.VERIFY_PARENTS, T.VERIFY_ACCEPTED, T.VERIFY_BONUS}
# Draft log-probs of a bf16 engine land within ~0.1-0.25 nats of a float32 replay's (logits of a few units,
# 8-bit mantissas, 1-3% error on the hidden state): candidates this close may swap ranks, and top-k log-probs
# are compared with this absolute tolerance (relative error is meaningless for log-probs near 0).
TIE_NATS = 0.3


@dataclass
class Match:
    name: str
    rel_l2: float | None
    match: bool


class Evidence:
    """Access to the trace, the replay and the models at one (round, stage)."""

    def __init__(self, target: Target, loaded: LoadedDraft, trace: T.Trace, golden: T.Trace, tol: float):
        self.target, self.loaded, self.trace, self.golden, self.tol = target, loaded, trace, golden, tol
        self.draft = loaded.model
        self.taps = loaded.contract.taps
        self.H = target.hidden_size

    def g(self, stage: str, rnd: int, part: str | None = None):
        try:
            return self.golden.get(stage, rnd, part=part) if part else self.golden.get(stage, rnd)
        except KeyError:
            return None

    def t(self, stage: str, rnd: int, part: str | None = None):
        try:
            return self.trace.get(stage, rnd, part=part) if part else self.trace.get(stage, rnd)
        except KeyError:
            return None

    def same(self, candidate: torch.Tensor, observed, segments: int | None = None) -> Match:
        c = _compare(observed, candidate.detach().float().cpu(), segments or 1, self.tol)
        return Match("", c["rel_l2"], c["match"])

    def best(self, candidates: dict[str, torch.Tensor], observed) -> tuple[str | None, dict[str, float | None]]:
        """Name of the candidate the observation matches (lowest error among matches) and all errors."""
        errors, hits = {}, []
        for name, cand in candidates.items():
            m = self.same(cand, observed)
            errors[name] = m.rel_l2
            if m.match:
                hits.append((m.rel_l2 or 0.0, name))
        return (min(hits)[1] if hits else None), errors

    @torch.no_grad()
    def normed(self, i: int, hs: torch.Tensor) -> torch.Tensor | None:
        """Layer i's input RMSNorm applied to hidden state i: what a 'normed tap' captures."""
        layers = getattr(getattr(self.target, "model", None), "model", None)
        layer_list = getattr(layers, "layers", None) or getattr(self.target, "layers", None)
        if layer_list is None or i >= len(layer_list):
            return None
        norm = getattr(layer_list[i], "input_layernorm", None)
        if norm is None:
            return None
        return norm(hs.to(self.target.dtype).to(self.target.device)).float().cpu()

    def hidden_states(self, rnd: int) -> dict[int, torch.Tensor]:
        out = {}
        for i in range(self.target.num_layers):
            h = self.g(replay_hs(i), rnd)
            if h is not None:
                out[i] = h.float()
        return out


def _segments(observed, count: int, H: int) -> list:
    if isinstance(observed, T.Fingerprint):
        return [observed.segment(j) for j in range(count)] if observed.segments == count else []
    if observed.shape[-1] != count * H:
        return []
    return [observed[..., j * H : (j + 1) * H] for j in range(count)]


# -- hypotheses, by stage family ----------------------------------------------------------------------
def diagnose_taps(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    """Which hidden state each captured segment holds, judged over the round's whole capture.

    A wrong order or a consistent shift only shows across segments, so the verdict comes from the
    concatenation the draft received (target.aux) when the trace has it, else from the per-tap stages.
    Engines label per-tap stages with the contract's layers even when they capture others.
    """
    contract = list(ev.taps.layers)
    views: list[tuple[str, list[int], list]] = []
    aux = observed if stage == T.TARGET_AUX else ev.t(T.TARGET_AUX, rnd)
    if aux is not None:
        segs = _segments(aux, len(contract), ev.H)
        if segs:
            views.append((T.TARGET_AUX, contract, segs))
        elif stage == T.TARGET_AUX:
            shape = list(aux.shape)
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
    present = [(i, ev.t(T.target_tap(i), rnd)) for i in contract]
    present = [(i, x) for i, x in present if x is not None]
    if present:
        views.append(("taps", [i for i, _ in present], [x for _, x in present]))
    if stage != T.TARGET_AUX and T.parse_stage(stage)[1] not in contract:
        views.append((stage, [T.parse_stage(stage)[1]], [observed]))
    candidates: dict[str, torch.Tensor] = {}
    for i, h in ev.hidden_states(rnd).items():
        candidates[f"hs{i}"] = h
        n = ev.normed(i, h)
        if n is not None:
            candidates[f"normed{i}"] = n
    for where, expected, segs in views:
        found, errs = [], []
        for seg in segs:
            name, e = ev.best(candidates, seg)
            found.append(name)
            errs.append(e)
        if all(f == f"hs{x}" for f, x in zip(found, expected)):
            continue  # this view is right: the divergence is elsewhere (e.g. precision)
        if where == "taps":
            where = next(T.target_tap(x) for f, x in zip(found, expected) if f != f"hs{x}")
        evidence = {
            "stage": where,
            "expected_taps": expected,
            "found": found,
            "rel_err_vs_expected": [e.get(f"hs{x}") for e, x in zip(errs, expected)],
        }
        return [_classify_taps(where, expected, found, evidence, rnd)]
    return []


def _classify_taps(stage: str, expected: list[int], found: list[str | None], evidence: dict, rnd: int) -> Finding:
    """Name the capture mistake from what each segment holds (found: "hs<i>", "normed<i>" or None)."""
    fix_conv = (
        "check the tap contract and the engine's layer-id convention (eaglescope inspect shows what SGLang "
        "and vLLM capture)"
    )
    what = "segment" if stage == T.TARGET_AUX else "tap"
    raw = [int(f[2:]) if f and f.startswith("hs") else None for f in found]
    normed = [(j, int(f[6:])) for j, f in enumerate(found) if f and f.startswith("normed")]
    if normed:
        j, layer = normed[0]
        where = "" if layer == expected[j] else f" (and of layer {layer}, not {expected[j]})"
        return Finding(
            "TAP_NORMED",
            stage,
            f"{what} {j} of {stage} is the RMS-normed input of layer {layer}{where}, not the raw residual stream",
            evidence,
            "capture the hidden state entering the layer (before input_layernorm)",
            0.95,
            rnd,
        )
    if None not in raw and sorted(raw) == sorted(expected) and raw != expected:
        return Finding(
            "TAP_ORDER",
            stage,
            f"{stage} holds the right taps in the order {raw} instead of {expected}",
            evidence,
            "concatenate taps from low to high layer",
            0.95,
            rnd,
        )
    emb = [j for j, (r, e) in enumerate(zip(raw, expected)) if r is not None and (r == 0) != (e == 0)]
    if emb:
        j = emb[0]
        held = "the embedding output" if raw[j] == 0 else f"layer {raw[j]}'s input"
        return Finding(
            "TAP_EMBEDDING",
            stage,
            f"{what} {j} of {stage} is {held}; the contract expects tap {expected[j]}",
            evidence,
            fix_conv,
            0.95,
            rnd,
        )
    if None not in raw and all(abs(r - e) <= 1 for r, e in zip(raw, expected)):
        deltas = sorted({r - e for r, e in zip(raw, expected) if r != e})
        return Finding(
            "TAP_OFF_BY_ONE",
            stage,
            f"{stage} holds taps {raw} instead of {expected} (off by {', '.join(f'{d:+d}' for d in deltas)})",
            evidence,
            fix_conv + "; SGLang adds +1 to explicit ids",
            0.95,
            rnd,
        )
    if None not in raw:
        return Finding(
            "TAP_WRONG_LAYER", stage, f"{stage} holds taps {raw} instead of {expected}", evidence, fix_conv, 0.9, rnd
        )
    return Finding(
        "DIVERGENCE_UNEXPLAINED",
        stage,
        f"{stage} matches no hidden state of the target (segments found: {found})",
        evidence,
        "compare the engine's capture code with the contract",
        0.5,
        rnd,
    )


def _tile_fc(ev: Evidence, x: torch.Tensor) -> torch.Tensor:
    """fc applied to an H-wide input tiled to the fc's width: what re-projecting projected features gives."""
    d = ev.draft
    with torch.no_grad():
        tiled = torch.cat([x] * ev.taps.count, dim=-1).to(d.fc.weight.dtype)
        return d.project(tiled).float().cpu()


def diagnose_fc(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    pending = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    fc_out = ev.g(T.DRAFT_FC_OUT, rnd)
    if pending is None or fc_out is None:
        return []
    cands = {f"raw_tap{i}": seg for i, seg in zip(ev.taps.layers, _segments(pending.float(), ev.taps.count, ev.H))}
    cands["raw_aux"] = pending.float()
    cands["fc_twice"] = _tile_fc(ev, fc_out.float())
    name, errs = ev.best(cands, observed)
    evidence = {"rel_err": errs}
    if name is None:
        return []
    if name == "fc_twice":
        return [
            Finding(
                "FC_REPEATED",
                stage,
                f"{stage} equals fc applied to already-projected features",
                evidence,
                "apply fc once, to the target's concatenated taps only",
                0.9,
                rnd,
            )
        ]
    return [
        Finding(
            "FC_SKIPPED",
            stage,
            f"{stage} is the target's {name.replace('_', ' ')} without the fc projection",
            evidence,
            "apply fc to the concatenated taps before the first draft step",
            0.9,
            rnd,
        )
    ]


def _fc_variants(d, aux: torch.Tensor) -> dict[str, torch.Tensor]:
    """fc over `aux` as an engine that reads the draft's EAGLE 3.1 norms wrongly would compute it (SGLang issue
    32226 / PR 32334: norm_before_fc ignored, accept length ~1.1). Each variant is the draft's own modules with one
    decision changed; a variant that reproduces the observed tensor names the drift."""
    c, out = d.config, {}
    with torch.no_grad():
        x = aux.to(d.fc.weight.dtype)
        segs = x.chunk(c.num_aux, -1)

        def per_segment(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([n(p) for n, p in zip(d.fc_norm, t.chunk(c.num_aux, -1))], -1)

        if d.input_norm is not None:
            out["norm_before_fc skipped"] = x if d.fc_norm is None else per_segment(x)
        if d.fc_norm is not None:
            out["fc_norm skipped"] = x if d.input_norm is None else d.input_norm(x)
            # one RMSNorm over the whole 3H with the segments' weights side by side, instead of one per segment
            w = torch.cat([n.weight for n in d.fc_norm])
            eps = d.fc_norm[0].eps
            one = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
            out["fc_norm as one norm over all taps"] = one if d.input_norm is None else d.input_norm(one)
        if d.input_norm is None and d.fc_norm is None:
            # a plain EAGLE-3 draft served as if it had 3.1 norms (unit weights: the engine's fresh RMSNorm)
            normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(x.dtype)
            out["a norm_before_fc the draft was not trained with"] = normed
            out["an fc_norm the draft was not trained with"] = torch.cat(
                [(s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(x.dtype)
                 for s in segs], -1)  # fmt: skip
        return {k: d.fc(v).float().cpu() for k, v in out.items()}


def diagnose_eagle31(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    """fc's output disagrees with the golden one: does fc over the trace's own features, with one EAGLE 3.1 norm
    decision changed, reproduce it (and the draft's trained decision not)?"""
    aux = ev.t(T.NEXT_HIDDEN_IN, rnd - 1)
    if aux is None or not isinstance(aux, torch.Tensor):
        aux = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    rows = observed.shape[0] if isinstance(observed, torch.Tensor) else observed.row_norm.shape[0]
    if aux is None or aux.shape[0] != rows:
        return []
    trained = _fc_variants_reference(ev.draft, aux)
    if ev.same(trained, observed).match:
        return []  # the trained computation explains it: not a norm decision
    name, errs = ev.best(_fc_variants(ev.draft, aux.float()), observed)
    if name is None:
        return []
    return [
        Finding(
            "EAGLE31_NORM",
            stage,
            f"{stage} is fc over the target's features with {name}: the draft was trained with "
            f"norm_before_fc={ev.draft.config.norm_before_fc}, fc_norm={ev.draft.config.fc_norm}",
            {"rel_err": errs},
            "serve the draft's EAGLE 3.1 options as its config.json states them (norm_before_fc in eagle_config and "
            "at the top level, fc_norm per tap segment), with an engine version that implements them",
            0.9,
            rnd,
        )
    ]


def _fc_variants_reference(d, aux: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return d.project(aux.to(d.fc.weight.dtype)).float().cpu()


def diagnose_stale(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    aux = ev.g(T.TARGET_AUX, rnd)
    if aux is None:
        return []
    good = ev.g(T.NEXT_HIDDEN_IN, rnd)
    n = observed.shape[0]
    cands = {"all tree positions": aux.float(), "first rows in tree order": aux.float()[:n]}
    prev = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    if prev is not None:
        cands["previous round's features"] = prev.float()
    name, errs = ev.best(cands, observed)
    if name is None:
        return []
    return [
        Finding(
            "STALE_ACCEPTED",
            stage,
            f"next-round features are the {name}, not the accepted positions "
            f"({good.shape[0] if good is not None else '?'} rows expected, {n} given)",
            {"rel_err": errs, "rows_expected": None if good is None else good.shape[0], "rows_given": n},
            "feed hidden_states[accepted_indices] (root + accepted nodes) to the next draft pass",
            0.9,
            rnd,
        )
    ]


def _sequence(ev: Evidence) -> list[int]:
    """The emitted sequence the traced run followed: prompt, first token, then each round's tokens."""
    seq = list(ev.golden.meta.get("prompt_ids", []))
    for rnd in sorted(ev.golden.rounds()):
        bonus = ev.g(T.VERIFY_BONUS, rnd)
        if rnd == 0:
            seq.append(int(bonus.flatten()[0]))
            continue
        acc, toks = ev.g(T.VERIFY_ACCEPTED, rnd), ev.g(T.VERIFY_TOKENS, rnd)
        if acc is None or toks is None or bonus is None:
            break
        seq += [int(toks[i]) for i in acc.flatten().tolist()] + [int(bonus.flatten()[0])]
    return seq


def diagnose_embed(ev: Evidence, rnd: int, stage: str, observed, step: int) -> list[Finding]:
    gold = ev.g(stage, rnd)
    if gold is None:
        return []
    emb = ev.draft.embed_tokens.weight
    findings: list[Finding] = []
    if step == 0:
        seq = _sequence(ev)
        P = gold.shape[0]
        # pending features sit at positions [start, start+P) and pair with the token after each position
        prompt_len = len(ev.golden.meta.get("prompt_ids", []))
        start = _committed_before(ev, rnd, prompt_len)
        cands = {}
        for delta, name in ((0, "the token at the feature's own position"), (2, "the token two ahead")):
            ids = [seq[p + delta] if 0 <= p + delta < len(seq) else 0 for p in range(start, start + P)]
            cands[name] = emb[torch.tensor(ids, device=emb.device)].float().cpu()
        name, errs = ev.best(cands, observed)
        if name is not None:
            findings.append(
                Finding(
                    "SHIFT_OFF_BY_ONE",
                    stage,
                    f"step-0 inputs pair each feature with {name} instead of the next token",
                    {"rel_err": errs},
                    "pair features at position t with the embedding of token t+1",
                    0.9,
                    rnd,
                )
            )
            return findings
    if (other := _other_tokens(emb, gold, observed, ev.tol)) is not None:
        rows, fed, want = other
        return [
            Finding(
                "DIVERGENCE_UNEXPLAINED",
                stage,
                f"{stage} rows {rows} are the target's embedding of tokens {fed}, not of {want}: the embedding is "
                "right but other tokens were fed at those rows (no named hypothesis covers that)",
                {"rows": rows, "fed_tokens": fed, "expected_tokens": want},
                "pair each position's features with the token after it at every row (vLLM 0.32's padded drafter "
                "batch pairs the last row of a prefill chunk with the prompt's last token: disable_padded_drafter_"
                "batch, or prefill unchunked)",
                0.5,
                rnd,
            )
        ]
    m = ev.same(gold.float(), observed)
    norm_ratio = None
    if isinstance(observed, torch.Tensor) and observed.shape == gold.shape:
        norm_ratio = float(observed.float().norm() / gold.float().norm().clamp_min(1e-12))
    return [
        Finding(
            "EMBEDDING_MISMATCH",
            stage,
            f"{stage} differs from the target's embedding of the same tokens",
            {"rel_err": m.rel_l2, "norm_ratio": norm_ratio},
            "use the target's embed_tokens in the draft (do not ship or load a different embedding)",
            0.8,
            rnd,
        )
    ]


def _other_tokens(emb: torch.Tensor, gold, observed, tol: float) -> tuple[list[int], list[int], list[int]] | None:
    """(rows, fed token ids, expected token ids) when the rows of `observed` that differ from `gold` are each exactly
    a row of the embedding table (so the table is right and the tokens are not); None otherwise."""
    if not (isinstance(observed, torch.Tensor) and isinstance(gold, torch.Tensor)) or observed.shape != gold.shape:
        return None
    a, b = observed.double().cpu(), gold.double().cpu()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
    rows = [int(i) for i in torch.nonzero(err > tol).flatten().tolist()]
    if not rows or len(rows) == a.shape[0]:  # every row differs: a table or a shift, not a few wrong tokens
        return None
    table = emb.detach().double().cpu()

    def lookup(x: torch.Tensor) -> list[int] | None:
        d = torch.cdist(x, table)  # [rows, V]
        best = d.min(dim=-1)
        ok = best.values <= tol * table[best.indices].norm(dim=-1)
        return [int(i) for i in best.indices.tolist()] if bool(ok.all()) else None

    fed, want = lookup(a[rows]), lookup(b[rows])
    if fed is None or want is None:
        return None
    return rows, fed, want


def _committed_before(ev: Evidence, rnd: int, prompt_len: int) -> int:
    """First position of round `rnd`'s pending features: the root position of round rnd-1 (0 for round 1)."""
    if rnd <= 1:
        return 0
    pos = prompt_len
    for r in range(1, rnd - 1):
        acc = ev.g(T.VERIFY_ACCEPTED, r)
        pos += 1 + (0 if acc is None else acc.numel())
    return pos


def diagnose_feedback(ev: Evidence, rnd: int, stage: str, observed, step: int) -> list[Finding]:
    gold = ev.g(stage, rnd)
    fc_out = ev.g(T.DRAFT_FC_OUT, rnd)
    if gold is None:
        return []
    m = gold.shape[0]
    cands = {}
    with torch.no_grad():
        cands["postnorm"] = ev.draft.norm(gold.to(ev.draft.fc.weight)).float().cpu()
    if fc_out is not None:
        cands["target"] = fc_out.float()[-1:].expand(m, -1)
        cands["fc_again"] = _tile_fc(ev, gold.float())
    pending = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    if pending is not None:
        for i, seg in zip(ev.taps.layers, _segments(pending.float(), ev.taps.count, ev.H)):
            cands[f"raw_tap{i}"] = seg[-1:].expand(m, -1)
    name, errs = ev.best(cands, observed)
    evidence = {"rel_err": errs, "step": step}
    if name == "postnorm":
        return [
            Finding(
                "FEEDBACK_POSTNORM",
                stage,
                f"draft step {step} received the normed output of step {step - 1} instead of its pre-norm output",
                evidence,
                "feed the layer's output before the final norm to the next step",
                0.9,
                rnd,
            )
        ]
    if name is not None and (name == "target" or name.startswith("raw_tap")):
        return [
            Finding(
                "FEEDBACK_TARGET_FEATURES",
                stage,
                f"draft step {step} received the target's features instead of the draft's own output",
                evidence,
                "after step 0, feed the draft's own pre-norm output, not the target's hidden states",
                0.9,
                rnd,
            )
        ]
    if name == "fc_again":
        return [
            Finding(
                "FC_REPEATED",
                stage,
                f"draft step {step} applied fc again to the draft's own output",
                evidence,
                "apply fc only to the target's features at step 0",
                0.85,
                rnd,
            )
        ]
    return []


class _Offset(Eagle3Proposer):
    """Reference proposer with one position rule shifted by `delta` from trace round `from_round` on."""

    delta = 0
    from_round = 1

    def _shift(self) -> int:
        # The replay's recorder is at the round being drafted: a fault that starts late shifts only from there.
        return self.delta if self.rec is not None and self.rec.round >= self.from_round else 0


class _TreeOffset(_Offset):
    def tree_position(self, root_position, level):
        return super().tree_position(root_position, level) + self._shift()


class _CatchUpOffset(_Offset):
    def catch_up_positions(self, start, count):
        return super().catch_up_positions(start, count) + self._shift()


def diagnose_positions(ev: Evidence, rnd: int, stage: str, observed, step: int, trace_dir, tmp: Path):
    """Re-run the replay with the draft's positions shifted and see whether the trace matches that instead."""
    variants = []
    for cls, deltas in ((_TreeOffset, (1, -1, 2)), (_CatchUpOffset, (1, -1))):
        if step == 0 and cls is _TreeOffset:
            continue
        for d in deltas:
            # the first divergent round is where the offset starts (an earlier start would have shown earlier)
            variants.append(
                (type(f"{cls.__name__}{d}", (cls,), {"delta": d, "from_round": rnd}), d, cls is _TreeOffset)
            )
    errors = {}
    for cls, d, tree in variants:
        out = tmp / f"pos{'tree' if tree else 'catchup'}{d:+d}"
        alt = T.load_trace(replay(ev.target, ev.loaded, trace_dir, out, proposer_cls=cls, until_round=rnd))
        try:
            cand = alt.get(stage, rnd)
        except KeyError:
            continue
        m = ev.same(cand.float(), observed)
        errors[f"{'tree' if tree else 'catch-up'} {d:+d}"] = m.rel_l2
        if m.match:
            where = f"tree step {step}" if tree else "the catch-up pass"
            return [
                Finding(
                    "POSITION_OFFSET",
                    stage,
                    f"RoPE positions in {where} are offset by {d:+d}",
                    {"rel_err": errors, "offset": d},
                    "draft step k uses position (feature position + k), continuing the committed cache",
                    0.85,
                    rnd,
                )
            ]
    return []


def diagnose_topk(ev: Evidence, rnd: int, stage: str, observed_ids) -> list[Finding]:
    gold_ids = ev.g(stage, rnd, part=T.TOPK_IDS)
    if gold_ids is None or not isinstance(observed_ids, torch.Tensor):
        return []
    # draft ids of the golden target ids: invert the offset map
    t2d_rank = torch.cumsum(ev.draft.t2d.cpu().long(), 0) - 1
    raw = t2d_rank[gold_ids.long()]
    evidence = {
        "observed_first": observed_ids.flatten()[:8].tolist(),
        "expected_first": gold_ids.flatten()[:8].tolist(),
    }
    if observed_ids.shape == raw.shape and torch.equal(observed_ids.long(), raw):
        verdict = "draft token ids reached the target unmapped (d2t not applied)"
    else:
        verdict = "draft token ids map to different target ids than the checkpoint's d2t says"
    return [
        Finding(
            "VOCAB_MAP",
            stage,
            verdict,
            evidence,
            "map draft ids with target_id = draft_id + d2t[draft_id]; ship d2t/t2d with the checkpoint",
            0.9,
            rnd,
        )
    ]


# -- the walk ------------------------------------------------------------------------------------------
def diagnose_trace(
    target: Target,
    loaded: LoadedDraft,
    trace_dir: Path | str,
    golden_dir: Path | str | None = None,
    tol: float = DEFAULT_TOL,
) -> tuple[list[Finding], dict]:
    """Findings (most likely first) and context: stage_table, first_divergence, segment_norms."""
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
        reordered: dict[int, int] = {}  # round -> first draft step whose frontier the traced run ordered otherwise
        for e in golden.events:
            if e.stage.startswith(REPLAY_HS) or e.stage in FORCED or (e.stage, e.round, e.part) not in trace_keys:
                continue
            family, step = T.parse_stage(e.stage)
            if family.startswith("draft.") and step is not None and step >= reordered.get(e.round, 1 << 30):
                continue
            gold = golden.get(e.stage, e.round, part=e.part) if e.part else golden.get(e.stage, e.round)
            obs = trace.get(e.stage, e.round, part=e.part) if e.part else trace.get(e.stage, e.round)
            if isinstance(gold, torch.Tensor) and not gold.is_floating_point():
                ok = isinstance(obs, torch.Tensor) and obs.shape == gold.shape and torch.equal(obs.long(), gold.long())
                if not ok and e.part == T.TOPK_IDS:
                    ok = _near_tie(ev, e.round, e.stage, obs, gold)
                row = {"round": e.round, "stage": e.stage, "part": e.part, "rel_err": 0.0 if ok else 1.0, "match": ok}
            elif e.part == T.TOPK_LOGPROBS and isinstance(obs, torch.Tensor) and obs.shape == gold.shape:
                err = float((obs.float() - gold.float()).abs().max()) if obs.numel() else 0.0
                row = {"round": e.round, "stage": e.stage, "part": e.part, "rel_err": err, "match": err <= TIE_NATS}
            else:
                c = _compare(obs, gold, e.segments, tol)
                row = {"round": e.round, "stage": e.stage, "part": e.part, "rel_err": c["rel_l2"], "match": c["match"]}
                if not row["match"] and family == "draft.embed_in" and step and _is_permutation(obs, gold, tol):
                    # Exactly tied candidates (bf16) put the same frontier in another row order: this step and
                    # the later ones of the round are not comparable row by row, and nothing is wrong.
                    reordered[e.round] = step
                    row["match"], row["note"] = True, "frontier reordered (tie)"
            table.append(row)
            if not row["match"] and first is None:
                first = (e, obs)
        context = {"stage_table": table, "first_divergence": None, "segment_norms": _segment_norms(ev)}
        if first is None:
            return [], context
        e, obs = first
        context["first_divergence"] = {"round": e.round, "stage": e.stage, "part": e.part}
        findings = _explain(ev, e, obs, trace_dir, tmp)
    if not findings:
        row = next(r for r in table if not r["match"])
        findings = [
            Finding(
                "DIVERGENCE_UNEXPLAINED",
                e.stage,
                f"the trace first diverges from the golden replay at "
                f"{e.stage} (round {e.round}); no named hypothesis explains it",
                {"rel_err": row["rel_err"], "round": e.round},
                "compare this stage's inputs and code path with eaglescope's reference",
                0.5,
                e.round,
            )
        ]
    return rank(findings), context


def _compare(obs, gold, segments: int, tol: float) -> dict:
    """T.compare's rel_l2 and match; two full tensors are compared directly (no fingerprints: much faster)."""
    if not (isinstance(obs, torch.Tensor) and isinstance(gold, torch.Tensor)):
        c = T.compare(obs, gold, segments=segments, tol=tol)
        return {"rel_l2": c["rel_l2"], "match": bool(c["match"])}
    if obs.shape != gold.shape:
        return {"rel_l2": None, "match": False}
    a, b = T._rows(obs).double(), T._rows(gold).double()
    rel = float(T._rel(a - b, b)) if a.numel() else 0.0
    row_err = T._rel(a - b, b, dim=-1)
    ratio = T._ratio(a.norm(dim=-1), b.norm(dim=-1))
    ok = rel <= tol and bool((row_err <= tol).all()) and bool(((ratio - 1).abs() <= tol).all())
    return {"rel_l2": rel, "match": ok}


def _is_permutation(obs, gold, tol: float) -> bool:
    """Rows of `obs` are the rows of `gold` in another order (each matched once, within tol)."""
    if not isinstance(obs, torch.Tensor) or obs.shape != gold.shape or obs.dim() != 2:
        return False
    a, b = obs.double(), gold.double()
    err = (a[:, None] - b[None]).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)[None]  # [n, n]
    free = set(range(b.shape[0]))
    for i in range(a.shape[0]):
        j = next((j for j in sorted(free, key=lambda j: float(err[i, j])) if err[i, j] <= tol), None)
        if j is None:
            return False
        free.discard(j)
    return True


def _near_tie(ev: Evidence, rnd: int, stage: str, obs, gold: torch.Tensor) -> bool:
    """True when top-k ids differ only between candidates the replay itself scores within TIE_NATS:
    a precision tie (the replay follows the traced run's choice afterwards), not a wiring fault."""
    step = T.parse_stage(stage)[1]
    h = ev.g(T.draft_hidden_out(step), rnd)
    if step == 0 and h is not None:
        h = h[-1:]  # step 0 runs over every pending position; only the root's row proposes
    if not isinstance(obs, torch.Tensor) or obs.shape != gold.shape or h is None or h.shape[0] != obs.shape[0]:
        return False
    d = ev.draft
    t2d = d.t2d.cpu()
    rank = torch.cumsum(t2d.long(), 0) - 1
    obs, gold = obs.long(), gold.long()
    if int(obs.min()) < 0 or int(obs.max()) >= t2d.shape[0] or not bool(t2d[obs].all()):
        return False
    with torch.no_grad():
        lp = torch.log_softmax(d.logits(h.to(d.fc.weight)).float(), dim=-1).cpu()  # [n, Vd]
    d_obs, d_gold = rank[obs], rank[gold]
    if not torch.equal(d.to_target_ids(d_obs.to(d.d2t.device)).cpu(), obs):
        return False
    gap = (lp.gather(-1, d_obs) - lp.gather(-1, d_gold)).abs()
    return bool((gap[obs != gold] <= TIE_NATS).all())


def _explain(ev: Evidence, e: T.TraceEvent, obs, trace_dir, tmp: Path) -> list[Finding]:
    family, idx = T.parse_stage(e.stage)
    rnd = e.round
    if family in ("target.tap", "target.aux"):
        return diagnose_taps(ev, rnd, e.stage, obs)
    if e.stage == T.NEXT_HIDDEN_IN:
        return diagnose_stale(ev, rnd, e.stage, obs)
    if e.stage == T.DRAFT_FC_OUT:
        return (
            diagnose_fc(ev, rnd, e.stage, obs)
            or diagnose_eagle31(ev, rnd, e.stage, obs)
            or diagnose_stale_fc(ev, rnd, e.stage, obs)
        )
    if family == "draft.embed_in":
        return diagnose_embed(ev, rnd, e.stage, obs, idx)
    if family == "draft.hidden_in":
        if idx == 0:
            return diagnose_fc(ev, rnd, e.stage, obs)
        return diagnose_feedback(ev, rnd, e.stage, obs, idx)
    if family == "draft.hidden_out":
        return diagnose_positions(ev, rnd, e.stage, obs, idx, trace_dir, tmp)
    if family == "draft.topk":
        if e.part == T.TOPK_IDS:
            return diagnose_topk(ev, rnd, e.stage, obs)
        return (
            diagnose_positions(
                ev, rnd, T.draft_hidden_out(idx), ev.t(T.draft_hidden_out(idx), rnd), idx, trace_dir, tmp
            )
            if ev.t(T.draft_hidden_out(idx), rnd) is not None
            else []
        )
    return []


def diagnose_stale_fc(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    """An engine that records no next.hidden_in shows stale features first at fc.out."""
    aux = ev.g(T.TARGET_AUX, rnd - 1) if rnd > 1 else None
    if aux is None:
        return []
    n = observed.shape[0]
    with torch.no_grad():
        w = ev.draft.fc.weight
        cands = {
            "all tree positions": ev.draft.project(aux.to(w)).float().cpu(),
            "first rows in tree order": ev.draft.project(aux[:n].to(w)).float().cpu(),
        }
    name, errs = ev.best(cands, observed)
    if name is None:
        return []
    return [
        Finding(
            "STALE_ACCEPTED",
            stage,
            f"the draft's features are fc of the {name}, not of the accepted positions",
            {"rel_err": errs},
            "feed hidden_states[accepted_indices] to the next draft pass",
            0.85,
            rnd,
        )
    ]


def _segment_norms(ev: Evidence) -> dict | None:
    """Mean row norm of each target.aux segment in round 0, trace vs replay (for the report's plot)."""
    gold, obs = ev.g(T.TARGET_AUX, 0), ev.t(T.TARGET_AUX, 0)
    if gold is None or obs is None:
        return None
    n = ev.taps.count

    def norms(x) -> list[float]:
        if isinstance(x, T.Fingerprint):
            return [float(v) for v in x.seg_norm.float().mean(0)] if x.segments == n else []
        segs = _segments(x.float(), n, ev.H)
        return [float(s.norm(dim=-1).mean()) for s in segs]

    return {"trace": [norms(obs)], "replay": [norms(gold)], "labels": [f"tap {i}" for i in ev.taps.layers]}
