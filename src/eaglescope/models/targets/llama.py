"""Native Llama-family target (Llama, Qwen2, Qwen3, Mistral): static KV cache, tree masks, taps.

Module and parameter names mirror transformers' so a checkpoint's state dict loads as it is.
The cache is written by slot, gpt-fast style: a verify writes its T new keys after the
committed prefix and `commit(keep)` moves the accepted ones down; rejected slots are simply
overwritten by the next forward.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import Target, TargetFingerprint, TargetOutput

NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


@dataclass
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"
    params: dict = field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> RopeSpec:
        # transformers 5 writes `rope_parameters`; older checkpoints use rope_theta + rope_scaling.
        params = dict(cfg.get("rope_parameters") or {})
        if not params:
            params = dict(cfg.get("rope_scaling") or {})
            params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise EagleScopeError(
                f"rope type {rope_type!r} is not supported by the native path (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}); use --backend hf"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise EagleScopeError("partial_rotary_factor != 1 is not supported by the native path; use --backend hf")
        return cls(float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), rope_type, params)

    def inv_freq(self, head_dim: int, max_position_embeddings: int, seq_len: int | None = None) -> torch.Tensor:
        """Inverse frequencies exactly as transformers computes them for this rope type."""
        base = self.theta
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        if self.rope_type == "dynamic":
            # NTK-aware: the base grows once the sequence is longer than the trained context.
            factor = self.params["factor"]
            seq = max(seq_len or 0, max_position_embeddings)
            base = base * ((factor * seq / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
        inv = 1.0 / (base**exponent)
        if self.rope_type == "linear":
            inv = inv / self.params["factor"]
        elif self.rope_type == "llama3":
            factor = self.params["factor"]
            low, high = self.params["low_freq_factor"], self.params["high_freq_factor"]
            old_ctx = self.params["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
            inv = torch.where(medium, smoothed, scaled)
        return inv


@dataclass
class LlamaArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaArgs:
        model_type = cfg.get("model_type")
        if model_type not in NATIVE_MODEL_TYPES:
            raise EagleScopeError(f"model_type {model_type!r} has no native implementation; use --backend hf")
        if cfg.get("hidden_act", "silu") != "silu":
            raise EagleScopeError(f"hidden_act {cfg.get('hidden_act')!r} is not supported by the native path")
        try:
            n_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            sliding = None
            if model_type == "mistral":
                sliding = cfg.get("sliding_window")
            elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
                # Qwen applies the window from layer max_window_layers upwards.
                if cfg.get("max_window_layers", 0) < cfg["num_hidden_layers"]:
                    sliding = cfg.get("sliding_window")
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=n_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or hidden // n_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rope=RopeSpec.from_hf_config(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                sliding_window=int(sliding) if sliding else None,
                architecture=(cfg.get("architectures") or ["LlamaForCausalLM"])[0],
            )
        except KeyError as e:
            raise EagleScopeError(f"config.json lacks required key {e.args[0]!r}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like transformers, then cast back before the weight multiply.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] → cos, sin [B, 1, T, D] (half-split layout, as transformers' Llama)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class KVCache(nn.Module):
    """All layers' keys and values in two buffers [L, B, n_kv, S, D] so compaction is one gather."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        n_kv: int,
        max_len: int,
        head_dim: int,
        dtype,
        device,
        v_dim: int | None = None,
    ) -> None:
        """`v_dim`: the values' head size when it differs from the keys' (multi-head latent attention)."""
        super().__init__()
        shape = (num_layers, batch, n_kv, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        vshape = shape if v_dim is None else (*shape[:-1], v_dim)
        self.register_buffer("v", torch.zeros(vshape, dtype=dtype, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new [B, n_kv, T, D] at slots start..start+T; return everything up to there."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move slots start+keep[j] to start+j (keep is increasing, so sources never get clobbered early)."""
        n = keep.numel()
        src = start + keep.to(self.k.device)
        self.k[:, :, :, start : start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start : start + n] = self.v.index_select(3, src)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl="sdpa") -> torch.Tensor:
    """Attention with grouped-query heads. q [B, H, T, D], k/v [B, Hkv, S, D], mask [B|1, 1, T, S] (None = causal).

    With a mask, the rep = H/Hkv query heads that share a kv head are folded into the query axis, so K/V are read
    once per kv head instead of being copied rep times: at batch 1 the copy of a whole static cache per step
    would cost more memory traffic than the attention itself.

    impl="matmul" (masked, decoding): two batched products and a float32 softmax instead of a fused attention
    kernel. For a handful of query rows a fused kernel is latency-bound (~14 µs per layer at 8B on an H200);
    under torch.compile the plain form becomes a few small fused kernels.

    impl may also be a function (q, k, v, mask) → y: the fast path's kernels (fast/engine.py set_attention), which
    this module does not import."""
    if callable(impl):
        return impl(q, k, v, mask)
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    if mask is None:
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, rep * T, D)  # head h = g*rep + r → group g, rows r*T .. r*T+T-1
    mg = mask.unsqueeze(2).expand(mask.shape[0], 1, rep, T, S).reshape(mask.shape[0], 1, rep * T, S)
    if impl == "matmul":
        scores = (qg @ k.transpose(-1, -2)).float() * D**-0.5
        probs = scores.masked_fill(~mg, float("-inf")).softmax(-1).to(v.dtype)
        y = probs @ v
    else:
        y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mg)
    return y.reshape(B, H, T, v.shape[-1])


class GrowingCache:
    """Same `write` contract as KVCache, but concatenates instead of writing in place, so autograd can see
    every step's keys (training-time test unrolls the draft through it)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        have = 0 if self.k is None else self.k.shape[2]
        if start != have:
            raise ValueError(f"GrowingCache appends only: start {start} != length {have}")
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of `parts`' outputs (same input)."""
    w = torch.cat([p.weight.detach() for p in parts])
    bias = parts[0].bias is not None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=bias, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(w)
        if bias:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    return fused.requires_grad_(parts[0].weight.requires_grad)


class QKVProjection(nn.Module):
    """q/k/v projections under transformers' names; `fuse()` merges them into one matmul for decoding.

    Why fuse: a batch-1 step is a chain of matrix-vector products, and one product over the stacked
    [q; k; v] weight reads the same bytes with one launch instead of three (the small k/v products
    alone run far below memory bandwidth). Inference only: the fused module no longer has the
    checkpoint's parameter names."""

    def _init_qkv(self, d_in: int, n_heads: int, n_kv: int, head_dim: int, bias: bool) -> None:
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(d_in, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_in, n_kv * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_in, n_kv * head_dim, bias=bias)
        self.qkv_proj: nn.Linear | None = None
        self.attention_impl = "sdpa"  # see attend(); the fast path sets its kernels (fast.engine.set_attention)

    def fuse(self) -> None:
        if self.qkv_proj is None:
            self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
            self.q_proj = self.k_proj = self.v_proj = None

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d_in] → q [B, T, H, D], k, v [B, T, Hkv, D]."""
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q, k, v = self.qkv_proj(x).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        hd = self.head_dim
        return q.view(B, T, self.n_heads, hd), k.view(B, T, self.n_kv, hd), v.view(B, T, self.n_kv, hd)


class Attention(QKVProjection):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self._init_qkv(a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.attention_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int, start: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, start, k, v)
        y = attend(q, k, v, mask, self.attention_impl)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """gate and up in one matmul (see QKVProjection: same bytes, one launch). Inference only."""
        if self.gate_up_proj is None:
            self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
            self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up of every layer of `model` (target or draft) in place; returns it."""
    for m in model.modules():
        if isinstance(m, (QKVProjection, MLP)):
            m.fuse()
    return model


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, layer, start) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.args = a
        self.model = LlamaBody(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", a.rope.inv_freq(a.head_dim, a.max_position_embeddings), persistent=False)

    def rope_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        a = self.args
        if a.rope.rope_type == "dynamic":
            seq_len = int(positions.max()) + 1
            if seq_len > a.max_position_embeddings:
                inv_freq = a.rope.inv_freq(a.head_dim, a.max_position_embeddings, seq_len).to(inv_freq.device)
        return rope_cos_sin(inv_freq, positions, self.model.embed_tokens.weight.dtype)

    def forward(
        self,
        idx: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        mask: torch.Tensor | None,  # [B|1, 1, T, S] bool (True = attend) or None = causal without cache
        cache: KVCache | None = None,
        start: int = 0,
        taps: tuple[int, ...] = (),
        head: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """→ logits [B, T, V] (None without `head`), aux [B, T, nH] (None without taps), final normed state [B, T, H]"""
        x = self.model.embed_tokens(idx)
        cos, sin = self.rope_for(positions)
        captured = []
        for i, layer in enumerate(self.model.layers):
            if i in taps:
                captured.append(x)
            x = layer(x, cos, sin, mask, cache, i, start)
        final = self.model.norm(x)
        aux = torch.cat(captured, dim=-1) if captured else None
        return self.lm_head(final) if head else None, aux, final


def _sliding_check(a: LlamaArgs, max_len: int) -> None:
    if a.sliding_window is not None and max_len > a.sliding_window:
        raise EagleScopeError(
            f"this {a.model_type} checkpoint uses sliding-window attention (window {a.sliding_window}); sequences "
            f"longer than the window ({max_len} requested) are not supported by the native path"
        )


class NativeTarget(Target):
    """Llama-family target on eaglescope's own model code."""

    def __init__(self, model: LlamaModel, fingerprint: TargetFingerprint, eos_token_ids: list[int], tokenizer=None):
        self.model = model.eval()
        self.args = model.args
        self.fingerprint = fingerprint
        self.taps = None
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_positions = self.args.max_position_embeddings
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.cache: KVCache | None = None
        self._len = 0
        self._pending = 0

    def reset(self, max_len: int) -> None:
        a = self.args
        _sliding_check(a, max_len)
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = KVCache(a.num_layers, 1, a.num_kv_heads, max_len, a.head_dim, self.dtype, self.device)
        self._len = 0
        self._pending = 0

    @property
    def cache_len(self) -> int:
        return self._len

    @torch.inference_mode()
    def forward(self, tokens, positions=None, tree_mask=None) -> TargetOutput:
        if self.cache is None:
            raise RuntimeError("reset() must be called before forward()")
        T = tokens.shape[0]
        start = self._len
        if start + T > self.cache.max_len:
            raise EagleScopeError(f"sequence of {start + T} tokens exceeds the cache of {self.cache.max_len}")
        if positions is None:
            positions = torch.arange(start, start + T, device=self.device)
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        mask = torch.cat([torch.ones(T, start, dtype=torch.bool, device=self.device), tree_mask.to(self.device)], 1)
        logits, aux, _ = self.model(
            tokens.to(self.device)[None],
            positions.to(self.device)[None],
            mask[None, None],
            self.cache,
            start,
            self.taps.layers if self.taps else (),
        )
        self._pending = T
        return TargetOutput(logits[0].float(), None if aux is None else aux[0])

    def commit(self, keep: torch.Tensor | None = None) -> None:
        if keep is None:
            self._len += self._pending
        else:
            keep = keep.to(self.device)
            if keep.numel() and not bool((keep == torch.arange(keep.numel(), device=self.device)).all()):
                self.cache.compact(self._len, keep)
            self._len += keep.numel()
        self._pending = 0

    @torch.inference_mode()
    def hidden_states(self, input_ids, attention_mask=None, logits: bool = True) -> TargetOutput:
        # Right padding only: causal attention never lets a real token see a pad, so no pad mask is needed.
        B, T = input_ids.shape
        _sliding_check(self.args, T)
        ids = input_ids.to(self.device)
        with whole_sequence_attention(self.device, T) as padded:
            if padded > T:  # more right padding, for the same reason; cut off below
                ids = F.pad(ids, (0, padded - T))
            positions = torch.arange(padded, device=self.device).expand(B, padded)
            taps = self.taps.layers if self.taps else ()
            out = self.model(ids, positions, None, None, 0, taps, head=logits)
        logits, aux, final = (None if t is None else t[:, :T] for t in out)
        return TargetOutput(logits, aux, final)

    @torch.inference_mode()
    def packed_hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[tuple[int, int, int]], logits=True
    ) -> TargetOutput:
        """hidden_states of a packed batch (train/packing.py): rows [R, T] holding several documents, each at
        (row, start, end) of `segments`, with positions restarting in each; attention is causal within each document
        only, so every document's states are those it has alone. Positions outside every segment (padding) get
        states that nothing reads."""
        _sliding_check(self.args, max((b - a for _, a, b in segments), default=0))
        taps = self.taps.layers if self.taps else ()
        with document_attention(self.model, segments):
            out = self.model(input_ids.to(self.device), positions.to(self.device), None, None, 0, taps, head=logits)
        return TargetOutput(*out)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot truncate a cache of {self._len} positions to {length}")
        self._len = length
        self._pending = 0

    @torch.inference_mode()
    def head(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(final_hidden.to(self.dtype))


def build_native(cfg: dict, state_dict: dict[str, torch.Tensor], device, dtype) -> LlamaModel:
    """The native model of `cfg` holding `state_dict`'s weights (consumed) on `device` in `dtype`."""
    a = LlamaArgs.from_hf_config(cfg)
    with torch.device("meta"):
        model = LlamaModel(a)
    model.register_buffer("inv_freq", a.rope.inv_freq(a.head_dim, a.max_position_embeddings).to(device), False)
    sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if a.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    expected = {k: p for k, p in model.state_dict().items() if not (a.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise EagleScopeError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]!r}")
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise EagleScopeError(f"checkpoint has {len(unexpected)} unexpected weights, e.g. {unexpected[0]!r}")
    for k, t in sd.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise EagleScopeError(
                f"weight {k!r} has shape {tuple(t.shape)} but config.json implies {tuple(expected[k].shape)}"
            )
    # The checkpoint's tensors become the parameters (assign=True): no second copy of the weights is allocated (an 8B
    # target read onto its GPU is not copied there again), and each one whose dtype is not `dtype` is converted on its
    # own. `state_dict` is consumed, so that each original is freed as soon as it is converted.
    state_dict.clear()
    weights = {}
    for k in list(sd):
        t = sd.pop(k)
        weights[k] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    model.load_state_dict(weights, strict=False, assign=True)
    if a.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


# A whole-sequence forward (training's online target, prepare's stored states) of at least this many tokens runs its
# causal attention on SDPA's cuDNN backend, with the length rounded up to a multiple of CUDNN_LENGTH_STEP.
# Why: on an H200 at 8B shape (32 heads of 128, 8 kv heads, batch 4) cuDNN's kernel takes 0.26 ms a layer at 2,048
# tokens where flash takes 0.62 (bench/results/attention-kernels-20261202.json), about 11 ms of a 458 ms training
# step. But cuDNN builds an execution plan for every new (batch, length) shape, about 63 ms each (same file), which
# one forward at a new length would not pay back; rounding the length bounds the shapes to 16 per batch size between
# 1,024 and 2,048 tokens, at the cost of computing up to 63 pad positions. Below the threshold (short samples, the
# demo's ~256 tokens) the attention is a small part of the step and each length would be a new plan: flash stays.
CUDNN_MIN_LENGTH = 1024
CUDNN_LENGTH_STEP = 64
_CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def whole_sequence_attention(device: torch.device, length: int):
    """Within: SDPA prefers cuDNN (CUDA, length >= CUDNN_MIN_LENGTH). Yields the length the forward should run at."""
    if torch.device(device).type != "cuda" or length < CUDNN_MIN_LENGTH:
        yield length
        return
    with sdpa_kernel(_CUDNN_FIRST, set_priority=True):  # also re-enables what load_native disabled, for this block
        yield -(-length // CUDNN_LENGTH_STEP) * CUDNN_LENGTH_STEP


_documents: list[tuple[int, int, int]] = []  # the packed batch document_attention runs: (row, start, end) each


@torch.compiler.disable
def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """attend()'s contract for a packed batch: causal attention within each document of `_documents`, one SDPA call
    per document (flash on a GPU: the documents' own lengths, no masked rectangle of the whole row), zeros elsewhere.
    Outside torch.compile (a layer compiled by `train --compile` breaks its graph here), so the documents, which change
    every batch, are read when it runs, not traced into a graph."""
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for r, a, b in _documents:
        ks, vs = k[r : r + 1, :, a:b], v[r : r + 1, :, a:b]
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        out[r : r + 1, :, a:b] = F.scaled_dot_product_attention(q[r : r + 1, :, a:b], ks, vs, is_causal=True)
    return out


@contextlib.contextmanager
def document_attention(model: LlamaModel, segments: list[tuple[int, int, int]]):
    """Within: every layer of `model` attends within the documents at `segments` (row, start, end) only."""
    attns = [layer.self_attn for layer in model.model.layers]
    previous = [a.attention_impl for a in attns]
    _documents[:] = segments
    for a in attns:
        a.attention_impl = _per_document
    try:
        yield
    finally:
        for a, impl in zip(attns, previous, strict=True):
            a.attention_impl = impl
        _documents.clear()


def load_native(model_dir: Path, cfg: dict, state_dict, fingerprint, eos, tokenizer, device, dtype) -> NativeTarget:
    if torch.device(device).type == "cuda":
        # SDPA's cuDNN backend builds an execution plan for every new key length, and the reference decoder's key
        # length grows by one each step: on an H200 that made a transformers decode 4x slower (measured with
        # bench/hf_generate_profile.py). The flash and memory-efficient backends need no plan.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return NativeTarget(build_native(cfg, state_dict, device, dtype), fingerprint, eos, tokenizer)
