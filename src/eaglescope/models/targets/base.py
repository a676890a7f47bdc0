"""The interface every target implements, native or generic.

Batch size is 1 for the cached decoding path (speculative decoding's home turf);
`hidden_states` is the batched, cache-free forward that data preparation and training use.

Cache protocol (what tree verification needs):
  * `forward(tokens, positions, tree_mask)` processes T new tokens after the committed
    prefix. Every new token sees the whole committed prefix; among the new tokens it sees
    those allowed by `tree_mask` [T, T] (None = causal). Their keys/values are *pending*.
  * `commit(keep)` appends the pending entries listed in `keep` (indices into the last
    forward's T tokens, in order) to the committed prefix and drops the rest. `commit()`
    keeps all of them.
  * Calling `forward` again without `commit` discards the previous pending entries.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eaglescope.errors import EagleScopeError
from eaglescope.jsonfile import read_object_or_none
from eaglescope.taps import TapContract


@dataclass(frozen=True)
class TargetFingerprint:
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer_sha256: str | None = None
    chat_template_sha256: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TargetFingerprint:
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [T, V] (batch 1 path) or [B, T, V]; None from hidden_states(logits=False)
    aux: torch.Tensor | None  # [T, nH] / [B, T, nH]: taps concatenated low to high; None without taps
    final_hidden: torch.Tensor | None = None  # [B, T, H] final normed state (hidden_states() only)


def sha256_file(path: Path) -> str | None:
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sha256_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def tokenizer_sha256(model_dir: Path) -> str | None:
    """Hash of the tokenizer's vocabulary/merges file, independent of unrelated config noise."""
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
        h = sha256_file(model_dir / name)
        if h is not None:
            return h
    return None


def chat_template_of(model_dir: Path) -> str | None:
    """The chat template serving will use: chat_template.jinja, else tokenizer_config.json's."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file():
        tpl = (read_object_or_none(cfg) or {}).get("chat_template")
        if isinstance(tpl, list):  # named templates: the default one is what serving uses
            tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
        return tpl
    return None


class Target(ABC):
    """A target LLM with tap capture and a prefix cache for one sequence."""

    fingerprint: TargetFingerprint
    taps: TapContract | None
    device: torch.device
    dtype: torch.dtype
    max_positions: int
    eos_token_ids: list[int]
    # False for a stand-in that plays a trace's recorded capture back instead of computing hidden states
    # (detective/draft_replay.py): the replay then taps no other layer.
    computes_layers = True

    @property
    def num_layers(self) -> int:
        return self.fingerprint.num_layers

    @property
    def hidden_size(self) -> int:
        return self.fingerprint.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.fingerprint.vocab_size

    def set_taps(self, taps: TapContract | None) -> None:
        if taps is not None and taps.num_layers != self.num_layers:
            raise EagleScopeError(
                f"tap contract is for a {taps.num_layers}-layer target; this target has {self.num_layers}"
            )
        self.taps = taps

    @abstractmethod
    def reset(self, max_len: int) -> None:
        """Start a new sequence; the cache must hold `max_len` tokens."""

    @property
    @abstractmethod
    def cache_len(self) -> int:
        """Number of committed positions."""

    @abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor | None = None,  # [T]; default cache_len + arange(T)
        tree_mask: torch.Tensor | None = None,  # [T, T] bool; None = causal
    ) -> TargetOutput:
        """Logits [T, V] and, if taps are set, aux [T, nH] for the new tokens."""

    @abstractmethod
    def commit(self, keep: torch.Tensor | None = None) -> None:
        """Keep the listed pending positions (all when None)."""

    def truncate(self, length: int) -> None:
        """Drop committed positions beyond `length` (a draft LM rolling back rejected tokens)."""
        raise NotImplementedError

    def head(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the final normed state (teacher logits recomputed from stored hidden states)."""
        raise NotImplementedError

    @abstractmethod
    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, logits: bool = True
    ) -> TargetOutput:
        """Cache-free batched forward: logits [B, T, V], aux [B, T, nH], final_hidden [B, T, H].
        Right padding only. logits=False: a target that can skips its output head (then logits is None), for a
        caller that applies `head` to final_hidden itself, a chunk of rows at a time."""
