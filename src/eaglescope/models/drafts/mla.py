"""The EAGLE-3 draft layer with multi-head latent attention (MLA), for DeepSeek-V2/V3 and Kimi-K2 targets
(vLLM `Eagle3DeepseekV3ForCausalLM`, model_executor/models/deepseek_eagle3.py; SGLang since its PR 25454).

The layer is the Llama draft layer (models/drafts/llama.py) with DeepSeek's attention reading the 2H input:

    q        = q_b(q_a_layernorm(q_a(x)))  (or q_proj(x) without a q LoRA rank)   → [nope | rope] per head
    [c, k_r] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)     a latent c [kv_lora_rank] and one shared rope key
    [k_n, v] = kv_b(c)                                           per head: k = [k_n | k_r], v
    scale    = (nope + rope)^-1/2 · mscale²  (YaRN)

RoPE on the rope parts only, interleaved pairs when `rope_interleave` (DeepSeek's layout), with the target's own
RoPE/YaRN settings: cos/sin come from transformers' DeepseekV3RotaryEmbedding, so they equal the target's exactly
(a mismatched YaRN setting is a known cause of a dead MLA draft, TorchSpec issues 54, 58, 61). The cache keeps the
expanded per-head keys and values: the draft has one layer, and its cache is small beside the target's."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
    yarn_apply_mscale,
)

from eaglescope.models.drafts.config import DraftConfig
from eaglescope.models.drafts.llama import Eagle3Layer
from eaglescope.models.targets.llama import KVCache, RMSNorm, attend


def rotary_config(c: DraftConfig) -> DeepseekV3Config:
    """The transformers config whose rotary embedding is the target's (only the RoPE fields matter)."""
    m = c.mla
    return DeepseekV3Config(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        qk_rope_head_dim=m.qk_rope_head_dim,
        qk_nope_head_dim=m.qk_nope_head_dim,
        v_head_dim=m.v_head_dim,
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=dict(m.rope_parameters),
        rope_interleave=m.rope_interleave,
    )


class MLAAttention(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        m = self.mla = c.mla
        H, d_in = c.num_heads, 2 * c.hidden_size
        self.n_heads = H
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(d_in, H * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_in, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d_in, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, c.hidden_size, bias=False)
        self.scaling = yarn_apply_mscale(m.rope_parameters, m.qk_head_dim**-0.5)
        self.attention_impl = "sdpa"

    def forward(self, x, cos, sin, mask, cache: KVCache, start: int) -> torch.Tensor:
        m, H = self.mla, self.n_heads
        B, T, _ = x.shape
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, m.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_rot = k_rot.view(B, 1, T, m.qk_rope_head_dim)
        rope = apply_rotary_pos_emb_interleave if m.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, H, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(B, H, T, m.qk_rope_head_dim)], dim=-1)
        k, v = cache.write(0, start, k, v.contiguous())
        # attend() scales by head_dim^-1/2; DeepSeek's scale carries the YaRN mscale too
        q = torch.cat([q_nope, q_rot], dim=-1) * (self.scaling * m.qk_head_dim**0.5)
        y = attend(q, k, v, mask, self.attention_impl)  # [B, H, T, v_head_dim]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Eagle3MLALayer(Eagle3Layer):
    """The Llama draft layer (norms, residual, MLP) around multi-head latent attention."""

    def attention(self, c: DraftConfig) -> nn.Module:
        return MLAAttention(c)

    def init_rope(self, c: DraftConfig) -> None:
        self.rotary_emb = DeepseekV3RotaryEmbedding(rotary_config(c))

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        return self.rotary_emb(probe, positions)  # [B, T, rope dim]; transformers' apply_* add the heads axis

    def new_cache(self, c: DraftConfig, batch: int, max_len: int, dtype, device) -> KVCache:
        return KVCache(1, batch, c.num_heads, max_len, c.mla.qk_head_dim, dtype, device, v_dim=c.mla.v_head_dim)


__all__ = ["Eagle3MLALayer", "MLAAttention"]
