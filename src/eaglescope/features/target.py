"""What `prepare --engine` needs of the target in eaglescope's own process: its tokenizer (eaglescope renders the
chats and builds the loss masks), its fingerprint, and the few tensors the checks and the norm convention need (the
final RMSNorm, the lm_head), each read alone from its shard. The decoder layers are never read: the engine runs
them, with whatever tensor and expert parallelism the target needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eaglescope.data.chat import chat_template_hash
from eaglescope.errors import EagleScopeError
from eaglescope.features.contract import FinalNorm
from eaglescope.models.targets.base import TargetFingerprint
from eaglescope.models.targets.head import TargetHead, load_target_head, read_fingerprint
from eaglescope.models.targets.loading import eos_token_ids, load_tensors, load_tokenizer, read_config

NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")


@dataclass
class EngineTarget:
    """The target as far as eaglescope's process holds it; duck-types the attributes prepare reads of a Target."""

    path: Path
    fingerprint: TargetFingerprint
    max_positions: int
    dtype: torch.dtype
    tokenizer: object
    eos_token_ids: list[int]
    head: TargetHead
    norm: FinalNorm

    @property
    def num_layers(self) -> int:
        return self.fingerprint.num_layers

    @property
    def hidden_size(self) -> int:
        return self.fingerprint.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.fingerprint.vocab_size

    def logits(self, final_normed: torch.Tensor) -> torch.Tensor:
        return self.head.head(final_normed).float()


def load_engine_target(model_dir: Path | str, dtype: torch.dtype) -> EngineTarget:
    model_dir = Path(model_dir)
    text, fp, max_positions = read_fingerprint(model_dir)
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise EagleScopeError(f"{model_dir} has no tokenizer; data must be rendered with the target's own.")
    chat_template_hash(tok)  # raises when the tokenizer has no chat template
    found = load_tensors(model_dir, {"norm": NORM_NAMES})
    if "norm" not in found:
        raise EagleScopeError(
            f"{model_dir} has no final norm weight ({' / '.join(NORM_NAMES)}): the engine's final state cannot be "
            "put in training's convention"
        )
    weight = found["norm"].float()
    if list(weight.shape) != [fp.hidden_size]:
        shape = list(weight.shape)
        raise EagleScopeError(f"{model_dir}: the final norm weight has shape {shape}, not [{fp.hidden_size}]")
    eps = float(text.get("rms_norm_eps", 1e-6))
    head = load_target_head(model_dir, torch.device("cpu"), torch.float32)
    eos = eos_token_ids(model_dir, read_config(model_dir), tok)
    return EngineTarget(model_dir, fp, max_positions, dtype, tok, eos, head, FinalNorm(weight, eps))
