"""Targets: a native Llama-family fast path and a generic transformers path behind one interface."""

from __future__ import annotations

from pathlib import Path

import torch

from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import Target, TargetFingerprint, TargetOutput
from eaglescope.models.targets.llama import NATIVE_MODEL_TYPES, load_native
from eaglescope.models.targets.loading import (
    check_dir,
    check_finite,
    eos_token_ids,
    fingerprint_of,
    load_state_dict,
    load_tokenizer,
    read_config,
)
from eaglescope.taps import TapContract

__all__ = [
    "Target",
    "TargetFingerprint",
    "TargetOutput",
    "load_target",
    "default_device",
    "parse_device",
    "parse_dtype",
]

BACKENDS = ("auto", "native", "hf")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(name: str | torch.device | None) -> torch.device:
    """A --device flag (None: the default) checked against this machine, so a wrong one is one clear line."""
    if name is None or name == "":
        return default_device()
    if isinstance(name, torch.device):
        dev = name
    else:
        try:
            dev = torch.device(str(name))
        except (RuntimeError, ValueError):
            raise EagleScopeError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EagleScopeError(f"--device {name}: this machine has no CUDA GPU that torch can use; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise EagleScopeError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "mps"):
        raise EagleScopeError(f"--device {name!r}: eaglescope runs on cpu or cuda")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise EagleScopeError(f"--device {name}: MPS is not available on this machine")
    return dev


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
    device = parse_device(device)
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
        sd = load_state_dict(model_dir, device)
        check_finite(sd, model_dir)
        target: Target = load_native(model_dir, cfg, sd, fp, eos_token_ids(model_dir, cfg, tok), tok, device, dtype)
    else:
        from eaglescope.models.targets.hf import HFTarget  # imports transformers' models: only for the hf backend

        target = HFTarget.from_dir(model_dir, device=device, dtype=dtype)
    if isinstance(taps, str):
        taps = TapContract.parse(taps, target.num_layers)
    target.set_taps(taps)
    return target
