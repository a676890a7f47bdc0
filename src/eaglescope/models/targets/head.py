"""What training needs of a target whose hidden states are already stored (`prepare --hidden-states`): its
fingerprint, its input embedding (the draft's, frozen) and its output head (teacher logits from the stored final
normed state). Read tensor by tensor from the checkpoint's shards, so a target that does not fit one GPU (a 671B
DeepSeek-V3, a 1T Kimi-K2) can still have its draft trained on one; the decoder layers are never read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import TargetFingerprint
from eaglescope.models.targets.loading import check_dir, check_finite, fingerprint_of, load_tensors, read_config

# Where Llama-style, DeepSeek and multimodal (language_model.*) checkpoints keep the two tensors; any other prefix
# ending in the same name is taken too.
EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight",
                   ".embed_tokens.weight")  # fmt: skip
HEAD_NAMES = ("lm_head.weight", ".lm_head.weight")


@dataclass
class TargetHead:
    fingerprint: TargetFingerprint
    max_positions: int
    embedding: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when the checkpoint ties them)
    device: torch.device
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return self.fingerprint.num_layers

    def head(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the final normed state, as the full target's lm_head computes them."""
        return F.linear(final_hidden.to(self.device, self.dtype), self.lm_head)


def read_fingerprint(model_dir: Path | str) -> tuple[dict, TargetFingerprint, int]:
    """(the text model's config, the fingerprint, the context length) from config.json alone."""
    model_dir = check_dir(model_dir)
    cfg = read_config(model_dir)
    text = cfg.get("text_config", cfg)
    try:
        return text, fingerprint_of(model_dir, cfg), int(text["max_position_embeddings"])
    except (KeyError, ValueError, TypeError) as e:
        raise EagleScopeError(f"{model_dir}/config.json is malformed or incomplete ({e})") from None


def load_target_head(model_dir: Path | str, device: torch.device, dtype: torch.dtype) -> TargetHead:
    model_dir = check_dir(model_dir)
    text, fp, max_positions = read_fingerprint(model_dir)
    cfg = read_config(model_dir)
    found = load_tensors(model_dir, {"embedding": EMBEDDING_NAMES, "lm_head": HEAD_NAMES})
    if "embedding" not in found:
        raise EagleScopeError(f"{model_dir} has no embed_tokens.weight")
    if "lm_head" not in found:
        # no lm_head in the weights: a tied head, unless the config says otherwise
        if text.get("tie_word_embeddings", cfg.get("tie_word_embeddings")) is False:
            raise EagleScopeError(f"{model_dir} has no lm_head.weight and its config does not tie it to the embedding")
        found["lm_head"] = found["embedding"]
    check_finite(found, model_dir)
    for name, t in found.items():
        if tuple(t.shape) != (fp.vocab_size, fp.hidden_size):
            raise EagleScopeError(
                f"{model_dir}: {name} has shape {list(t.shape)}, config.json says [{fp.vocab_size}, {fp.hidden_size}]"
            )
    emb = found["embedding"].to(device, dtype)
    head = emb if found["lm_head"] is found["embedding"] else found["lm_head"].to(device, dtype)
    return TargetHead(fp, max_positions, emb, head, device, dtype)
