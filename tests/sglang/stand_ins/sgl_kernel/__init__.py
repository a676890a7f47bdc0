"""This project's stand-ins for the `sgl_kernel` CPU ops SGLang 0.5.23's EAGLE-3 path calls, in plain torch.

SGLang's CPU kernels (sgl-kernel/csrc/cpu in SGLang's repository) are not published as a package: PyPI's
`sglang-kernel` / `sgl-kernel` wheels are CUDA builds. These stand-ins let SGLang's own Python code — its scheduler,
EAGLE worker, draft model, verify step and the `intel_amx` attention backend's Python side — run on a CPU without
them, for eaglescope's tests. SGLang's kernels themselves are therefore NOT exercised: only what they are documented
to compute, re-implemented here and tested against SGLang's Triton versions (tests/sglang/kernel_check.py).

Importable as `sgl_kernel` only where tests/sglang puts this directory on the path (SGLang's processes); nothing of
eaglescope imports it. The two attention ops are reached as `torch.ops.sgl_kernel.*`, so they are registered as torch
operators; the rest are imported by name.
"""

from __future__ import annotations

import torch

from .attention import decode_attention_cpu, extend_attention_cpu
from .spec import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
    weak_ref_tensor,
)

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "decode_attention_cpu",
    "extend_attention_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
    "weak_ref_tensor",
]

# The argument lists intel_amx_backend.py passes, in order.
_SCHEMAS = {
    "decode_attention_cpu": (
        decode_attention_cpu,
        "(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, float v_scale, Tensor(c!) output, "
        "Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window, "
        "Tensor? encoder_lens, Tensor? sinks) -> ()",
    ),
    "extend_attention_cpu": (
        extend_attention_cpu,
        "(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
        "Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int? max_len_extend, float sm_scale, "
        "float logit_cap, bool is_cross_attn, int sliding_window, Tensor? encoder_lens, Tensor? sinks, "
        "Tensor? custom_mask, bool is_causal) -> ()",
    ),
}

_LIB = torch.library.Library("sgl_kernel", "DEF")
for _name, (_fn, _schema) in _SCHEMAS.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _fn, "CPU")
