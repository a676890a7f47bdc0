"""The bookkeeping ops of SGLang's speculative path on the CPU (csrc/cpu/spec.cpp in SGLang's sgl-kernel), in plain
torch. Each writes its outputs in place into the tensors SGLang allocated, as the C++ ops do; the docstrings say what
is computed, the unit tests (tests/sglang/kernel_check.py) compare every op with SGLang's own Triton version of it.
Index tensors may be int32 or int64, as in the C++ ops; `req_to_token` is int32, cache locations int64."""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:  # fmt: skip
    """req_to_token[req_pool_indices[b], start[b]:end[b]] = the next end[b] - start[b] entries of out_cache_loc
    (the requests' new KV slots, back to back in batch order)."""
    taken = 0
    for b in range(req_pool_indices.shape[0]):
        s, e = int(start_offset[b]), int(end_offset[b])
        req_to_token[int(req_pool_indices[b]), s:e] = out_cache_loc[taken : taken + e - s].to(req_to_token.dtype)
        taken += e - s


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:  # fmt: skip
    """The reverse gather: out_cache_loc = req_to_token[req_pool_indices[b], start[b]:end[b]] for every b, back to
    back, as int64."""
    taken = 0
    for b in range(req_pool_indices.shape[0]):
        s, e = int(start_offset[b]), int(end_offset[b])
        out_cache_loc[taken : taken + e - s] = req_to_token[int(req_pool_indices[b]), s:e].long()
        taken += e - s


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk,
                                           num_steps) -> None:  # fmt: skip
    """The n = topk * num_steps draft slots reserved after each request's committed tokens:
    out_cache_loc[b * n : (b + 1) * n] = req_to_token[req_pool_indices[b], seq_lens[b] : seq_lens[b] + n]."""
    n = topk * num_steps
    for b in range(req_pool_indices.shape[0]):
        s = int(seq_lens[b])
        out_cache_loc[b * n : (b + 1) * n] = req_to_token[int(req_pool_indices[b]), s : s + n].long()


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, num_steps,
                                    pool_len) -> torch.Tensor:  # fmt: skip
    """A req_to_token table for the multi-step draft: row b * topk + t holds request b's committed prefix and then
    candidate t's num_steps draft slots (laid out at seq_len + t * num_steps). Entries past those are zero (the C++
    op leaves them undefined; nothing reads them)."""
    out = torch.zeros((req_pool_indices.shape[0] * topk, pool_len), dtype=req_to_token.dtype)
    for b in range(req_pool_indices.shape[0]):
        src, s = req_to_token[int(req_pool_indices[b])], int(seq_lens[b])
        for t in range(topk):
            row = out[b * topk + t]
            row[:s] = src[:s]
            row[s : s + num_steps] = src[s + t * num_steps : s + (t + 1) * num_steps]
    return out


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """bonus_tokens[b] = the last accepted token of request b: accept_tokens.flat[b * stride + accept_lens[b] - 1]
    (accept_lens counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    idx = torch.arange(accept_lens.shape[0]) * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(flat[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc, size=None) -> None:
    """The KV slots of the accepted tokens, in order: out_cache_loc at every accept_index entry that is not -1,
    packed to the front of accept_out_cache_loc."""
    idx = accept_index.reshape(-1)[: accept_index.numel() if size is None else size].long()
    kept = out_cache_loc[idx[idx != -1]]
    accept_out_cache_loc[: kept.numel()] = kept


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict) -> None:  # fmt: skip
    """Greedy verify of each request's draft tree. From the root, repeatedly take the first child (then its
    siblings, in link order) whose draft token equals the target's argmax at the last accepted node; stop when none
    does or after accept_index.shape[1] - 1 accepted drafts. Writes accept_index[b] (flat node indices from the
    root, the rest left as they were: SGLang fills -1), accept_token_num[b] (drafts accepted, bonus not counted) and
    predicts[node] = the target's token at every accepted node (the last one's is the bonus token)."""
    steps = accept_index.shape[1]
    target = target_predict.reshape(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = int(retrive_next_token[b, cur])
            while cur != -1 and int(candidates[b, cur]) != int(target[last]):
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
            predicts[last] = target[last]
            accepted += 1
            last = int(retrive_index[b, cur])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = target[last]


def _parent_node(selected: list[int], parents: list[int], topk: int, node: int) -> int:
    """The tree node (0 = the root) that node `node` >= 1 hangs from, or len(selected) + 1 when its parent was not
    among the selected nodes. Node i is the expansion entry selected[i - 1]; entry e's parent is parents[e // topk]."""
    parent_slot = selected[node - 1] // topk
    if parent_slot == 0:
        return 0
    parent_token = parents[parent_slot]
    return selected.index(parent_token) + 1 if parent_token in selected else len(selected) + 1


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrive_index, retrive_next_token, retrive_next_sibling, topk, depth,
                                    draft_token_num, tree_mask_mode) -> None:  # fmt: skip
    """The verify tree from the draft's top-k expansion. Node 0 is the root (the last verified token); node i >= 1
    is selected_index[b, i - 1], a flat index into the expansion whose parent is parent_list[b, index // topk]
    (0 meaning the root). Writes, per request: positions (seq_len + depth), retrive_index (flat node ids),
    retrive_next_token (first child) and retrive_next_sibling (SGLang pre-fills both with -1; a node's children are
    linked in the order they were selected), and the tree mask (each node sees the root and its ancestors):
    mode 0 (FULL_MASK) a [draft_token_num, seq_len + draft_token_num] block per request whose prefix columns SGLang
    pre-filled, mode 1 (QLEN_ONLY) a [draft_token_num, draft_token_num] block per request."""
    if tree_mask_mode not in (0, 1):
        raise NotImplementedError("sgl_kernel stand-in: only FULL_MASK (0) and QLEN_ONLY (1) tree masks")
    n = draft_token_num
    mask_offset = 0
    for b in range(parent_list.shape[0]):
        seq_len = int(verified_seq_len[b])
        sel = [int(x) for x in selected_index[b, : n - 1]]
        parents = [int(x) for x in parent_list[b]]
        positions[b * n] = seq_len
        retrive_index[b, 0] = b * n
        for node in range(n - 1, 0, -1):
            retrive_index[b, node] = b * n + node
            p = _parent_node(sel, parents, topk, node)
            if p == n:
                continue
            retrive_next_sibling[b, node] = retrive_next_token[b, p]  # -1 for a first child
            retrive_next_token[b, p] = node
        width = seq_len + n if tree_mask_mode == 0 else n
        prefix = seq_len if tree_mask_mode == 0 else 0
        block = tree_mask[mask_offset : mask_offset + n * width].view(n, width)
        mask_offset += n * width
        block[:, prefix:] = False
        block[:, prefix] = True
        for node in range(1, n):
            depth_of, cur = 0, node
            while cur not in (0, n):  # n: an ancestor that was not selected ends the path
                block[node, prefix + cur] = True
                depth_of += 1
                cur = _parent_node(sel, parents, topk, cur)
            positions[b * n + node] = seq_len + depth_of


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """Move KV rows inside every layer's buffer: row tgt_loc[i] = row src_loc[i]. SGLang passes the buffers as raw
    addresses (data_ptrs, int64/uint64) with each buffer's row size in bytes (strides), so the copy is by address.
    Every source row is read before any target row is written, so a row that is both reads its old contents."""
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(ptr + s * stride, stride) for s in src_loc.tolist()]
        for t, row in zip(tgt_loc.tolist(), rows, strict=True):
            ctypes.memmove(ptr + t * stride, row, stride)


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """SGLang's graph runners keep weak references to graph outputs. Plain torch has none for tensors: this returns
    an alias (a strong reference), which only keeps memory alive longer."""
    return tensor.view(tensor.shape)
