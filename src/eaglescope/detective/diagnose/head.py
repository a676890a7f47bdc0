"""Causes in the draft's head: its top-k ids and log-probs (vocabulary map, lm_head, relabelled ids)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.detective.diagnose.evidence import Evidence, Head, compare_rows
from eaglescope.detective.diagnose.judge import Hypothesis, judge, worst_score
from eaglescope.detective.diagnose.positions import position_hypotheses
from eaglescope.detective.findings import Finding


def _map_variants(ev: Evidence) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The draft→target id maps of engines that read d2t wrongly (each differs from the checkpoint's map)."""
    d = ev.draft
    d2t = d.d2t.detach().long().cpu()
    n = d2t.shape[0]
    maps: dict[str, Callable] = {
        "d2t not applied (draft ids used as target ids)": lambda i: i.long().cpu(),
        "d2t written as arange(draft_vocab) under the offset convention (target id = 2 x draft id)": lambda i: (
            2 * i.long().cpu()
        ),
        "d2t applied twice": lambda i: i.long().cpu() + 2 * d2t[i.long().cpu()],
        "the map read one row late": lambda i: (i.long().cpu() + 1) % n + d2t[(i.long().cpu() + 1) % n],
        "the map read one row early": lambda i: (i.long().cpu() - 1) % n + d2t[(i.long().cpu() - 1) % n],
    }
    clean = d.to_target_ids(torch.arange(n, device=d.d2t.device)).cpu()
    return {k: f for k, f in maps.items() if not torch.equal(f(torch.arange(n)), clean)}


def _tie_aware_pairs(head: Head, ids: torch.Tensor) -> tuple[list[tuple[int, int]], list[tuple[list[int], list[int]]]]:
    """(draft id, the target id the trace gave it) for each top-k entry, and the entries no single draft id explains.
    Candidates this head scores within its tolerance (a precision tie) may come in either order: within such a group
    both sides are paired in sorted order, which an increasing map preserves. A group that ties with candidates the
    top-k left out is ambiguous: its target ids came from some of those draft ids, which ones is open (returned as
    (the draft ids in the tie, best first; the target ids))."""
    K = ids.shape[1]
    vals, draft = head.lp.topk(min(K + 1, head.lp.shape[-1]), dim=-1)
    pairs, ambiguous = [], []
    for r in range(ids.shape[0]):
        v, d, t = vals[r].tolist(), draft[r].tolist(), ids[r].tolist()
        start = 0
        for j in range(1, K + 1):
            if j < K and v[j - 1] - v[j] <= head.nats:
                continue
            if j == K and K < len(v) and v[K - 1] - v[K] <= head.nats:
                # the group's last member ties with a candidate the top-k left out: every draft id that ties with it
                # (best first; the first `start` are the groups above this one, apart by more than the tolerance)
                tied = (head.lp[r] >= v[K - 1] - head.nats).nonzero().flatten()
                tied = tied[head.lp[r][tied].argsort(descending=True)].tolist()[start:]
                ambiguous.append((tied, t[start:K]))
                break
            pairs += list(zip(sorted(d[start:j]), sorted(t[start:j])))
            start = j
    return pairs, ambiguous


def _increasing(f: dict[int, int]) -> bool:
    order = sorted(f)
    return len(set(f.values())) == len(f) and all(f[a] < f[b] for a, b in zip(order, order[1:]))


def _resolve_ties(f: dict[int, int], ambiguous: list[tuple[list[int], list[int]]]) -> bool:
    """Extend the map `f` (draft id → target id) with the tie groups' entries where the map allows it: a target id
    the map already has must come from a draft id in the tie; each other one from a tied draft id the map has not
    placed, the best-scored ones first, paired in sorted order (an increasing map keeps it). False when a group
    cannot be placed so that the map stays one-to-one and increasing."""
    for tied, targets in ambiguous:
        inverse = {t: d for d, t in f.items()}
        if any(t in inverse and inverse[t] not in tied for t in targets):
            return False
        new = sorted(t for t in targets if t not in inverse)
        free = sorted([d for d in tied if d not in f][: len(new)])
        if len(free) < len(new):
            return False
        f.update(zip(free, new))
        if not _increasing(f):
            return False
    return True


def _relabelling(ev: Evidence, stage: str, rnd: int, head: Head, obs: dict) -> Hypothesis | None:
    """LM_HEAD_MAP_MISALIGNED: the log-probs are the draft's own, but its top-k reach the target as other tokens, and
    consistently so: from this round on, each draft id always becomes the same target id, no two draft ids the same
    one, in the draft ids' order (as a d2t built from another sorted hot-token list maps them: a map regenerated
    after training, or an engine's own token map such as SGLang's --speculative-token-map), inside the target's
    vocabulary."""
    if obs.get(T.TOPK_IDS) is None:
        return None
    step = T.parse_stage(stage)[1]
    seen: dict[int, list[int]] = {}  # draft id → the target ids the trace gave it
    ties: list[tuple[list[int], list[int]]] = []  # entries that one of several tied draft ids explains
    for r in sorted(ev.trace.rounds()):
        o = obs if r == rnd else ev.topk_obs(stage, r)
        ids = o.get(T.TOPK_IDS)
        if r < rnd or ids is None or ids.dim() != 2:
            continue
        h = ev.head_rows(step, r, ids.shape[0])
        if h is None:
            continue
        own = ev.head(h)
        values = own.topk(ids.shape[1])[1]  # the draft's own best values, whichever tokens the map makes of them
        if T.TOPK_LOGPROBS in o and not compare_rows(o[T.TOPK_LOGPROBS], values, own.nats, absolute=True).match:
            continue  # another ranking than the draft's own: no evidence about the map
        pairs, ambiguous = _tie_aware_pairs(own, ids.long())
        for d, t in pairs:
            seen.setdefault(d, []).append(t)
        ties += ambiguous
    f = {d: ts[0] for d, ts in seen.items() if len(set(ts)) == 1}
    vocab = int(getattr(ev.target, "vocab_size", 0) or 0)
    consistent = bool(f) and len(f) == len(seen) and _increasing(f)
    # the tied entries are placed last, where the entries one draft id explains leave room for them
    consistent = consistent and _resolve_ties(f, ties)
    consistent = consistent and all(0 <= t and (not vocab or t < vocab) for t in f.values())

    repeated = sum(len(ts) > 1 for ts in seen.values())

    def to_target(i: torch.Tensor) -> torch.Tensor:
        return torch.tensor([f.get(int(x), -1) for x in i.flatten().tolist()], dtype=torch.long).view(i.shape)

    relabelled = Head(head.lp, to_target, head.nats)
    return Hypothesis(
        "LM_HEAD_MAP_MISALIGNED",
        "another valid vocabulary map",
        f"the draft's own ranking reached the target through another vocabulary map than the checkpoint's d2t "
        f"({len(seen)} draft ids seen, each always mapped to one target id, in order; {len(f) - len(seen)} more placed "
        "among tied candidates): lm_head's rows were trained for "
        "the checkpoint's hot tokens and are read as other tokens",
        "serve the d2t/t2d the draft was trained with (the checkpoint's), not a regenerated hot-token map; if the map "
        "must change, retrain lm_head with it",
        lambda: relabelled.compare(obs).score if consistent else None,
        tier=1,
        evidence={"draft_ids_seen": len(seen), "placed_from_ties": len(f) - len(seen), "seen_more_than_once": repeated},
        # fitted to what was seen: as sure as the draft ids that recurred with the same target id make it
        max_weight=0.6 + 0.35 * min(1.0, repeated / 5),
    )


def _head_events(ev: Evidence, stage: str, rnd: int) -> list[tuple[dict, torch.Tensor]]:
    """(the trace's top-k parts, the golden step outputs behind them) at the first divergent top-k and at step 0's of
    every round from there on. A head or map mistake acts on every top-k the engine computes; step 0's rows are the
    same in the trace and the replay whatever the trees did (its inputs are the verified features and tokens), so
    they test a hypothesis on more than the few rows of one stage."""
    out, step = [], T.parse_stage(stage)[1]
    places = [(stage, rnd)] + [(T.draft_topk(0), r) for r in sorted(ev.trace.rounds()) if r >= rnd]
    for s, r in dict.fromkeys(places):
        obs = ev.topk_obs(s, r)
        if not obs:
            continue
        h = ev.head_rows(T.parse_stage(s)[1] if s != stage else step, r, next(iter(obs.values())).shape[0])
        if h is not None:
            out.append((obs, h))
    return out


def diagnose_topk(ev: Evidence, rnd: int, stage: str, trace_dir, tmp: Path) -> list[Finding]:
    """Top-k ids or log-probs differ: the vocabulary map, the head (final norm, logit_scale), or a position offset
    upstream, each re-run over the golden step outputs and compared at this stage (ids and log-probs together) and,
    for the map and the head, at every later step 0 (`_head_events`)."""
    step = T.parse_stage(stage)[1]
    events = _head_events(ev, stage, rnd)
    if not events:
        return []
    obs, h = events[0]
    clean_head = ev.head(h)
    clean = clean_head.compare(obs)
    heads = [(o, ev.head(x)) for o, x in events]
    hyps: list[Hypothesis] = []
    map_fix = "map draft ids with target_id = draft_id + d2t[draft_id]; ship d2t/t2d with the checkpoint"
    for name, f in _map_variants(ev).items():
        hyps.append(
            Hypothesis(
                "VOCAB_MAP",
                name,
                f"draft token ids reached the target through a wrong map: {name}",
                map_fix,
                lambda f=f: worst_score(Head(hd.lp, f, hd.nats).compare(o).score for o, hd in heads),
            )
        )
    c = ev.draft.config
    variants = {
        "final norm skipped": (
            "DRAFT_FINAL_NORM_SKIPPED",
            "lm_head applied to the layer's output without the draft's final norm",
            "apply the draft's norm (norm.weight) before lm_head",
        )
    }
    if c.norm_output:
        variants.pop("final norm skipped")  # its step output is already normed: there is no separate final norm
    if c.logit_scale != 1.0:
        variants["logit_scale not applied"] = (
            "EAGLE31_IGNORED",
            f"the draft's logits were not multiplied by its logit_scale ({c.logit_scale:g})",
            "apply logit_scale from the draft's config.json to its logits (an engine version that implements it)",
        )
    for variant, (code, verdict, fix) in variants.items():
        score = lambda v=variant: worst_score(ev.head(x, v).compare(o).score for o, x in events)  # noqa: E731
        hyps.append(Hypothesis(code, variant, verdict, fix, score, evidence={"places": len(events)}))
    if (relabel := _relabelling(ev, stage, rnd, clean_head, obs)) is not None:
        hyps.append(relabel)
    hyps += position_hypotheses(ev, rnd, stage, None, obs, step, trace_dir, tmp)
    return judge(ev, stage, rnd, clean, hyps)
