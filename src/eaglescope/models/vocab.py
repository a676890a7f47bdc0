"""The reduced draft vocabulary (docs/field.md §2).

The draft's lm_head predicts N of the target's V tokens: the N most frequent *supervised*
(loss-masked, assistant) tokens of the training data, sorted by target id.
  d2t [N] int64: offsets, target_id = draft_id + d2t[draft_id] (the checkpoint convention)
  t2d [V] bool : True where a target id has a draft id
Ties in frequency go to the lower target id. That same rule fills the map when fewer than N
tokens were ever seen: zero-count ids all tie, so the lowest unseen ids are taken. The map is
therefore a pure function of the counts, and N == V gives the identity map.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from eaglescope.errors import EagleScopeError


def count_tokens(sequences: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64 counts of the loss-masked tokens of (input_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for k, (ids, mask) in enumerate(sequences):
        if len(ids) != len(mask):
            raise EagleScopeError(f"sequence {k}: {len(ids)} token ids but {len(mask)} loss-mask entries.")
        ids_t = torch.as_tensor(ids, dtype=torch.int64)
        kept = ids_t[torch.as_tensor(mask, dtype=torch.bool)]
        if kept.numel() and (kept.min() < 0 or kept.max() >= vocab_size):
            raise EagleScopeError(f"sequence {k}: token id out of range for a vocabulary of {vocab_size}.")
        counts += torch.bincount(kept, minlength=vocab_size)
    return counts


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-N target ids by count (ties → lower id), sorted by id → (d2t [N] int64 offsets, t2d [V] bool)."""
    if token_counts.dim() != 1 or token_counts.dtype.is_floating_point or token_counts.dtype == torch.bool:
        raise EagleScopeError("token counts must be a 1-D integer tensor over the target vocabulary.")
    if (token_counts < 0).any():
        raise EagleScopeError("token counts must be non-negative.")
    vocab = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise EagleScopeError(f"draft vocab size {draft_vocab_size} must be between 1 and the target's {vocab}.")
    # A stable descending sort keeps equal counts in ascending id order: the tie rule.
    order = torch.sort(token_counts.to(torch.int64), descending=True, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def validate_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, target_vocab_size: int, draft_vocab_size: int) -> None:
    """Raise EagleScopeError unless (d2t, t2d) is a consistent map of draft_vocab_size ids into the target's."""
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (draft_vocab_size,):
        raise EagleScopeError(f"d2t must be int64 of shape [{draft_vocab_size}], got {d2t.dtype} {list(d2t.shape)}.")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (target_vocab_size,):
        raise EagleScopeError(f"t2d must be bool of shape [{target_vocab_size}], got {t2d.dtype} {list(t2d.shape)}.")
    target = d2t.cpu() + torch.arange(draft_vocab_size)
    if draft_vocab_size and (target.min() < 0 or target.max() >= target_vocab_size):
        raise EagleScopeError("d2t maps a draft id outside the target vocabulary (d2t must hold offsets).")
    if (target[1:] <= target[:-1]).any():
        raise EagleScopeError("d2t target ids are not strictly increasing (map unsorted or duplicated).")
    n = int(t2d.sum())
    if n != draft_vocab_size:
        raise EagleScopeError(f"t2d marks {n} target ids but the draft vocabulary has {draft_vocab_size}.")
    if not t2d.cpu()[target].all():
        raise EagleScopeError("t2d disagrees with d2t about which target ids are in the draft vocabulary.")


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of draft ids (any shape)."""
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft ids, in_vocab mask) of target ids (any shape). Out-of-vocab ids get draft id -1 so that
    using one as an index without checking the mask fails loudly in gather/embedding."""
    in_vocab = t2d[target_ids]
    rank = torch.cumsum(t2d.to(torch.int64), 0) - 1  # draft id of each in-vocab target id
    return torch.where(in_vocab, rank[target_ids], torch.full_like(target_ids, -1)), in_vocab
