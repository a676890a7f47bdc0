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
        # work on the k survivors only: topk returns them sorted, so nucleus needs no full-vocab sort
        vals, idx = logits.topk(top_k, dim=-1)
        return torch.zeros_like(logits).scatter_(-1, idx, _nucleus(torch.softmax(vals, dim=-1), top_p))
    probs = torch.softmax(logits, dim=-1)
    if top_p is None or top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    return torch.zeros_like(probs).scatter_(-1, order, _nucleus(sorted_p, top_p))


def _nucleus(sorted_p: torch.Tensor, top_p: float | None) -> torch.Tensor:
    """Top-p on probabilities sorted in descending order; returns them renormalised (same order)."""
    if top_p is None or top_p >= 1.0:
        return sorted_p
    # drop a token when the mass strictly before it already reaches p; the first is never dropped
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    drop[..., 0] = False
    kept = sorted_p.masked_fill(drop, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``probs [..., V]`` → LongTensor ``[...]``.

    ``generator`` must live on ``probs``' device (a CUDA generator for CUDA probs)."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator)
    return out.reshape(probs.shape[:-1])
