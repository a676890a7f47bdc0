"""Causes in the feedback between draft steps: what step k+1 receives from step k."""

from __future__ import annotations

from eaglescope import trace as T
from eaglescope.detective.diagnose.evidence import Evidence, on_model
from eaglescope.detective.diagnose.fc import fc_again
from eaglescope.detective.diagnose.judge import judge, split_segments, tensor_hypothesis
from eaglescope.detective.findings import Finding


def diagnose_feedback(ev: Evidence, rnd: int, stage: str, observed, step: int) -> list[Finding]:
    gold = ev.g(stage, rnd)
    fc_out = ev.g(T.DRAFT_FC_OUT, rnd)
    if gold is None:
        return []
    m = gold.shape[0]
    h = tensor_hypothesis
    postnorm = on_model(ev.draft.norm, gold, ev.draft.fc.weight)
    hyps = [
        h(
            ev,
            observed,
            "FEEDBACK_POSTNORM",
            "postnorm",
            f"draft step {step} received the normed output of step {step - 1} instead of its pre-norm output",
            "feed the layer's output before the final norm to the next step",
            postnorm,
        )
    ]
    target_fix = "after step 0, feed the draft's own pre-norm output, not the target's hidden states"
    target_verdict = f"draft step {step} received the target's features instead of the draft's own output"
    if fc_out is not None:
        hyps.append(
            h(
                ev,
                observed,
                "FEEDBACK_TARGET_FEATURES",
                "fc of the root's target features",
                target_verdict,
                target_fix,
                fc_out.float()[-1:].expand(m, -1),
            )
        )
        for how, cand in fc_again(ev, gold.float()).items():
            hyps.append(
                h(
                    ev,
                    observed,
                    "FC_REPEATED",
                    f"fc again ({how})",
                    f"draft step {step} applied fc again to the draft's own output ({how})",
                    "apply fc only to the target's features at step 0",
                    cand,
                )
            )
    pending = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    if pending is not None:
        for i, seg in zip(ev.taps.layers, split_segments(pending.float(), ev.taps.count, ev.H)):
            hyps.append(
                h(
                    ev,
                    observed,
                    "FEEDBACK_TARGET_FEATURES",
                    f"raw tap {i} of the root",
                    target_verdict,
                    target_fix,
                    seg[-1:].expand(m, -1),
                )
            )
    return judge(ev, stage, rnd, ev.compare(observed, gold), hyps, {"step": step})
