"""Decoding on the backend that fits, chosen in one place from typed settings.

Two backends run the one round (decode/round.py): the reference backend (decode/loop.py `ReferenceRunner`: any
target, eager, greedy or sampled, every proposer) and the static-shape one (fast/: native Llama-family targets,
greedy, EAGLE-3 or no proposer, each round one CUDA graph on a GPU). `choose_backend` decides from a
`DecodeSettings` (what the command asked for) and the target; `Decoder` decodes prompts on the chosen backend,
keeping across prompts what can be kept (the loaded draft, a built static runner).
"""

from __future__ import annotations

import contextlib
import logging

from eaglescope import trace as T
from eaglescope.decode.generation import DecodeSettings, begin_generation
from eaglescope.decode.loop import ReferenceRunner, Runner, decode
from eaglescope.decode.speculative import NoProposer, build_proposer, check_top_k, load_eagle3
from eaglescope.errors import EagleScopeError
from eaglescope.fast.run import fast_runner, why_not_fast
from eaglescope.models.draft import Eagle3Draft
from eaglescope.models.targets.base import Target

log = logging.getLogger(__name__)

FAST, REFERENCE = "fast", "reference"


def choose_backend(settings: DecodeSettings, target: Target) -> str:
    """FAST or REFERENCE: the static-shape backend when asked for (refused, with the reason, where it cannot run),
    and by default on a GPU wherever it can run (the same tokens, several times faster); the reference one
    otherwise."""
    if settings.decoder == FAST:
        why = why_not_fast(settings, target)
        if why is not None:
            raise EagleScopeError(f"--fast cannot run this: {why}")
        return FAST
    if settings.decoder == REFERENCE or target.device.type != "cuda":
        return REFERENCE
    why = why_not_fast(settings, target)
    if why is not None:
        log.info("the reference decoder, because the fast one cannot: %s", why)
        return REFERENCE
    return FAST


def open_trace(settings: DecodeSettings) -> T.TraceRecorder | None:
    """The recorder `settings.trace` asks for (None without one); its meta comes from `trace_meta`."""
    if not settings.trace:
        return None
    inputs = (settings.target_dir, settings.draft)
    return T.TraceRecorder(
        settings.trace, mode=settings.trace_mode, producer="eaglescope", inputs=inputs, flag="--trace"
    )


def trace_meta(recorder: T.TraceRecorder, settings: DecodeSettings, target: Target, prompt_ids, backend: str) -> None:
    """What a trace of a decode says about its run (the prompt, the target, taps, the settings, the backend)."""
    s = settings.sampling
    recorder.set_meta(
        prompt_ids=list(prompt_ids),
        target=target.fingerprint.to_dict(),
        taps=target.taps.to_dict() if target.taps else None,
        settings={
            "chain": settings.chain,
            "tree": settings.tree,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "seed": s.seed,
            "max_new_tokens": settings.max_new_tokens,
            "proposer": settings.proposer,
            "fast": backend == FAST,
        },
    )


class Decoder:
    """Decodes prompts of up to `max_len` tokens with their new ones, with one target and settings, on the backend
    `choose_backend` picks. `draft`: an EAGLE-3 draft already loaded for this target (else loaded on first use)."""

    def __init__(self, target: Target, settings: DecodeSettings, max_len: int, draft: Eagle3Draft | None = None):
        self.target, self.settings, self.max_len = target, settings, max_len
        self.backend = choose_backend(settings, target)
        self._draft = draft
        self.static_runner: Runner | None = None  # the static backend's runner, once built (and captured)
        self.info: dict = {}

    def draft(self) -> Eagle3Draft:
        if self._draft is None:
            if self.settings.draft is None:
                raise EagleScopeError("EAGLE-3 methods (chain=K, tree=...) need --draft DIR")
            self._draft = load_eagle3(self.settings.draft, self.target)
        return self._draft

    def _eagle3(self) -> bool:
        return self.settings.speculative and self.settings.proposer == "eagle3"

    def _runner(self, prompt_ids, budget, sampling, gen, recorder) -> Runner:
        s, t = self.settings, self.target
        if self.backend == FAST:
            if self.static_runner is not None and recorder is None:
                return self.static_runner
            draft, shape = (self.draft(), s.shape) if self._eagle3() else (None, None)
            if draft is not None:
                check_top_k(draft, shape[1])
                if len(prompt_ids) < 2:
                    raise EagleScopeError("--fast with a draft needs a prompt of at least 2 tokens")
            runner, self.info = fast_runner(t, draft, shape, self.max_len, s.batch_invariant, recorder, s.trace_layers,
                                            compile_round=s.compile)  # fmt: skip
            if recorder is None:
                self.static_runner = runner
            return runner
        if not s.speculative:
            proposer = NoProposer()
        else:
            draft = self.draft() if self._eagle3() else None
            proposer = build_proposer(s, t, len(prompt_ids) + budget + 1, recorder, draft)
        return ReferenceRunner(t, proposer, sampling, gen, recorder, s.trace_layers)

    def run(self, prompt_ids: list[int], stop_ids: list[int] | None = None, max_new_tokens: int | None = None):
        """Decode one prompt → GenerationResult (stop_ids None: the target's end-of-sequence tokens; max_new_tokens
        None: the settings'), with a trace where the settings ask for one."""
        s, t = self.settings, self.target
        max_new = s.max_new_tokens if max_new_tokens is None else max_new_tokens
        sampling, budget, stop, gen = begin_generation(t, prompt_ids, max_new, s.sampling, stop_ids)
        recorder = open_trace(s) if s.speculative else None
        # vanilla and n-gram read no features: the target computes none (and its taps come back after)
        taps = t.taps
        if not self._eagle3():
            t.set_taps(None)
        try:
            # the recorder writes its trace when the block ends, or drops it when the block raises
            with recorder if recorder is not None else contextlib.nullcontext():
                runner = self._runner(prompt_ids, budget, sampling, gen, recorder)
                if self.backend == FAST and not s.speculative:
                    runner.chunk = 16 if stop else budget  # a stop token is looked for every 16 steps, not every step
                if recorder is not None:
                    trace_meta(recorder, s, t, prompt_ids, self.backend)
                result = decode(runner, prompt_ids, budget, max_new, stop, t.device)
        finally:
            if not self._eagle3():
                t.set_taps(taps)
        if not s.speculative:
            result.stats = None
        result.extra = dict(self.info)
        return result


__all__ = ["FAST", "REFERENCE", "DecodeSettings", "Decoder", "choose_backend", "open_trace", "trace_meta"]
