"""Paged attention over SGLang's KV pool, in plain torch: what the `intel_amx` backend asks of `decode_attention_cpu`
and `extend_attention_cpu` (srt/layers/attention/intel_amx_backend.py). Each request's keys are the pool rows that
`req_to_token[req_pool_indices[b], :seq_lens[b]]` names; query heads share kv heads in groups (GQA, and MLA's one
latent head). One request at a time, float32 arithmetic: slow and exact, for tiny test models only.

Not implemented, and refused rather than approximated: sliding windows, attention sinks, cross-attention.
"""

from __future__ import annotations

import torch


def _refuse_unsupported(sliding_window: int, sinks: torch.Tensor | None, is_cross_attn: bool) -> None:
    # SGLang passes `sliding_window_size + 1`, so 0 is "no window" (sliding_window_size = -1).
    if sliding_window > 0 or sinks is not None or is_cross_attn:
        raise NotImplementedError("sgl_kernel stand-in: sliding windows, sinks and cross-attention are not supported")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, logit_cap: float,
            visible: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv], visible [Tq, Tk] bool or None → [Tq, Hq, Dv] (float32)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if logit_cap > 0:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)


def decode_attention_cpu(q, k_buffer, v_buffer, k_scale, v_scale, output, key, value, loc, attn_logits, req_to_token,
                         req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attn, sliding_window, encoder_lens,
                         sinks) -> None:  # fmt: skip
    """One new query token per request. When `key`/`value` are given they are first written to the pool at `loc`
    (the backend leaves that write to the kernel). `attn_logits` is the kernel's scratch space: unused here."""
    _refuse_unsupported(sliding_window, sinks, is_cross_attn)
    if key is not None:
        k_buffer[loc] = key.to(k_buffer.dtype)
        if value is not None and v_buffer.data_ptr() != k_buffer.data_ptr():  # MLA: the values are a view of the keys
            v_buffer[loc] = value.to(v_buffer.dtype)
    for b in range(q.shape[0]):
        rows = req_to_token[req_pool_indices[b], : int(seq_lens[b])].long()
        k = k_buffer[rows].float() * k_scale
        v = v_buffer[rows].float() * v_scale
        output[b] = _attend(q[b : b + 1], k, v, sm_scale, logit_cap, None)[0].to(output.dtype)


def extend_attention_cpu(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale, req_to_token,
                         req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale,
                         logit_cap, is_cross_attn, sliding_window, encoder_lens, sinks, custom_mask,
                         is_causal) -> None:  # fmt: skip
    """The last `extend_seq_lens[b]` of request b's `seq_lens[b]` tokens are new: their queries attend to the
    cached prefix and, causally, to each other. With `custom_mask` (a tree verify) the mask says instead which new
    tokens each new token sees, the prefix staying visible: SGLang's CPU path builds it QLEN_ONLY
    (srt/speculative/eagle_utils.py default_tree_mask_mode), per request an [extend_len, extend_len] row-major block,
    the blocks back to back. The new tokens' keys come from `k_extend`/`v_extend` (the backend has already stored
    them), or from the pool when those are None."""
    _refuse_unsupported(sliding_window, sinks, is_cross_attn)
    mask_offset = 0
    for b in range(seq_lens.shape[0]):
        seq_len, ext = int(seq_lens[b]), int(extend_seq_lens[b])
        prefix, start = seq_len - ext, int(extend_start_loc[b])
        rows = req_to_token[req_pool_indices[b], :seq_len].long()
        if k_extend is not None and k_extend.shape[1:] != k_buffer.shape[1:]:
            # MLA's prefill runs as ordinary multi-head attention over keys and values the pool does not hold (it
            # holds the latent): the new tokens' own k/v are all there is, so there may be no cached prefix.
            if prefix:
                raise NotImplementedError("sgl_kernel stand-in: MLA multi-head prefill over a cached prefix")
            k, v = k_extend[start : start + ext].float(), v_extend[start : start + ext].float()
        else:
            k = k_buffer[rows].float() * k_scale
            v = v_buffer[rows].float() * v_scale
            if k_extend is not None:
                k[prefix:] = k_extend[start : start + ext].float()
                v[prefix:] = v_extend[start : start + ext].float()
        if custom_mask is not None:
            visible = torch.ones((ext, seq_len), dtype=torch.bool)
            visible[:, prefix:] = custom_mask[mask_offset : mask_offset + ext * ext].view(ext, ext).bool()
            mask_offset += ext * ext
        elif is_causal:
            visible = torch.arange(seq_len)[None, :] <= (prefix + torch.arange(ext))[:, None]
        else:
            visible = None
        q = q_extend[start : start + ext]
        o_extend[start : start + ext] = _attend(q, k, v, sm_scale, logit_cap, visible).to(o_extend.dtype)
