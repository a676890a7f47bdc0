"""Golden replay: what a correct pipeline computes for the prompt and decisions a trace recorded.

The replay follows the trace's *decisions* (the tree sent to verify, the accepted path, the bonus
token, and which draft candidates each tree step expanded) so that every round and every draft step
sees the same context as the traced run, and recomputes everything else with eaglescope's reference
path: the target's taps, fc, every draft step, its own top-k, the features handed to the next round.
A stage where the trace and the replay disagree is therefore a wiring difference, not a different
path (nor a near-tie that another precision broke the other way).

Besides the canonical stages the replay records, per target forward, every hidden state
`replay.hs.<i>` (i = 0..L-1): what the diagnoses need to say *which* tensor an engine tapped.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.decode.generation import SamplingConfig, check_prompt
from eaglescope.decode.loop import ReferenceRunner, decode
from eaglescope.decode.speculative import Eagle3Proposer, parse_tree_shape, target_embedding
from eaglescope.decode.tree import DraftTree
from eaglescope.decode.verify import VerifyResult
from eaglescope.draft import LoadedDraft
from eaglescope.errors import EagleScopeError
from eaglescope.taps import TapContract
from eaglescope.target.base import Target, TargetOutput

REPLAY_HS = "replay.hs"  # replay.hs.<i>: hidden state i of every target forward (all layers)


def replay_hs(i: int) -> str:
    return f"{REPLAY_HS}.{i}"


def _tree_shape(settings: dict) -> tuple[int, int, int]:
    chain = settings.get("chain")
    tree = settings.get("tree")
    if isinstance(tree, (list, tuple)):
        tree = ",".join(str(x) for x in tree)
    return parse_tree_shape(int(chain) if chain is not None else None, tree)


class _Forced:
    """The trace's target-side decisions, round by round."""

    def __init__(self, trace: T.Trace) -> None:
        self.trace = trace

    def get(self, stage: str, rnd: int) -> torch.Tensor | None:
        if (stage, rnd) not in self._index:
            return None
        obj = self.trace.get(stage, rnd)
        if not isinstance(obj, torch.Tensor):
            raise EagleScopeError(f"trace stage {stage} (round {rnd}) must be stored in full to be replayed")
        return obj

    @property
    def _index(self) -> set[tuple[str, int]]:
        if not hasattr(self, "_idx"):
            self._idx = {(e.stage, e.round) for e in self.trace.events}
        return self._idx


def _following(proposer_cls: type[Eagle3Proposer], trace: T.Trace) -> type[Eagle3Proposer]:
    """`proposer_cls` that records its own top-k but grows the tree the traced run grew.

    A near-tie between draft candidates can go either way in another precision (bf16 against this float32
    replay); the traced run's choice decides which tokens the next draft step sees, so the replay follows
    it (its logprobs, or failing those its ids) to keep comparing like with like. Ids that are not valid
    outputs of the draft's vocabulary map (a VOCAB_MAP fault) are not followed: the replay keeps its own.
    """

    def _record_topk(self, step: int, lp: torch.Tensor) -> None:
        proposer_cls._record_topk(self, step, lp)
        rnd = self.rec.round if self.rec is not None else None
        key = (T.draft_topk(step - 1), rnd)
        if key not in index:
            return
        ids = trace.get(key[0], rnd, part=T.TOPK_IDS)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != lp.shape[0]:
            return
        t2d = self.draft.t2d
        ids = ids.long().to(lp.device)
        if int(ids.min()) < 0 or int(ids.max()) >= t2d.shape[0] or not bool(t2d[ids].all()):
            return
        draft_ids = (torch.cumsum(t2d.long(), 0) - 1)[ids]
        if not torch.equal(self.to_target_ids(draft_ids), ids):
            return
        try:
            vals = trace.get(key[0], rnd, part=T.TOPK_LOGPROBS)
        except KeyError:
            vals = None
        if not isinstance(vals, torch.Tensor) or vals.shape != ids.shape:
            vals = lp.gather(-1, draft_ids)  # fingerprinted logprobs: the replay's own values of those ids
        # The caller expands the tree from `lp` right after recording it: make it the traced run's choice.
        # Exact ties (bf16 logits round to equal values) would leave the child order to topk's tie-breaking:
        # a nudge far below any real gap keeps the recorded rank order.
        vals = vals.to(lp) - 1e-6 * torch.arange(vals.shape[-1], device=lp.device, dtype=lp.dtype)
        forced = torch.full_like(lp, -torch.inf)
        forced.scatter_(-1, draft_ids, vals)
        lp.copy_(forced)

    index = {(e.stage, e.round) for e in trace.events}
    return type(f"Following{proposer_cls.__name__}", (proposer_cls,), {"_record_topk": _record_topk})


def _all_layer_forward(target: Target, all_taps: TapContract, contract: TapContract, fn) -> tuple[TargetOutput, dict]:
    """Run `fn()` with every layer tapped; return the output with the contract's aux, and all hidden states."""
    target.set_taps(all_taps)
    out = fn()
    target.set_taps(contract)
    H = target.hidden_size
    hs = {i: out.aux[:, i * H : (i + 1) * H] for i in all_taps.layers}
    aux = torch.cat([hs[i] for i in contract.layers], dim=-1)
    return TargetOutput(out.logits, aux), hs


class _ReplayRunner(ReferenceRunner):
    """The reference backend following a trace: the tree sent to verify, the accepted path and the bonus token are
    the trace's; everything else is recomputed, with every layer of the target tapped (replay.hs.<i>)."""

    def __init__(self, target, proposer, rec, forced: _Forced, rounds: list[int], contract, extra_room: int):
        super().__init__(target, proposer, SamplingConfig(), None, rec)
        self.forced, self.contract, self.extra_room = forced, contract, extra_room
        self.all_taps = TapContract(tuple(range(target.num_layers)), target.num_layers)
        self._rounds = iter([r for r in rounds if r != 0])
        self._hs: dict = {}

    def cache_room(self, prompt_ids, budget) -> int:
        return super().cache_room(prompt_ids, budget) + self.extra_room

    def target_forward(self, tokens, positions=None, tree_mask=None) -> TargetOutput:
        fn = lambda: self.target.forward(tokens, positions=positions, tree_mask=tree_mask)  # noqa: E731
        out, self._hs = _all_layer_forward(self.target, self.all_taps, self.contract, fn)
        return out

    def _record_target(self, out: TargetOutput) -> None:
        super()._record_target(out)
        for i, h in self._hs.items():
            self.rec.record(replay_hs(i), h)

    def first_token(self, prefill: TargetOutput) -> int:
        bonus = self.forced.get(T.VERIFY_BONUS, 0)
        return int(bonus.flatten()[0]) if bonus is not None else int(prefill.logits[-1].argmax())

    def next_round(self) -> None:
        self.round = next(self._rounds)
        self.rec.next_round()
        while self.rec.round < self.round:  # keep round numbers aligned with the trace's
            self.rec.next_round()

    def propose(self) -> DraftTree:
        own = self.proposer.propose(self.tokens, self.target.cache_len)  # records the draft stages
        ft, fp = self.forced.get(T.VERIFY_TOKENS, self.round), self.forced.get(T.VERIFY_PARENTS, self.round)
        tree = own if ft is None or fp is None else DraftTree.from_parents(ft.long(), fp.long())
        self.rec.record(T.VERIFY_TOKENS, tree.tokens)
        self.rec.record(T.VERIFY_PARENTS, tree.parents)
        return tree

    def accept(self, tree: DraftTree, out: TargetOutput) -> VerifyResult:
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
    settings = meta.get("settings") or {}
    depth, top_k, total = _tree_shape(settings)
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
    rec.set_meta(**{**meta, "replay_of": str(trace_dir), "taps": contract.to_dict()})
    try:
        proposer = _following(proposer_cls, trace)(draft, depth, top_k, total, max_len, recorder=rec)
        runner = _ReplayRunner(target, proposer, rec, forced, rounds, contract, extra_room=biggest + 2)
        decode(runner, prompt_ids, budget, budget, set(), target.device, max_rounds=len([r for r in rounds if r]))
    except BaseException:
        rec.abort()
        raise
    return rec.close()
