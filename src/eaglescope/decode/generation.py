"""What every decoding path shares: sampling settings, the prompt check and token budget, the first-token choice,
and the result type."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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

    @property
    def shape(self) -> tuple[int, int, int]:
        """(depth, top_k, total_tokens) of the draft tree."""
        return parse_tree_shape(self.chain, self.tree)


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
    "begin_generation",
    "choose_token",
    "sync",
]
