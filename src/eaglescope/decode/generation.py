"""What every decoding path shares: sampling settings, the prompt check and token budget, the first-token choice,
and the result type."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from eaglescope.decode.sampling import process_logits, sample
from eaglescope.decode.tree import parse_tree_shape
from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import Target


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise EagleScopeError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise EagleScopeError(f"top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:  # also refuses NaN
            raise EagleScopeError(f"top-p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class DecodeSettings:
    """What a decode is asked to do, read from a command's flags once (the command layer) and passed down typed."""

    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    draft: str | None = None  # an EAGLE-3 draft directory, or a draft LM's (proposer "draft-lm")
    proposer: str = "eagle3"  # eagle3 | ngram | draft-lm; none of them without a draft (vanilla), but ngram
    chain: int | None = None  # a chain of K draft tokens, or
    tree: str | None = None  # an EAGLE-2 tree "DEPTH,TOPK,TOTAL" (neither: the EAGLE default tree)
    decoder: str = "auto"  # auto (the static-shape backend on a GPU wherever it can run) | fast | reference
    batch_invariant: bool = True  # the static backend's target on the batch-invariant kernels (GPU)
    compile: bool = False  # the static backend compiles its EAGLE-3 round's draft side (once per tree budget)
    backend: str = "auto"  # how a draft LM is loaded (native or transformers)
    trace: str | None = None  # record a trace of the run into this directory
    trace_mode: str = "full"  # full | fingerprint
    trace_layers: bool = False  # the trace also gets every layer's state of the prefill
    target_dir: str | None = None  # where the target came from (a trace's provenance)

    @property
    def speculative(self) -> bool:
        return self.draft is not None or self.proposer == "ngram"

    @cached_property
    def shape(self) -> tuple[int, int, int]:
        """(depth, top_k, total_tokens) of the draft tree, parsed once."""
        return parse_tree_shape(self.chain, self.tree)

    def validate(self) -> None:
        """Every check the settings allow before any model is loaded, in one place: the command layer calls it once,
        so a bad flag is refused in one stderr line before the seconds a load takes."""
        self.sampling.validate()
        if self.max_new_tokens < 1:
            raise EagleScopeError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.proposer != "ngram" and not self.draft:
            for flag, given in (("--chain", self.chain), ("--tree", self.tree)):
                if given is not None:
                    raise EagleScopeError(f"{flag} shapes a speculative run: add --draft DIR (or --proposer ngram)")
            if self.proposer == "draft-lm":
                raise EagleScopeError("--proposer draft-lm needs --draft DIR (the draft language model)")
        _ = self.shape  # parsed here, once: a bad --chain/--tree is refused before any model is loaded
        if self.trace and not self.speculative:
            raise EagleScopeError("--trace records a speculative run: add --draft DIR (or --proposer ngram)")
        if self.trace_layers and not self.trace:
            raise EagleScopeError("--trace-layers adds to a trace: give --trace DIR too")

    def room(self, target: Target, prompt_ids: list[int]) -> int:
        """The new tokens `prompt_ids` leave room for on `target` (check_prompt), once a speculative round's drafts
        past the prompt fit the target's context too."""
        if self.speculative:
            depth = self.shape[0]
            if len(prompt_ids) + depth + 1 > target.max_positions:
                raise EagleScopeError(
                    f"a round drafts {depth} tokens past the {len(prompt_ids)}-token prompt, beyond the target's "
                    f"context of {target.max_positions}; use a shorter --chain/--tree depth or prompt"
                )
        return check_prompt(target, prompt_ids, self.max_new_tokens)

    def check_backend(self, fast: bool) -> None:
        """The fast decoder's own switches refused where another backend runs (`fast`: whether it runs)."""
        if not self.batch_invariant and not fast:
            raise EagleScopeError("--no-batch-invariant chooses the kernels of the fast decoder (a GPU, or --fast)")
        if self.compile and not fast:
            raise EagleScopeError("--compile compiles the fast decoder's round (a GPU, or --fast)")


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "eos" | "length" | "context"
    seconds: float
    stats: object | None = None  # SpecStats for speculative runs
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


def check_prompt(target: Target, prompt_ids: list[int], max_new_tokens: int) -> int:
    """Validate the prompt against the target; return how many tokens may be generated."""
    if not prompt_ids:
        raise EagleScopeError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise EagleScopeError(f"prompt token id {bad[0]} is outside the target vocabulary (size {target.vocab_size})")
    if len(prompt_ids) >= target.max_positions:
        raise EagleScopeError(
            f"the prompt has {len(prompt_ids)} tokens but the target's context is {target.max_positions}"
        )
    if max_new_tokens < 1:
        raise EagleScopeError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    return min(max_new_tokens, target.max_positions - len(prompt_ids))


def stop_ids_for(target: Target, extra: list[int]) -> list[int]:
    """The target's end-of-sequence tokens and `extra` (--stop-ids), each inside its vocabulary."""
    outside = [i for i in extra if i >= target.vocab_size]
    if outside:
        raise EagleScopeError(f"--stop-ids {outside[0]} is outside the target vocabulary (size {target.vocab_size})")
    return list(target.eos_token_ids) + extra


def choose_token(logits: torch.Tensor, sampling: SamplingConfig, gen: torch.Generator | None) -> int:
    """Next token from one row of target logits: argmax when greedy, else a draw from the processed distribution."""
    if sampling.greedy:
        return int(logits.argmax())
    probs = process_logits(logits.float(), sampling.temperature, sampling.top_k, sampling.top_p)
    return int(sample(probs, gen))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def begin_generation(
    target: Target,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None,
    stop_ids: list[int] | None,
) -> tuple[SamplingConfig, int, set[int], torch.Generator | None]:
    """What every decoding loop checks and sets up first: sampling, token budget, stop set, generator."""
    sampling = sampling or SamplingConfig()
    sampling.validate()
    budget = check_prompt(target, prompt_ids, max_new_tokens)
    stop = set(target.eos_token_ids if stop_ids is None else stop_ids)
    return sampling, budget, stop, sampling.generator(target.device)


__all__ = [
    "DecodeSettings",
    "SamplingConfig",
    "GenerationResult",
    "check_prompt",
    "stop_ids_for",
    "begin_generation",
    "choose_token",
    "sync",
]
