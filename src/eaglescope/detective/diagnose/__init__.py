"""Compare a trace with its golden replay; name the cause of the first divergence.

Walk the replay's events in order; the first canonical stage whose trace tensor differs is where
the wiring first goes wrong (later stages inherit the error, so they are not diagnosed). At that
stage each named hypothesis is a *re-run of the golden path with that one mistake*: it builds the
tensor the mistake would have produced there (from the replay's own tensors, or by replaying again
with the mistake in the proposer). A cause is named only if its tensor reproduces the trace's at the
first divergent stage (within tolerance) while the clean path's does not; its ranking weight comes from
that test (how much closer the mistake gets than the clean path and than the next-best other cause).
A divergence no hypothesis reproduces is reported as DIVERGENCE_UNEXPLAINED at that stage, with the
rows that differ, by how much, and the stages the trace would need to locate it better.

Rows of a tree step are compared by content (the node each row holds, as the replay paired them:
replay.step<k>.trace_rows), so an engine that keeps its frontier in another order is not a divergence.

The modules, in the order a divergence is met:

    walk.py        diagnose_trace: the walk over the trace's events, the first divergent stage explained
    evidence.py    precision and tolerances, Cmp (one observation against one reference), Head, Evidence
    judge.py       Hypothesis and the one rule that judges them
    taps.py        the capture (target.aux): which hidden states it holds
    fc.py          fc over the concatenated taps (EAGLE 3.1 norms, stale inputs)
    stale.py       the features handed to the next round
    embeddings.py  the token embeddings the draft reads
    feedback.py    what draft step k+1 receives from step k
    positions.py   the draft's positions (re-runs with an offset proposer)
    head.py        the draft's top-k ids and log-probs
"""

from eaglescope.detective.diagnose.walk import diagnose_trace

__all__ = ["diagnose_trace"]
