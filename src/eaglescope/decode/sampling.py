"""The target distribution: one function that vanilla sampling and speculative verification share.

Order of operations (what HF ``generate`` and vLLM do, and what a user expects):

1. temperature: ``logits / T``; ``T == 0`` means greedy, a one-hot on the argmax;
2. top-k: keep the ``k`` largest logits (exactly ``k``; ties broken by ``torch.topk``);
3. top-p (nucleus): keep the smallest set of the most likely tokens whose cumulative
   probability is ``>= p``; the most likely token is always kept;
4. renormalise.

Speculative decoding is lossless *with respect to this distribution*: verification samples
from exactly what ``process_logits`` returns, so a sampled speculative run and a sampled
vanilla run draw from the same law.
"""

from __future__ import annotations

import torch

from eaglescope.errors import EagleScopeError


def process_logits(
    logits: torch.Tensor,  # [..., V]
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:  # [..., V] float32, rows sum to 1
    if temperature < 0:
        raise EagleScopeError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 0:
        raise EagleScopeError(f"top_k must be >= 0 (0 or None disables it), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise EagleScopeError(f"top_p must be in (0, 1] (None disables it), got {top_p}")
    logits = logits.float()
    vocab = logits.shape[-1]
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).to(logits.dtype)
    logits = logits / temperature
    if top_k and top_k < vocab:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches p; the first is never dropped
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``probs [..., V]`` → LongTensor ``[...]``.

    ``generator`` must live on ``probs``' device (a CUDA generator for CUDA probs)."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator)
    return out.reshape(probs.shape[:-1])
