"""Targets: a native Llama-family fast path and a generic transformers path behind one interface."""

from __future__ import annotations

from pathlib import Path

import torch

from eaglescope.errors import EagleScopeError
from eaglescope.taps import TapContract
from eaglescope.target.base import Target, TargetFingerprint, TargetOutput
from eaglescope.target.llama import NATIVE_MODEL_TYPES, load_native
from eaglescope.target.loading import (
    check_dir,
    eos_token_ids,
    fingerprint_of,
    load_state_dict,
    load_tokenizer,
    read_config,
)

__all__ = ["Target", "TargetFingerprint", "TargetOutput", "load_target", "default_device", "parse_dtype"]

BACKENDS = ("auto", "native", "hf")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise EagleScopeError(f"unknown dtype {name!r}; use one of {', '.join(table)}")
    return table[name]


def load_target(
    model_dir: Path | str,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    taps: TapContract | str | None = None,
    backend: str = "auto",
) -> Target:
    """Load a target from a Hugging Face checkpoint directory.

    `taps` may be a TapContract, a "2,8,13" string, "default", or None (no tap capture).
    """
    if backend not in BACKENDS:
        raise EagleScopeError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    model_dir = check_dir(model_dir)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or parse_dtype(None, device)
    cfg = read_config(model_dir)
    native = cfg.get("model_type") in NATIVE_MODEL_TYPES
    if backend == "native" and not native:
        raise EagleScopeError(f"model_type {cfg.get('model_type')!r} has no native implementation; use --backend hf")
    if backend == "native" or (backend == "auto" and native):
        try:
            fp = fingerprint_of(model_dir, cfg)
        except (KeyError, ValueError, TypeError) as e:
            raise EagleScopeError(f"config.json is malformed: {e}") from None
        tok = load_tokenizer(model_dir)
        target: Target = load_native(
            model_dir, cfg, load_state_dict(model_dir), fp, eos_token_ids(model_dir, cfg, tok), tok, device, dtype
        )
    else:
        from eaglescope.target.hf import HFTarget

        target = HFTarget.from_dir(model_dir, device=device, dtype=dtype)
    if isinstance(taps, str):
        taps = TapContract.parse(taps, target.num_layers)
    target.set_taps(taps)
    return target
