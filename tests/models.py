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
# TINY's widths with head_dim 32: the fused kernels' tensor-core tiles need D/2 >= 16
WIDE_HEADS = dict(num_attention_heads=2, num_key_value_heads=1)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    # DeepSeek-V3 / Kimi-K2 shape in miniature: multi-head latent attention (q LoRA, compressed KV, rope/nope split)
    # and mixture-of-experts layers after the first dense one; YaRN RoPE as the real models have it
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        {
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "num_key_value_heads": 4,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        },
    ),
}


def make_checkpoint(family: str, out: Path, seed: int = 0, **overrides) -> Path:
    """Save a random `family` model to `out` (safetensors) and return `out`."""
    config_cls, model_cls, extra = FAMILIES[family]
    kw = {**TINY, **extra, **overrides}
    config = config_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init is tiny (std 0.02); scale up so that logits are peaked enough for greedy
    # decoding to be far from ties, which float32 reordering could otherwise flip. Biases (qwen2's q/k/v) start at
    # zero in transformers: drawn here, so a bias dropped or added twice changes the output.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(
        out,
        safe_serialization=True,
        **({"max_shard_size": overrides.pop("_shard", None)} if "_shard" in overrides else {}),
    )
    return out


def fit_checkpoint(path: Path, ids: torch.Tensor, steps: int, lr: float = 3e-3, seq_len: int = 64, batch: int = 16,
                   seed: int = 0) -> None:  # fmt: skip
    """Train the checkpoint at `path` in place (transformers' own forward and loss, AdamW) on windows of the token
    stream `ids`, so that its greedy continuations follow what the stream teaches: a draft trained on a random target
    has almost nothing to learn. config.json is kept as it was (keys transformers does not know survive)."""
    config = (path / "config.json").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len, (batch,), generator=g)
        x = torch.stack([ids[s : s + seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(path, safe_serialization=True)
    (path / "config.json").write_text(config)


# Llama-3-8B's shape (the GPU tests' and benchmarks' realistic scale)
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    max_position_embeddings=2048,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def make_llama8b(out: Path, seed: int = 0, **overrides) -> Path:
    """A random bf16 Llama of LLAMA_8B's shape (`overrides` change it), built on the GPU and saved with save_pretrained
    (~16 GB at full shape). Weights as `make_checkpoint` draws them. Built beside `out` and renamed into place, so an
    `out` that exists is complete and is reused as it is (a benchmark and the GPU tests may share one)."""
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    config = transformers.LlamaConfig(**{**LLAMA_8B, **overrides})
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
    model.generation_config.eos_token_id = None  # random weights: no token ends a generation
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    partial.rename(out)
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
