"""Golden replay: what a correct pipeline computes for the prompt and decisions a trace recorded.

The replay follows the trace's *decisions* (the tree sent to verify, the accepted path, the bonus
token, and which draft candidates each tree step expanded) so that every round and every draft step
sees the same context as the traced run, and recomputes everything else with eaglescope's reference
path: the target's taps, fc, every draft step, its own top-k, the features handed to the next round.
A stage where the trace and the replay disagree is therefore a wiring difference, not a different
path (nor a near-tie that another precision broke the other way).

Besides the canonical stages the replay records, per target forward, every hidden state
`replay.hs.<i>` (i = 0..L-1) and the final normed state `replay.final` (what lm_head reads): what the
diagnoses need to say *which* tensor an engine tapped. Per tree step k >= 1 it records
`replay.step<k>.trace_rows`: for each of its frontier rows, the trace's row holding the same tree node. Engines
order a frontier as they like (best first, creation order); rows are matched by content, not position.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.decode.generation import SamplingConfig, check_prompt
from eaglescope.decode.loop import ReferenceRunner, decode
from eaglescope.decode.round import RoundState, record_tree
from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.decode.tree import EAGLE_DEFAULT_TREE, DraftTree, parse_tree_shape
from eaglescope.decode.verify import VerifyResult
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import LoadedDraft
from eaglescope.models.targets.base import Target, TargetOutput
from eaglescope.models.targets.layer_states import forward_all_layers

REPLAY_HS = "replay.hs"  # replay.hs.<i>: hidden state i of every target forward (all layers)
REPLAY_FINAL = "replay.final"  # the target's final normed state (lm_head's input) of every target forward
REPLAY_PREFIX = "replay."  # every replay-only stage: never compared with the trace
REPLAY_COPIES_TARGET = "replay_copies_target"  # meta key: target.* stages are the trace's own (a draft-side replay)


def replay_hs(i: int) -> str:
    return f"{REPLAY_HS}.{i}"


def replay_rows(k: int) -> str:
    """[n] int64: for each replay row of tree step k, the index of the trace's row that holds the same node."""
    return f"replay.step{int(k)}.trace_rows"


# -- the tree shape ----------------------------------------------------------------------------------------------
def _shape_of(chain, tree) -> tuple[int, int, int]:
    if isinstance(tree, dict):  # docs/trace-format.md's form: {"depth", "topk", "total_tokens"}
        tree = f"{tree['depth']},{tree['topk']},{tree['total_tokens']}"
    elif isinstance(tree, (list, tuple)):
        tree = ",".join(str(x) for x in tree)
    return parse_tree_shape(int(chain) if chain is not None else None, tree)


def tree_shape(meta: dict, trace: T.Trace | None = None) -> tuple[int, int, int]:
    """(depth, top_k, total_tokens) of the traced run: `meta.settings` (eaglescope's own traces: chain and tree both
    null mean its default tree), else `meta.decoding` (the format's manifest example), else what the trace's stages
    show (the deepest draft step, the width of its top-k, the largest verified tree)."""
    settings = meta.get("settings")
    if isinstance(settings, dict) and ("chain" in settings or "tree" in settings):
        return _shape_of(settings.get("chain"), settings.get("tree"))
    decoding = meta.get("decoding")
    if isinstance(decoding, dict) and (decoding.get("chain") is not None or decoding.get("tree") is not None):
        return _shape_of(decoding.get("chain"), decoding.get("tree"))
    if trace is not None and (shape := _shape_from_stages(trace)) is not None:
        return shape
    return EAGLE_DEFAULT_TREE


def _shape_from_stages(trace: T.Trace) -> tuple[int, int, int] | None:
    steps = [k for s in trace.stages() if (k := T.parse_stage(s)[1]) is not None and s.startswith("draft.")]
    widths = [ev.shape[-1] for ev in trace.events if ev.part == T.TOPK_IDS and len(ev.shape) == 2]
    nodes = [int(math.prod(ev.shape)) for ev in trace.events if ev.stage == T.VERIFY_TOKENS]
    if not steps or not widths or not nodes:
        return None
    depth, top_k, total = max(steps) + 1, max(widths), max(nodes)
    return (depth, 1, depth + 1) if top_k == 1 else (depth, top_k, max(total, 2))


def tree_attention(meta: dict) -> str:
    """Which tree nodes the traced engine's draft tree steps attend (trace.DRAFT_TREE_ATTENTION): the replay computes
    the tree the engine computed, EAGLE-2's ancestors unless the trace names its engine's own layout."""
    got = meta.get(T.DRAFT_TREE_ATTENTION, T.TREE_ANCESTORS)
    if got not in T.TREE_ATTENTIONS:
        raise EagleScopeError(f"trace meta.{T.DRAFT_TREE_ATTENTION} must be one of {', '.join(T.TREE_ATTENTIONS)}, "
                              f"got {got!r}")  # fmt: skip
    return got


# -- rows compared by content -----------------------------------------------------------------------------------------
def comparable_rows(x: torch.Tensor | T.Fingerprint, like: torch.Tensor | T.Fingerprint) -> torch.Tensor:
    """`x` as rows [R, D'] that can be subtracted from `like`'s: raw rows when neither is a fingerprint, else the
    fingerprints' per-segment projections [R, S*16] (a tensor is fingerprinted with the other side's segments and
    seed), float64 on the host whatever device `x` is on. ||row difference|| then estimates the true one (exactly, or
    by Johnson-Lindenstrauss)."""
    ref = x if isinstance(x, T.Fingerprint) else like if isinstance(like, T.Fingerprint) else None
    if ref is None:
        return T._rows(x).double()
    proj = x.proj if isinstance(x, T.Fingerprint) else T.projection(x, ref.segments, ref.seed)
    return proj.double().reshape(proj.shape[0], -1)


def _host_ids(x: torch.Tensor) -> torch.Tensor:
    """Integer rows as `comparable_rows` gives float ones: on the host (the replay's own on --device, the trace's
    read from disk), where the cost of pairing them is summed."""
    return x.detach().to("cpu", torch.long)


def row_norms(x: torch.Tensor | T.Fingerprint) -> torch.Tensor:
    """Exact row norms [R] (a fingerprint stores them)."""
    return x.row_norm.double() if isinstance(x, T.Fingerprint) else T._rows(x).double().norm(dim=-1)


def pairwise_row_errors(trace_value: torch.Tensor | T.Fingerprint, own: torch.Tensor) -> torch.Tensor | None:
    """[n_trace, n_own]: ||trace row r - own row j|| / ||own row j|| (None when the widths differ)."""
    if tuple(trace_value.shape[-1:]) != tuple(own.shape[-1:]):
        return None
    a, b = comparable_rows(trace_value, own), comparable_rows(own, trace_value)
    return torch.cdist(a, b) / row_norms(own).clamp_min(1e-30)[None, :]


def match_rows(trace_rows: dict[str, torch.Tensor | T.Fingerprint], own_rows: dict[str, torch.Tensor]) -> list[int]:
    """For each own row j of one tree step, the trace row r that holds the same node: the assignment of least total
    cost over the signals both sides recorded (the token's embedding, the parent's features, the step's output, its
    top-k ids and log-probs), each a row error clipped at 1. Greedy from the cheapest pair (ties: the same index),
    which is the optimum when the right pairs are far cheaper than the wrong ones, as for the same node recomputed."""
    n = next(iter(own_rows.values())).shape[0] if own_rows else 0
    identity = list(range(n))
    cost = torch.zeros(n, n, dtype=torch.float64)
    used = 0
    for stage, own in own_rows.items():
        obs = trace_rows.get(stage)
        if obs is None or obs.shape[0] != n:
            continue
        if not own.is_floating_point():  # top-k ids: the share of ids two rows do not have in common
            o, t = _host_ids(own), _host_ids(obs)
            same = (t[:, None, :, None] == o[None, :, None, :]).any(-1).double().mean(-1)
            cost += 1.0 - same
        else:
            err = pairwise_row_errors(obs, own)
            if err is None:
                continue
            cost += err.clamp(max=1.0)
        used += 1
    if not used or n < 2:
        return identity
    order = sorted((float(cost[r, j]), r != j, r, j) for r in range(n) for j in range(n))
    pairing, taken = [-1] * n, set()
    for _, _, r, j in order:
        if pairing[j] < 0 and r not in taken:
            pairing[j] = r
            taken.add(r)
    # Take the pairing only where it is clearly better than the recorded order on the rows it moves (half the cost or
    # less): under a fault every pairing is about as bad, and the rows are then compared in the engine's order.
    moved = [j for j in range(n) if pairing[j] != j]
    ours = sum(float(cost[pairing[j], j]) for j in moved)
    theirs = sum(float(cost[j, j]) for j in moved)
    return pairing if moved and ours <= 0.5 * theirs else identity


def parent_rows(hidden_in, parent_out) -> list[int] | None:
    """For each row of a tree step's input features, the row of the previous step's outputs it equals (a healthy
    step reads its parent's output as it is: equal tensors, equal fingerprints); None when a row equals none, as when
    the features fed are not the parents' (a feedback mistake), or when either is missing."""
    if hidden_in is None or parent_out is None or (err := pairwise_row_errors(hidden_in, parent_out)) is None:
        return None
    best = err.min(dim=-1)
    return best.indices.tolist() if float(best.values.max()) <= 1e-4 else None


def distinct_assignment(cost: torch.Tensor) -> list[int] | None:
    """For each row of `cost` [R, C] (inf: not allowed) a distinct column: cheapest pairs first, then, for a row left
    without one, an augmenting path that moves earlier rows to other allowed columns, so an assignment is found
    whenever one exists. None when none exists."""
    R, C = cost.shape
    allowed = torch.isfinite(cost)
    col_of, row_of = [-1] * R, [-1] * C
    for flat in torch.argsort(cost.flatten(), stable=True).tolist():
        r, c = divmod(flat, C)
        if not allowed[r, c]:
            break
        if col_of[r] < 0 and row_of[c] < 0:
            col_of[r], row_of[c] = c, r
    options = [torch.nonzero(allowed[r]).flatten().tolist() for r in range(R)]

    def augment(r: int, seen: set[int]) -> bool:
        for c in options[r]:
            if c not in seen:
                seen.add(c)
                if row_of[c] < 0 or augment(row_of[c], seen):
                    col_of[r], row_of[c] = c, r
                    return True
        return False

    for r in range(R):
        if col_of[r] < 0 and not augment(r, set()):
            return None
    return col_of


# -- following the trace -------------------------------------------------------------------------------------------
class _Forced:
    """The trace's target-side decisions, round by round."""

    def __init__(self, trace: T.Trace) -> None:
        self.trace = trace
        self._idx = {(e.stage, e.round) for e in trace.events}

    def get(self, stage: str, rnd: int) -> torch.Tensor | None:
        if (stage, rnd) not in self._idx:
            return None
        obj = self.trace.get(stage, rnd)
        if not isinstance(obj, torch.Tensor):
            raise EagleScopeError(f"trace stage {stage} (round {rnd}) must be stored in full to be replayed")
        return obj


class _FollowsTrace:
    """The proposer methods a replay overrides to follow a trace (mixed in before the proposer class: see _following).
    `_trace` and `_in_trace` are set on the class _following makes."""

    _trace: T.Trace
    _in_trace: set

    def _traced(self, stage: str, rnd: int, part: str | None = None):
        """The trace's value of (stage, round, part), or None when the trace has none."""
        if (stage, rnd, part) not in self._in_trace:
            return None
        return self._trace.get(stage, rnd, part=part) if part else self._trace.get(stage, rnd)

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._own_rows: dict[str, torch.Tensor] = {}  # this step's tensors, to pair its rows with the trace's
        self._paired: dict[int, list[int]] = {}  # step k → own row j holds the node of trace row [j], this round
        self._prev_out: torch.Tensor | None = None  # the previous step's own outputs

    def _record(self, stage: str, tensor: torch.Tensor, **kw) -> None:
        super()._record(stage, tensor, **kw)
        self._own_rows[stage] = tensor

    def _record_topk(self, step: int, lp: torch.Tensor) -> None:
        k = step - 1
        rnd = self.rec.round if self.rec is not None else None
        ids = self._traced(T.draft_topk(k), rnd, T.TOPK_IDS)
        ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        own, self._own_rows = self._own_rows, {}
        if k == 0:
            self._paired = {}
        rows = list(range(lp.shape[0]))  # own row j of `lp` follows the trace's row rows[j]
        h0 = own.get(T.draft_hidden_out(0))
        if k == 0 and ids is not None and h0 is not None and ids.shape[0] == h0.shape[0] > lp.shape[0]:
            # the trace keeps step 0's top-k of every row (docs/trace-format.md allows both): so does the replay
            super()._record_topk(step, self._logprobs(h0))
            rows = [ids.shape[0] - 1]  # the last row (the root's) proposes
        else:
            super()._record_topk(step, lp)
        if k > 0:
            rows = self._pair_rows(k, rnd, lp, ids, own)
            self.rec.record(replay_rows(k), torch.tensor(rows, dtype=torch.long))
        self._paired[k], self._prev_out = rows, own.get(T.draft_hidden_out(k))
        if ids is not None and max(rows) < ids.shape[0] and (k == 0 or ids.shape[0] == lp.shape[0]):
            self._force(lp, k, rnd, ids.long()[torch.tensor(rows)].to(lp.device), rows, own)

    def _pair_rows(self, k: int, rnd: int, lp: torch.Tensor, ids, own: dict) -> list[int]:
        if (by_nodes := self._pair_by_nodes(k, rnd, own)) is not None:
            return by_nodes
        mine = {s: own[s] for s in (T.draft_embed_in(k), T.draft_hidden_in(k), T.draft_hidden_out(k)) if s in own}
        theirs = {s: v for s in mine if (v := self._traced(s, rnd)) is not None}
        top = lp.topk(min(self.top_k, lp.shape[-1]), dim=-1)
        if ids is not None:
            mine[T.TOPK_IDS], theirs[T.TOPK_IDS] = self.to_target_ids(top.indices), ids
        if (vals := self._traced(T.draft_topk(k), rnd, T.TOPK_LOGPROBS)) is not None:
            mine[T.TOPK_LOGPROBS], theirs[T.TOPK_LOGPROBS] = top.values, vals
        return match_rows(theirs, mine) if mine else list(range(lp.shape[0]))

    def _force(self, lp: torch.Tensor, k: int, rnd: int, ids: torch.Tensor, rows: list[int], own: dict) -> None:
        """Make `lp` (the caller expands the tree from it right after) the traced run's choice for these rows."""
        t2d = self.draft.t2d
        if int(ids.min()) < 0 or int(ids.max()) >= t2d.shape[0] or not bool(t2d[ids].all()):
            return
        draft_ids = (torch.cumsum(t2d.long(), 0) - 1)[ids]
        if not torch.equal(self.to_target_ids(draft_ids), ids):
            return
        vals = self._traced(T.draft_topk(k), rnd, T.TOPK_LOGPROBS)
        if isinstance(vals, torch.Tensor) and vals.dim() == 2 and vals.shape[0] > max(rows):
            vals = vals[torch.tensor(rows)]
        if not isinstance(vals, torch.Tensor) or vals.shape != ids.shape:
            # fingerprinted log-probs: the replay's own values of those ids, put in the trace's rank order (a bf16
            # near-tie may rank them the other way here)
            vals = lp.gather(-1, draft_ids).sort(dim=-1, descending=True).values
        # Exact ties (bf16 logits round to equal values) would leave the child order to topk's tie-breaking:
        # a nudge far below any real gap keeps the recorded rank order.
        vals = vals.to(lp) - 1e-6 * torch.arange(vals.shape[-1], device=lp.device, dtype=lp.dtype)
        if k > 0 and (chosen := self._expanded_next(k, rnd, draft_ids, own)) is not None:
            # candidates the traced run did not expand next: far below every one it did
            vals = torch.where(chosen, vals, vals - 1e4)
        forced = torch.full_like(lp, -torch.inf)
        forced.scatter_(-1, draft_ids, vals)
        lp.copy_(forced)

    def _expanded_next(self, k: int, rnd: int, draft_ids: torch.Tensor, own: dict) -> torch.Tensor | None:
        """[n, K] bool: which of this step's candidates (own row j, its child draft_ids[j, i]) the trace's step k+1
        rows hold, told by their embedding and their parent's features; None when the trace does not show it."""
        by_tokens = self._expanded_by_nodes(k, rnd, draft_ids)
        if by_tokens is None:
            by_tokens = self._expanded_by_tokens(k, rnd, draft_ids, own)
        if by_tokens is not None:
            return by_tokens
        emb, parent = self._traced(T.draft_embed_in(k + 1), rnd), self._traced(T.draft_hidden_in(k + 1), rnd)
        out = own.get(T.draft_hidden_out(k))
        if out is None or (emb is None and parent is None):
            return None
        n, K = draft_ids.shape
        cost = torch.zeros(0)
        with torch.inference_mode():
            cand_emb = self.embed(self.to_target_ids(draft_ids.flatten()))  # [n*K, H]
        cand_parent = out.repeat_interleave(K, dim=0)
        for theirs, mine in ((emb, cand_emb), (parent, cand_parent)):
            if theirs is None:
                continue
            err = pairwise_row_errors(theirs, mine)
            if err is None:
                return None
            cost = err.clamp(max=1.0) if cost.numel() == 0 else cost + err.clamp(max=1.0)
        best = cost.min(dim=-1)
        picked = best.indices.tolist()
        # every next-step row must be one candidate, clearly (the wrong ones are a token or a parent away)
        if len(set(picked)) != len(picked) or float(best.values.max()) > 0.5:
            return None
        chosen = torch.zeros(n * K, dtype=torch.bool)
        chosen[best.indices] = True
        return chosen.view(n, K).to(draft_ids.device)

    def _trace_nodes(self, k: int, rnd: int) -> list[tuple[int, int]] | None:
        """(own row of the parent, token id) of each trace row of tree step k >= 1, the parent told by the trace's
        own features (its step k input rows equal its step k-1 output rows) and put in the replay's rows by the
        pairing of step k-1; None where the trace does not show it exactly."""
        tokens = self._traced(T.draft_tokens(k), rnd)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            return None
        if k == 1:
            parents = [0] * tokens.numel()  # every step-1 node is a child of the root
        else:
            parents = parent_rows(self._traced(T.draft_hidden_in(k), rnd), self._traced(T.draft_hidden_out(k - 1), rnd))
            prev = self._paired.get(k - 1)
            if parents is None or prev is None or sorted(prev) != list(range(len(prev))):
                return None
            own_of = {r: j for j, r in enumerate(prev)}
            parents = [own_of.get(p, -1) for p in parents]
        return list(zip(parents, tokens.long().tolist(), strict=True))

    def _pair_by_nodes(self, k: int, rnd: int, own: dict) -> list[int] | None:
        """Rows paired by what a tree node is, its parent and its token, when both sides show it exactly (the
        replay: its step input rows equal its previous outputs); None otherwise."""
        theirs = self._trace_nodes(k, rnd)
        tokens = own.get(T.draft_tokens(k))
        parents = [0] * len(tokens) if k == 1 and tokens is not None else None
        if k > 1:
            parents = parent_rows(own.get(T.draft_hidden_in(k)), self._prev_out)
        if theirs is None or parents is None or tokens is None or len(theirs) != len(parents):
            return None
        row_of = {node: r for r, node in enumerate(theirs)}
        rows = [row_of.get(node, -1) for node in zip(parents, tokens.long().tolist(), strict=True)]
        return rows if len(row_of) == len(theirs) and sorted(rows) == list(range(len(rows))) else None

    def _expanded_by_nodes(self, k: int, rnd: int, draft_ids: torch.Tensor) -> torch.Tensor | None:
        """[n, K] bool: the candidates that are the trace's step k+1 nodes (`_trace_nodes`), or None."""
        nodes = self._trace_nodes(k + 1, rnd)
        if nodes is None:
            return None
        cand = self.to_target_ids(draft_ids).cpu()
        chosen = torch.zeros_like(cand, dtype=torch.bool)
        for parent, token in nodes:
            if not 0 <= parent < cand.shape[0] or not bool((hit := cand[parent] == token).any()):
                return None
            chosen[parent] |= hit
        return chosen.to(draft_ids.device) if int(chosen.sum()) == len(nodes) else None

    def _expanded_by_tokens(self, k: int, rnd: int, draft_ids: torch.Tensor, own: dict) -> torch.Tensor | None:
        """The candidates the trace expanded next, told by the token ids its step k+1 read (exact in every trace
        mode): each of its rows is one candidate with that id, distinct candidates for distinct rows; where an id
        belongs to more candidates than rows read it, the parents' features decide (the trace's step k+1
        hidden_in against this step's outputs). None when the trace has no step tokens or reads ids no distinct
        candidates have (then nothing the replay could expand reproduces it)."""
        nxt = self._traced(T.draft_tokens(k + 1), rnd)
        if not isinstance(nxt, torch.Tensor) or nxt.dim() != 1 or nxt.numel() == 0:
            return None
        cand = self.to_target_ids(draft_ids).cpu().flatten()  # [n*K], candidate c = (row c // K, child c % K)
        n, K = draft_ids.shape
        same = nxt.long().cpu()[:, None] == cand[None, :]  # [rows, n*K]
        cost = torch.zeros(same.shape, dtype=torch.float64)
        parents, out = self._traced(T.draft_hidden_in(k + 1), rnd), own.get(T.draft_hidden_out(k))
        if parents is not None and out is not None and (err := pairwise_row_errors(parents, out)) is not None:
            cost = err.double().cpu().repeat_interleave(K, dim=1)  # row r read candidate c's parent's output
        picked = distinct_assignment(torch.where(same, cost, torch.inf))
        if picked is None:
            return None
        chosen = torch.zeros(n * K, dtype=torch.bool)
        chosen[torch.tensor(picked)] = True
        return chosen.view(n, K).to(draft_ids.device)


def _following(proposer_cls: type[Eagle3Proposer], trace: T.Trace) -> type[Eagle3Proposer]:
    """`proposer_cls` that records its own top-k but grows the tree the traced run grew.

    A near-tie between draft candidates can go either way in another precision (bf16 against this float32
    replay); the traced run's choice decides which tokens the next draft step sees, so the replay follows
    it (its logprobs, or failing those its ids in their recorded rank order) to keep comparing like with like. Ids
    that are not valid outputs of the draft's vocabulary map (a VOCAB_MAP fault) are not followed: the replay keeps
    its own. A tree step's rows are paired with the trace's by what each node is, its parent and its token: the
    trace shows both exactly (its step tokens, and its step inputs equal to its parents' outputs, even fingerprinted),
    so each node follows the trace's choice for that node whatever order the engine keeps its frontier in, and the
    replay expands exactly the nodes the trace expanded next, so a near-tie between candidates of different rows
    cannot pick another frontier either. Where the trace does not show the nodes exactly (no step tokens, or features
    that are not the parents' under a feedback mistake) rows are paired by content (`match_rows`) and the next
    frontier is told by its ids and its parents' features.
    """
    index = {(e.stage, e.round, e.part) for e in trace.events}
    name = f"Following{proposer_cls.__name__}"
    return type(name, (_FollowsTrace, proposer_cls), {"_trace": trace, "_in_trace": index, "__qualname__": name})


class _ReplayRunner(ReferenceRunner):
    """The reference backend following a trace: the tree sent to verify, the accepted path and the bonus token are
    the trace's; everything else is recomputed, with every layer of the target tapped (replay.hs.<i>)."""

    def __init__(self, target, proposer, rec, forced: _Forced, rounds: list[int], contract, extra_room: int):
        super().__init__(target, proposer, SamplingConfig(), None, rec)
        self.forced, self.contract, self.extra_room = forced, contract, extra_room
        self._rounds = iter([r for r in rounds if r != 0])
        self._hs: dict = {}

    def cache_room(self, prompt_ids, budget) -> int:
        return super().cache_room(prompt_ids, budget) + self.extra_room

    def target_forward(self, tokens, positions=None, tree_mask=None) -> TargetOutput:
        fn = lambda: self.target.forward(tokens, positions=positions, tree_mask=tree_mask)  # noqa: E731
        if not self.target.computes_layers:  # the trace's own capture played back (draft_replay.py): nothing to tap
            return fn()
        out, states, final = forward_all_layers(self.target, fn, self.contract)
        self._hs = {replay_hs(i): h for i, h in enumerate(states)}
        if final is not None:
            self._hs[REPLAY_FINAL] = final
        return out

    def _record_target(self, out: TargetOutput) -> None:
        super()._record_target(out)
        for stage, h in self._hs.items():
            self.rec.record(stage, h)

    def first_token(self, prefill: TargetOutput) -> int:
        bonus = self.forced.get(T.VERIFY_BONUS, 0)
        return int(bonus.flatten()[0]) if bonus is not None else int(prefill.logits[-1].argmax())

    def next_round(self) -> None:
        self.round = next(self._rounds)
        self.rec.next_round()
        while self.rec.round < self.round:  # keep round numbers aligned with the trace's
            self.rec.next_round()

    def propose(self) -> RoundState:
        own = self.proposer.propose(self.tokens, self.target.cache_len)  # records the draft stages
        ft, fp = self.forced.get(T.VERIFY_TOKENS, self.round), self.forced.get(T.VERIFY_PARENTS, self.round)
        tree = own if ft is None or fp is None else DraftTree.from_parents(ft.long(), fp.long())
        record_tree(self.rec, tree)
        return RoundState(tree)

    def verdict(self, state: RoundState) -> VerifyResult:
        tree = state.tree
        fa, fb = self.forced.get(T.VERIFY_ACCEPTED, self.round), self.forced.get(T.VERIFY_BONUS, self.round)
        if fa is None or fb is None:
            raise EagleScopeError(f"trace round {self.round} lacks verify.accepted / verify.bonus: cannot follow it")
        accepted = [int(x) for x in fa.flatten().tolist()]
        bonus = int(fb.flatten()[0])
        return VerifyResult(accepted, bonus, [int(tree.tokens[i]) for i in accepted] + [bonus])


def replay(
    target: Target,
    loaded: LoadedDraft,
    trace_dir: Path | str,
    out_dir: Path | str,
    mode: str = "full",
    proposer_cls: type[Eagle3Proposer] = Eagle3Proposer,
    until_round: int | None = None,
) -> Path:
    """Write the golden trace for `trace_dir` into `out_dir` and return its path (rounds up to `until_round`)."""
    try:
        trace = T.load_trace(trace_dir)
    except T.TraceError as e:
        raise EagleScopeError(f"cannot read trace {trace_dir}: {e}") from None
    meta = trace.meta or {}
    prompt_ids = meta.get("prompt_ids")
    if not prompt_ids:
        raise EagleScopeError(f"trace {trace_dir} has no prompt_ids in its manifest meta: nothing to replay")
    if not (isinstance(prompt_ids, list) and all(type(t) is int for t in prompt_ids)):
        raise EagleScopeError(f"trace {trace_dir}: meta.prompt_ids must be a list of token ids")
    try:
        check_prompt(target, prompt_ids, 1)
    except EagleScopeError as e:
        raise EagleScopeError(f"trace {trace_dir} cannot be replayed on this target: {e}") from None
    depth, top_k, total = tree_shape(meta, trace)
    attention = tree_attention(meta)
    contract = loaded.contract.taps
    if contract.num_layers != target.num_layers:
        raise EagleScopeError(
            f"the draft's taps are for a {contract.num_layers}-layer target; this target has {target.num_layers}"
        )
    forced = _Forced(trace)
    rounds = [r for r in sorted(trace.rounds()) if until_round is None or r <= until_round]
    draft = loaded.model
    # The reference embedding is the target's, even when the checkpoint ships one: EAGLE-3 trains with the
    # target's table frozen, so a shipped copy that differs is a fault to find, not the golden path.
    draft.load_target_embedding(target_embedding(target))
    verified = [forced.get(T.VERIFY_ACCEPTED, r) for r in rounds if r != 0]
    budget = 1 + sum(int(a.numel()) + 1 for a in verified if a is not None)
    biggest = max((int(t.numel()) for r in rounds if (t := forced.get(T.VERIFY_TOKENS, r)) is not None), default=0)
    max_len = len(prompt_ids) + budget + total + 2
    rec = T.TraceRecorder(out_dir, mode=mode, producer="eaglescope-replay", inputs=(trace_dir,), flag="--out")
    # a replay whose target plays the trace's capture back copies target.* from the trace: those are not evidence
    rec.set_meta(**{**meta, "replay_of": str(trace_dir), "taps": contract.to_dict(),
                    REPLAY_COPIES_TARGET: not target.computes_layers})  # fmt: skip
    try:
        proposer = _following(proposer_cls, trace)(draft, depth, top_k, total, max_len, recorder=rec,
                                                    tree_attention=attention)  # fmt: skip
        runner = _ReplayRunner(target, proposer, rec, forced, rounds, contract, extra_room=biggest + 2)
        decode(runner, prompt_ids, budget, budget, set(), target.device, max_rounds=len([r for r in rounds if r]))
    except BaseException:
        rec.abort()
        raise
    return rec.close()
