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

from eaglescope.models.draft import Eagle3Draft
from eaglescope.models.targets.llama import GrowingCache
from eaglescope.train.attention import resolve, ttt_attention
from eaglescope.train.loss_kernels import kernels_available, soft_ce_backward, soft_ce_forward

LOSS_MASK_SHIFT = "shifted"  # recorded in the draft contract
STEP_WEIGHT = 0.8  # L = Σ_k 0.8^k · L_k


def shift_left(x: torch.Tensor, n: int, fill: int | float | bool = 0) -> torch.Tensor:
    """x[:, t] ← x[:, t + n], padded with `fill` at the end. Works on [B, T, ...]."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def shift_within(ids: torch.Tensor, n: int, doc: torch.Tensor | None) -> torch.Tensor:
    """shift_left(ids, n) where position t + n is of t's document, else 0: a packed row (train/packing.py) gives a
    position near its document's end the pad id, as a padded sample's end sees, never the next document's token."""
    shifted = shift_left(ids, n)
    if doc is None or n == 0:
        return shifted
    return shifted.masked_fill(shift_left(doc, n, -1) != doc, 0)


def supervised_at(mask: torch.Tensor, k: int, doc: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: step k at position t is supervised iff token t+k+2 (the one it predicts) is, and, in a packed row,
    is of t's document (the teacher at t+k+1 is then of it too)."""
    supervised = shift_left(mask, k + 2, False)
    if doc is not None:
        supervised = supervised & (shift_left(doc, k + 2, -1) == doc)
    return supervised


def ttt_mask(T: int, k: int, device, doc: torch.Tensor | None = None) -> torch.Tensor:
    """[1, 1, T, (k+1)·T] bool: causal over step-0 keys, then the diagonal of each later step. With doc [B, T] (a
    packed batch) [B, 1, T, (k+1)·T]: the step-0 keys of the query's own document only."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    if doc is None:
        return torch.cat([causal] + [eye] * k, dim=1)[None, None]
    B = doc.shape[0]
    first = causal[None] & (doc[:, :, None] == doc[:, None, :])
    return torch.cat([first] + [eye.expand(B, T, T)] * k, dim=2)[:, None]


@dataclass
class Unrolled:
    logits: list[torch.Tensor]  # per step: [B, T, Vd] draft logits at each position
    hidden_out: list[torch.Tensor]  # per step: [B, T, H] pre-norm outputs


def ttt_unroll(
    draft: Eagle3Draft,
    input_ids: torch.Tensor,
    aux: torch.Tensor | None,
    ttt_length: int,
    attention: str = "dense",
    projected: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    doc: torch.Tensor | None = None,
) -> Unrolled:
    """Run `ttt_length` draft steps over a batch. input_ids [B, T] (target ids), aux [B, T, nH]. `attention`: "dense"
    (SDPA under ttt_mask, what decoding's masked attention computes), "flex" (the same function over the
    block-sparse key set, train/attention.py) or "auto" (flex for long batches: attention.resolve). `projected`
    [B, T, H]: step 0's features already through fc (draft.project), in place of aux: the wiring search
    (detective/wiring.py) sums per-segment projections it computed once. `positions` and `doc` [B, T]: a packed batch
    (train/packing.py): each row holds several documents, positions restart in each, and no step's attention or input
    token crosses a document's edge."""
    B, T = input_ids.shape
    attention = resolve(attention, T)
    device = input_ids.device
    cache = GrowingCache()
    hidden = draft.project(aux) if projected is None else projected
    base_pos = torch.arange(T, device=device).expand(B, T) if positions is None else positions
    logits, outs = [], []
    with ttt_attention(draft, attention, doc):
        for k in range(ttt_length):
            embeds = draft.embed_tokens(shift_within(input_ids, k + 1, doc))
            mask = ttt_mask(T, k, device, doc) if attention == "dense" else None
            out = draft.step(embeds, hidden, base_pos + k, cache, k * T, mask)
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


# Rows per chunk of a vocabulary-wide float32 temporary: CHUNK_ELEMENTS / vocabulary (2,097 rows of a 32,000-token
# draft vocabulary, 256 MB each), so no [B, T, V] float32 tensor ever exists at once.
CHUNK_ELEMENTS = 1 << 26


# The target head's chunks are 4 times larger: they hold the model's dtype only (bf16 on a GPU: 0.5 GB at 2,092 rows
# of 128,256), and at the loss's 523 rows the head's product ran at 640 TFLOP/s, at 2,092 at 705 (8B shape, H200).
HEAD_CHUNK_FACTOR = 4


def chunk_rows(width: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, width))


@dataclass
class Teacher:
    """What the loss needs of the target, and no more. The full-vocabulary logits are not kept: at a 128,256-token
    vocabulary they are 0.5 GB per 2,048-token sample in bf16 (1 GB in float32); the restriction to the draft
    vocabulary is what the soft cross-entropy reads, and the argmax over the whole vocabulary decides which positions
    can be trained and which draft token is a hit."""

    logits: torch.Tensor  # [B, T, Vd] the target's logits at the draft vocabulary's target ids (its own dtype)
    argmax: torch.Tensor  # [B, T] int64: the target's argmax over its whole vocabulary (a target id)


def teacher_of(vocab_ids: torch.Tensor, target_logits: torch.Tensor) -> Teacher:
    """Teacher from the target's full logits [B, T, V] (vocab_ids: draft_vocab_ids)."""
    return Teacher(target_logits.index_select(-1, vocab_ids.to(target_logits.device)), target_logits.argmax(-1))


def teacher_from_head(head, final_hidden: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> Teacher:
    """Teacher from the target's final normed state [B, T, H] through its output head (`head`: rows [n, H] → logits
    [n, V]), a few thousand rows at a time, so the full-vocabulary logits exist one chunk at a time."""
    B, T, H = final_hidden.shape
    rows = final_hidden.reshape(B * T, H)
    vocab_ids = vocab_ids.to(final_hidden.device)
    logits = argmax = None
    n = chunk_rows(vocab_size) * HEAD_CHUNK_FACTOR
    for a in range(0, B * T, n):
        full = head(rows[a : a + n])  # [n, V]
        if logits is None:  # allocated here, outside any inference mode `head` runs under: autograd may save them
            logits = torch.empty(B * T, vocab_ids.numel(), dtype=full.dtype, device=full.device)
            argmax = torch.empty(B * T, dtype=torch.long, device=full.device)
        logits[a : a + n] = full.index_select(-1, vocab_ids)
        argmax[a : a + n] = full.argmax(-1)
    return Teacher(logits.reshape(B, T, -1), argmax.reshape(B, T))


def _chunk_loss(z: torch.Tensor, teacher: torch.Tensor, src: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_r w_r · H(softmax(teacher[src_r]), softmax(z_r)) over a chunk of rows, in float32."""
    p = torch.softmax(teacher.index_select(0, src).float(), -1)
    return (-(p * torch.log_softmax(z.float(), -1)).sum(-1) * w).sum()


def _chunk_grad(z: torch.Tensor, teacher: torch.Tensor, src: torch.Tensor, wg: torch.Tensor) -> torch.Tensor:
    """d/dz of _chunk_loss scaled by the incoming gradient (wg = w · grad): d/dz of -Σ p log softmax(z) =
    softmax(z) · Σp - p, in float32, returned in z's dtype."""
    p = torch.softmax(teacher.index_select(0, src).float(), -1)
    g = torch.softmax(z.float(), -1) * p.sum(-1, keepdim=True) - p
    return (g * wg[:, None]).to(z.dtype)


class _SoftCrossEntropy(torch.autograd.Function):
    """Σ_r w_r · H(p_r, q_r): q_r = softmax(logits[r]), p_r = softmax(teacher[r + shift]) (the teacher row `shift`
    positions later, clamped at the end where w is 0), in float32. On a GPU one Triton kernel per direction reads each
    row once (train/loss_kernels.py); elsewhere the torch form above runs a chunk of rows at a time. Either way the
    backward keeps only the inputs (which the training step holds anyway; the kernels add two floats a row) and
    recomputes both softmaxes; the dense form instead kept log q and the shifted p in float32, 2 × 4 × Vd bytes per
    position and TTT step."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, shift: int) -> torch.Tensor:
        ctx.shift = shift
        if kernels_available(logits.device):
            total, lse_z, lse_t = soft_ce_forward(logits, teacher, weight, shift)
            ctx.save_for_backward(logits, teacher, weight, lse_z, lse_t)
            return total
        ctx.save_for_backward(logits, teacher, weight)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows, src in _chunks(logits, shift):
            total = total + _chunk_loss(logits[rows], teacher, src, weight[rows])
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, teacher, weight, *lse = ctx.saved_tensors
        if lse:
            return soft_ce_backward(logits, teacher, weight, ctx.shift, grad, *lse), None, None, None
        out = torch.empty_like(logits)
        for rows, src in _chunks(logits, ctx.shift):
            out[rows] = _chunk_grad(logits[rows], teacher, src, weight[rows] * grad)
        return out, None, None, None


def _chunks(logits: torch.Tensor, shift: int):
    """(row slice, the teacher rows `shift` later, clamped) over [N, Vd] logits."""
    N = logits.shape[0]
    step = chunk_rows(logits.shape[1])
    for a in range(0, N, step):
        rows = slice(a, min(N, a + step))
        yield rows, torch.arange(rows.start, rows.stop, device=logits.device).add_(shift).clamp_(max=N - 1)


def soft_cross_entropy(logits: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, shift: int) -> torch.Tensor:
    """Σ_{b,t} weight[b, t] · H(softmax(teacher[b, t + shift]), softmax(logits[b, t])), logits and teacher [B, T, Vd],
    weight [B, T] float32 (0 wherever t + shift runs past the sample)."""
    B, T, Vd = logits.shape
    flat = logits.reshape(B * T, Vd), teacher.reshape(B * T, Vd), weight.reshape(-1)
    return _SoftCrossEntropy.apply(*flat, shift)


def _per_document(x: torch.Tensor, doc: torch.Tensor, num_docs: int) -> torch.Tensor:
    """[B, T]: at each position, the sum of x over its document, at least 1 (x is 0 on padding, document -1)."""
    d = doc.clamp_min(0)
    sums = torch.zeros(num_docs, dtype=x.dtype, device=x.device).index_add_(0, d.reshape(-1), x.reshape(-1))
    return sums.clamp_min(1)[d]


def ttt_loss(
    draft: Eagle3Draft,
    unrolled: Unrolled,
    teacher: Teacher | torch.Tensor,  # or the target's logits [B, T, V] at every position
    loss_mask: torch.Tensor,  # [B, T] 1 where the token is supervised (assistant)
    valid: torch.Tensor | None = None,  # [B, T] 1 on real (non-pad) tokens
    per_sample: bool = False,
    doc: torch.Tensor | None = None,  # [B, T] a packed batch's documents (train/packing.py): each is a sample
) -> TTTLoss:
    """Σ_k 0.8^k · L_k. L_k averages over supervised positions of the batch, or with `per_sample`, over
    samples of each sample's own mean (so a batch split across processes weighs data exactly as one
    process would; then step_loss is the mean over samples too). In a packed batch the samples are its documents."""
    vocab_ids = draft_vocab_ids(draft)
    if isinstance(teacher, torch.Tensor):
        teacher = teacher_of(vocab_ids, teacher)
    # Teacher: the target's distribution restricted to the draft vocabulary and renormalised (soft_cross_entropy).
    in_vocab = draft.t2d[teacher.argmax]
    mask = loss_mask.bool()
    if valid is not None:
        mask = mask & valid.bool()
    total = torch.zeros((), dtype=torch.float32, device=teacher.logits.device)
    step_loss, step_acc, step_count = [], [], []
    num_docs = int(doc.max()) + 1 if doc is not None else 0  # documents are 0..D-1, padding -1
    for k, logits in enumerate(unrolled.logits):
        # position t at step k predicts token t+k+2 from the target's distribution at t+k+1
        supervised = supervised_at(mask, k, doc)
        trainable = (supervised & shift_left(in_vocab, k + 1, False)).float()
        if per_sample and doc is not None:
            weight = trainable / (_per_document(trainable, doc, num_docs) * num_docs)
        elif per_sample:
            weight = trainable / (trainable.sum(-1, keepdim=True).clamp_min(1) * trainable.shape[0])
        else:
            weight = trainable / trainable.sum().clamp_min(1)
        lk = soft_cross_entropy(logits, teacher.logits, weight, k + 1)
        total = total + (STEP_WEIGHT**k) * lk
        with torch.no_grad():
            pred = vocab_ids[logits.argmax(-1)]
            hit = (pred == shift_left(teacher.argmax, k + 1)) & supervised
        ns = int(supervised.sum())
        step_loss.append(float(lk.detach()))
        step_acc.append(float(hit.sum()) / ns if ns else float("nan"))
        step_count.append(ns)
    return TTTLoss(total, step_loss, step_acc, step_count)
