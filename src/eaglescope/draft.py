"""The EAGLE-3 draft model (`LlamaForCausalLMEagle3`), its contract, and checkpoint I/O.

    step 0:  h = fc(aux)                      aux = cat(taps low→high)  [T, nH] → [T, H]
    step k:  h = own pre-norm output of step k-1 (fc is never applied again)
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))    [T, 2H], embedding first
    h'     = h + o_proj(attn(x));  out = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(out))   over the draft vocabulary; target id = draft id + d2t[draft id]

Training (TTT) and decoding both call `Eagle3Draft.step`; only the attention mask and the
cache slots differ. That shared forward is what makes the train/decode equality test possible.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from eaglescope.data.vocab import validate_vocab_map
from eaglescope.errors import EagleScopeError
from eaglescope.outputs import read_json, staged_dir
from eaglescope.taps import TapContract, engine_capture
from eaglescope.target.base import TargetFingerprint
from eaglescope.target.llama import (
    MLP,
    KVCache,
    LlamaArgs,
    QKVProjection,
    RMSNorm,
    RopeSpec,
    apply_rope,
    attend,
    rope_cos_sin,
)
from eaglescope.target.loading import check_dir, check_finite, load_state_dict, read_config

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class DraftContract:
    """What the draft was trained under; saved as the `eaglescope` section of config.json."""

    taps: TapContract
    target: TargetFingerprint | None = None
    ttt_length: int | None = None
    loss_mask_shift: str | None = None  # "shifted" | "unshifted"
    draft_vocab_source: str | None = None
    inferred: bool = False  # True when loaded from a checkpoint without an eaglescope section
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "format_version": 1,
            "taps": self.taps.to_dict(),
            "target": self.target.to_dict() if self.target else None,
            "ttt_length": self.ttt_length,
            "loss_mask_shift": self.loss_mask_shift,
            "draft_vocab_source": self.draft_vocab_source,
            **self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict) -> DraftContract:
        known = {"format_version", "taps", "target", "ttt_length", "loss_mask_shift", "draft_vocab_source"}
        return cls(
            taps=TapContract.from_dict(d["taps"]),
            target=TargetFingerprint.from_dict(d["target"]) if d.get("target") else None,
            ttt_length=d.get("ttt_length"),
            loss_mask_shift=d.get("loss_mask_shift"),
            draft_vocab_source=d.get("draft_vocab_source"),
            extra={k: v for k, v in d.items() if k not in known},
        )


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

    @classmethod
    def for_target(cls, target_cfg: dict, taps: TapContract, draft_vocab_size: int) -> DraftConfig:
        """The usual EAGLE-3 shape: one decoder layer of the target's own width."""
        a = (
            LlamaArgs.from_hf_config({**target_cfg, "model_type": "llama"})
            if target_cfg.get("model_type") not in ("llama", "qwen2", "qwen3", "mistral")
            else LlamaArgs.from_hf_config(target_cfg)
        )
        return cls.from_target_args(a, taps, draft_vocab_size)

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
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
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
        eagle_config: dict = {"use_aux_hidden_state": True}
        if tap_ids is not None:
            eagle_config["eagle_aux_hidden_state_layer_ids"] = list(tap_ids)
        cfg["eagle_config"] = eagle_config
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict, fc_in: int | None = None) -> DraftConfig:
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            target_hidden = int(cfg.get("target_hidden_size") or hidden)
            num_aux = 3 if fc_in is None else fc_in // target_hidden
            return cls(
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_heads=n_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or hidden // n_heads),
                vocab_size=int(cfg["vocab_size"]),
                draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
                target_hidden_size=target_hidden,
                num_aux=num_aux,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rope=RopeSpec.from_hf_config(cfg),
                norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            )
        except KeyError as e:
            raise EagleScopeError(f"draft config.json lacks required key {e.args[0]!r}") from None


class DraftAttention(QKVProjection):
    """Llama attention whose q/k/v read the 2H concatenation [embedding, hidden]."""

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self._init_qkv(2 * c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache, start: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cache.write(0, start, k, v)
        y = attend(q, k, v, mask, self.attention_impl)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Eagle3Layer(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.self_attn = DraftAttention(c)
        self.mlp = MLP(
            LlamaArgs(
                "llama",
                c.vocab_size,
                c.hidden_size,
                c.intermediate_size,
                1,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                c.rms_norm_eps,
                c.max_position_embeddings,
                c.rope,
            )
        )
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, embeds, hidden, cos, sin, mask, cache, start) -> torch.Tensor:
        normed_hidden = self.hidden_norm(hidden)
        # The embedding never enters the residual stream: the residual is the feature h.
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        h = residual + self.self_attn(x, cos, sin, mask, cache, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        c = self.config = config
        # A frozen copy of the target's embedding; engines swap in the target's own at load time.
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(c.num_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("inv_freq", c.rope.inv_freq(c.head_dim, c.max_position_embeddings), persistent=False)

    # -- the shared forward ------------------------------------------------------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc: the target's concatenated taps [.., nH] → draft features [.., H]. Step 0 only."""
        return self.fc(aux)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        p = self.fc.weight
        return KVCache(1, batch, c.num_kv_heads, max_len, c.head_dim, p.dtype, p.device)

    def step(
        self,
        embeds: torch.Tensor,  # [B, T, H] target embeddings of the tokens paired with `hidden`
        hidden: torch.Tensor,  # [B, T, H] fc(aux) at step 0, own pre-norm output afterwards
        positions: torch.Tensor,  # [B, T] RoPE positions
        cache: KVCache,  # keys/values of every earlier query this one may see
        start: int,  # cache slot where this call's keys go
        mask: torch.Tensor,  # [B|1, 1, T, start+T] bool, True = attend
    ) -> torch.Tensor:
        """One draft layer application → pre-norm output [B, T, H] (what the next step receives)."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, hidden.dtype)
        return self.midlayer(embeds.to(hidden.dtype), hidden, cos, sin, mask, cache, start)

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits from a pre-norm output."""
        return self.lm_head(self.norm(hidden_out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- vocabulary map ----------------------------------------------------------------
    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        validate_vocab_map(d2t, t2d, self.config.vocab_size, self.config.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def load_target_embedding(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise EagleScopeError(
                f"target embedding has shape {tuple(weight.shape)}, "
                f"draft expects {tuple(self.embed_tokens.weight.shape)}"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)


# -- checkpoint I/O --------------------------------------------------------------------------
WEIGHT_NAMES = (
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


@dataclass
class LoadedDraft:
    model: Eagle3Draft
    contract: DraftContract
    has_embedding: bool
    path: Path
    hf_config: dict


def eaglescope_section(path: Path) -> dict | None:
    """The `eaglescope` section of a checkpoint directory's config.json, or None."""
    cfg = read_json(Path(path) / "config.json")
    section = None if cfg is None else cfg.get("eaglescope")
    return section if isinstance(section, dict) else None


def save_draft(
    model: Eagle3Draft,
    contract: DraftContract,
    out: Path | str,
    save_embedding: bool = False,
    tap_ids: list[int] | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Save in the LlamaForCausalLMEagle3 format + `eaglescope` section.

    Layer ids: default taps ([2, L//2, L-3]) are left unwritten, which every engine reads correctly (legacy
    SGLang adds +1 to explicit ids); other taps are written in vLLM's convention (= HF indices) unless
    `tap_ids` says otherwise. `eaglescope export --to sglang|vllm` writes each engine's own convention."""
    out = Path(out)
    if tap_ids is None and not contract.taps.is_default:
        tap_ids = list(contract.taps.layers)
    with staged_dir(out) as tmp:
        cfg = model.config.to_hf_config(tap_ids)
        cfg["eaglescope"] = contract.to_dict()
        sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k in WEIGHT_NAMES}
        if save_embedding:
            sd["embed_tokens.weight"] = model.embed_tokens.weight.detach().contiguous().cpu()
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return out


def infer_contract(cfg: dict, num_layers: int | None, source: str) -> DraftContract:
    """A contract for a checkpoint without an eaglescope section (official EAGLE, SpecForge, …)."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if num_layers is None:
        raise EagleScopeError(
            "this draft has no eaglescope section, so the target's layer count is unknown: pass --target"
        )
    # SpecForge writes "output of layer i" ids; without an eaglescope section assume that convention
    # when ids are present (what SGLang-era checkpoints mean), otherwise the engines' shared default.
    engine = "specforge" if ids is not None else "vllm"
    taps = TapContract(tuple(engine_capture(ids, engine, num_layers)), num_layers)
    return DraftContract(
        taps=taps,
        inferred=True,
        draft_vocab_source=source,
        extra={"inferred_from": f"{engine} convention" if ids is not None else "engine default"},
    )


def load_draft(
    path: Path | str,
    target_num_layers: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedDraft:
    path = check_dir(path, "draft")
    cfg = read_config(path)
    archs = cfg.get("architectures") or []
    if archs and not any("Eagle3" in a or "Eagle" in a for a in archs):
        raise EagleScopeError(f"{path} holds a {archs[0]} checkpoint, not an EAGLE-3 draft ({ARCHITECTURE})")
    sd = load_state_dict(path)
    check_finite(sd, path)
    # Strip "model." first so that "model.layers.0.*" is renamed too.
    sd = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in sd.items()}
    sd = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v for k, v in sd.items()}
    if "fc.weight" not in sd:
        raise EagleScopeError(f"{path} has no fc.weight: not an EAGLE-3 draft checkpoint")
    config = DraftConfig.from_hf_config(cfg, fc_in=sd["fc.weight"].shape[1])
    section = cfg.get("eaglescope")
    if section is not None:
        try:
            if not isinstance(section, dict):
                raise TypeError(f"it is a {type(section).__name__}, not an object")
            contract = DraftContract.from_dict(section)
        except (KeyError, TypeError, ValueError, AttributeError, EagleScopeError) as e:
            raise EagleScopeError(f"the eaglescope section of {path}/config.json is malformed ({e})") from None
        if target_num_layers is not None and contract.taps.num_layers != target_num_layers:
            raise EagleScopeError(
                f"the draft was trained for a {contract.taps.num_layers}-layer target; this target has "
                f"{target_num_layers} layers"
            )
    else:
        contract = infer_contract(cfg, target_num_layers, "checkpoint")
        warnings.warn(
            f"{path} has no eaglescope section: contract inferred (taps {list(contract.taps.layers)}, "
            f"{contract.extra['inferred_from']})",
            stacklevel=2,
        )
    if contract.taps.count != config.num_aux:
        raise EagleScopeError(
            f"fc reads {config.num_aux} hidden states of width {config.target_hidden_size} but the contract names "
            f"{contract.taps.count} taps"
        )
    model = Eagle3Draft(config)
    has_embedding = "embed_tokens.weight" in sd
    missing = [k for k in WEIGHT_NAMES if k not in sd and k not in ("d2t", "t2d")]
    if missing:
        raise EagleScopeError(f"draft checkpoint {path} lacks {missing[0]!r}")
    if "d2t" not in sd or "t2d" not in sd:
        if config.draft_vocab_size != config.vocab_size:
            raise EagleScopeError(
                f"draft vocabulary ({config.draft_vocab_size}) is smaller than the target's ({config.vocab_size}) but "
                "the checkpoint has no d2t/t2d map: engines would map draft ids to the first target ids"
            )
        sd.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        sd.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
    expected = model.state_dict()
    for k, t in sd.items():
        if k in expected and tuple(t.shape) != tuple(expected[k].shape):
            raise EagleScopeError(
                f"draft weight {k!r} has shape {tuple(t.shape)}, config implies {tuple(expected[k].shape)}"
            )
    t2d = sd["t2d"]
    sd["t2d"] = t2d.bool() if t2d.dtype != torch.bool else t2d
    validate_vocab_map(sd["d2t"], sd["t2d"], config.vocab_size, config.draft_vocab_size)
    model.load_state_dict({k: v for k, v in sd.items() if k in expected}, strict=False)
    model = model.to(device=device, dtype=dtype)
    model.d2t = model.d2t.long()
    model.t2d = model.t2d.bool()
    model.inv_freq = model.inv_freq.float()
    return LoadedDraft(model.eval(), contract, has_embedding, path, cfg)


def check_draft_matches_target(contract: DraftContract, target_fp: TargetFingerprint) -> None:
    """Refuse a draft trained for a different target (the fingerprint it recorded)."""
    fp = contract.target
    if contract.taps.num_layers != target_fp.num_layers:
        raise EagleScopeError(
            f"draft taps are for a {contract.taps.num_layers}-layer target; this target has {target_fp.num_layers}"
        )
    if fp is None:
        return
    for name in ("vocab_size", "hidden_size", "num_layers"):
        if getattr(fp, name) != getattr(target_fp, name):
            raise EagleScopeError(
                f"draft was trained for a target with {name}={getattr(fp, name)}; this target has "
                f"{getattr(target_fp, name)}"
            )
    if fp.tokenizer_sha256 and target_fp.tokenizer_sha256 and fp.tokenizer_sha256 != target_fp.tokenizer_sha256:
        raise EagleScopeError("draft was trained with a different tokenizer than this target's (sha256 differs)")
