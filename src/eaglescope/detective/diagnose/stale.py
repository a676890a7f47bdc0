"""Causes in what is handed to the next round: the features of the accepted tokens."""

from __future__ import annotations

import torch

from eaglescope import trace as T
from eaglescope.detective.diagnose.evidence import Evidence
from eaglescope.detective.diagnose.judge import judge, tensor_hypothesis
from eaglescope.detective.diagnose.taps import handed_taps
from eaglescope.detective.findings import Finding
from eaglescope.detective.replay import tree_shape

_STALE_FIX = "feed hidden_states[accepted_indices] (root + accepted nodes) to the next draft pass"


def feature_rules(ev: Evidence, rnd: int, aux: torch.Tensor, n: int) -> dict[str, tuple[str, torch.Tensor, str]]:
    """Round `rnd`'s next-round features as wrongly selecting engines compute them: name → (code, rows, fix)."""
    out = {
        "all tree positions": ("STALE_ACCEPTED", aux, _STALE_FIX),
        "first rows in tree order": ("STALE_ACCEPTED", aux[:n], _STALE_FIX),
    }
    acc, parents = ev.g(T.VERIFY_ACCEPTED, rnd), ev.g(T.VERIFY_PARENTS, rnd)
    if acc is not None and parents is not None and aux.shape[0] == parents.numel():
        path = [0] + [int(i) for i in acc.flatten().tolist()]
        kids = [i for i, p in enumerate(parents.tolist()) if p == path[-1]]
        # The features of the emitted tokens' own positions: the root's dropped, each accepted node's kept, and for
        # the bonus token (not in the tree) some row after the path: a child of its last node, or that node again.
        for after in kids + [path[-1]]:
            rows = path[1:] + [after]
            out[f"emitted tokens' own positions (rows {rows})"] = (
                "SHIFT_OFF_BY_ONE",
                aux[torch.tensor(rows)],
                "hand on the features of the root and the accepted nodes (each paired with the token after it), not "
                "those at the emitted tokens' own positions",
            )
        depth, top_k, _ = tree_shape(ev.trace.meta, ev.trace)
        if top_k > 1 and (layout := path_to_front(path, aux.shape[0], depth)) is not None and n <= len(layout):
            out["verified rows, the accepted path moved to the front, up to the one selected"] = (
                "STALE_ACCEPTED",
                aux[torch.tensor(layout[:n])],
                _STALE_FIX,
            )
    return out


def path_to_front(path: list[int], nodes: int, depth: int) -> list[int] | None:
    """The verified rows (tree order, `nodes` of them) as a tree engine lays them out once it has moved the accepted
    path (root first) to the front, for its draft to read the path as a chain's: SGLang writes the path over the first
    depth + 1 rows, pads those past the path with the root's and leaves the rest in tree order
    (eagle_worker_common._compact_accept_to_front; a batch pads with its first request's root, which one request's
    trace shows only when it was served alone). None where the rows cannot be so laid out."""
    slots = depth + 1
    if not len(path) <= slots <= nodes:
        return None
    return path + [0] * (slots - len(path)) + list(range(slots, nodes))


def diagnose_stale(ev: Evidence, rnd: int, stage: str, observed) -> list[Finding]:
    aux = ev.g(T.TARGET_AUX, rnd)
    gold = ev.g(T.NEXT_HIDDEN_IN, rnd)
    if aux is None or gold is None:
        return []
    n = observed.shape[0]
    rules = feature_rules(ev, rnd, aux.float(), n)
    prev = ev.g(T.NEXT_HIDDEN_IN, rnd - 1)
    if prev is not None:
        rules["previous round's features"] = ("STALE_ACCEPTED", prev.float(), _STALE_FIX)
    hyps = [
        tensor_hypothesis(
            ev,
            observed,
            code,
            name,
            f"next-round features are the {name}, not the accepted "
            f"positions ({gold.shape[0]} rows expected, {n} given)",
            fix,
            rows,
            rows_expected=gold.shape[0],
            rows_given=n,
        )
        for name, (code, rows, fix) in rules.items()
    ]
    return judge(ev, stage, rnd, ev.compare(observed, gold), hyps) or handed_taps(ev, rnd, stage, observed)
