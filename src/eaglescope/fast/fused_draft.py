"""The EAGLE-3 draft layer (Llama attention) on a few rows, in the fused verify's kernels.

Why: at 8B a round's draft side is ~1.8 ms of kernels and ~0.5 ms of launch gaps in its graph, for ~1.1 ms of
weight reads (the replayed round's kernel profile). A tree level's products already stream the draft
layer's weights near the copy bandwidth; the rest is ~20 small kernels a level that torch.compile leaves around
them (norms, the 2H concatenation, RoPE, the cache write, attention's pieces, SiLU, residual adds). Here a step of
T rows (a catch-up's pending positions or a tree level's frontier) is twelve launches:

- input:    one kernel for both input norms, written side by side as the attention's [T, 2H] input (embedding
            first), and the residual stream (the feature h, or its norm with norm_before_residual);
- q/k/v:    cuBLAS, then fused_verify's RoPE + cache-write kernel at each row's draft-cache slot;
- attend:   fused_decode.fused_attention's split-slot kernel (few rows: the cache is cut into slot blocks so
            that all SMs work; flash attention walks it with one program per kv group);
- o, down:  cuBLAS into a buffer that the next norm kernel adds into the residual stream (rounded as the
            module's `h + proj(...)`): o's by the post-attention norm, down's by the final norm, which also leaves
            the step's pre-norm output in the residual stream;
- gate/up:  cuBLAS, then fused_verify's SiLU·up kernel;
- lm_head:  the draft's own head over the final norm's rows (`head`);
- top-k:    `log_softmax_top_k`, one launch for a tree level's children: each row's top k of its log-softmax, where
            torch takes a copy to float32, a log-softmax, two top-k passes and a sort (~40 µs of a 254 µs level at 8B,
            bench-roofline-20261205T032356.json's draft_step_fused_profile).

Around the layer, a tree level's inputs and the tree's start are one launch each (`level_inputs`, `tree_start`:
six and ten compiled kernels otherwise) where the proposer's wiring is Eagle3Proposer's own.

The products are the modules' (cuBLAS, as compiled modules call it), or in half precision on a Hopper-or-later GPU
fast.stream_mm's (TMA-fed weight tiles: q/k/v, o, gate/up, down and the head 1-10% faster at 4 rows than the
libraries, bench/results/skinny-products-20261206T125137.json). Roundings follow the modules' except RoPE and the
norm's reciprocal square root, which round once in float32 (1-ulp differences in bf16, as the fused verify's).
Not for MLA drafts.
"""

from __future__ import annotations

import torch

from eaglescope.decode.tree import expand_level, top_k_rows
from eaglescope.fast.fused_decode import (
    attention_scratch,
    available,
    fused_attention,
    pdl_options,
    triton,
)
from eaglescope.fast.fused_verify import _mm, check_stream, split_k_mm
from eaglescope.fast.stream_mm import default_stream, stream_launch, stream_mm
from eaglescope.models.draft import Eagle3Draft
from eaglescope.models.drafts.llama import DraftAttention

if triton is not None:  # without it the kernels are not defined, and `available` keeps every caller off them
    import triton.language as tl

    from eaglescope.fast.fused_decode import await_previous
    from eaglescope.fast.fused_verify import _rows_rmsnorm_kernel, _rows_rope_cache_kernel, _rows_silu_mul_kernel

if triton is not None:

    @triton.jit
    def _rms_norm_row(raw, w, eps, K: tl.constexpr):
        """The module's RMSNorm of one row: normalised in float32 and rounded to the row's dtype, then weighted."""
        xs = raw.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xs * xs, 0) / K + eps)
        normed = (xs * rstd).to(raw.dtype).to(tl.float32)
        return (w.to(tl.float32) * normed).to(raw.dtype)

    @triton.jit
    def _draft_input_kernel(emb, hid, w_emb, w_hid, x, h, eps_emb, eps_hid, K: tl.constexpr, KP2: tl.constexpr,
                            NORM_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """Program t: x[t] = [input_layernorm(emb[t]), hidden_norm(hid[t])] and h[t] = that hidden norm
        (NORM_RESIDUAL) or hid[t]."""
        await_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, KP2)
        ok = k < K
        e = tl.load(emb + t * K + k, mask=ok, other=0.0)
        tl.store(x + t * 2 * K + k, _rms_norm_row(e, tl.load(w_emb + k, mask=ok, other=0.0), eps_emb, K), mask=ok)
        raw = tl.load(hid + t * K + k, mask=ok, other=0.0)
        y = _rms_norm_row(raw, tl.load(w_hid + k, mask=ok, other=0.0), eps_hid, K)
        tl.store(x + t * 2 * K + K + k, y, mask=ok)
        if NORM_RESIDUAL:
            tl.store(h + t * K + k, y, mask=ok)
        else:
            tl.store(h + t * K + k, raw, mask=ok)

    @triton.jit
    def _log_softmax_top_k_kernel(x, vals, ids, part_max, part_sum, part_val, part_id, count, V, stride,
                                  K: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, SP2: tl.constexpr,
                                  CAND: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """Program (r, s): the maximum, the sum of exponentials under it and the K largest entries (ties to the lower
        column) of row r's columns s*CHUNK.. ; the last program of the row to finish (a counter per row) merges the
        SPLITS partials in order: the K largest of log_softmax(x[r]) in float32, best first. A chosen entry becomes
        NaN, which equals nothing (the padding past the row starts so)."""
        await_previous(PDL)
        r = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        cols = s * CHUNK + tl.arange(0, CHUNK)
        v = tl.load(x + r * stride + cols, mask=cols < V, other=float("nan")).to(tl.float32)
        top = tl.max(tl.where(v == v, v, float("-inf")), 0)
        total = tl.sum(tl.where(v == v, tl.exp(v - top), 0.0), 0)  # NaN for a chunk of -inf: the merge skips it
        at_part = r * SPLITS + s
        tl.store(part_max + at_part, top)
        tl.store(part_sum + at_part, total)
        for j in tl.static_range(K):
            best = tl.max(tl.where(v == v, v, float("-inf")), 0)
            at = tl.min(tl.where(v == best, cols, V), 0)  # V: this chunk has no entry left
            tl.store(part_val + at_part * K + j, tl.where(at < V, best, float("nan")))
            tl.store(part_id + at_part * K + j, at)
            v = tl.where(cols == at, float("nan"), v)
        tl.debug_barrier()  # every warp's partial stores land before the counter says so
        if tl.atomic_add(count + r, 1) == SPLITS - 1:
            c = tl.arange(0, CAND)
            c_ok = c < SPLITS * K
            cv = tl.load(part_val + r * SPLITS * K + c, mask=c_ok, other=float("nan"), cache_modifier=".cg")
            cid = tl.load(part_id + r * SPLITS * K + c, mask=c_ok, other=V, cache_modifier=".cg")
            p = tl.arange(0, SP2)
            p_ok = p < SPLITS
            p_max = tl.load(part_max + r * SPLITS + p, mask=p_ok, other=float("-inf"), cache_modifier=".cg")
            p_sum = tl.load(part_sum + r * SPLITS + p, mask=p_ok, other=0.0, cache_modifier=".cg")
            row_max = tl.max(p_max, 0)
            scaled = tl.where(p_max > float("-inf"), p_sum * tl.exp(p_max - row_max), 0.0)  # chunks of -inf: none
            # log-softmax = (x - max) - log(sum(exp(x - max))), as torch computes it
            log_sum = tl.log(tl.sum(scaled, 0))
            for j in tl.static_range(K):
                best = tl.max(tl.where(cv == cv, cv, float("-inf")), 0)
                # the lowest column holding it not chosen yet: distinct ids even among -inf entries; a row of NaN
                # gets the last column, in range, rather than an id past the vocabulary
                at = tl.minimum(tl.min(tl.where(cv == best, cid, V), 0), V - 1)
                tl.store(vals + r * K + j, (best - row_max) - log_sum)
                tl.store(ids + r * K + j, at.to(tl.int64))
                cv = tl.where(cid == at, float("nan"), cv)
            tl.store(count + r, 0)  # for the next call

    @triton.jit
    def _expand_level_kernel(tokens, parents, depths, scores, lineage, next_id, parent_nodes, child_lp, child_tok,
                             frontier, COLS: tl.constexpr, N: tl.constexpr, K: tl.constexpr, TOP: tl.constexpr,
                             NP2: tl.constexpr, CP2: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """decode/tree.py expand_level with the children picked, in one program of one warp (the warp reads next_id
        before it moves it): candidate c = j*K + i is child i of parent_nodes[j]; the TOP best by cumulative
        log-prob, ties to the earlier candidate, are the next frontier."""
        await_previous(PDL)
        c = tl.arange(0, NP2)
        ok = c < N
        base = tl.load(next_id)
        ids = base + c
        of = tl.load(parent_nodes + c // K, mask=ok, other=0)
        cum = tl.load(scores + of, mask=ok, other=0.0) + tl.load(child_lp + c, mask=ok, other=0.0)
        depth = tl.load(depths + of, mask=ok, other=0) + 1
        tl.store(tokens + ids, tl.load(child_tok + c, mask=ok, other=0), mask=ok)
        tl.store(parents + ids, of, mask=ok)
        tl.store(depths + ids, depth, mask=ok)
        tl.store(scores + ids, cum, mask=ok)
        col = tl.arange(0, CP2)[None, :]
        row_ok = ok[:, None] & (col < COLS)
        up = tl.load(lineage + of[:, None] * COLS + col, mask=row_ok, other=0)
        tl.store(lineage + ids[:, None] * COLS + col, tl.where(col >= depth[:, None], ids[:, None], up), mask=row_ok)
        taken = ~ok
        for j in tl.static_range(TOP):
            best = tl.max(tl.where(taken, float("-inf"), cum), 0)
            at = tl.minimum(tl.min(tl.where((cum == best) & ~taken, c, NP2), 0), N - 1)
            tl.store(frontier + j, base + at)
            taken = taken | (c == at)
        tl.store(next_id, base + N)

    @triton.jit
    def _level_inputs_kernel(tokens, parents, lineage, slot_of, ctx_mask, frontier, prev_front, prev_out, out_stride,
                             root_position, level, d2t, embedding, tok_out, pos_out, emb_out, hid_out, slots_out,
                             mask_out, tree_base, S, M: tl.constexpr, MP2: tl.constexpr, TOP_K: tl.constexpr,
                             COLS: tl.constexpr, CP2: tl.constexpr, H: tl.constexpr, HP2: tl.constexpr,
                             BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """Program t: Eagle3Proposer.level_inputs for frontier row t. Its features are the output of the previous
        level's row whose node is its parent; its token the builder's draft id mapped to the target's and embedded;
        its slot tree_base + (level-1)*TOP_K + t; its mask row the context's slots and its ancestors' (its own for
        itself); then slot_of[its node] = its slot. No program reads another's node in slot_of: a frontier is one
        depth, and a lineage holds only shallower nodes and the node itself."""
        await_previous(PDL)
        t = tl.program_id(0)
        f = tl.load(frontier + t)
        par = tl.load(parents + f)
        j = tl.arange(0, MP2)
        front = tl.load(prev_front + j, mask=j < M, other=-1)
        src = tl.min(tl.where(front == par, j, MP2), 0)
        src = tl.where(src == MP2, 0, src).to(tl.int64)  # no parent among them: row 0, as an argmax of zeros
        k = tl.arange(0, HP2)
        ok = k < H
        tl.store(hid_out + t * H + k, tl.load(prev_out + src * out_stride + k, mask=ok), mask=ok)
        d = tl.load(tokens + f)
        tok = d + tl.load(d2t + d)
        tl.store(tok_out + t, tok)
        tl.store(emb_out + t * H + k, tl.load(embedding + tok * H + k, mask=ok), mask=ok)
        lv = tl.load(level)
        tl.store(pos_out + t, tl.load(root_position) + lv - 1)
        slot = tree_base + (lv - 1) * TOP_K + t
        tl.store(slots_out + t, slot)
        c = tl.arange(0, CP2)
        lin = tl.load(lineage + f * COLS + c, mask=c < COLS, other=f)
        own = tl.where(lin == f, slot, tl.load(slot_of + lin))
        for s0 in range(0, S, BLOCK_S):
            cols = s0 + tl.arange(0, BLOCK_S)
            in_row = cols < S
            hit = tl.load(ctx_mask + cols, mask=in_row, other=0) != 0
            hit = hit | (tl.max((cols[:, None] == own[None, :]).to(tl.int32), 1) != 0)
            tl.store(mask_out + t.to(tl.int64) * S + cols, hit.to(tl.int8), mask=in_row)
        tl.store(slot_of + f, slot)

    @triton.jit
    def _tree_start_kernel(root, h_root, context, tokens, parents, depths, scores, lineage, next_id, slot_of, ctx_mask,
                           prev_front, prev_out, CAP, CELLS, S, NO_SLOT, M: tl.constexpr, H: tl.constexpr,
                           HP2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """Eagle3Proposer.tree_start's writes: programs 0..M-1 level 1's parents (the root's id 0 and its features
        h_root, one row each); program M the builder of the root alone (decode/tree.py tree_buffers: the root's
        token at id 0, parents -1, depths, scores and lineage 0, next_id 1), slot_of NO_SLOT (the cache's size: no
        node has a slot yet) and the committed context's mask (slots below `context`)."""
        await_previous(PDL)
        p = tl.program_id(0)
        if p < M:
            k = tl.arange(0, HP2)
            tl.store(prev_out + p * H + k, tl.load(h_root + k, mask=k < H), mask=k < H)
            tl.store(prev_front + p, p.to(tl.int64) * 0)  # the root's builder id
        else:
            r = tl.load(root)
            none = tl.zeros([BLOCK], tl.int64)
            for s0 in range(0, CAP, BLOCK):
                i = s0 + tl.arange(0, BLOCK)
                ok = i < CAP
                tl.store(tokens + i, tl.where(i == 0, r, none), mask=ok)
                tl.store(parents + i, none - 1, mask=ok)
                tl.store(depths + i, none, mask=ok)
                tl.store(scores + i, tl.zeros([BLOCK], tl.float32), mask=ok)
                tl.store(slot_of + i, none + NO_SLOT, mask=ok)
            for s0 in range(0, CELLS, BLOCK):
                i = s0 + tl.arange(0, BLOCK)
                tl.store(lineage + i, none, mask=i < CELLS)
            ctx = tl.load(context)
            for s0 in range(0, S, BLOCK):
                i = s0 + tl.arange(0, BLOCK)
                tl.store(ctx_mask + i, (i < ctx).to(tl.int8), mask=i < S)
            tl.store(next_id, r * 0 + 1)

    @triton.jit
    def _finalize_kernel(tokens, parents, depths, scores, lineage, d2t, tok_out, par_out, dep_out, score_out,
                         src_out, mask_out, N, KEEP, COLS: tl.constexpr, NP2: tl.constexpr,
                         PDL: tl.constexpr = False):  # fmt: skip
        """decode/tree.py finalize_tree, then Eagle3Proposer.finalize's draft-to-target ids, in one program over
        the builder's N nodes as [NP2, NP2] pairs (a row node a, a column node b). Candidates 1..N-1 rank by score
        descending, then depth, then id: the order of finalize_tree's two stable sorts. The root and the KEEP best
        are kept, placed by (depth, rank); the mask row of a kept node holds the kept nodes its lineage names (its
        ancestor at each depth, itself). A NaN score ranks as -inf, as finalize_tree ranks it."""
        await_previous(PDL)
        a = tl.arange(0, NP2)[:, None]
        b = tl.arange(0, NP2)[None, :]
        node = tl.arange(0, NP2)
        ok = node < N
        d = tl.load(depths + node, mask=ok, other=0)
        score = tl.load(scores + node, mask=ok, other=0.0)
        s = tl.where(score != score, float("-inf"), score)
        d_a, d_b, s_a, s_b = d[:, None], d[None, :], s[:, None], s[None, :]
        higher, same = s_a > s_b, s_a == s_b
        cand_a, cand_b = (a >= 1) & (a < N), (b >= 1) & (b < N)
        # a_first[a, b]: candidate a ranks before candidate b (a strict total order over the candidates)
        a_first = cand_a & cand_b & (higher | (same & ((d_a < d_b) | ((d_a == d_b) & (a < b)))))
        rank_b = tl.sum(a_first.to(tl.int32), 0)  # how many rank before b, b along the columns
        rank_a = (N - 2) - tl.sum(a_first.to(tl.int32), 1)  # the same for a: the others minus those a precedes
        cand = (node >= 1) & ok
        kept_a = tl.where(cand, rank_a < KEEP, node == 0)[:, None]
        kept_b = tl.where(cand, rank_b < KEEP, node == 0)[None, :]
        r_a = tl.where(node == 0, -1, rank_a)[:, None]  # the root first: depth 0, before every rank
        r_b = tl.where(node == 0, -1, rank_b)[None, :]
        # a kept node's place: how many kept nodes come before it by (depth, rank)
        pos_a = tl.sum((kept_b & ((d_b < d_a) | ((d_b == d_a) & (r_b < r_a)))).to(tl.int32), 1)[:, None]
        pos_b = tl.sum((kept_a & ((d_a < d_b) | ((d_a == d_b) & (r_a < r_b)))).to(tl.int32), 0)[None, :]
        par = tl.load(parents + node, mask=ok, other=-1)[:, None]
        par_pos = tl.sum(tl.where(b == par, pos_b, 0), 1)[:, None]
        n = KEEP + 1
        row = kept_a & (a < N)
        tok = tl.load(tokens + a, mask=row, other=0)
        tok = tl.where(a == 0, tok, tok + tl.load(d2t + tok, mask=row & (a > 0), other=0))
        tl.store(tok_out + pos_a, tok, mask=row)
        tl.store(par_out + pos_a, tl.where(a == 0, -1, par_pos).to(tl.int64), mask=row)
        tl.store(dep_out + pos_a, d_a, mask=row)
        tl.store(score_out + pos_a, score[:, None], mask=row)
        tl.store(src_out + pos_a, a.to(tl.int64), mask=row)
        pair = row & kept_b & (b < N)
        col = tl.minimum(d_b, COLS - 1)
        ancestor = tl.load(lineage + a.to(tl.int64) * COLS + col, mask=pair, other=-1) == b
        tl.store(mask_out + pos_a.to(tl.int64) * n + pos_b, ancestor.to(tl.int8), mask=pair)


def expand_level_fused(tokens, parents, depths, scores, lineage, next_id, parent_nodes, logprobs, k: int,
                       top_k: int) -> torch.Tensor:  # fmt: skip
    """decode/tree.py expand_level in one launch (where the children are picked already, `logprobs` = (log-probs,
    ids) [m, k], and Triton runs): eagerly a dozen small kernels a level, compiled as many (its index_copy_'s, the
    lineage, the frontier's top-k). The same writes and frontier; among candidates of equal cumulative log-prob,
    the earlier one first."""
    if not isinstance(logprobs, tuple) or not available(tokens.device):
        return expand_level(tokens, parents, depths, scores, lineage, next_id, parent_nodes, logprobs, k, top_k)
    child_lp, child_tok = logprobs
    n = parent_nodes.shape[0] * k
    top = min(top_k, n)
    frontier = torch.empty(top, dtype=torch.long, device=tokens.device)
    cols = lineage.shape[1]
    _expand_level_kernel[(1,)](tokens, parents, depths, scores, lineage, next_id, parent_nodes.contiguous(),
                               child_lp.to(scores.dtype).contiguous(), child_tok.contiguous(), frontier, COLS=cols,
                               N=n, K=k, TOP=top, NP2=triton.next_power_of_2(n),
                               CP2=triton.next_power_of_2(cols), num_warps=1, **pdl_options(tokens))  # fmt: skip
    return frontier


# o and down as this many products over K's slices (fast/fused_verify.py split_k_mm), summed by the next norm kernel
# in place of cuBLAS's own split-K and its reduce kernel (two launches a level); 1: one product, today's. At 4 rows
# cuBLAS runs both as split-K + reduce (bench-roofline-20261205T050738.json's propose table); in halves they were
# 0.9-1.6% faster a level on an H100 and an H200, which their tuning files say (fast/tuning.py)
DRAFT_K_SPLITS = {"o": 1, "down": 1}
# the products fast.stream_mm may run in a draft level: the layer's four and the head (`head`)
DRAFT_STREAM_PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")
# a tree level's inputs, the tree's start and its finalize in one launch each (FusedDraftStep.level_inputs,
# .tree_start, .finalize) where the proposer's wiring is Eagle3Proposer's own; False: the composed Eagle3Proposer
# pieces (run_bench.py's roofline replays both: FastEagle.set_one_launch)
ONE_LAUNCH_PIECES = True
# the largest builder finalize's kernel takes (every pair of nodes in one program's registers): the (6, 4) tree's 85
# nodes fit; the (7, 10) tree's 611 run the composed finalize
FINALIZE_MAX_NODES = 128
# its warps: compiled for sm_90 (tests/test_kernels_compile.py) at 128 pairs a side, 8 warps hold 64 pairs a thread
# in 255 registers and spill 408 bytes a thread, 8,792 instructions a warp; 32 warps hold 16 in 64 registers, spill 40
# bytes, 1,960 instructions a warp: about the same work, four times the warps to hide each step's latency
FINALIZE_WARPS = 32
# log_softmax_top_k's columns a program (16 a thread over 4 warps: top_k_warps), and the widest row it takes (its
# merge holds every chunk's k candidates: 128 chunks at most)
TOP_K_CHUNK = 2048
TOP_K_MAX_WIDTH = 128 * TOP_K_CHUNK


def top_k_warps(chunk: int) -> int:
    """Warps of a log_softmax_top_k program over `chunk` columns: 16 values a thread up to 32 warps (a whole 32k row
    in one program, 842fe7c's kernel, takes 32)."""
    return max(4, min(32, chunk // 512))


def log_softmax_top_k(
    logits: torch.Tensor, k: int, count: torch.Tensor | None = None, chunk: int = TOP_K_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_rows(torch.log_softmax(logits.float(), -1), k) of a draft head's logits [m, V] → (log-probs float32,
    columns int64), each [m, k], best first, in one Triton launch: a program per 2048 columns of a row, the last of
    the row to finish merging (16 x 4 programs for a tree level of a 32k vocabulary). `count`: int32 zeros, one a
    row at least, that the launch leaves at zero (FusedDraftStep keeps one; None: made here); `chunk`: the columns a
    program takes, a power of two (the tests shrink it to run many programs a row). Rows wider than
    TOP_K_MAX_WIDTH, or where Triton cannot run, take torch's ops. The same values up to the float32 sum's order;
    among equal values the lower column first."""
    m, V = logits.shape
    if not available(logits.device) or V > 128 * chunk or k > V:
        return top_k_rows(torch.log_softmax(logits.float(), dim=-1), k)
    logits, dev = logits.contiguous(), logits.device
    splits = triton.cdiv(V, chunk)
    if count is None:
        count = torch.zeros(m, device=dev, dtype=torch.int32)
    vals = torch.empty(m, k, device=dev, dtype=torch.float32)
    ids = torch.empty(m, k, device=dev, dtype=torch.long)
    part_max, part_sum = torch.empty(2, m, splits, device=dev, dtype=torch.float32)
    part_val = torch.empty(m, splits, k, device=dev, dtype=torch.float32)
    part_id = torch.empty(m, splits, k, device=dev, dtype=torch.int32)
    _log_softmax_top_k_kernel[(m, splits)](logits, vals, ids, part_max, part_sum, part_val, part_id, count, V,
                                           logits.stride(0), K=k, CHUNK=chunk, SPLITS=splits,
                                           SP2=triton.next_power_of_2(splits),
                                           CAND=triton.next_power_of_2(splits * k),
                                           num_warps=top_k_warps(chunk), **pdl_options(logits))  # fmt: skip
    return vals, ids


def fused_draft_supported(draft: Eagle3Draft) -> str | None:
    """None if FusedDraftStep can run `draft` where its weights are, else why not (one line)."""
    device = draft.fc.weight.device
    if not available(device):
        return "the fused draft step needs Triton and a CUDA device (or TRITON_INTERPRET=1)"
    layer = draft.midlayer
    if not isinstance(layer.self_attn, DraftAttention):
        return f"the fused draft step runs the Llama-attention draft layer, not {type(layer.self_attn).__name__}"
    if layer.self_attn.qkv_proj is None or layer.mlp.gate_up_proj is None:
        return "the fused draft step needs fused q/k/v and gate/up projections (fuse_projections)"
    D = draft.config.head_dim
    if D & (D - 1) or D < 16:
        return f"the fused draft step needs a power-of-two head_dim of 16 or more, not {D}"
    return None


class FusedDraftStep:
    """`Eagle3Draft.step` and its normed output for up to `rows` rows (a catch-up's pending positions, a tree level's
    frontier) on `cache` (the proposer's SlotCache).

    Call with embeds, hidden [T, H], the RoPE cos, sin [T, D] of the rows' positions (Eagle3Proposer.rotary),
    slots [T] and mask [T, S] bool → (what the next step receives, as `step` returns it: the pre-norm output, or the
    normed one with norm_output; the final norm's output, what `Eagle3Draft.head` reads), both [T, H]: views of
    buffers the next call overwrites. `stream`: {product: launch} of the products fast.stream_mm runs where it fits
    (default: fast.stream_mm.default_stream's; "lm_head" through `head`)."""

    def __init__(self, draft: Eagle3Draft, cache, rows: int, k_splits: dict[str, int] | None = None,
                 stream: dict[str, tuple[int, ...]] | None = None) -> None:  # fmt: skip
        why = fused_draft_supported(draft)
        if why:
            raise ValueError(why)
        c, layer = draft.config, draft.midlayer
        self.draft, self.cache, self.config, self.layer = draft, cache, c, layer
        w = draft.fc.weight
        dev, dt = w.device, w.dtype
        self.rows = R = rows
        H, D = c.hidden_size, c.head_dim
        n_qkv = (c.num_heads + 2 * c.num_kv_heads) * D
        z = lambda *shape: torch.zeros(*shape, device=dev, dtype=dt)  # noqa: E731
        self.x = z(R, 2 * H)  # the attention's input: [input_layernorm(embedding), hidden_norm(h)]
        self.h = z(R, H)  # the residual stream; after a step, its pre-norm output
        self.qkv_out, self.q, self.attn = z(R, n_qkv), z(R, c.num_heads * D), z(R, c.num_heads * D)
        self.residual_out = z(R, H)  # o's or down's product, added by the next norm kernel
        self.normed = z(R, H)
        self.gate_up_out, self.act = z(R, 2 * c.intermediate_size), z(R, c.intermediate_size)
        self.scratch = attention_scratch(R, c.num_heads, D, cache.size, dev)
        self.k_splits = {**DRAFT_K_SPLITS, **(k_splits or {})}  # o's and down's (fast/tuning.py's draft k_splits)
        if stream is None:
            stream = default_stream("draft", draft.lm_head.weight)
        self.stream = {name: tuple(launch) for name, launch in stream.items()}
        check_stream(self.stream, DRAFT_STREAM_PRODUCTS, "FusedDraftStep")
        self.logits_out = torch.zeros(R, c.draft_vocab_size, device=dev, dtype=draft.lm_head.weight.dtype)
        self.topk_count = torch.zeros(R, device=dev, dtype=torch.int32)  # log_softmax_top_k's counters
        # a tree level's inputs (level_inputs): token, position and slot of each row, its embedding and features, its
        # mask row over the draft cache
        self.level_tok, self.level_pos, self.level_slots = torch.zeros(3, R, device=dev, dtype=torch.long)
        self.level_emb = torch.zeros(R, H, device=dev, dtype=draft.embed_tokens.weight.dtype)
        self.level_hidden = z(R, H)
        self.level_mask = torch.zeros(R, cache.size, device=dev, dtype=torch.bool)
        self.one_launch = ONE_LAUNCH_PIECES
        self._tree: tuple[torch.Tensor, ...] | None = None  # tree_start's buffers, made at its first call
        self._final: tuple[torch.Tensor, ...] | None = None  # finalize's outputs, made at its first call

    expand_level = staticmethod(expand_level_fused)

    def level_inputs(self, tokens, parents, lineage, slot_of, ctx_mask, frontier, prev_front, prev_out,
                     root_position, level, tree_base: int, top_k: int):  # fmt: skip
        """Eagle3Proposer.level_inputs with that class's own wiring, in one launch where the composed function is
        six compiled kernels (eleven eager): the same (tokens, positions, embeddings, features in, slots [m], mask
        [m, S]), as views of buffers the next level overwrites, and the same writes to slot_of."""
        m, H, S = frontier.shape[0], self.config.hidden_size, self.level_mask.shape[1]
        if not 1 <= m <= self.rows or ctx_mask.shape[0] != S:
            raise ValueError(f"level inputs for 1..{self.rows} rows over {S} slots, not {m} over {ctx_mask.shape[0]}")
        cols = lineage.shape[1]
        _level_inputs_kernel[(m,)](tokens, parents, lineage, slot_of, ctx_mask.view(torch.uint8), frontier,
                                   prev_front, prev_out, prev_out.stride(0), root_position, level, self.draft.d2t,
                                   self.draft.embed_tokens.weight, self.level_tok, self.level_pos, self.level_emb,
                                   self.level_hidden, self.level_slots, self.level_mask.view(torch.uint8), tree_base,
                                   S, M=prev_front.shape[0], MP2=triton.next_power_of_2(prev_front.shape[0]),
                                   TOP_K=top_k, COLS=cols, CP2=triton.next_power_of_2(cols), H=H,
                                   HP2=triton.next_power_of_2(H), BLOCK_S=1024, num_warps=4,
                                   **pdl_options(prev_out))  # fmt: skip
        return (self.level_tok[:m], self.level_pos[:m], self.level_emb[:m], self.level_hidden[:m],
                self.level_slots[:m], self.level_mask[:m])  # fmt: skip

    def tree_start(self, root, h_root: torch.Tensor, context, capacity: int, columns: int, m: int):
        """Eagle3Proposer.tree_start in one launch where compiled it is ten kernels: the same tensors (the builder's
        buffers of the root alone [capacity] and its lineage [capacity, columns], the context's mask [S], slot_of
        [capacity], level 1's parents [m] and their features [m, H]), as buffers the next round's start overwrites."""
        H, S, dev = self.config.hidden_size, self.cache.size, h_root.device
        if not 1 <= m <= self.rows:
            raise ValueError(f"a tree start for 1..{self.rows} parents, not {m}")
        if self._tree is None or self._tree[0].shape[0] != capacity or self._tree[4].shape[1] != columns:
            z = lambda *shape, dt=torch.long: torch.empty(*shape, device=dev, dtype=dt)  # noqa: E731
            builder = (z(capacity), z(capacity), z(capacity), z(capacity, dt=torch.float32), z(capacity, columns), z(1))
            self._tree = (*builder, z(capacity), z(S, dt=torch.bool), z(self.rows), z(self.rows, H, dt=h_root.dtype))
        tokens, parents, depths, scores, lineage, next_id, slot_of, ctx_mask, prev_front, prev_out = self._tree
        _tree_start_kernel[(m + 1,)](root, h_root.contiguous(), context, tokens, parents, depths, scores, lineage,
                                     next_id, slot_of, ctx_mask.view(torch.uint8), prev_front, prev_out, capacity,
                                     capacity * columns, S, S, M=m, H=H, HP2=triton.next_power_of_2(H), BLOCK=1024,
                                     num_warps=4, **pdl_options(h_root))  # fmt: skip
        return (tokens, parents, depths, scores, lineage, next_id), ctx_mask, slot_of, prev_front[:m], prev_out[:m]

    @staticmethod
    def takes_finalize(capacity: int) -> bool:
        """Whether `finalize` runs a builder of `capacity` nodes: its kernel holds every pair of nodes at once."""
        return capacity <= FINALIZE_MAX_NODES

    def finalize(self, tokens, parents, depths, scores, lineage, num_nodes: int, total: int):
        """Eagle3Proposer.finalize with that class's own wiring (finalize_tree, then draft ids to the target's), in
        one launch where compiled it is about a dozen kernels (its sorts, the remap, the mask's scatter): the same
        (tokens, parents, depths, scores, source ids [n], ancestor mask [n, n]) for n = min(total, num_nodes), as
        buffers the next round's finalize overwrites."""
        if not self.takes_finalize(num_nodes):
            raise ValueError(f"a one-launch finalize holds up to {FINALIZE_MAX_NODES} nodes, not {num_nodes}")
        n, dev = min(total, num_nodes), tokens.device
        if self._final is None or self._final[0].shape[0] != n:
            z = lambda *shape, dt=torch.long: torch.empty(*shape, device=dev, dtype=dt)  # noqa: E731
            self._final = (z(n), z(n), z(n), z(n, dt=torch.float32), z(n), z(n, n, dt=torch.bool))
        tok, par, dep, score, src, mask = self._final
        _finalize_kernel[(1,)](tokens, parents, depths, scores, lineage, self.draft.d2t, tok, par, dep, score, src,
                               mask.view(torch.uint8), num_nodes, n - 1, COLS=lineage.shape[1],
                               NP2=triton.next_power_of_2(num_nodes), num_warps=FINALIZE_WARPS,
                               **pdl_options(scores))  # fmt: skip
        return self._final

    def children(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A level's top-k children from the head's logits [m, V]: (log-probs, draft ids) [m, min(k, V)] each."""
        if logits.shape[0] > self.topk_count.shape[0]:
            self.topk_count = torch.zeros(logits.shape[0], device=logits.device, dtype=torch.int32)
        return log_softmax_top_k(logits, min(k, logits.shape[-1]), self.topk_count)

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """Eagle3Draft.head of the final norm's rows [m, H]: its lm_head on stream_mm where that runs it (a view of a
        buffer the next call overwrites), else the draft's own head. A draft whose head is not Eagle3Draft's (a fault
        under test, a subclass) always runs its own."""
        d = self.draft
        stream = stream_launch(self.stream, "lm_head", normed, d.lm_head.weight, d.lm_head.bias)
        own_head = type(d).head is Eagle3Draft.head and "head" not in vars(d)  # not overridden, nor patched on
        if stream is None or not own_head or type(d.lm_head) is not torch.nn.Linear:
            return d.head(normed)
        y = stream_mm(normed, d.lm_head.weight, stream, self.logits_out[: normed.shape[0]])
        return y.mul_(d.config.logit_scale) if d.config.logit_scale != 1.0 else y

    def _norm(self, norm, T: int, add: torch.Tensor) -> torch.Tensor:
        """self.h += add ([T, H], or split_k_mm's float32 partials [parts, T, H], summed first), then its RMSNorm into
        self.normed (one kernel)."""
        H = self.config.hidden_size
        parts = add.shape[0] if add.dim() == 3 else 1
        _rows_rmsnorm_kernel[(T,)](self.h, add, norm.weight, self.normed, norm.eps, add.stride(0) if parts > 1 else 0,
                                   self.h, 0, K=H, KP2=triton.next_power_of_2(H), ADD=True, PARTS=parts,
                                   **pdl_options(add))  # fmt: skip
        return self.normed[:T]

    def _residual_product(self, name: str, x: torch.Tensor, proj) -> torch.Tensor:
        """o's or down's product for the next norm to add: one product into a buffer, or float32 partials over K's
        slices (k_splits; not with a bias, which the one product adds)."""
        T, splits = x.shape[0], self.k_splits[name]
        stream = stream_launch(self.stream, name, x, proj.weight, proj.bias)
        if stream is not None:
            return stream_mm(x, proj.weight, stream, self.residual_out[:T])
        if splits > 1 and proj.bias is None:
            return split_k_mm(x, proj.weight, splits)
        return _mm(x, proj.weight, proj.bias, self.residual_out[:T])

    @torch.inference_mode()
    def __call__(self, embeds, hidden, cos, sin, slots, mask) -> tuple[torch.Tensor, torch.Tensor]:
        c, layer, attn, mlp = self.config, self.layer, self.layer.self_attn, self.layer.mlp
        T, H, D = embeds.shape[0], c.hidden_size, c.head_dim
        if not 1 <= T <= self.rows:
            raise ValueError(f"this fused draft step runs 1..{self.rows} rows, not {T}")
        emb, hid = embeds.to(self.h.dtype).contiguous(), hidden.contiguous()
        emb_norm, hid_norm = layer.input_layernorm, layer.hidden_norm
        _draft_input_kernel[(T,)](emb, hid, emb_norm.weight, hid_norm.weight, self.x, self.h, emb_norm.eps,
                                  hid_norm.eps, K=H, KP2=triton.next_power_of_2(H),
                                  NORM_RESIDUAL=layer.norm_before_residual, **pdl_options(hid))  # fmt: skip
        cos, sin = cos.contiguous(), sin.contiguous()
        wq, bq = attn.qkv_proj.weight, attn.qkv_proj.bias
        stream = stream_launch(self.stream, "qkv", self.x[:T], wq, bq)
        if stream is not None:  # one product, or float32 partials that the RoPE kernel sums
            qkv, parts = stream_mm(self.x[:T], wq, stream, self.qkv_out[:T]), stream[2]
        else:
            qkv, parts = _mm(self.x[:T], wq, bq, self.qkv_out[:T]), 1
        kc, vc = self.cache.k[0], self.cache.v[0]
        _rows_rope_cache_kernel[(T, c.num_heads + 2 * c.num_kv_heads)](qkv, cos, sin, self.q, kc, vc, slots,
                                                                       c.num_heads, c.num_kv_heads, self.cache.size,
                                                                       qkv, qkv.stride(0) if parts > 1 else 0, D=D,
                                                                       PARTS=parts, **pdl_options(qkv))  # fmt: skip
        q, out = self.q[:T].view(T, c.num_heads, D), self.attn[:T].view(T, c.num_heads, D)
        fused_attention(q, kc[0], vc[0], mask, out, self.scratch)
        o = self._residual_product("o", self.attn[:T], attn.o_proj)
        x = self._norm(layer.post_attention_layernorm, T, o)
        wg, bg = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
        stream = stream_launch(self.stream, "gate_up", x, wg, bg)
        gate_up = stream_mm(x, wg, stream, self.gate_up_out[:T]) if stream else _mm(x, wg, bg, self.gate_up_out[:T])
        F = c.intermediate_size
        _rows_silu_mul_kernel[(T, triton.cdiv(F, 1024))](gate_up, self.act, F, BLOCK=1024, **pdl_options(gate_up))
        down = self._residual_product("down", self.act[:T], mlp.down_proj)
        normed = self._norm(self.draft.norm, T, down)  # self.h is now the step's pre-norm output
        return (normed if c.norm_output else self.h[:T]), normed
