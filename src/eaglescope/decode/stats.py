"""Acceptance statistics for speculative decoding, with the definitions of docs/field.md §5.

- τ (accept length) = tokens emitted per target verify, bonus included = mean(accepted + 1).
  SGLang "accept len" and vLLM "Mean acceptance length" are τ; gpt-fast "Mean Accepted" is τ - 1.
- α_k (conditional) = P(accepted >= k | accepted >= k-1), over the rounds that drafted at least
  k deep (a round that only drafted 3 deep says nothing about position 4).
- accepted_per_position (vLLM-style, unconditional) = rounds with accepted >= k / all rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from eaglescope.decode.tree import DraftTree
from eaglescope.errors import EagleScopeError


class SpecStats:
    def __init__(self) -> None:
        self.accepted: list[int] = []  # accepted draft tokens per round (bonus excluded)
        self.drafted_depth: list[int] = []  # how deep each round drafted
        self.drafted_tokens: list[int] = []  # draft nodes (root excluded) each round sent to verify

    def record_round(
        self,
        drafted: DraftTree | Sequence[int] | int | None,
        accepted_len: int,
        max_depth: int | None = None,
        num_drafted: int | None = None,
    ) -> None:
        """One verify round.

        ``drafted``: the tree that was verified, or draft-node counts by depth ``[n_1, n_2, ...]``,
        or the number of draft tokens of a chain, or None. ``max_depth``: how deep the proposer
        drafted this round (default: the depth of ``drafted``). ``num_drafted``: the draft tokens sent to
        verify, when ``drafted`` is None (a static-shape round drafts the same number every time)."""
        if isinstance(drafted, DraftTree):
            depth, count = drafted.max_depth, drafted.num_nodes - 1
        elif isinstance(drafted, int):
            depth, count = drafted, drafted
        elif drafted is None:
            depth, count = (max_depth if max_depth is not None else accepted_len), num_drafted or 0
        else:
            counts = [int(c) for c in drafted]
            depth = max((k + 1 for k, c in enumerate(counts) if c > 0), default=0)
            count = sum(counts)
        if max_depth is not None:
            depth = max_depth
        if not 0 <= accepted_len <= depth:
            raise EagleScopeError(f"accepted length {accepted_len} is outside 0..{depth} (the drafted depth)")
        self.accepted.append(int(accepted_len))
        self.drafted_depth.append(int(depth))
        self.drafted_tokens.append(int(count))

    def merge(self, other: SpecStats) -> SpecStats:
        """Add ``other``'s rounds to this one (in place); returns self."""
        self.accepted += other.accepted
        self.drafted_depth += other.drafted_depth
        self.drafted_tokens += other.drafted_tokens
        return self

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def emitted_tokens(self) -> int:
        return sum(self.accepted) + self.rounds

    @property
    def accept_length(self) -> float:
        """τ: tokens per verify, bonus included (nan before any round)."""
        return self.emitted_tokens / self.rounds if self.rounds else math.nan

    @property
    def depth(self) -> int:
        return max(self.drafted_depth, default=0)

    @property
    def alpha(self) -> list[float]:
        """Conditional α_k for k = 1..depth; nan where no round reached position k."""
        out = []
        for k in range(1, self.depth + 1):
            reached = [a for a, d in zip(self.accepted, self.drafted_depth, strict=True) if d >= k and a >= k - 1]
            out.append(sum(a >= k for a in reached) / len(reached) if reached else math.nan)
        return out

    @property
    def accepted_per_position(self) -> list[float]:
        """Unconditional (vLLM): rounds with position k accepted / all rounds, k = 1..depth."""
        if not self.rounds:
            return []
        return [sum(a >= k for a in self.accepted) / self.rounds for k in range(1, self.depth + 1)]

    @property
    def histogram(self) -> list[int]:
        """``h[n]`` = rounds that accepted exactly n draft tokens, n = 0..depth."""
        h = [0] * (self.depth + 1)
        for a in self.accepted:
            h[a] += 1
        return h

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (vLLM "draft acceptance rate"; trees draft many)."""
        drafted = sum(self.drafted_tokens)
        return sum(self.accepted) / drafted if drafted else math.nan

    def to_dict(self) -> dict:
        """JSON-safe summary (nan → None)."""

        def clean(x: float) -> float | None:
            return None if math.isnan(x) else x

        alpha = self.alpha
        return {
            "rounds": self.rounds,
            "emitted_tokens": self.emitted_tokens,
            "accept_length": clean(self.accept_length),
            "alpha": [clean(a) for a in alpha],
            "accepted_per_position": self.accepted_per_position,
            "histogram": self.histogram,
            "drafted_tokens": sum(self.drafted_tokens),
            "acceptance_rate": clean(self.acceptance_rate),
            "predicted_accept_length": clean(predicted_accept_length(alpha)) if self.rounds else None,
        }


def predicted_accept_length(alpha: Sequence[float]) -> float:
    """τ predicted from conditional α: 1 + Σ_k Π_{i<=k} α_i (SpecForge's simulated_acc_len is this minus 1).

    Exact for rounds that all draft len(alpha) deep: E[accepted] = Σ_k P(accepted >= k)."""
    total, run = 1.0, 1.0
    for a in alpha:
        if run == 0.0:  # nothing gets past a zero; later α may be undefined (nan)
            break
        run *= a
        total += run
    return total


def alpha_from_unconditional(acc: Sequence[float]) -> list[float]:
    """Conditional α_k from unconditional rates: α_k = acc_k / acc_{k-1} (acc_0 = 1); nan after a 0."""
    out, prev = [], 1.0
    for a in acc:
        out.append(a / prev if prev > 0 else math.nan)
        prev = a
    return out
