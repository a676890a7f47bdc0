"""`train --pack`: the samples of a micro-batch concatenated into rows instead of each padded to the longest.

Why: prepared conversations differ in length by an order of magnitude (a ShareGPT-like mix has a median near 600
tokens and a tail to the 4,096-token cut), and right padding computes every sample at the batch's longest length.
Packed, a micro-batch's B samples are placed into rows (first fit, longest first), each row padded only to the
longest row (from 1,024 tokens, where training takes flex attention, rounded up to a multiple of its 128-token block,
so that each TTT step's keys start on a block edge: train/attention.py). How many tokens a row holds follows the TTT
attention's cost (loop.py picks): under flex attention (a GPU, Llama-attention drafts) the cost is each document's own
(the blocks holding an allowed pair), so the whole micro-batch goes into one row and nothing but the rounding is
padding; under the dense masked form (the CPU, MLA drafts) it grows with the square of the row, so rows hold at most
--max-length tokens. A step takes the same samples as padded (the data order, the loss's per-sample weighting and
resume are unchanged); only their layout differs.

Each sample becomes a *document* of its row: its positions restart at 0 (RoPE sees what it sees alone), the target's
attention runs causally within each document (models/targets/llama.py `packed_hidden_states`; other targets run
padded and their features are moved into the packed layout), the draft's TTT attention is masked to the document
(train/ttt.py `ttt_mask`, train/attention.py `packed_ttt_block_mask`), a TTT step's input token never comes from the
next document (train/ttt.py `shift_within`: the pad id 0, as a padded sample sees past its end), and a position is
supervised at step k only if the token it predicts, k+2 positions on, is of its own document (`supervised_at`). So
every real position's logits, loss weight and gradient are those of the sample run alone (tests/test_train_pack.py).

Layout tensors (a raw batch, before make_batch moves it to the device):
    doc        [R, T] int64  the document (0..D-1, numbered in row order, so increasing along each row); -1 on padding
    positions  [R, T] int64  the position within the document (0 on padding)
    and, as Python lists: the sample index of each document, its length, and its (row, start, end) segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglescope.train.attention import BLOCK, FLEX_MIN_LENGTH

# Rows long enough for flex attention are padded to a multiple of its block (at most 127 tokens, an eighth of the
# shortest such row); shorter rows, which the dense form runs, to their longest.
ROW_MULTIPLE = BLOCK


@dataclass(frozen=True)
class Layout:
    """Where each sample of a micro-batch goes: document d is sample `order[d]`, at (row, start, start + length)."""

    rows: int
    length: int  # T: the rows' common length (a multiple of ROW_MULTIPLE from FLEX_MIN_LENGTH tokens)
    order: list[int]  # index into the micro-batch's samples, per document
    segments: list[tuple[int, int, int]]  # (row, start, end) per document

    @property
    def lengths(self) -> list[int]:
        return [b - a for _, a, b in self.segments]


def plan(lengths: list[int], capacity: int | None = None) -> Layout:
    """First fit, longest first (ties by index): samples of these lengths into rows of at most `capacity` tokens (None:
    all in one row). Deterministic; every length must be <= capacity (collate truncates to --max-length first)."""
    capacity = sum(lengths) if capacity is None else capacity
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a row of {capacity}")
    by_length = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    used: list[int] = []
    members: list[list[int]] = []
    for i in by_length:
        row = next((r for r, u in enumerate(used) if u + lengths[i] <= capacity), None)
        if row is None:
            used.append(0)
            members.append([])
            row = len(used) - 1
        members[row].append(i)
        used[row] += lengths[i]
    order, segments = [], []
    for r, ids in enumerate(members):
        start = 0
        for i in ids:
            order.append(i)
            segments.append((r, start, start + lengths[i]))
            start += lengths[i]
    longest = max(used, default=1)
    T = -(-longest // ROW_MULTIPLE) * ROW_MULTIPLE if longest >= FLEX_MIN_LENGTH else longest
    return Layout(len(members), T, order, segments)


def collate_packed(samples: list[dict[str, torch.Tensor]], max_length: int, row_tokens: int | None = -1) -> dict:
    """The packed counterpart of loop.collate: the same keys (input_ids, loss_mask, valid, aux, final_hidden), the
    samples truncated to max_length and packed into rows of at most `row_tokens` (-1: max_length; None: one row), plus
    doc, positions and the layout (see the module docstring)."""
    samples = [{k: v[:max_length] for k, v in s.items()} for s in samples]
    layout = plan([len(s["input_ids"]) for s in samples], max_length if row_tokens == -1 else row_tokens)
    R, T = layout.rows, layout.length
    out: dict = {
        "input_ids": torch.zeros(R, T, dtype=torch.long),
        "loss_mask": torch.zeros(R, T, dtype=torch.long),
        "valid": torch.zeros(R, T, dtype=torch.long),
        "doc": torch.full((R, T), -1, dtype=torch.long),
        "positions": torch.zeros(R, T, dtype=torch.long),
    }
    for key in ("aux", "final_hidden"):
        if key in samples[0]:
            ref = samples[0][key]
            out[key] = torch.zeros(R, T, ref.shape[-1], dtype=ref.dtype)
    for d, (i, (r, a, b)) in enumerate(zip(layout.order, layout.segments, strict=True)):
        s = samples[i]
        out["input_ids"][r, a:b] = s["input_ids"]
        out["loss_mask"][r, a:b] = s["loss_mask"]
        out["valid"][r, a:b] = 1
        out["doc"][r, a:b] = d
        out["positions"][r, a:b] = torch.arange(b - a)
        for key in ("aux", "final_hidden"):
            if key in s:
                out[key][r, a:b] = s[key]
    out["layout"] = layout
    return out


def to_packed(padded: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[N, L, ...] right-padded per-sample rows (sample i in row i) → [R, T, ...] in `layout` (zeros on padding).
    For a target that cannot run documents itself: it runs the padded batch and its features are moved here."""
    out = padded.new_zeros(layout.rows, layout.length, *padded.shape[2:])
    for i, (r, a, b) in zip(layout.order, layout.segments, strict=True):
        out[r, a:b] = padded[i, : b - a]
    return out


__all__ = ["Layout", "plan", "collate_packed", "to_packed", "ROW_MULTIPLE"]
