"""The settings of `prepare` and `train`, defined once: the functions take them, and the command line takes
its flags and defaults from these fields (eaglescope.cli.parsers). Standard library only, so `--help` is instant."""

from __future__ import annotations

import math
from dataclasses import dataclass

from eaglescope.errors import EagleScopeError

DEFAULT_DEPTH = 5  # doctor's chain depth for served and predicted α_k


ENGINES_FOR_FEATURES = ("vllm", "sglang")  # `prepare --engine`


@dataclass
class PrepareConfig:
    target: str
    data: str
    out: str
    taps: str | None = None  # "2,4,5" | "default"; None → default (or none when no hidden states and L < 7)
    max_length: int = 2048
    draft_vocab_size: int | None = None  # None → min(32000, target vocab)
    regenerate: bool = False
    regen_max_new_tokens: int = 256
    hidden_states: bool = False
    batch_size: int = 8
    shard_samples: int = 1024
    device: str | None = None
    dtype: str = "auto"
    backend: str = "auto"
    limit: int | None = None
    overwrite: bool = False
    # The serving engine computes the features instead of a target in this process (eaglescope.features): "vllm",
    # "sglang".
    engine: str | None = None
    engine_python: str | None = None  # the engine environment's interpreter (default $EAGLESCOPE_<ENGINE>_PYTHON)
    engine_args: str | None = None  # JSON object of the engine's own arguments (vLLM: LLM keywords; SGLang: Engine)
    # A vLLM server already running (the target too large for anything but its serving cluster) instead of an engine
    # eaglescope starts; its log lets the captured layer ids be checked (features/vllm_server.py).
    engine_url: str | None = None
    engine_log: str | None = None

    def validate(self) -> None:
        if self.engine is not None:
            if self.engine not in ENGINES_FOR_FEATURES:
                known = ", ".join(ENGINES_FOR_FEATURES)
                raise EagleScopeError(f"--engine must be one of {known}, not {self.engine!r}.")
            if self.regenerate:
                raise EagleScopeError(
                    "--regenerate with --engine is not supported yet: regenerate in a prepare without --engine first."
                )
            self.hidden_states = True  # what an engine is for
        if self.engine_url is not None:
            if self.engine != "vllm":
                raise EagleScopeError(
                    "--engine-url needs --engine vllm: SGLang's server hands on no per-layer states, so eaglescope "
                    "starts SGLang itself with its capture plugin."
                )
            if self.engine_python or self.engine_args:
                raise EagleScopeError(
                    "--engine-python and --engine-args do not apply to a running server (--engine-url)."
                )
        elif self.engine_log is not None:
            raise EagleScopeError("--engine-log is the log of the server given by --engine-url.")
        for name, low in (("max_length", 2), ("batch_size", 1), ("shard_samples", 1), ("regen_max_new_tokens", 1)):
            if getattr(self, name) < low:
                raise EagleScopeError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}.")
        if self.limit is not None and self.limit < 1:
            raise EagleScopeError(f"--limit must be >= 1, got {self.limit}.")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise EagleScopeError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}.")


@dataclass
class TrainConfig:
    target: str
    data: str
    out: str
    ttt_length: int = 7
    taps: str | None = None  # online mode only; with stored hidden states it must match them
    draft_vocab_size: int | None = None  # None → the prepared vocabulary
    max_steps: int | None = None
    epochs: float | None = None  # default 1 when max_steps is not given
    # A wall-clock budget for the optimizer steps: after the first few steps the run's length (where the cosine
    # schedule ends) is fitted to the steps that fit, never more than max_steps / epochs give (train/loop.py).
    max_seconds: float | None = None
    batch_size: int = 8  # per process
    grad_accum: int = 1
    lr: float = 1e-4
    warmup_steps: int | None = None
    warmup_ratio: float = 0.02
    weight_decay: float = 0.0
    clip: float = 0.5  # 0 disables clipping
    max_length: int = 2048
    eval_every: int = 0  # 0 → evaluate at the end only
    eval_fraction: float = 0.05
    save_every: int = 0  # 0 → save at the end only
    resume: bool = False
    overwrite: bool = False
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"
    log_dir: str | None = None  # default OUT/tb
    backend: str = "auto"
    draft_arch: str = "llama"  # the draft layer: "llama" (Llama attention) or "mla" (DeepSeek-V2/V3, Kimi-K2 targets)
    norm_before_fc: bool = False  # EAGLE 3.1 options (models/drafts/config.py)
    fc_norm: bool = False
    norm_output: bool = False
    compile: bool = False  # torch.compile the target's layers and the draft's regions (train/compiled.py)
    pack: bool = False  # a micro-batch's samples packed into rows as documents, not padded (train/packing.py)

    def validate(self) -> None:
        if self.draft_arch not in ("llama", "mla"):
            raise EagleScopeError(f"--draft-arch must be llama or mla, got {self.draft_arch!r}.")
        for name, low in (("ttt_length", 1), ("batch_size", 1), ("grad_accum", 1), ("max_length", 3)):
            if getattr(self, name) < low:
                raise EagleScopeError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}.")
        for name in ("lr", "weight_decay", "clip", "warmup_ratio", "eval_fraction"):
            if not math.isfinite(getattr(self, name)):
                raise EagleScopeError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}.")
        if self.epochs is not None and not math.isfinite(self.epochs):
            raise EagleScopeError(f"--epochs must be a finite number, got {self.epochs}.")
        if self.max_seconds is not None and not (math.isfinite(self.max_seconds) and self.max_seconds > 0):
            raise EagleScopeError(f"--max-seconds must be a positive number of seconds, got {self.max_seconds}.")
        if self.warmup_ratio > 1:
            raise EagleScopeError(f"--warmup-ratio must be in [0, 1], got {self.warmup_ratio}.")
        for name in ("eval_every", "save_every", "weight_decay", "clip", "warmup_ratio"):
            if getattr(self, name) < 0:
                raise EagleScopeError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}.")
        if self.max_steps is not None and self.epochs is not None:
            raise EagleScopeError("pass either --max-steps or --epochs, not both.")
        if self.max_steps is not None and self.max_steps < 1:
            raise EagleScopeError(f"--max-steps must be >= 1, got {self.max_steps}.")
        if self.epochs is not None and not self.epochs > 0:
            raise EagleScopeError(f"--epochs must be > 0, got {self.epochs}.")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise EagleScopeError(f"--lr must be a positive number, got {self.lr}.")
        if not 0 <= self.eval_fraction < 1:
            raise EagleScopeError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}.")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise EagleScopeError(f"--warmup-steps must be >= 0, got {self.warmup_steps}.")


# Settings a resumed run must share with the run it continues (others, like --eval-every, may change).
RESUME_KEYS = (
    "ttt_length",
    "taps",
    "draft_vocab_size",
    "max_steps",
    "epochs",
    "max_seconds",
    "grad_accum",
    "lr",
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "clip",
    "max_length",
    "eval_fraction",
    "seed",
    "draft_arch",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
)


__all__ = ["PrepareConfig", "TrainConfig", "RESUME_KEYS", "DEFAULT_DEPTH"]
