"""The EAGLE-3 draft layer with Llama attention (`LlamaForCausalLMEagle3`): the original EAGLE-3 draft.

x   = cat(input_layernorm(embed(token)), hidden_norm(h))    [T, 2H], embedding first
h'  = r + o_proj(attn(x))       r = h (or hidden_norm(h) with norm_before_residual)
out = h' + mlp(post_attention_layernorm(h'))
"""

from __future__ import annotations

import torch
from torch import nn

from eaglescope.models.drafts.config import DraftConfig
from eaglescope.models.targets.llama import (
    MLP,
    KVCache,
    LlamaArgs,
    QKVProjection,
    RMSNorm,
    apply_rope,
    attend,
    rope_cos_sin,
)


class DraftAttention(QKVProjection):
    """Llama attention whose q/k/v read the 2H concatenation [embedding, hidden]."""

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self._init_qkv(2 * c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def rotated_qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, 2H] → q [B, H, T, D] and k, v [B, Hkv, T, D], RoPE applied to q and k."""
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, mask, cache: KVCache, start: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.rotated_qkv(x, cos, sin)
        k, v = cache.write(0, start, k, v)
        y = attend(q, k, v, mask, self.attention_impl)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def draft_mlp(c: DraftConfig) -> MLP:
    """The draft's SwiGLU MLP (gate/up/down), the same for both attention kinds."""
    args = LlamaArgs("llama", c.vocab_size, c.hidden_size, c.intermediate_size, 1, c.num_heads, c.num_kv_heads,
                     c.head_dim, c.rms_norm_eps, c.max_position_embeddings, c.rope)  # fmt: skip
    return MLP(args)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer; subclasses change the attention, its RoPE and its cache (models/drafts/mla.py)."""

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.self_attn = self.attention(c)
        self.mlp = draft_mlp(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.init_rope(c)

    def attention(self, c: DraftConfig) -> nn.Module:
        return DraftAttention(c)

    def init_rope(self, c: DraftConfig) -> None:
        self.register_buffer("inv_freq", c.rope.inv_freq(c.head_dim, c.max_position_embeddings), persistent=False)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def new_cache(self, c: DraftConfig, batch: int, max_len: int, dtype, device) -> KVCache:
        return KVCache(1, batch, c.num_kv_heads, max_len, c.head_dim, dtype, device)

    # The layer in three parts around its attention (whose keys go through a cache the caller owns), so that training
    # can compile the parts that are elementwise work and products and leave the attention to its own kernel
    # (train/compiled.py).
    def attention_input(self, embeds, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """→ the attention's input [B, T, 2H], embedding first, and the residual [B, T, H]."""
        normed_hidden = self.hidden_norm(hidden)
        # The embedding never enters the residual stream: the residual is the feature h.
        residual = normed_hidden if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1), residual

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, embeds, hidden, cos, sin, mask, cache, start) -> torch.Tensor:
        x, residual = self.attention_input(embeds, hidden)
        return self.feed_forward(residual + self.self_attn(x, cos, sin, mask, cache, start))


__all__ = ["Eagle3Layer", "DraftAttention", "draft_mlp"]
