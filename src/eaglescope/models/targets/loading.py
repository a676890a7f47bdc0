"""Reading a Hugging Face checkpoint directory: config, weights, tokenizer, fingerprint."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eaglescope.errors import EagleScopeError
from eaglescope.jsonfile import read_object, read_object_or_none
from eaglescope.models.targets.base import TargetFingerprint, chat_template_of, sha256_text, tokenizer_sha256


def check_dir(model_dir: Path | str, what: str = "target") -> Path:
    p = Path(model_dir)
    if not p.exists():
        raise EagleScopeError(f"{what} directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise EagleScopeError(f"{what} path {str(p)!r} is not a directory")
    return p


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise EagleScopeError(f"{model_dir} has no config.json; is it a Hugging Face checkpoint directory?")
    return read_object(path, EagleScopeError)


def _load_safetensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise EagleScopeError(f"weight file {path} is corrupted or truncated ({e})") from None


def check_finite(sd: dict[str, torch.Tensor], where: Path | str) -> None:
    """Refuse NaN/Inf weights at load: one pass over floating tensors (memory-bound, far cheaper than the load),
    instead of a draft that never accepts or a loss that is NaN from step 1."""
    for name, t in sd.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise EagleScopeError(f"{where}: weight {name} holds {bad} NaN/Inf values; the checkpoint is damaged")


def _inside(model_dir: Path, name: str, index: Path) -> Path:
    """A shard named by an index, which must lie inside the checkpoint directory."""
    p = model_dir / str(name)
    if Path(str(name)).is_absolute() or not p.resolve().is_relative_to(model_dir.resolve()):
        raise EagleScopeError(f"{index} names shard {name!r}, outside {model_dir}; refusing to read it")
    return p


def check_index(model_dir: Path) -> dict[str, str] | None:
    """The weight map of a sharded safetensors checkpoint (None when unsharded), every shard inside model_dir."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return None
    weight_map = read_object(index, EagleScopeError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise EagleScopeError(f"{index} is malformed (weight_map must map tensor names to shard file names)")
    for shard in set(weight_map.values()):
        _inside(model_dir, shard, index)
    return weight_map


def load_state_dict(model_dir: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All weights of a checkpoint: model.safetensors, a sharded index, or (weights_only) .bin, read onto `device`
    (straight from the file's memory map: an 8B target on a GPU is not first copied into host memory)."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return _load_safetensors(single, device)
    if index.is_file():
        weight_map = check_index(model_dir)
        sd: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = _inside(model_dir, shard, index)
            if not shard_path.is_file():
                raise EagleScopeError(f"shard {shard} listed in {index.name} is missing")
            sd.update(_load_safetensors(shard_path, device))
        missing = sorted(set(weight_map) - set(sd))
        if missing:
            raise EagleScopeError(f"{index.name} lists {missing[0]!r} but no shard holds it")
        return sd
    binary = model_dir / "pytorch_model.bin"
    if binary.is_file():
        try:
            return torch.load(binary, map_location=device, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file for the user
            # torch's message spans lines and advises weights_only=False, i.e. running the file's code: we never do.
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise EagleScopeError(
                f"{binary} is not a plain tensor checkpoint ({first[:160]}); eaglescope loads weights without "
                "running pickled code: convert it to safetensors (model.safetensors) first"
            ) from None
    raise EagleScopeError(f"{model_dir} has no weights (model.safetensors, an index, or pytorch_model.bin)")


def _first_name(names, candidates: tuple[str, ...]) -> str | None:
    for c in candidates:
        if c.startswith("."):
            hits = sorted(k for k in names if k.endswith(c))
            if hits:
                return hits[0]
        elif c in names:
            return c
    return None


def load_tensors(model_dir: Path, names: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """A few tensors of a checkpoint, each read alone from its shard: a 671B target need not be read whole for its
    embedding or head. `names`: what → the tensor names to look for, in order; a name starting with "." matches
    any tensor ending with it. A `what` that matches nothing is left out."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    try:
        if single.is_file():
            with safe_open(str(single), "pt") as f:
                files = dict.fromkeys(f.keys(), single)  # noqa: SIM118 - safe_open is not a mapping
        elif index.is_file():
            files = {k: _inside(model_dir, v, index) for k, v in check_index(model_dir).items()}
        else:  # pytorch_model.bin: one file, read whole (weights_only)
            sd = load_state_dict(model_dir)
            files = dict.fromkeys(sd, None)
        out: dict[str, torch.Tensor] = {}
        for what, candidates in names.items():
            key = _first_name(files, candidates)
            if key is None:
                continue
            if files[key] is None:
                out[what] = sd[key]
            else:
                with safe_open(str(files[key]), "pt") as f:
                    out[what] = f.get_tensor(key)
        return out
    except (SafetensorError, OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise EagleScopeError(f"could not read {', '.join(names)} from {model_dir} ({e})") from None


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer through transformers, or None when the directory has none."""
    if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer  # seconds to import: only for checkpoints that have a tokenizer

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001
        raise EagleScopeError(f"tokenizer in {model_dir} could not be loaded ({e})") from None


def eos_token_ids(model_dir: Path, cfg: dict, tokenizer=None) -> list[int]:
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    sources = [cfg.get("eos_token_id")]
    if gen.is_file():
        sources.insert(0, (read_object_or_none(gen) or {}).get("eos_token_id"))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for s in sources:
        for i in s if isinstance(s, list) else [s]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def fingerprint_of(model_dir: Path, cfg: dict) -> TargetFingerprint:
    text_cfg = cfg.get("text_config", cfg)
    return TargetFingerprint(
        architecture=(cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0],
        num_layers=int(text_cfg["num_hidden_layers"]),
        hidden_size=int(text_cfg["hidden_size"]),
        vocab_size=int(text_cfg["vocab_size"]),
        tokenizer_sha256=tokenizer_sha256(model_dir),
        chat_template_sha256=sha256_text(chat_template_of(model_dir)),
    )
