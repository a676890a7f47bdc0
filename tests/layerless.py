"""A copy of a target checkpoint without its decoder layers, as a user has a 1T-parameter target at hand: config.json,
the tokenizer and the other small files, and only the embedding and lm_head tensors, each in its own shard under a
safetensors index (as large checkpoints are sharded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

KEPT = ("embed_tokens.weight", "lm_head.weight")
FINAL_NORM = "model.norm.weight"  # kept too with `final_norm`: what the wiring search's teacher needs
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def layerless_copy(target_dir: Path, out: Path, final_norm: bool = False) -> Path:
    """`out`: `target_dir` with every tensor but the embedding and lm_head (and the final norm) deleted."""
    target_dir, out = Path(target_dir), Path(out)
    out.mkdir(parents=True)
    for p in target_dir.iterdir():
        if p.is_file() and p.name not in WEIGHT_FILES and not p.name.endswith(".safetensors"):
            shutil.copy2(p, out / p.name)
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    sd = {}
    for f in files:
        sd |= load_file(str(target_dir / f))
    keep = {k: v for k, v in sd.items() if k.endswith(KEPT) or (final_norm and k == FINAL_NORM)}
    assert any(k.endswith("embed_tokens.weight") for k in keep) and len(keep) < len(sd)
    shards = {k: f"model-{i + 1:05d}-of-{len(keep):05d}.safetensors" for i, k in enumerate(sorted(keep))}
    for k, shard in shards.items():
        save_file({k: keep[k].contiguous()}, str(out / shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return out
