"""The speculative loop, written once for every decoding path.

A round is `speculative_round`: propose a draft tree rooted at the last emitted token → verify it with one target
forward → accept a path and a bonus token → commit the target's KV of root + accepted nodes and hand the target's
features of exactly those positions to the proposer for the next round. `decode` drives rounds until the budget or
a stop token: it is the only loop, and it keeps the statistics.

What differs between paths is a backend, a `Runner` whose four round operations `speculative_round` calls:

- `ReferenceRunner` (here): any Target (native or transformers) on any device, dynamic trees, greedy or sampled
  acceptance, every stage recordable in a trace. Vanilla decoding is this runner with `NoProposer` (a tree of the
  root alone: one target step, the bonus token is the next token); replay (detective/replay.py) is this runner with
  the trace's decisions forced.
- `FastEagle` / `FastVanilla` (fast/engine.py): static shapes on slot caches, the whole round graph-captured on a
  GPU, one host read per round, the next round queued before that read (`run_ahead`).
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from eaglescope import trace as T
from eaglescope.decode.generation import (
    GenerationResult,
    SamplingConfig,
    begin_generation,
    check_prompt,
    choose_token,
    sync,
)
from eaglescope.decode.speculative import (
    Eagle3Proposer,
    NoProposer,
    Proposer,
    build_proposer,
)
from eaglescope.decode.stats import SpecStats
from eaglescope.decode.tree import DraftTree
from eaglescope.decode.verify import VerifyResult, verify_greedy, verify_sampling
from eaglescope.target.base import Target, TargetOutput
from eaglescope.target.layer_states import forward_all_layers, normed_inputs


@dataclass
class RoundReport:
    """What the host learns of one round: the tokens it emits (accepted drafts, then the bonus token)."""

    tokens: list[int]
    accepted: int  # accepted draft tokens (bonus excluded)
    depth: int  # how deep the proposer drafted
    drafted: int  # draft tokens sent to verify
    tree: DraftTree | None = None  # the verified tree, where the backend keeps one on the host


def speculative_round(b: Runner):
    """One round, the same for every backend: propose → verify → accept → commit (KV kept, features handed on)."""
    tree = b.propose()
    verified = b.verify(tree)
    accepted = b.accept(tree, verified)
    b.commit(tree, accepted, verified)
    return tree, accepted


class Runner(ABC):
    """A decoding backend: the four operations of a round, plus starting a sequence and running rounds."""

    run_ahead = False  # whether `launch` may queue a round before the previous one is read

    def prepare(self, prompt_ids: list[int], budget: int) -> None:  # noqa: B027 - most backends have nothing to do
        """One-time costs that are not decoding time (a graph capture, a first compiled round)."""

    @abstractmethod
    def start(self, prompt_ids: list[int], budget: int) -> int:
        """Prefill the prompt (room for `budget` new tokens); → the first generated token."""

    @abstractmethod
    def propose(self): ...

    @abstractmethod
    def verify(self, tree): ...

    @abstractmethod
    def accept(self, tree, verified): ...

    @abstractmethod
    def commit(self, tree, accepted, verified) -> None: ...

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
        if self.rec is None or out.aux is None or self.target.taps is None:
            return
        H = self.target.hidden_size
        for j, layer in enumerate(self.target.taps.layers):
            self.rec.record(T.target_tap(layer), out.aux[:, j * H : (j + 1) * H])
        self.rec.record(T.TARGET_AUX, out.aux, segments=self.target.taps.count)

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
        self._record_target(prefill)
        if layers:
            self.rec.record_layers(states, final, normed_inputs(t, states))
        self._record(T.VERIFY_BONUS, torch.tensor([first]))
        if prefill.aux is not None:
            self._record(T.NEXT_HIDDEN_IN, prefill.aux)
        self.tokens = list(prompt_ids) + [first]
        self.proposer.start(list(prompt_ids), prefill, first)
        return first

    def first_token(self, prefill: TargetOutput) -> int:
        return choose_token(prefill.logits[-1], self.sampling, self.gen)

    def next_round(self) -> None:
        if self.rec is not None:
            self.rec.next_round()

    # -- the round's operations ---------------------------------------------------------------------------------
    def propose(self) -> DraftTree:
        tree = self.proposer.propose(self.tokens, self.target.cache_len)
        self._record(T.VERIFY_TOKENS, tree.tokens)
        self._record(T.VERIFY_PARENTS, tree.parents)
        return tree

    def verify(self, tree: DraftTree) -> TargetOutput:
        dev = self.target.device
        out = self.target_forward(
            tree.tokens.to(dev),
            positions=self.target.cache_len + tree.depths.to(dev),
            tree_mask=tree.ancestor_mask().to(dev),
        )
        self._record_target(out)
        return out

    def accept(self, tree: DraftTree, out: TargetOutput) -> VerifyResult:
        if self.sampling.greedy:
            return verify_greedy(tree, out.logits)
        s = self.sampling
        return verify_sampling(tree, out.logits, s.temperature, s.top_k, s.top_p, self.gen)

    def commit(self, tree: DraftTree, res: VerifyResult, out: TargetOutput) -> None:
        self.target.commit(torch.tensor(res.path, device=self.target.device))
        self._record(T.VERIFY_ACCEPTED, torch.tensor(res.accepted, dtype=torch.long))
        self._record(T.VERIFY_BONUS, torch.tensor([res.bonus]))
        self.tokens += res.tokens
        self.proposer.accepted(tree, res, out)
        if isinstance(self.proposer, Eagle3Proposer):
            self._record(T.NEXT_HIDDEN_IN, self.proposer.pending_aux)

    # -- running rounds -----------------------------------------------------------------------------------------
    def launch(self) -> None:
        self.next_round()
        tree, res = speculative_round(self)
        self._report = RoundReport(res.tokens, len(res.accepted), tree.max_depth, tree.num_nodes - 1, tree)

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


def open_trace(args) -> T.TraceRecorder | None:
    """`generate --trace DIR`'s recorder (None without the flag); its meta comes from `trace_meta`."""
    if not args.trace:
        return None
    return T.TraceRecorder(
        args.trace, mode=args.trace_mode, producer="eaglescope", inputs=(args.target, args.draft), flag="--trace"
    )


def trace_meta(recorder: T.TraceRecorder, args, target: Target, prompt_ids, sampling: SamplingConfig) -> None:
    """What a trace of `eaglescope generate` says about its run (the prompt, the target, taps, the settings)."""
    recorder.set_meta(
        prompt_ids=list(prompt_ids),
        target=target.fingerprint.to_dict(),
        taps=target.taps.to_dict() if target.taps else None,
        settings={
            "chain": args.chain,
            "tree": args.tree,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "max_new_tokens": args.max_new_tokens,
            "proposer": args.proposer,
            "fast": bool(getattr(args, "fast", False)),
        },
    )


def run_speculative_from_args(args, target: Target, prompt_ids, sampling, stop) -> GenerationResult:
    """`eaglescope generate --draft …` (or --proposer ngram) on the reference backend, with an optional trace."""
    budget = check_prompt(target, prompt_ids, args.max_new_tokens)
    recorder = open_trace(args)
    proposer = build_proposer(args, target, sampling, len(prompt_ids) + budget + 1, recorder)
    if recorder is not None:
        trace_meta(recorder, args, target, prompt_ids, sampling)
    # the recorder writes its trace when the block ends, or drops it when the block raises
    with recorder if recorder is not None else contextlib.nullcontext():
        return generate_speculative(target, proposer, prompt_ids, args.max_new_tokens, sampling, stop, recorder,
                                    trace_layers=bool(getattr(args, "trace_layers", False)))  # fmt: skip


__all__ = [
    "RoundReport",
    "Runner",
    "ReferenceRunner",
    "speculative_round",
    "decode",
    "generate_speculative",
    "generate_vanilla",
    "run_speculative_from_args",
]
