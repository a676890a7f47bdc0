"""The TTT unroll's attention without the masked rectangle: flex_attention over the block-sparse TTT key set.

At TTT step k the T queries of a sample see the causal step-0 keys and, from each of the steps 1..k, the one key at
their own position (train/ttt.py). The dense form, SDPA with a [T, (k+1)·T] bool mask, computes every score of the
rectangle: (k+1)·T² pairs where about T²/2 + k·T are allowed (29.4 M for 2.1 M + 12 K at T = 2,048 and k = 6), and a
mask keeps SDPA off its flash kernel (the memory-efficient one takes the mask as an additive bias it reads per
score). `torch.nn.attention.flex_attention` with a block mask computes only the 128 × 128 blocks that hold an allowed
pair: the causal triangle's, and per later step the one partial block on each query block's diagonal (128·T pairs),
so step k costs about T²/2 + 128·k·T pairs instead of (k+1)·T², forward and backward. It is the same function: the
scores of the allowed pairs, softmax over them, their values; `tests/test_train_attention.py` checks the logits and
every gradient against the dense form in float32, and a trained draft's held-out acc_k.

On a GPU flex_attention is compiled (`torch.compile`: Triton kernels, a one-off cost in the first step, which the
speed report leaves out); uncompiled it would materialise the scores like the dense form. On the CPU training keeps
the dense form; the tests run flex there uncompiled, which computes the same function by its reference path.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

ATTENTION_KINDS = ("dense", "flex", "auto")
# "auto" (training's choice on a GPU): flex from this padded length on, dense below. Why: the dense rectangle's cost
# grows as (k+1)·T², and at a few hundred tokens it is small, while compiled flex pays a compilation for each new
# padded length and step kind (up to 8 graphs, seconds each) until dynamo makes the sizes symbolic. A short run under
# --max-seconds spent that on compiling: the demo-scale protocol run of bench/run_bench.py (samples of ~256 tokens,
# 25 s of training) fitted 51 steps where the dense form had taken 241 (bench/results/bench-all-20261202T114617.json).
FLEX_MIN_LENGTH = 1024
_MAX_MASKS = 32  # block masks kept per process (one per padded length T and step)
RECOMPILE_LIMIT = 64  # graphs of the compiled flex_attention before dynamo stops compiling it (torch's default: 8)

_block_masks: dict[tuple[int, int, str], BlockMask] = {}
_compiled_flex = None


def ttt_block_mask(T: int, S: int, device: torch.device) -> BlockMask:
    """The TTT mask for T queries over S = (k+1)·T keys (step-0 keys, then steps 1..k, T slots each) as a block mask."""
    key = (T, S, str(device))
    if key not in _block_masks:
        if len(_block_masks) >= _MAX_MASKS:
            _block_masks.clear()
        # The query position each key slot belongs to; a tensor, not a Python int captured by the closure, so a new
        # padded length T is new data for the compiled kernel rather than a new constant to recompile for.
        slot_position = torch.arange(S, device=device) % T

        def allowed(b, h, q, kv):
            # step-0 keys causally (kv < T there); a later step's key only at the query's own position
            return (kv <= q) | (slot_position[kv] == q)

        _block_masks[key] = create_block_mask(allowed, None, None, T, S, device=device)
    return _block_masks[key]


BLOCK = 128  # flex attention's default sparse block, which packed rows are padded to a multiple of (train/packing.py)


def _sparse(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, nq, nkv] bool → (the count of True per query block, their indices first, ascending) as int32, [R, 1, ...]."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def packed_ttt_block_mask(doc: torch.Tensor, S: int) -> BlockMask:
    """The TTT mask of a packed batch (doc [R, T], train/packing.py) over S = (k+1)·T keys as a block mask: a query
    sees the step-0 keys of its own document up to itself and, of each later step, the key at its own position.

    Built from the documents' block ranges instead of create_block_mask, which evaluates the mask at every (row, query,
    key) triple: 2 G of them at step 6 of a 16,384-token row (training packs a micro-batch into one row). Documents
    increase along a row (padding, -1, is taken as one more document at the end), so a step-0 key block below the
    query block holds an allowed pair iff the key block's last document is the query block's first, and all its pairs
    are allowed iff both blocks lie in that one document. That needs T a multiple of BLOCK, so each later step's keys
    start on a block edge (packing pads long rows so); a shorter row's mask is built by create_block_mask."""
    R, T = doc.shape
    if S % T:
        raise ValueError(f"packed TTT attention: {S} keys are not a whole number of {T}-slot steps")
    steps, device = S // T, doc.device
    d = doc.masked_fill(doc < 0, torch.iinfo(torch.int64).max)
    slot_position = torch.arange(S, device=device) % T

    def allowed(b, h, q, kv):
        position = slot_position[kv]
        return ((kv <= q) & (d[b, position] == d[b, q])) | (position == q)

    if T % BLOCK:  # a short row (packing rounds long ones): the mask evaluated pair by pair is small
        return create_block_mask(allowed, R, None, T, S, device=device)
    nb = T // BLOCK
    first, last = d[:, ::BLOCK], d[:, BLOCK - 1 :: BLOCK]  # [R, nb]
    i = torch.arange(nb, device=device)
    below, diagonal = i[None, :] < i[:, None], i[None, :] == i[:, None]  # [query block, key block]
    q_first, q_last, k_first, k_last = first[:, :, None], last[:, :, None], first[:, None, :], last[:, None, :]
    full = below & (k_first == k_last) & (k_last == q_first) & (q_first == q_last)
    partial = ((below & (k_last == q_first)) | diagonal) & ~full
    later = diagonal.expand(R, nb, nb)
    partial = torch.cat([partial] + [later] * (steps - 1), dim=2)
    full = torch.cat([full] + [torch.zeros_like(later)] * (steps - 1), dim=2)
    return BlockMask.from_kv_blocks(*_sparse(partial), *_sparse(full), BLOCK_SIZE=BLOCK, mask_mod=allowed,
                                    seq_lengths=(T, S))  # fmt: skip


def _flex_for(device: torch.device):
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def flex_ttt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """attend()'s contract for the TTT key layout: q [B, H, T, D], k/v [B, Hkv, (k+1)·T, D] → [B, H, T, D]. `mask` is
    not read: the layout decides it (ttt_block_mask)."""
    T, S = q.shape[2], k.shape[2]
    if S % T:
        raise ValueError(f"flex TTT attention: {S} keys are not a whole number of {T}-slot steps")
    return _flex(q, k, v, ttt_block_mask(T, S, q.device))


def packed_flex_attention(doc: torch.Tensor):
    """flex_ttt_attention for a packed batch (doc [R, T]): the block mask of each step built once per unroll."""
    masks: dict[int, BlockMask] = {}

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        S = k.shape[2]
        if S not in masks:
            masks[S] = packed_ttt_block_mask(doc, S)
        return _flex(q, k, v, masks[S])

    return attention


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    # Autocast has cast the projections already (SDPA would run in that dtype too); the compiled kernel runs outside it.
    # Each padded length T, batch size (an evaluation's last batch), grad mode and step 0 (whose keys are a transposed
    # view, S = T) against later steps can ask for a graph of its own before dynamo makes the sizes symbolic: 8 graphs
    # for 10 lengths of a real run's spread (counted with dynamo's eager backend), and torch's default limit of 8 would
    # then run flex uncompiled, materialising every score, for the rest of the run (tests/gpu hit it, short samples).
    with torch.autocast(q.device.type, enabled=False), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        flex = _flex_for(q.device)
        return flex(q, k.to(q.dtype), v.to(q.dtype), block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def default_attention(draft, device: torch.device) -> str:
    """auto (flex for long batches) on a GPU for the Llama-attention draft; dense otherwise (the CPU, and MLA drafts,
    whose attention is its own module)."""
    from eaglescope.models.drafts.llama import DraftAttention

    return "auto" if device.type == "cuda" and type(draft.midlayer.self_attn) is DraftAttention else "dense"


def resolve(kind: str, T: int) -> str:
    """The kind a batch of padded length T runs: "auto" is flex from FLEX_MIN_LENGTH tokens, dense below."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"TTT attention {kind!r} is not one of {ATTENTION_KINDS}")
    if kind == "auto":
        return "flex" if T >= FLEX_MIN_LENGTH else "dense"
    return kind


@contextlib.contextmanager
def ttt_attention(draft, kind: str, doc: torch.Tensor | None = None):
    """The draft's attention set to `kind` ("dense" or "flex", as resolve() gives it) for the duration (decoding's own
    setting is restored after). `doc` [R, T]: a packed batch's documents (the flex mask then keeps to them)."""
    if kind not in ("dense", "flex"):
        raise ValueError(f"TTT attention {kind!r} is not one of {ATTENTION_KINDS}")
    if kind == "dense":
        yield
        return
    attn = draft.midlayer.self_attn
    previous = attn.attention_impl
    attn.attention_impl = flex_ttt_attention if doc is None else packed_flex_attention(doc)
    try:
        yield
    finally:
        attn.attention_impl = previous
