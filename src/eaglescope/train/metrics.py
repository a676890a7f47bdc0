"""Held-out metrics for a draft, in the units decoding reports (docs/field.md §5).

Indexing: TTT step k = 0..K-1 drafts token k+1 of a round, so `acc[k]` is acc_k of step k and
`alpha[k]` is α_{k+1} (decode.stats numbers α from 1).

- acc_k (teacher-forced, *unconditional*): over positions where step k is supervised, how often
  the draft's argmax at step k equals the target's argmax. Step k still sees the ground-truth
  tokens, so a position counts as a hit even when an earlier step missed; that is why a training
  acc of 0.9 can coexist with a served accept length of 1.5 (EAGLE issues 191, 264).
- α_k (conditional) = P(hit_k | hit_1 … hit_{k-1}) over positions where steps 1..k are all
  supervised, counted from the per-position hit matrix [positions, K], never from the averages:
  the averages lose which positions hit, and hits are strongly correlated across steps. When the
  data are the target's own greedy outputs (prepare --regenerate), ground-truth token t+k+1 *is*
  the target's argmax, so along a run of hits the teacher-forced inputs are exactly the tokens a
  greedy chain would have drafted and α_k is the chain's acceptance at depth k.
- predicted accept length τ = 1 + Σ_k Π_{i≤k} α_i (decode.stats.predicted_accept_length).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from eaglescope.decode.stats import alpha_from_unconditional
from eaglescope.decode.stats import predicted_accept_length as _predicted_accept_length
from eaglescope.models.draft import Eagle3Draft
from eaglescope.train.ttt import Teacher, draft_vocab_ids, shift_left, supervised_at, ttt_loss, ttt_unroll


@dataclass
class Batch:
    """One padded training/eval batch (right padding), or a packed one (train/packing.py: several samples per row,
    `doc` and `positions` set). All tensors on the draft's device."""

    input_ids: torch.Tensor  # [B, T] int64 target ids
    loss_mask: torch.Tensor  # [B, T] 1 on supervised (assistant) tokens
    valid: torch.Tensor  # [B, T] 1 on real tokens, 0 on padding
    aux: torch.Tensor  # [B, T, nH] the target's concatenated taps
    teacher: Teacher  # the target's logits over the draft vocabulary and its argmax (train.ttt)
    doc: torch.Tensor | None = None  # [B, T] packed: each position's document (a sample), -1 on padding
    positions: torch.Tensor | None = None  # [B, T] packed: the position within the document
    doc_lengths: list[int] | None = None  # packed: each document's length

    def lengths(self) -> list[int]:
        """The samples' lengths (real tokens each): what the speed report counts FLOPs of."""
        return self.doc_lengths if self.doc_lengths is not None else [int(n) for n in self.valid.sum(-1).tolist()]


def acceptance_from_acc(acc: list[float]) -> list[float]:
    """α from unconditional acc_k alone: α_k ≈ acc_k / acc_{k-1}.

    Exact only if hits are nested (a hit at step k implies hits at every earlier step). Use it when
    only averages exist (a training log); `acceptance_from_hits` is the real estimate."""
    return alpha_from_unconditional(acc)


def acceptance_from_hits(hits: torch.Tensor, supervised: torch.Tensor) -> tuple[list[float], list[int], list[int]]:
    """Conditional α from a hit matrix. hits, supervised: [N, K] bool (positions × TTT steps).

    → (alpha, accepted, reached): reached[k] = positions with steps 0..k supervised and steps < k
    all hits; accepted[k] = those that also hit at step k; alpha[k] = accepted/reached (nan if 0)."""
    counts = hit_counts(hits, supervised)
    return _alpha(counts["accepted"], counts["reached"]), counts["accepted"], counts["reached"]


def hit_counts(hits: torch.Tensor, supervised: torch.Tensor) -> dict[str, list[int]]:
    """Additive counts (so batches and ranks can be summed) behind acc_k and α_k."""
    hits, supervised = hits.bool(), supervised.bool()
    K = hits.shape[-1]
    all_sup = supervised.cumprod(-1).bool()  # steps 0..k all supervised
    prior = torch.ones_like(hits)
    prior[..., 1:] = hits[..., :-1].cumprod(-1).bool()  # steps < k all hit
    reached = all_sup & prior
    return {
        "hits": [int((hits[..., k] & supervised[..., k]).sum()) for k in range(K)],
        "supervised": [int(supervised[..., k].sum()) for k in range(K)],
        "reached": [int(reached[..., k].sum()) for k in range(K)],
        "accepted": [int((reached[..., k] & hits[..., k]).sum()) for k in range(K)],
    }


def _alpha(accepted: list[int], reached: list[int]) -> list[float]:
    return [a / r if r else math.nan for a, r in zip(accepted, reached, strict=True)]


def predicted_accept_length(alpha: list[float]) -> float:
    """τ (bonus token included) a chain drafting len(alpha) deep would reach with these α.
    An undefined α (no position reached that depth) ends the chain there."""
    defined = []
    for a in alpha:
        if a is None or math.isnan(a):
            break
        defined.append(a)
    return _predicted_accept_length(defined)


def step_hits(draft: Eagle3Draft, logits: list[torch.Tensor], batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position hits and supervision, [B, T, K] bool each, aligned exactly as ttt_loss aligns them."""
    vocab_ids = draft_vocab_ids(draft)
    target_argmax = batch.teacher.argmax
    mask = batch.loss_mask.bool() & batch.valid.bool()
    hits, sup = [], []
    for k, lg in enumerate(logits):
        supervised = supervised_at(mask, k, batch.doc)
        pred = vocab_ids[lg.argmax(-1)]
        hits.append((pred == shift_left(target_argmax, k + 1)) & supervised)
        sup.append(supervised)
    return torch.stack(hits, -1), torch.stack(sup, -1)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(
    draft: Eagle3Draft,
    batches: Iterable[Batch],
    ttt_length: int,
    autocast_dtype: torch.dtype | None = None,
    attention: str = "dense",
) -> dict:
    """Teacher-forced metrics over `batches`: acc (unconditional, per step), alpha (conditional),
    predicted_accept_length, loss (per-step soft CE, weighted by supervised positions), counts. `attention`: as
    ttt_unroll takes it."""
    was_training = draft.training
    draft.eval()
    totals: dict[str, list[int]] = {}
    loss_sum = [0.0] * ttt_length
    loss_n = [0] * ttt_length
    try:
        for batch in batches:
            with _autocast(batch.input_ids.device, autocast_dtype):
                unrolled = ttt_unroll(draft, batch.input_ids, batch.aux, ttt_length, attention, None, batch.positions,
                                      batch.doc)  # fmt: skip
            res = ttt_loss(draft, unrolled, batch.teacher, batch.loss_mask, batch.valid, doc=batch.doc)
            hits, sup = step_hits(draft, unrolled.logits, batch)
            for key, vals in hit_counts(hits.flatten(0, 1), sup.flatten(0, 1)).items():
                totals[key] = [a + b for a, b in zip(totals.get(key, [0] * ttt_length), vals, strict=True)]
            for k in range(ttt_length):
                if res.step_count[k]:
                    loss_sum[k] += res.step_loss[k] * res.step_count[k]
                    loss_n[k] += res.step_count[k]
    finally:
        draft.train(was_training)
    if not totals:
        totals = {key: [0] * ttt_length for key in ("hits", "supervised", "reached", "accepted")}
    acc = _alpha(totals["hits"], totals["supervised"])
    alpha = _alpha(totals["accepted"], totals["reached"])
    return {
        "acc": acc,
        "alpha": alpha,
        "predicted_accept_length": predicted_accept_length(alpha),
        "loss": [s / n if n else math.nan for s, n in zip(loss_sum, loss_n, strict=True)],
        "supervised_positions": totals["supervised"],
        "reached": totals["reached"],
        "accepted": totals["accepted"],
    }


def format_report(m: dict) -> str:
    """One line: acc_k, α_k and predicted τ."""

    def fmt(xs):
        return " ".join("-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}" for x in xs)

    return f"acc_k [{fmt(m['acc'])}]  alpha_k [{fmt(m['alpha'])}]  predicted tau {m['predicted_accept_length']:.3f}"
