"""Causes in positions: the draft's RoPE positions, re-run with the proposer offset."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.decode.speculative import Eagle3Proposer
from eaglescope.detective.diagnose.evidence import Cmp, Evidence, golden_value
from eaglescope.detective.diagnose.judge import Hypothesis, judge, worst_score
from eaglescope.detective.findings import Finding
from eaglescope.detective.replay import replay

# A hypothesis tested on top-k alone is tested on this many rounds after the first divergent one too.
_TOPK_ROUNDS = 2


class _Offset(Eagle3Proposer):
    """The draft side of the round (the code both backends run) with one position rule shifted by `delta` from trace
    round `from_round` on; the golden replay runs it on the reference backend."""

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


_PASSES = {
    "catch-up": "the catch-up pass (draft step 0, over the positions handed in)",
    "tree": "the tree steps (draft steps k >= 1)",
}
_POSITION_FIX = "draft step k uses position (feature position + k), continuing the committed cache"


def diagnose_positions(ev: Evidence, rnd: int, stage: str, observed, step: int, trace_dir, tmp: Path) -> list[Finding]:
    """The RoPE positions a draft step ran at (draft.step<k>.positions), compared exactly: one offset over every row
    names the pass (step 0's catch-up, or the tree steps) and its sign. The golden path re-run with that offset
    reproduces the positions, and the evidence says whether it also reproduces the step's output (an engine whose
    cache slots moved with its positions computes something else again)."""
    gold = ev.g(stage, rnd)
    if gold is None or not isinstance(observed, torch.Tensor) or observed.shape != gold.shape:
        return []
    deltas = (observed.long().flatten() - gold.long().flatten()).unique()
    if deltas.numel() != 1 or int(deltas[0]) == 0:
        return []
    d, pass_ = int(deltas[0]), "tree" if step > 0 else "catch-up"
    cls = _TreeOffset if step > 0 else _CatchUpOffset
    variant = type(f"{cls.__name__}{d}", (cls,), {"delta": d, "from_round": rnd})
    evidence: dict = {"pass": pass_, "offset": d, "step": step, "positions": observed.flatten().tolist()[:8],
                      "expected": gold.flatten().tolist()[:8]}  # fmt: skip

    def score() -> float | None:
        alt = T.load_trace(replay(ev.target, ev.loaded, trace_dir, tmp / f"pos-{pass_}{d:+d}", proposer_cls=variant,
                                  until_round=rnd))  # fmt: skip
        cand = golden_value(alt, stage, rnd)
        if cand is None or not torch.equal(cand.long(), observed.long()):
            return None
        out, alt_out = ev.t(T.draft_hidden_out(step), rnd), golden_value(alt, T.draft_hidden_out(step), rnd)
        if out is not None and alt_out is not None:
            c = ev.compare(out, alt_out.float())
            evidence["hidden_out_reproduced"], evidence["hidden_out_score"] = c.match, c.score
        return 0.0

    verdict = (
        f"RoPE positions in {_PASSES[pass_]} are offset by {d:+d}: step {step} ran at {evidence['positions']} where "
        f"the contract puts {evidence['expected']} (round {rnd})"
    )
    hyp = Hypothesis("POSITION_OFFSET", f"{pass_} {d:+d}", verdict, _POSITION_FIX, score, evidence=evidence)
    clean = Cmp(2.0, 1.0, list(range(observed.numel())))
    found = judge(ev, stage, rnd, clean, [hyp])
    for f in found:
        if f.evidence.get("hidden_out_reproduced") is False:
            f.verdict += f"; re-run with that offset, step {step}'s output still differs (the engine's cache moved too)"
            f.weight = min(f.weight, 0.7)
    return found


def position_hypotheses(
    ev: Evidence, rnd: int, stage: str, part: str | None, observed, step: int, trace_dir, tmp: Path
) -> list[Hypothesis]:
    """Re-run the replay with the draft's positions shifted; each variant's tensor at the first divergent stage (and
    part: a top-k compares ids and log-probs) is what that offset would have produced there."""
    out = []
    for cls, deltas in ((_TreeOffset, (1, -1, 2)), (_CatchUpOffset, (1, -1))):
        if step == 0 and cls is _TreeOffset:
            continue
        tree = cls is _TreeOffset
        for d in deltas:
            # the first divergent round is where the offset starts (an earlier start would have shown earlier)
            variant = type(f"{cls.__name__}{d}", (cls,), {"delta": d, "from_round": rnd})
            where = _PASSES["tree" if tree else "catch-up"]
            name = f"{'tree' if tree else 'catch-up'} {d:+d}"

            def score(variant=variant, name=name) -> float | None:
                path = tmp / f"pos-{name.replace(' ', '')}"
                last = rnd + _TOPK_ROUNDS if T.parse_stage(stage)[0] == "draft.topk" else rnd
                alt_dir = replay(ev.target, ev.loaded, trace_dir, path, proposer_cls=variant, until_round=last)
                alt = T.load_trace(alt_dir)
                if T.parse_stage(stage)[0] != "draft.topk":
                    cand = golden_value(alt, stage, rnd, part)
                    return None if cand is None else ev.compare(observed, cand.float()).score
                # a few top-k rows say little: the offset must reproduce every later top-k of this and the next rounds
                places = [
                    (e.stage, e.round)
                    for e in ev.trace.events
                    if e.part == T.TOPK_IDS and rnd <= e.round <= last
                    and (e.round > rnd or T.parse_stage(e.stage)[1] >= step)
                ]  # fmt: skip
                scores = []
                for s, r in places:
                    obs = ev.topk_obs(s, r)
                    h = ev.head_rows(T.parse_stage(s)[1], r, obs[T.TOPK_IDS].shape[0], source=alt)
                    scores.append(None if h is None else ev.head(h).compare(obs).score)
                return worst_score(scores)

            out.append(
                Hypothesis(
                    "POSITION_OFFSET",
                    name,
                    f"RoPE positions in {where} are offset by {d:+d}",
                    _POSITION_FIX + " (a trace that records draft.step<k>.positions tells the passes apart)",
                    score,
                    tier=2,
                    evidence={"offset": d, "pass": "tree" if tree else "catch-up"},
                )
            )
    return out


def norm_output_hypothesis(ev: Evidence, rnd: int, stage: str, observed, trace_dir, tmp: Path) -> Hypothesis:
    """Re-run the replay with the draft's norm_output read the other way from round `rnd` on: a norm_output draft
    whose steps hand on their pre-norm output with the norm before lm_head (an older SpecForge's meaning of the
    flag), or a draft without it whose steps hand on the post-norm output (an engine that assumes the flag). The
    logits are the same either way; what the next step receives (hidden_out) is not."""
    d = ev.loaded.model
    c = d.config
    flipped = copy.copy(d)  # the same modules and weights, another config
    object.__setattr__(flipped, "config", dataclasses.replace(c, norm_output=not c.norm_output))
    loaded = dataclasses.replace(ev.loaded, model=flipped)

    def score() -> float | None:
        alt_dir = replay(ev.target, loaded, trace_dir, tmp / "norm-output-flipped", until_round=rnd)
        cand = golden_value(T.load_trace(alt_dir), stage, rnd)
        return None if cand is None else ev.compare(observed, cand.float()).score

    if c.norm_output:
        name = "norm_output read as 'norm before lm_head'"
        verdict = (
            f"{stage} is the draft layer's pre-norm output: the draft was trained with norm_output (the next step "
            "receives the post-norm output) and the engine reads the flag as 'norm before lm_head' (an older "
            "SpecForge's meaning), handing the pre-norm output on"
        )
    else:
        name = "norm_output the draft was not trained with"
        verdict = (
            f"{stage} is the draft layer's post-norm output: the engine hands each step's normed output on as if the "
            "draft had norm_output, and the draft was trained without it"
        )
    fix = (
        "serve norm_output as vLLM, speculators and eaglescope read it: when config.json sets it the next step "
        "receives the post-norm output (lm_head reads it as it is), otherwise the pre-norm output (lm_head reads "
        "norm of it)"
    )
    return Hypothesis("EAGLE31_NORM", name, verdict, fix, score, tier=2, evidence={"norm_output": c.norm_output})
