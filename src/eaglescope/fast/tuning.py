"""Per-device launch settings of the fast path's kernels: the fused verify's products (library, Triton tiles, K
splits) and flash attention's launch by row count, and the fused draft level's K splits.

Why files: which tile, BLAS library or K split is fastest for a product depends on the GPU (an H100 and an H200
differ in bandwidth and SM count) and on the verify's rows (a tree's 24 against a 64-token verify: the tiles that
fit 64 rows waste half of a 24-row one), and the sweeps that find them take minutes of a GPU. The kernels' modules
keep, as built-ins, the settings measured on one H200 at 64 rows; a file written by `bench/fused_decode_check.py
--tuning-out` overrides them where it says. vLLM's fused-MoE kernel does the same with one JSON file of launch
settings per device name (vllm/model_executor/layers/fused_moe/configs/, `VLLM_TUNED_CONFIG_FOLDER`).

The file used, first found: the path in $EAGLESCOPE_TUNING; `tuned/<device name>.json` beside this module (the
name torch reports, spaces and slashes as underscores: `NVIDIA_H200.json`); else none (the built-ins). Its format,
every key optional but an entry's "max_rows":

    {"device": "NVIDIA H200",            # what it was measured on (a warning where the GPU differs)
     "source": {...},                    # free-form: the command, commit and result file it came from
     "verify": [{"max_rows": 24, "cublas": ["o"], "cublaslt": [], "blocks": {"qkv": [16, 128, 4, 3, 1]},
                 "k_splits": {"down": 2}, "flash_launch": [16, 128, 8, 2, 3],
                 "stream": {"qkv": [64, 128, 2, 3]}}, {"max_rows": 64, ...}],
     "draft": {"k_splits": {"o": 2, "down": 2}, "stream": {"lm_head": [64, 256, 1, 3]}}}

A T-row verify takes the entry with the smallest max_rows >= T, each key it names in place of the built-in (see
FusedVerify.settings); rows past every entry take the built-ins. "stream" names fast.stream_mm's launches (BN, BK,
K splits, stages) for the products it runs, in place of its built-in STREAM_LAUNCH ({}: none on it); a verify
entry's may also name the lm_head (one K slice), which has no built-in launch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglescope.errors import EagleScopeError
from eaglescope.fast.fused_draft import DRAFT_K_SPLITS, DRAFT_STREAM_PRODUCTS
from eaglescope.fast.fused_verify import (
    CUBLAS_PRODUCTS,
    K_SPLITS,
    MAX_ROWS,
    ROW_BLOCKS,
    STREAM_PRODUCTS,
    check_stream,
)

log = logging.getLogger(__name__)

ENV = "EAGLESCOPE_TUNING"
TUNED_DIR = Path(__file__).parent / "tuned"
VERIFY_KEYS = ("max_rows", "cublas", "cublaslt", "blocks", "k_splits", "flash_launch", "stream")


@dataclass(frozen=True)
class Tuning:
    """A tuning file, checked: `verify` as (max_rows, settings) sorted by max_rows, `draft_k_splits` and
    `draft_stream` (None: the built-ins), and where it came from (`path`, `sha256` of its bytes; both None for the
    built-ins)."""

    verify: tuple[tuple[int, dict], ...] = ()
    draft_k_splits: dict[str, int] | None = None
    path: str | None = None
    sha256: str | None = None
    device: str | None = None
    source: dict = field(default_factory=dict)
    draft_stream: dict[str, tuple[int, ...]] | None = None

    def describe(self) -> dict:
        """What a benchmark's result records of the settings it ran with."""
        return {"path": self.path, "sha256": self.sha256, "device": self.device}

    def document(self) -> dict:
        """The tuning as its file's JSON (what load_tuning reads back to an equal Tuning, less path and sha256)."""
        doc: dict = {}
        if self.device is not None:
            doc["device"] = self.device
        if self.source:
            doc["source"] = self.source
        if self.verify:
            doc["verify"] = [{"max_rows": rows, **{k: _json(v) for k, v in o.items()}} for rows, o in self.verify]
        draft = {}
        if self.draft_k_splits is not None:
            draft["k_splits"] = dict(self.draft_k_splits)
        if self.draft_stream is not None:
            draft["stream"] = _json(self.draft_stream)
        if draft:
            doc["draft"] = draft
        return doc


BUILT_IN = Tuning()


def device_file(device_name: str) -> Path:
    """tuned/<the GPU's name, its spaces and slashes as underscores>.json"""
    return TUNED_DIR / (re.sub(r"[\s/]+", "_", device_name) + ".json")


def tuning_for(device: torch.device) -> Tuning:
    """The tuning the fast path runs with on `device` (module docstring); a bad file is an EagleScopeError."""
    path = os.environ.get(ENV)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    if path:
        tuning = load_tuning(Path(path))
    elif name is not None and device_file(name).is_file():
        tuning = load_tuning(device_file(name))
    else:
        return BUILT_IN
    if tuning.device is not None and name is not None and tuning.device != name:
        log.warning("tuning %s was measured on %s, running on %s", tuning.path, tuning.device, name)
    log.info("fast path tuning: %s", tuning.path)
    return tuning


def load_tuning(path: Path) -> Tuning:
    """Read and check a tuning file; anything wrong with it is one EagleScopeError line naming the file."""
    try:
        raw = path.read_bytes()
        data = json.loads(raw)
    except OSError as e:
        raise EagleScopeError(f"tuning file {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EagleScopeError(f"tuning file {path} is not JSON: {e}") from e
    try:
        return _parse(data, str(path), hashlib.sha256(raw).hexdigest())
    except (TypeError, ValueError) as e:
        raise EagleScopeError(f"tuning file {path}: {e}") from e


def _parse(data, path: str, sha256: str) -> Tuning:
    _keys(data, ("device", "source", "verify", "draft"), "the file")
    device = data.get("device")
    if device is not None and not isinstance(device, str):
        raise TypeError("'device' is a GPU's name")
    source = data.get("source", {})
    if not isinstance(source, dict):
        raise TypeError("'source' is an object")
    entries = data.get("verify", [])
    if not isinstance(entries, list):
        raise TypeError("'verify' is a list of entries")
    verify = sorted((_verify_entry(e, i) for i, e in enumerate(entries)), key=lambda e: e[0])
    rows = [r for r, _ in verify]
    if len(set(rows)) != len(rows):
        raise ValueError(f"two verify entries for the same max_rows ({rows})")
    draft = data.get("draft", {})
    _keys(draft, ("k_splits", "stream"), "'draft'")
    k_splits = _splits(draft["k_splits"], DRAFT_K_SPLITS, "draft k_splits") if "k_splits" in draft else None
    stream = _stream(draft["stream"], DRAFT_STREAM_PRODUCTS, "draft stream") if "stream" in draft else None
    return Tuning(tuple(verify), k_splits, path, sha256, device, source, stream)


def _keys(obj, allowed: tuple[str, ...], where: str) -> None:
    if not isinstance(obj, dict):
        raise TypeError(f"{where} is an object")
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown} (known: {list(allowed)})")


def _verify_entry(entry, i: int) -> tuple[int, dict]:
    where = f"verify entry {i}"
    _keys(entry, VERIFY_KEYS, where)
    rows = entry.get("max_rows")
    if not _is_int(rows) or not 2 <= rows <= MAX_ROWS:
        raise ValueError(f"{where}: max_rows is a row count 2..{MAX_ROWS}, not {rows!r}")
    out: dict = {}
    for key in ("cublas", "cublaslt"):
        if key in entry:
            names = entry[key]
            if not isinstance(names, list) or set(names) - set(CUBLAS_PRODUCTS):
                raise ValueError(f"{where}: {key} lists products of {list(CUBLAS_PRODUCTS)}, not {names!r}")
            out[key] = tuple(names)
    if "cublaslt" in out and "cublas" in out and set(out["cublaslt"]) - set(out["cublas"]):
        raise ValueError(f"{where}: cublaslt names products left to cuBLAS, {list(out['cublas'])}")
    if "blocks" in entry:
        blocks = entry["blocks"]
        _keys(blocks, tuple(ROW_BLOCKS), f"{where} blocks")
        out["blocks"] = {name: _ints(b, (4, 5), f"{where}: blocks of {name}", zero_last=True)
                         for name, b in blocks.items()}  # fmt: skip
    if "k_splits" in entry:
        out["k_splits"] = _splits(entry["k_splits"], K_SPLITS, f"{where}: k_splits")
    if "flash_launch" in entry:
        out["flash_launch"] = _ints(entry["flash_launch"], (4, 5), f"{where}: flash_launch")
    if "stream" in entry:
        out["stream"] = _stream(entry["stream"], STREAM_PRODUCTS, f"{where}: stream")
    return rows, out


def _stream(obj, products: tuple[str, ...], where: str) -> dict[str, tuple[int, ...]]:
    """fast.stream_mm's launches by product, (BN, BK, K splits, stages) each; an empty object: none on it."""
    _keys(obj, products, where)
    launches = {name: _ints(launch, (4,), f"{where} of {name}") for name, launch in obj.items()}
    check_stream(launches, products, where)
    return launches


def _splits(obj, names: dict, where: str) -> dict[str, int]:
    _keys(obj, tuple(names), where)
    for name, n in obj.items():
        if not _is_int(n) or n < 1:
            raise ValueError(f"{where}: {name} is cut into a positive number of slices, not {n!r}")
    return dict(obj)


def _ints(values, lengths: tuple[int, ...], where: str, zero_last: bool = False) -> tuple[int, ...]:
    """A launch tuple: positive integers (the last may be 0 where it is a flag, as a product's swap)."""
    ok = isinstance(values, list) and len(values) in lengths and all(_is_int(v) for v in values)
    ok = ok and all(v > 0 or (zero_last and j == 4 and v == 0) for j, v in enumerate(values))
    if not ok:
        raise ValueError(f"{where} is {' or '.join(map(str, lengths))} positive integers, not {values!r}")
    return tuple(values)


def _json(value):
    """Tuples as lists, inside dicts too (JSON's arrays)."""
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
