"""The speculative loop, written once for every decoding path, and the reference backend.

A round is `speculative_round`: propose a draft tree rooted at the last emitted token → verify it with one target
forward → accept a path and a bonus token → commit the target's KV of root + accepted nodes and hand the target's
features of exactly those positions to the proposer for the next round. `decode` drives rounds until the budget or
a stop token: it is the only loop, and it keeps the statistics. The round's state is decode/round.py's RoundState,
its steps are written once (docs/architecture.md says where each lives).

What differs between paths is a backend, a `Runner` whose four round operations `speculative_round` calls:

- `ReferenceRunner` (here): any Target (native or transformers) on any device, dynamic trees, greedy or sampled
  acceptance, every stage recordable in a trace. Vanilla decoding is this runner with `NoProposer` (a tree of the
  root alone: one target step, the bonus token is the next token); replay (detective/replay.py) is this runner with
  the trace's decisions forced.
- `FastEagle` / `FastVanilla` (fast/engine.py): static shapes on slot caches, the whole round graph-captured on a
  GPU, one host read per round, the next round queued before that read (`run_ahead`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from eaglescope import trace as T
from eaglescope.decode.generation import (
    GenerationResult,
    SamplingConfig,
    begin_generation,
    choose_token,
    sync,
)
from eaglescope.decode.round import RoundState, record_prefill, record_target, record_tree, record_verdict
from eaglescope.decode.speculative import (
    Eagle3Proposer,
    NoProposer,
    Proposer,
)
from eaglescope.decode.stats import SpecStats
from eaglescope.decode.tree import DraftTree
from eaglescope.decode.verify import VerifyResult, verify_greedy, verify_sampling
from eaglescope.models.targets.base import Target, TargetOutput
from eaglescope.models.targets.layer_states import forward_all_layers, normed_inputs


@dataclass
class RoundReport:
    """What the host learns of one round: the tokens it emits (accepted drafts, then the bonus token)."""

    tokens: list[int]
    accepted: int  # accepted draft tokens (bonus excluded)
    depth: int  # how deep the proposer drafted
    drafted: int  # draft tokens sent to verify
    tree: DraftTree | None = None  # the verified tree, where the backend keeps one on the host


def speculative_round(b: Runner) -> RoundState:
    """One round, the same for every backend: propose → verify → accept → commit (KV kept, features handed on)."""
    state = b.propose()
    b.verify(state)
    b.accept(state)
    b.commit(state)
    return state


class Runner(ABC):
    """A decoding backend: the four operations of a round, plus starting a sequence and running rounds."""

    run_ahead = False  # whether `launch` may queue a round before the previous one is read

    def prepare(self, prompt_ids: list[int], budget: int) -> None:  # noqa: B027 - most backends have nothing to do
        """One-time costs that are not decoding time (a graph capture, a first compiled round)."""

    @abstractmethod
    def start(self, prompt_ids: list[int], budget: int) -> int:
        """Prefill the prompt (room for `budget` new tokens); → the first generated token."""

    @abstractmethod
    def propose(self) -> RoundState:
        """The round's tree (the draft side: catch-up, expansion)."""

    @abstractmethod
    def verify(self, state: RoundState) -> None:
        """One target forward over the tree: fills logits and aux."""

    @abstractmethod
    def accept(self, state: RoundState) -> None:
        """Fills accepted, path, bonus and emitted."""

    @abstractmethod
    def commit(self, state: RoundState) -> None:
        """Keeps the target KV of the path, hands its features on, records the verdict."""

    @abstractmethod
    def launch(self) -> None:
        """Run (or queue) one `speculative_round`."""

    @abstractmethod
    def read(self) -> RoundReport:
        """The report of the oldest launched round not read yet."""

    def room_for_another(self, emitted: int) -> bool:
        """Whether one more round fits after `emitted` tokens whatever the unread rounds accept."""
        return False


def decode(
    runner: Runner,
    prompt_ids: list[int],
    budget: int,
    max_new_tokens: int,
    stop: set[int],
    device: torch.device,
    max_rounds: int | None = None,
) -> GenerationResult:
    """Run rounds until `budget` tokens, a stop token, or `max_rounds`; → tokens, finish reason, time, stats."""
    stats = SpecStats()
    runner.prepare(list(prompt_ids), budget)
    sync(device)
    t0 = time.perf_counter()
    first = runner.start(list(prompt_ids), budget)
    generated = [first]
    reason = "length" if budget == max_new_tokens else "context"
    launched = read = 0
    if first in stop:
        reason = "eos"
    elif len(generated) < budget and max_rounds != 0:
        runner.launch()
        launched = 1
    while read < launched:
        # A backend whose rounds depend only on device state queues the next one before reading this one, so the
        # device never waits for the host; only when the output cannot be complete yet and the caches hold it.
        more = max_rounds is None or launched < max_rounds
        if runner.run_ahead and more and len(generated) + 1 < budget and runner.room_for_another(len(generated)):
            runner.launch()
            launched += 1
        rep = runner.read()
        read += 1
        stats.record_round(rep.tree if rep.tree is not None else None, rep.accepted, rep.depth, rep.drafted)
        # the budget first: a stop token past it was never emitted, so the reason stays "length"/"context"
        emitted = rep.tokens[: budget - len(generated)]
        for i, tok in enumerate(emitted):
            if tok in stop:
                emitted = emitted[: i + 1]
                reason = "eos"
                break
        generated += emitted
        if reason == "eos" or len(generated) >= budget:
            break
        if read == launched and (max_rounds is None or launched < max_rounds):
            runner.launch()
            launched += 1
    sync(device)
    return GenerationResult(list(prompt_ids), generated, reason, time.perf_counter() - t0, stats)


# -- the reference backend ----------------------------------------------------------------------------------------
class ReferenceRunner(Runner):
    """Any Target, any device: dynamic trees, greedy or sampled acceptance, every stage recordable."""

    def __init__(
        self,
        target: Target,
        proposer: Proposer,
        sampling: SamplingConfig,
        gen: torch.Generator | None,
        recorder: T.TraceRecorder | None = None,
        trace_layers: bool = False,
    ) -> None:
        self.target, self.proposer, self.sampling, self.gen, self.rec = target, proposer, sampling, gen, recorder
        self.trace_layers = trace_layers  # the trace also gets every layer's state of the prefill (target.layer.*)
        self.tokens: list[int] = []
        self._report: RoundReport | None = None

    def _record(self, stage: str, tensor: torch.Tensor, **kw) -> None:
        if self.rec is not None:
            self.rec.record(stage, tensor, **kw)

    def _record_target(self, out: TargetOutput) -> None:
        if self.rec is not None and out.aux is not None and self.target.taps is not None:
            record_target(self.rec, out.aux, self.target.taps.layers)

    def target_forward(self, tokens: torch.Tensor, positions=None, tree_mask=None) -> TargetOutput:
        return self.target.forward(tokens, positions=positions, tree_mask=tree_mask)

    def cache_room(self, prompt_ids: list[int], budget: int) -> int:
        return len(prompt_ids) + budget + self.proposer.max_nodes + 1

    def start(self, prompt_ids, budget) -> int:
        t = self.target
        t.reset(self.cache_room(prompt_ids, budget))
        ids = torch.tensor(prompt_ids, device=t.device)
        layers = self.rec is not None and self.trace_layers
        if layers:
            prefill, states, final = forward_all_layers(t, lambda: self.target_forward(ids))
        else:
            prefill = self.target_forward(ids)
        t.commit()
        first = self.first_token(prefill)
        if self.rec is not None:
            layers = (states, final, normed_inputs(t, states)) if layers else None
            record_prefill(
                self.rec, lambda aux: self._record_target(prefill), prefill.aux, torch.tensor([first]), layers
            )
        self.tokens = list(prompt_ids) + [first]
        self.proposer.start(list(prompt_ids), prefill, first)
        return first

    def first_token(self, prefill: TargetOutput) -> int:
        return choose_token(prefill.logits[-1], self.sampling, self.gen)

    def next_round(self) -> None:
        if self.rec is not None:
            self.rec.next_round()

    # -- the round's operations ---------------------------------------------------------------------------------
    def propose(self) -> RoundState:
        tree = self.proposer.propose(self.tokens, self.target.cache_len)
        if self.rec is not None:
            record_tree(self.rec, tree)
        return RoundState(tree)

    def verify(self, state: RoundState) -> None:
        dev, tree = self.target.device, state.tree
        out = self.target_forward(
            tree.tokens.to(dev),
            positions=self.target.cache_len + tree.depths.to(dev),
            tree_mask=tree.ancestor_mask().to(dev),
        )
        state.logits, state.aux = out.logits, out.aux
        self._record_target(out)

    def verdict(self, state: RoundState) -> VerifyResult:
        """The acceptance on the host: greedy (verify.accept_greedy), or recursive rejection sampling."""
        if self.sampling.greedy:
            return verify_greedy(state.tree, state.logits)
        s = self.sampling
        return verify_sampling(state.tree, state.logits, s.temperature, s.top_k, s.top_p, self.gen)

    def accept(self, state: RoundState) -> None:
        state.settle(self.verdict(state))

    def commit(self, state: RoundState) -> None:
        self.target.commit(state.path.to(self.target.device))
        self.tokens += state.emitted.tolist()
        self.proposer.accepted(state)
        if self.rec is not None:
            handed = self.proposer.state.aux if isinstance(self.proposer, Eagle3Proposer) else None
            record_verdict(self.rec, state, handed)

    # -- running rounds -----------------------------------------------------------------------------------------
    def launch(self) -> None:
        self.next_round()
        state = speculative_round(self)
        tree = state.tree
        self._report = RoundReport(
            state.emitted.tolist(), int(state.accepted), tree.max_depth, tree.num_nodes - 1, tree
        )

    def read(self) -> RoundReport:
        rep, self._report = self._report, None
        return rep


def generate_speculative(
    target: Target,
    proposer: Proposer,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_ids: list[int] | None = None,
    recorder: T.TraceRecorder | None = None,
    trace_layers: bool = False,
) -> GenerationResult:
    """Speculative decoding on the reference backend (lossless: greedy output is vanilla greedy's). `trace_layers`:
    the trace also records every layer's state of the prefill (TraceRecorder.record_layers)."""
    sampling, budget, stop, gen = begin_generation(target, prompt_ids, max_new_tokens, sampling, stop_ids)
    runner = ReferenceRunner(target, proposer, sampling, gen, recorder, trace_layers)
    return decode(runner, prompt_ids, budget, max_new_tokens, stop, target.device)


def generate_vanilla(
    target: Target,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_ids: list[int] | None = None,
) -> GenerationResult:
    """Autoregressive decoding: the loop with no proposer (each round verifies the root alone)."""
    sampling, budget, stop, gen = begin_generation(target, prompt_ids, max_new_tokens, sampling, stop_ids)
    runner = ReferenceRunner(target, NoProposer(), sampling, gen)
    res = decode(runner, prompt_ids, budget, max_new_tokens, stop, target.device)
    res.stats = None
    return res


__all__ = [
    "RoundReport",
    "Runner",
    "ReferenceRunner",
    "speculative_round",
    "decode",
    "generate_speculative",
    "generate_vanilla",
]
