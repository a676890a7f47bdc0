"""Vanilla autoregressive decoding, the reference every speculative run must reproduce: one sequence is the
speculative loop with no proposer (decode/loop.py, on either backend); several prompts at once decode in one batch
(greedy_rows: regenerating training answers, and the GPU benchmark's)."""

from __future__ import annotations

import torch

from eaglescope.decode.generation import (  # noqa: F401 - the names callers know this module by
    GenerationResult,
    SamplingConfig,
    begin_generation,
    check_prompt,
    choose_token,
)
from eaglescope.decode.loop import generate_vanilla
from eaglescope.decode.round import SlotCache
from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import Target
from eaglescope.models.targets.llama import LlamaModel, NativeTarget


@torch.inference_mode()
def greedy_batch(
    target: Target, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int] | None = None
) -> list[list[int]]:
    """Greedy continuations of several prompts in one batched decode (native targets; others loop), each cut after
    its first stop token."""
    stop = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if not isinstance(target, NativeTarget) or len(prompts) == 1:
        return [generate_vanilla(target, p, max_new_tokens, stop_ids=sorted(stop)).token_ids for p in prompts]
    dev = target.device
    B, T = len(prompts), max(len(p) for p in prompts)
    budget = min(max_new_tokens, target.max_positions - T)
    if budget < 1:
        raise EagleScopeError(f"a prompt of {T} tokens leaves no room in the target's context")
    pad = torch.tensor([T - len(p) for p in prompts], device=dev)
    ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.tensor(p, device=dev)
    out = []
    for row in greedy_rows(target.model, ids, budget, pad, stop)[:, T:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
        out.append(row[:cut])
    return out


@torch.inference_mode()
def greedy_rows(
    model: LlamaModel, ids: torch.Tensor, new: int, pad: torch.Tensor | None = None, stop: set[int] | None = None
) -> torch.Tensor:
    """The batched vanilla loop: greedy continuations of the rows of `ids` [B, T] on a slot cache → [B, T + k] (the
    prompts, then k <= `new` tokens: fewer only when every row has met a token of `stop`; rows past their stop token
    hold what followed it). `pad` [B]: each row's count of left-padding (None: none); a row's positions start at 0 at
    its first real token and pad keys are masked, so a row sees exactly what a batch-1 decode sees (up to float
    reordering). Without `stop` no step reads the device."""
    a, dev = model.args, ids.device
    B, T = ids.shape
    S = T + new
    cache = SlotCache(a.num_layers, B, a.num_kv_heads, S, a.head_dim, next(model.parameters()).dtype, dev)
    slots, every = torch.arange(T, device=dev), torch.arange(S, device=dev)
    mask = (every[None, :] <= slots[:, None])[None, None]  # [1, 1, T, S] causal
    positions = slots.expand(B, T)
    if pad is not None:
        real_key = every[None, :] >= pad[:, None]  # [B, S]
        # a fully padded query row would attend to nothing (NaN): pad queries see themselves
        mask = (mask & real_key[:, None, None, :]) | (every[None, :] == slots[:, None])[None, None]
        positions = (slots[None] - pad[:, None]).clamp_min(0)
    logits = model(ids, positions, mask, cache, slots)[0]
    seq = [ids, logits[:, -1:].argmax(-1)]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    for t in range(T, S - 1):
        if stop:
            done |= torch.tensor([tok in stop for tok in seq[-1][:, 0].tolist()], device=dev)
            if bool(done.all()):
                break
        s = torch.full((1,), t, device=dev)
        m = (every <= t)[None, None, None]
        pos = s.expand(B, 1)
        if pad is not None:
            m = m & real_key[:, None, None, :]
            pos = (t - pad)[:, None]
        logits = model(seq[-1], pos, m, cache, s)[0]
        seq.append(logits[:, -1:].argmax(-1))
    return torch.cat(seq, 1)


__all__ = [
    "GenerationResult",
    "SamplingConfig",
    "begin_generation",
    "check_prompt",
    "choose_token",
    "generate_vanilla",
    "greedy_batch",
    "greedy_rows",
]
