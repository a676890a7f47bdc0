"""Training-time test (TTT): the draft unrolled on its own outputs, exactly as decoding runs it.

Alignment (docs/field.md §3). The target's features at position t (context up to token t) are paired
with the embedding of token t+1 and predict token t+2. Step k of the unroll, at position t:

    token   = ids[t + k + 1]            (ground truth shifted by k+1)
    hidden  = fc(aux[t]) if k == 0 else the step k-1 pre-norm output at t
    RoPE    = t + k
    teacher = the target's distribution at position t + k + 1 (it predicts token t + k + 2)
    keys    = step-0 keys at 0..t (causal) + the keys of steps 1..k at t only (a diagonal)

That is what the decoding loop computes at chain depth k+1 for the prefix ending at t, so the
train/decode equality test can compare logits exactly.

Loss mask decision: the mask *shifts with the prediction*: step k at position t is supervised iff
token t+k+2 (the token being predicted) is supervised (an assistant token). The official code and
SpecForge use loss_mask[t] unshifted, which also trains on predicting the user turn that follows
an answer and skips the last assistant tokens (SpecForge issue 885). The contract records this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglescope.draft import Eagle3Draft
from eaglescope.target.llama import GrowingCache

LOSS_MASK_SHIFT = "shifted"  # recorded in the draft contract
STEP_WEIGHT = 0.8  # L = Σ_k 0.8^k · L_k


def shift_left(x: torch.Tensor, n: int, fill: int | float | bool = 0) -> torch.Tensor:
    """x[:, t] ← x[:, t + n], padded with `fill` at the end. Works on [B, T, ...]."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_mask(T: int, k: int, device) -> torch.Tensor:
    """[1, 1, T, (k+1)·T] bool: causal over step-0 keys, then the diagonal of each later step."""
    blocks = [torch.ones(T, T, dtype=torch.bool, device=device).tril()]
    eye = torch.eye(T, dtype=torch.bool, device=device)
    blocks += [eye] * k
    return torch.cat(blocks, dim=1)[None, None]


@dataclass
class Unrolled:
    logits: list[torch.Tensor]  # per step: [B, T, Vd] draft logits at each position
    hidden_out: list[torch.Tensor]  # per step: [B, T, H] pre-norm outputs


def ttt_unroll(draft: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, ttt_length: int) -> Unrolled:
    """Run `ttt_length` draft steps over a batch. input_ids [B, T] (target ids), aux [B, T, nH]."""
    B, T = input_ids.shape
    device = input_ids.device
    cache = GrowingCache()
    hidden = draft.project(aux)
    base_pos = torch.arange(T, device=device).expand(B, T)
    logits, outs = [], []
    for k in range(ttt_length):
        embeds = draft.embed_tokens(shift_left(input_ids, k + 1))
        out = draft.step(embeds, hidden, base_pos + k, cache, k * T, ttt_mask(T, k, device))
        logits.append(draft.logits(out))
        outs.append(out)
        hidden = out
    return Unrolled(logits, outs)


@dataclass
class TTTLoss:
    loss: torch.Tensor  # scalar: Σ_k 0.8^k · L_k
    step_loss: list[float]
    step_acc: list[float]  # teacher-forced, unconditional: draft argmax == target argmax
    step_count: list[int]  # supervised positions per step


def draft_vocab_ids(draft: Eagle3Draft) -> torch.Tensor:
    """Target ids of the draft vocabulary, in draft-id order."""
    return torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device) + draft.d2t


def ttt_loss(
    draft: Eagle3Draft,
    unrolled: Unrolled,
    target_logits: torch.Tensor,  # [B, T, V] the target's logits at every position
    loss_mask: torch.Tensor,  # [B, T] 1 where the token is supervised (assistant)
    valid: torch.Tensor | None = None,  # [B, T] 1 on real (non-pad) tokens
    per_sample: bool = False,
) -> TTTLoss:
    """Σ_k 0.8^k · L_k. L_k averages over supervised positions of the batch, or with `per_sample`, over
    samples of each sample's own mean (so a batch split across processes weighs data exactly as one
    process would; then step_loss is the mean over samples too)."""
    vocab_ids = draft_vocab_ids(draft)
    target_argmax = target_logits.argmax(-1)  # [B, T]
    in_vocab = draft.t2d[target_argmax]
    # Teacher: the target's distribution restricted to the draft vocabulary and renormalised.
    teacher = torch.softmax(target_logits.float().index_select(-1, vocab_ids), dim=-1)
    mask = loss_mask.bool()
    if valid is not None:
        mask = mask & valid.bool()
    total = target_logits.new_zeros((), dtype=torch.float32)
    step_loss, step_acc, step_count = [], [], []
    for k, logits in enumerate(unrolled.logits):
        # position t at step k predicts token t+k+2 from the target's distribution at t+k+1
        p = shift_left(teacher, k + 1)
        supervised = shift_left(mask, k + 2, False)
        trainable = supervised & shift_left(in_vocab, k + 1, False)
        logq = torch.log_softmax(logits.float(), dim=-1)
        ce = -(p * logq).sum(-1)
        if per_sample:
            lk = ((ce * trainable).sum(-1) / trainable.sum(-1).clamp_min(1)).mean()
        else:
            lk = (ce * trainable).sum() / trainable.sum().clamp_min(1)
        total = total + (STEP_WEIGHT**k) * lk
        pred = vocab_ids[logits.argmax(-1)]
        hit = (pred == shift_left(target_argmax, k + 1)) & supervised
        ns = int(supervised.sum())
        step_loss.append(float(lk.detach()))
        step_acc.append(float(hit.sum()) / ns if ns else float("nan"))
        step_count.append(ns)
    return TTTLoss(total, step_loss, step_acc, step_count)
