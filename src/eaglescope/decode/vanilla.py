"""Vanilla autoregressive decoding: the reference every speculative run must reproduce."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from eaglescope.decode.sampling import process_logits, sample
from eaglescope.errors import EagleScopeError
from eaglescope.target.base import Target


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


def _sync(device: torch.device) -> None:
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


def generate_vanilla(
    target: Target,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_ids: list[int] | None = None,
) -> GenerationResult:
    sampling, budget, stop, gen = begin_generation(target, prompt_ids, max_new_tokens, sampling, stop_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    target.reset(len(prompt_ids) + budget)
    out = target.forward(torch.tensor(prompt_ids, device=target.device))
    target.commit()
    tokens: list[int] = []
    reason = "length" if budget == max_new_tokens else "context"
    while True:
        tok = choose_token(out.logits[-1], sampling, gen)
        tokens.append(tok)
        if tok in stop:
            reason = "eos"
            break
        if len(tokens) >= budget:
            break
        out = target.forward(torch.tensor([tok], device=target.device))
        target.commit()
    _sync(target.device)
    return GenerationResult(list(prompt_ids), tokens, reason, time.perf_counter() - t0)


@torch.inference_mode()
def greedy_batch(
    target: Target, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int] | None = None
) -> list[list[int]]:
    """Greedy continuations of several prompts in one batched decode (native targets; others loop).

    Prompts are left-padded; each row's positions start at 0 at its first real token and pad keys are
    masked, so a row sees exactly what a batch-1 decode sees (up to float reordering)."""
    from eaglescope.target.llama import KVCache, NativeTarget

    stop = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if not isinstance(target, NativeTarget) or len(prompts) == 1:
        return [generate_vanilla(target, p, max_new_tokens, stop_ids=sorted(stop)).token_ids for p in prompts]
    a, dev = target.args, target.device
    B, T = len(prompts), max(len(p) for p in prompts)
    budget = min(max_new_tokens, target.max_positions - T)
    if budget < 1:
        raise EagleScopeError(f"a prompt of {T} tokens leaves no room in the target's context")
    pad = torch.tensor([T - len(p) for p in prompts], device=dev)
    ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.tensor(p, device=dev)
    S = T + budget
    cache = KVCache(a.num_layers, B, a.num_kv_heads, S, a.head_dim, target.dtype, dev)
    slots = torch.arange(S, device=dev)
    real_key = slots[None, :] >= pad[:, None]  # [B, S]
    positions = (torch.arange(T, device=dev)[None] - pad[:, None]).clamp_min(0)
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    mask = causal[None] & real_key[:, None, :T]
    # A fully padded query row would attend to nothing (NaN); let pad queries see themselves.
    mask |= torch.eye(T, dtype=torch.bool, device=dev)[None]
    logits, _, _ = target.model(ids, positions, mask[:, None], cache, 0)
    out = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    nxt = logits[:, -1].argmax(-1)
    for step in range(budget):
        for i in range(B):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= torch.tensor([t in stop for t in nxt.tolist()], device=dev)
        if bool(done.all()) or step == budget - 1:
            break
        pos = (T + step - pad)[:, None]
        step_mask = real_key[:, None, None, : T + step + 1]
        logits, _, _ = target.model(nxt[:, None], pos, step_mask, cache, T + step)
        nxt = logits[:, -1].argmax(-1)
    return out
