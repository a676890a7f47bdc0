"""Tiny checkpoints for the independent engine: a transformers Llama target (save_pretrained) and an EAGLE-3 draft
written straight in the checkpoint format (config.json + model.safetensors), without eaglescope's draft code."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

TARGET = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def make_target(out: Path, seed: int = 0, **overrides) -> Path:
    """A random Llama saved as a Hugging Face checkpoint. Weights are drawn wider than the default init so that
    greedy decoding is far from ties (float32 reordering cannot flip it)."""
    config = transformers.LlamaConfig(**{**TARGET, **overrides})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.15 if "embed" in name else 1.0 / p.shape[1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name:  # norms around 1, not exactly 1: a normed tap differs from a scaled raw one
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_draft(
    out: Path,
    target_dir: Path,
    seed: int = 0,
    scale: float = 1.0,
    draft_vocab_size: int = 48,
    taps: list[int] | None = None,
    logit_scale: float | None = None,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
    norm_output: bool = False,
) -> Path:
    """An EAGLE-3 draft (LlamaForCausalLMEagle3) for `target_dir` with random weights (std scale/sqrt(fan_in)), a
    reduced vocabulary map (d2t offsets, t2d mask) and the eaglescope contract section naming its taps.

    EAGLE 3.1 options, as the checkpoint format states them: `norm_before_fc` (one RMSNorm over the concatenated
    taps before fc, weight `input_norm.weight`; the flag in `eagle_config` and at the top level), `fc_norm` (one
    RMSNorm per tap segment, `fc_norm.<i>.weight`), `norm_output` (the next step receives the post-norm output)."""
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    H, I = tcfg["hidden_size"], tcfg["intermediate_size"]
    nh, nkv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    hd = H // nh
    L, V = tcfg["num_hidden_layers"], tcfg["vocab_size"]
    taps = taps or [2, L // 2, L - 3]
    g = torch.Generator().manual_seed(seed)

    def lin(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) * scale / i**0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    hot = torch.randperm(V, generator=g)[:draft_vocab_size].sort().values  # the draft's tokens, ascending
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    sd = {
        "fc.weight": lin(H, len(taps) * H),
        "midlayer.self_attn.q_proj.weight": lin(nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": lin(nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": lin(nkv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": lin(H, nh * hd),
        "midlayer.mlp.gate_proj.weight": lin(I, H),
        "midlayer.mlp.up_proj.weight": lin(I, H),
        "midlayer.mlp.down_proj.weight": lin(H, I),
        "midlayer.input_layernorm.weight": norm(H),
        "midlayer.hidden_norm.weight": norm(H),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "norm.weight": norm(H),
        "lm_head.weight": lin(draft_vocab_size, H),
        "d2t": hot - torch.arange(draft_vocab_size),  # offsets: target id = draft id + d2t[draft id]
        "t2d": t2d,
    }
    # drawn after the plain draft's weights: a draft without these options is the same draft as before
    if norm_before_fc:
        sd["input_norm.weight"] = norm(len(taps) * H)
    if fc_norm:
        for i in range(len(taps)):
            sd[f"fc_norm.{i}.weight"] = norm(H)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": H,
        "intermediate_size": I,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "hidden_act": "silu",
        "rms_norm_eps": tcfg["rms_norm_eps"],
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "rope_theta": tcfg.get("rope_theta", 10000.0),
        "rope_scaling": None,
        "vocab_size": V,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": H,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "torch_dtype": "float32",
        # no layer ids: with the default taps every engine captures the right layers (SGLang adds 1 to explicit ones)
        "eagle_config": {"use_aux_hidden_state": True},
        "eaglescope": {
            "format_version": 1,
            "taps": {"layers": list(taps), "index_convention": "hf_output_hidden_states", "num_layers": L},
            "target": None,
            "ttt_length": 7,
        },
    }
    if logit_scale is not None:
        cfg["logit_scale"] = logit_scale
    if norm_before_fc:
        cfg["eagle_config"]["norm_before_fc"] = True
        cfg["norm_before_fc"] = True
    if fc_norm:
        cfg["fc_norm"] = True
    if norm_output:
        cfg["norm_output"] = True
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def greedy_reference(target_dir: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate: the output a lossless speculative decoder must reproduce."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()
