"""What a draft is: its architecture (the layer: Llama attention or multi-head latent attention), its shapes, and the
EAGLE 3.1 options, read from and written to a checkpoint's config.json in the engines' own key names.

EAGLE 3.1 options (vLLM 0.32 `model_executor/models/llama_eagle3.py` and `deepseek_eagle3.py`, speculators, SGLang):
- `norm_before_fc`: one RMSNorm over the whole concatenated target features [.., nH] before fc (weight
  `input_norm.weight`; vLLM reads it from `eagle_config`, else the top level). vLLM's DeepSeek (MLA) draft does
  not implement it.
- `fc_norm`: one RMSNorm per tap segment [.., H] before fc (weights `fc_norm.<i>.weight`).
- `norm_output`: the next draft step receives the layer's *post*-norm output instead of the pre-norm one (the
  logits are the final norm's output either way).
- `norm_before_residual`: the residual is hidden_norm(h) instead of h.
- `logit_scale`: the logits are multiplied by it (vLLM's LogitsProcessor scale).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.llama import LlamaArgs, RopeSpec
from eaglescope.taps import TapContract

LLAMA_ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"  # vLLM's registry maps it to deepseek_eagle3.py
SGLANG_MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # the one name SGLang 0.5.23 registers (kimi_k25_eagle3.py)
MLA_TARGET_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
DRAFT_ARCHS = ("llama", "mla")


@dataclass
class MLASpec:
    """Multi-head latent attention shapes (DeepSeek-V2/V3): a low-rank query and a compressed, shared KV latent."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> MLASpec:
        try:
            params = dict(cfg.get("rope_parameters") or {})
            if not params:
                params = dict(cfg.get("rope_scaling") or {})
                params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
            params.setdefault("rope_type", params.pop("type", "default") or "default")
            q = cfg.get("q_lora_rank")
            return cls(
                q_lora_rank=None if q in (None, 0) else int(q),
                kv_lora_rank=int(cfg["kv_lora_rank"]),
                qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                v_head_dim=int(cfg["v_head_dim"]),
                rope_interleave=bool(cfg.get("rope_interleave", True)),
                rope_parameters=params,
            )
        except KeyError as e:
            raise EagleScopeError(f"an MLA config needs {e.args[0]!r} (DeepSeek-V2/V3 attention shapes)") from None

    def to_hf_config(self) -> dict:
        rope = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
        return {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_interleave": self.rope_interleave,
            "rope_theta": float(self.rope_parameters.get("rope_theta", 10000.0)),
            "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        }


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    num_aux: int = 3
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope: RopeSpec = field(default_factory=RopeSpec)
    norm_before_residual: bool = False
    arch: str = "llama"  # the draft layer: "llama" (models/drafts/llama.py) or "mla" (models/drafts/mla.py)
    mla: MLASpec | None = None
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.arch not in DRAFT_ARCHS:
            raise EagleScopeError(f"unknown draft architecture {self.arch!r}; choose one of {', '.join(DRAFT_ARCHS)}")
        if self.arch == "mla" and self.mla is None:
            raise EagleScopeError("an MLA draft needs its attention shapes (q/kv LoRA ranks, rope/nope/v head dims)")

    @property
    def architecture(self) -> str:
        return MLA_ARCHITECTURE if self.arch == "mla" else LLAMA_ARCHITECTURE

    @property
    def eagle31(self) -> dict[str, bool]:
        return {"norm_before_fc": self.norm_before_fc, "fc_norm": self.fc_norm, "norm_output": self.norm_output}

    @classmethod
    def for_target(
        cls, target_cfg: dict, taps: TapContract, draft_vocab_size: int, arch: str = "llama", **options
    ) -> DraftConfig:
        """The usual EAGLE-3 shape: one decoder layer of the target's own width (`arch` "mla": the target's own
        multi-head latent attention shapes, for DeepSeek-V2/V3 / Kimi-K2 targets). `options`: the EAGLE 3.1 flags
        (norm_before_fc, fc_norm, norm_output)."""
        if arch == "mla":
            if "kv_lora_rank" not in target_cfg:
                raise EagleScopeError(
                    f"--draft-arch mla needs a target with multi-head latent attention (DeepSeek-V2/V3, Kimi-K2); "
                    f"this one is {target_cfg.get('model_type')!r}"
                )
            mla = MLASpec.from_hf_config(target_cfg)  # the target's own shapes and RoPE (YaRN included)
            n_heads = int(target_cfg["num_attention_heads"])
            c = cls(
                hidden_size=int(target_cfg["hidden_size"]),
                intermediate_size=int(target_cfg["intermediate_size"]),
                num_heads=n_heads,
                num_kv_heads=n_heads,  # the latent is expanded per head
                head_dim=mla.qk_head_dim,
                vocab_size=int(target_cfg["vocab_size"]),
                draft_vocab_size=draft_vocab_size,
                target_hidden_size=int(target_cfg["hidden_size"]),
                num_aux=taps.count,
                rms_norm_eps=float(target_cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(target_cfg.get("max_position_embeddings", 2048)),
                arch="mla",
                mla=mla,
            )
        elif arch == "llama":
            a = (
                LlamaArgs.from_hf_config({**target_cfg, "model_type": "llama"})
                if target_cfg.get("model_type") not in ("llama", "qwen2", "qwen3", "mistral")
                else LlamaArgs.from_hf_config(target_cfg)
            )
            c = cls.from_target_args(a, taps, draft_vocab_size)
        else:
            raise EagleScopeError(f"unknown draft architecture {arch!r}; choose one of {', '.join(DRAFT_ARCHS)}")
        for k, v in options.items():
            if k not in ("norm_before_fc", "fc_norm", "norm_output"):
                raise TypeError(f"unknown draft option {k!r}")
            setattr(c, k, bool(v))
        c.__post_init__()
        return c

    @classmethod
    def from_target_args(cls, a: LlamaArgs, taps: TapContract, draft_vocab_size: int) -> DraftConfig:
        return cls(
            hidden_size=a.hidden_size,
            intermediate_size=a.intermediate_size,
            num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            vocab_size=a.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=a.hidden_size,
            num_aux=taps.count,
            rms_norm_eps=a.rms_norm_eps,
            max_position_embeddings=a.max_position_embeddings,
            rope=a.rope,
        )

    def to_hf_config(self, tap_ids: list[int] | None) -> dict:
        cfg = {
            "architectures": [self.architecture],
            # deepseek_v2, not v3, for an MLA draft: vLLM 0.32 rewrites every deepseek_v3 draft config into DeepSeek
            # MTP whatever the method (config/speculative.py, SpeculativeConfig.hf_config_override), and then looks
            # for an "Eagle3DeepSeekMTPModel" no model implements; deepseek_v2 it leaves alone and still reads as
            # MLA. eaglescope tells MLA by kv_lora_rank, not by model_type.
            "model_type": "deepseek_v2" if self.arch == "mla" else "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope.theta,
            "rope_scaling": None
            if self.rope.rope_type == "default"
            else {k: v for k, v in self.rope.params.items() if k != "rope_theta"} | {"rope_type": self.rope.rope_type},
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "norm_before_residual": self.norm_before_residual,
            "torch_dtype": "float32",
        }
        if self.arch == "mla":
            cfg |= self.mla.to_hf_config()
            # one dense layer: DeepSeek configs count MoE layers from first_k_dense_replace; no experts is 0, not
            # null: transformers' DeepseekV2Config types n_routed_experts int, and vLLM's config parser refuses null
            cfg |= {"first_k_dense_replace": 1, "n_routed_experts": 0, "moe_layer_freq": 1}
        eagle_config: dict = {"use_aux_hidden_state": True}
        if tap_ids is not None:
            eagle_config["eagle_aux_hidden_state_layer_ids"] = list(tap_ids)
        # EAGLE 3.1: written where every reader looks (vLLM reads norm_before_fc from eagle_config first, the
        # others at the top level), and only when set, so a plain EAGLE-3 checkpoint stays plain.
        if self.norm_before_fc:
            eagle_config["norm_before_fc"] = True
            cfg["norm_before_fc"] = True
        if self.fc_norm:
            cfg["fc_norm"] = True
        if self.norm_output:
            cfg["norm_output"] = True
        if self.logit_scale != 1.0:
            cfg["logit_scale"] = self.logit_scale
        cfg["eagle_config"] = eagle_config
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict, fc_in: int | None = None) -> DraftConfig:
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            target_hidden = int(cfg.get("target_hidden_size") or hidden)
            num_aux = 3 if fc_in is None else fc_in // target_hidden
            archs = cfg.get("architectures") or []
            is_mla = "kv_lora_rank" in cfg or any("Deepseek" in a for a in archs)
            mla = MLASpec.from_hf_config(cfg) if is_mla else None
            eagle = cfg.get("eagle_config") or {}
            return cls(
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_heads=n_heads,
                num_kv_heads=n_heads if is_mla else int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=mla.qk_head_dim if is_mla else int(cfg.get("head_dim") or hidden // n_heads),
                vocab_size=int(cfg["vocab_size"]),
                draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
                target_hidden_size=target_hidden,
                num_aux=num_aux,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rope=RopeSpec() if is_mla else RopeSpec.from_hf_config(cfg),
                norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                arch="mla" if is_mla else "llama",
                mla=mla,
                norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
                fc_norm=bool(cfg.get("fc_norm", False)),
                norm_output=bool(cfg.get("norm_output", False)),
                logit_scale=float(cfg.get("logit_scale") or 1.0),
            )
        except KeyError as e:
            raise EagleScopeError(f"draft config.json lacks required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise EagleScopeError(f"draft config.json is malformed ({e})") from None


__all__ = ["DraftConfig", "MLASpec", "LLAMA_ARCHITECTURE", "MLA_ARCHITECTURE", "DRAFT_ARCHS", "MLA_TARGET_TYPES"]
