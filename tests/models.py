"""Tiny random checkpoints built with transformers and saved the way users' checkpoints are."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
}


def make_checkpoint(family: str, out: Path, seed: int = 0, **overrides) -> Path:
    """Save a random `family` model to `out` (safetensors) and return `out`."""
    config_cls, model_cls, extra = FAMILIES[family]
    kw = {**TINY, **extra, **overrides}
    config = config_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init is tiny (std 0.02); scale up so that logits are peaked enough for greedy
    # decoding to be far from ties, which float32 reordering could otherwise flip.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
    model.save_pretrained(
        out,
        safe_serialization=True,
        **({"max_shard_size": overrides.pop("_shard", None)} if "_shard" in overrides else {}),
    )
    return out


def load_hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def attention_case(T: int, S: int, rep: int, seed: int, density: float):
    """Random grouped-query attention inputs over a slot cache: q [1, 2*rep, T, 16], k/v [1, 2, S, 16], and a
    mask [T, S] keeping each slot with probability `density` (every row keeps at least one)."""
    g = torch.Generator().manual_seed(seed)
    hkv, D = 2, 16
    q = torch.randn(1, hkv * rep, T, D, generator=g)
    k, v = torch.randn(1, hkv, S, D, generator=g), torch.randn(1, hkv, S, D, generator=g)
    mask = torch.rand(T, S, generator=g) < density
    mask[torch.arange(T), torch.randint(0, S, (T,), generator=g)] = True
    return q, k, v, mask
