"""Vanilla autoregressive decoding, the reference every speculative run must reproduce: one sequence is the
speculative loop with no proposer (decode/loop.py); several prompts at once decode in one batch (greedy_batch,
for regenerating training answers)."""

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
from eaglescope.errors import EagleScopeError
from eaglescope.target.base import Target
from eaglescope.target.llama import KVCache, NativeTarget


@torch.inference_mode()
def greedy_batch(
    target: Target, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int] | None = None
) -> list[list[int]]:
    """Greedy continuations of several prompts in one batched decode (native targets; others loop).

    Prompts are left-padded; each row's positions start at 0 at its first real token and pad keys are
    masked, so a row sees exactly what a batch-1 decode sees (up to float reordering)."""
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


__all__ = [
    "GenerationResult",
    "SamplingConfig",
    "begin_generation",
    "check_prompt",
    "choose_token",
    "generate_vanilla",
    "greedy_batch",
]
