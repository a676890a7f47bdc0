"""Generic target: any `transformers.AutoModelForCausalLM` checkpoint, taps through forward hooks.

Correct rather than fast. The prefix cache is transformers' own `DynamicCache`; tree verification
works by handing the model an explicit 4D additive mask (transformers passes a 4D mask through
unchanged) and explicit `position_ids`, and by editing each cache layer's key/value tensors along
the sequence dimension (-2) to crop or keep accepted positions. That edit is agnostic to what a
layer stores there: full per-head K/V for ordinary attention, or compressed latents of different
widths for MLA (DeepSeek-V3 / Kimi-K2 cache `kv_lora_rank` and `qk_rope_head_dim` wide tensors).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import (
    Target,
    TargetFingerprint,
    TargetOutput,
    chat_template_of,
    sha256_text,
    tokenizer_sha256,
)
from eaglescope.models.targets.loading import (
    check_dir,
    check_finite,
    check_index,
    eos_token_ids,
    load_tokenizer,
    read_config,
)
from eaglescope.taps import TapContract

_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


def _decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder blocks whose inputs are hs[0..L-1]: `model.model.layers` for most families."""
    base = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
            return layers
    raise EagleScopeError(
        f"cannot find the {num_layers} decoder layers of {type(model).__name__}: the generic target supports "
        "models whose base model holds them in a `layers`, `h` or `blocks` list"
    )


def _cache_kwarg(model: nn.Module) -> str:
    # transformers 5.2x renamed `past_key_values` to `cache` (old name deprecated, still accepted for a while).
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(config):

    try:
        return DynamicCache(config=config)
    except TypeError:  # older signature without `config`
        return DynamicCache()


def _check_cache_supported(config) -> None:
    """Only plain full-attention layers can be cropped and index-selected position by position."""
    cache = _new_cache(config)

    for i, layer in enumerate(getattr(cache, "layers", [])):
        if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
            raise EagleScopeError(
                f"layer {i} of this model uses a {type(layer).__name__} cache (sliding-window or recurrent state); "
                "the generic target supports full-attention models only"
            )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types - {"full_attention"}:
        raise EagleScopeError(
            f"this model has {sorted(types)} layers; the generic target supports full-attention models only"
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _read_hf_config(model_dir: Path, trust_remote_code: bool):
    """(config.json as read, transformers' config, its text config, architectures) of a checkpoint a target can be
    loaded from; every reason it cannot is one EagleScopeError."""
    raw = read_config(model_dir)
    if "auto_map" in raw and not trust_remote_code:
        raise EagleScopeError(
            f"{model_dir} ships its own modeling code (auto_map in config.json); eaglescope does not run it "
            "unless trust_remote_code is set"
        )
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as e:
        kind = raw.get("model_type", "<missing model_type>")
        raise EagleScopeError(
            f"transformers does not know the model type {kind!r} of {model_dir}: {str(e).splitlines()[0]}"
        ) from None
    except (OSError, TypeError) as e:
        raise EagleScopeError(f"cannot read the config of {model_dir}: {str(e).splitlines()[0]}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise EagleScopeError(f"{model_dir} is an encoder-decoder model; a target must be a decoder-only LM")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise EagleScopeError(f"{model_dir}/config.json names no architectures; cannot tell which model it is")
    needed = ("num_hidden_layers", "hidden_size", "vocab_size")
    missing = [k for k in needed if not isinstance(getattr(text, k, None), int)]
    if missing:
        raise EagleScopeError(f"{model_dir}/config.json lacks {', '.join(missing)}")
    _check_cache_supported(config)
    if not any(any(model_dir.glob(g)) for g in _WEIGHT_GLOBS):
        raise EagleScopeError(f"{model_dir} holds no weights (*.safetensors or pytorch_model*.bin)")
    check_index(model_dir)  # transformers would follow an index to shards outside the directory
    return raw, config, text, archs


def _load_hf_weights(model_dir: Path, config, dtype, attn_implementation: str, trust_remote_code: bool, arch: str):
    """The causal LM of `config` with every weight from `model_dir` (never a randomly initialised one)."""
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir,
            config=config,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    except ValueError as e:
        if "Unrecognized configuration" in str(e) or "not supported" in str(e).lower():
            raise EagleScopeError(
                f"transformers has no causal-LM class for {arch} in {model_dir}: {str(e).splitlines()[0]}"
            ) from None
        raise EagleScopeError(f"cannot load the weights in {model_dir}: {str(e).splitlines()[0]}") from None
    except (RuntimeError, OSError) as e:
        if "mismatch" in str(e).lower():
            raise EagleScopeError(
                f"the weights in {model_dir} do not fit its config.json: tensor shapes differ"
            ) from None
        raise EagleScopeError(f"cannot load the weights in {model_dir}: {_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - e.g. UnpicklingError from weights_only: the files, not a bug
        raise EagleScopeError(
            f"cannot load the weights in {model_dir} safely ({type(e).__name__}: {_first_line(e)}); eaglescope "
            "never runs pickled code: convert the checkpoint to safetensors"
        ) from None
    # transformers silently random-initialises missing or mismatched weights; a target must never be random.
    bad = list(info.get("missing_keys") or []) + [str(m[0]) for m in info.get("mismatched_keys") or []]
    if bad:
        raise EagleScopeError(
            f"the weights in {model_dir} do not fit its config: {len(bad)} tensors missing or of the wrong "
            f"shape (first: {bad[0]})"
        )
    return model


class HFTarget(Target):
    """A transformers causal LM behind the `Target` interface (batch 1 cache path + batched taps path)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        fingerprint: TargetFingerprint,
        max_positions: int,
        eos_token_ids: list[int],
        taps: TapContract | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.max_positions = max_positions
        self.eos_token_ids = eos_token_ids
        emb = model.get_input_embeddings().weight  # not next(parameters()): MoE routers may be kept in fp32
        self.device, self.dtype = emb.device, emb.dtype
        self.layers = _decoder_layers(model, fingerprint.num_layers)
        self._cache_kw = _cache_kwarg(model)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self.taps = None
        self.set_taps(taps)
        self._cache = None
        self._committed = 0
        self._pending = 0
        self._max_len = 0

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def from_dir(
        cls,
        model_dir: Path | str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        taps: TapContract | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str = "sdpa",
    ) -> HFTarget:

        model_dir = check_dir(model_dir)
        raw, config, text, archs = _read_hf_config(model_dir, trust_remote_code)
        model = _load_hf_weights(model_dir, config, dtype, attn_implementation, trust_remote_code, archs[0])
        check_finite(dict(model.state_dict()), model_dir)
        model.to(device).eval()
        model.requires_grad_(False)

        tokenizer = load_tokenizer(model_dir)
        fp = TargetFingerprint(
            architecture=archs[0],
            num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            tokenizer_sha256=tokenizer_sha256(model_dir),
            chat_template_sha256=sha256_text(chat_template_of(model_dir)),
        )
        max_pos = getattr(text, "max_position_embeddings", None)
        if not isinstance(max_pos, int):
            raise EagleScopeError(f"{model_dir}/config.json lacks max_position_embeddings")
        return cls(model, tokenizer, fp, max_pos, eos_token_ids(model_dir, raw, tokenizer), taps)

    # -- taps ----------------------------------------------------------------------------
    def set_taps(self, taps: TapContract | None) -> None:
        super().set_taps(taps)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if taps is None:
            return
        for i in taps.layers:
            self._hooks.append(self.layers[i].register_forward_pre_hook(self._capture_hook(i), with_kwargs=True))

    def _capture_hook(self, i: int):
        def hook(module, args, kwargs):
            # hs[i] is whatever enters decoder layer i; families pass it positionally or by name.
            self._captured[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _aux(self) -> torch.Tensor | None:
        if self.taps is None:
            return None
        try:
            aux = torch.cat([self._captured[i] for i in self.taps.layers], dim=-1)
        finally:
            self._captured = {}
        return aux

    # -- cached batch-1 path ---------------------------------------------------------------
    def reset(self, max_len: int) -> None:
        if max_len > self.max_positions:
            raise EagleScopeError(f"a sequence of {max_len} tokens exceeds the target's {self.max_positions} positions")
        self._cache = _new_cache(self.model.config)
        self._committed = 0
        self._pending = 0
        self._max_len = max_len

    @property
    def cache_len(self) -> int:
        return self._committed

    def _edit_cache(self, keep: torch.Tensor | None) -> None:
        """Crop every layer to the committed prefix, appending the pending positions in `keep` (if any)."""
        n = self._committed
        for layer in self._cache.layers:
            keys = getattr(layer, "keys", None)  # layers stay uninitialised until their first update
            if not getattr(layer, "is_initialized", True) or keys is None or keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)  # [B, heads, S, d]; d differs between keys and values under MLA
                new = t[..., :n, :]
                if keep is not None and keep.numel():
                    new = torch.cat([new, t[..., n:, :].index_select(-2, keep.to(t.device))], dim=-2)
                setattr(layer, name, new)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        if self._cache is None:
            raise EagleScopeError("call reset(max_len) before forward")
        if self._pending:
            self._edit_cache(None)
            self._pending = 0
        T, n = tokens.shape[0], self._committed
        if n + T > self._max_len:
            raise EagleScopeError(f"{n + T} tokens exceed the cache size {self._max_len} given to reset")
        if positions is None:
            positions = torch.arange(n, n + T, device=self.device)
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        visible = torch.cat(
            [torch.ones(T, n, dtype=torch.bool, device=self.device), tree_mask.to(self.device, torch.bool)], dim=1
        )
        # Additive float mask works with both eager (adds it to the scores) and SDPA (float attn_mask).
        mask = torch.zeros(T, n + T, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        out = self.model(
            input_ids=tokens.to(self.device).view(1, T),
            attention_mask=mask.view(1, 1, T, n + T),
            position_ids=positions.to(self.device).view(1, T),
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        self._pending = T
        aux = self._aux()
        return TargetOutput(out.logits[0].float(), None if aux is None else aux[0])

    def commit(self, keep: torch.Tensor | None = None) -> None:
        if keep is None:
            self._committed += self._pending
        else:
            keep = keep.to(torch.long).flatten()
            if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= self._pending):
                raise EagleScopeError(f"commit keeps positions {keep.tolist()} but only {self._pending} are pending")
            self._edit_cache(keep)
            self._committed += keep.numel()
        self._pending = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._committed:
            raise ValueError(f"cannot truncate a cache of {self._committed} positions to {length}")
        self._committed, self._pending = length, 0
        self._edit_cache(None)

    @torch.no_grad()
    def head(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(final_hidden.to(self.device, self.dtype))

    # -- batched cache-free path -------------------------------------------------------------
    @torch.no_grad()
    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, logits: bool = True
    ) -> TargetOutput:
        # transformers' models compute their logits whatever `logits` says; they are returned either way.
        # The input of the output embedding is the final normed state, whatever the architecture calls its norm.
        captured: list[torch.Tensor] = []
        handle = self.model.get_output_embeddings().register_forward_pre_hook(lambda m, a: captured.append(a[0]))
        try:
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                use_cache=False,
            )
        finally:
            handle.remove()
        return TargetOutput(out.logits.float(), self._aux(), captured[-1] if captured else None)
