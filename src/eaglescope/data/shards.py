"""A prepared data directory (what `eaglescope prepare` writes and `train` reads).

    prepare.json                manifest, written last: its presence means the directory is complete
    samples.safetensors         input_ids int32 [N_tok], loss_mask uint8 [N_tok], offsets int64 [N+1]
    vocab.safetensors           d2t int64 [N_draft] (offsets), t2d bool [V], token_counts int64 [V]
    hidden/shard-00000.safetensors   (with --hidden-states) for the shard's samples, concatenated:
                                aux [T, nH] and final_hidden [T, H] in the target dtype, norms [T, n_taps]
                                float32 (per-token L2 norm of each tap), offsets int64 [n+1]
    progress.json, parts/       resume bookkeeping (per-shard token files and their sha256)

`final_hidden` is the target's final normed state, not logits: train recomputes the teacher
logits with `target.head(final_hidden)`, which is V/H times smaller on disk.

Every file is listed in the manifest with its size and sha256, so a truncated or corrupted
file is named on open instead of surfacing as a NaN loss hours into training.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eaglescope.errors import EagleScopeError
from eaglescope.jsonfile import read_object
from eaglescope.outputs import dir_kind, has_partial, partial_dir
from eaglescope.taps import TapContract

FORMAT_VERSION = 1
MANIFEST = "prepare.json"
PROGRESS = "progress.json"
SAMPLES = "samples.safetensors"
VOCAB = "vocab.safetensors"
HIDDEN_DIR = "hidden"
PARTS_DIR = "parts"

# What `prepare --out` may replace: a directory it wrote itself, holding nothing else.
PREPARED = dir_kind(
    "prepared data directory",
    markers=[MANIFEST, PROGRESS],
    entries=[MANIFEST, PROGRESS, SAMPLES, VOCAB, HIDDEN_DIR, PARTS_DIR, ".eaglescope-stage"],
    replace_flag="--overwrite",
    resumable=True,
)


def shard_name(k: int) -> str:
    return f"{HIDDEN_DIR}/shard-{k:05d}.safetensors"


def part_name(k: int) -> str:
    return f"{PARTS_DIR}/tokens-{k:05d}.safetensors"


# -- file helpers ----------------------------------------------------------------------------
def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def save_atomic(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> dict:
    """Write a safetensors file via a temp name and rename; → {file: name, sha256, bytes}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return {"sha256": sha256_of(path), "bytes": path.stat().st_size}


def write_json_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def check_file(root: Path, entry: dict, verify: bool) -> Path:
    """Raise EagleScopeError naming the file if it is missing, truncated (size) or corrupted (sha256), or if the
    manifest names a file outside its directory (a manifest must never make us read or trust other files)."""
    try:
        name, size_recorded = entry["file"], int(entry["bytes"])
    except (KeyError, TypeError, ValueError):
        raise EagleScopeError(f"{root}: a file entry of the manifest is malformed ({entry!r:.80}).") from None
    path = root / str(name)
    if Path(str(name)).is_absolute() or not path.resolve().is_relative_to(root.resolve()):
        raise EagleScopeError(f"{root}: the manifest names {name!r}, outside the prepared data directory.")
    if not path.is_file():
        raise EagleScopeError(f"{path} is missing from the prepared data directory.")
    size = path.stat().st_size
    if size != size_recorded:
        raise EagleScopeError(f"{path} is truncated or altered: {size} bytes, the manifest records {size_recorded}.")
    if verify and sha256_of(path) != entry.get("sha256"):
        raise EagleScopeError(f"{path} is corrupted: its sha256 differs from the one recorded in the manifest.")
    return path


def open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise EagleScopeError(f"{path} is corrupted or truncated ({e}).") from None


def shape_of(handle, path: Path, key: str) -> list[int]:
    if key not in handle.keys():
        raise EagleScopeError(f"{path} has no tensor {key!r}.")
    return list(handle.get_slice(key).get_shape())


def read_offsets(handle, path: Path, n: int, total: int | None = None) -> torch.Tensor:
    """offsets [n+1] int64, non-decreasing from 0 (to `total` when given)."""
    if shape_of(handle, path, "offsets") != [n + 1]:
        raise EagleScopeError(f"{path}: offsets should hold {n + 1} entries for {n} samples.")
    off = handle.get_tensor("offsets").to(torch.int64)
    if int(off[0]) != 0 or bool((off[1:] < off[:-1]).any()) or (total is not None and int(off[-1]) != total):
        raise EagleScopeError(f"{path}: offsets are not a valid partition of the stored tokens.")
    return off


# -- the reader ------------------------------------------------------------------------------
class PreparedData:
    """Random access to a prepared directory: `PreparedData.open(dir).sample(i)`.

    sample(i) → {"input_ids": int64 [T], "loss_mask": int64 [T] (0/1)} plus, with hidden
    states, {"aux": [T, nH], "final_hidden": [T, H]} in the stored dtype. Files are opened
    lazily and per process (memory-mapped), so DataLoader workers can share one instance.
    """

    def __init__(self, root: Path, manifest: dict, offsets: torch.Tensor, shard_starts: list[int]) -> None:
        self.root = root
        self.manifest = manifest
        self._offsets = offsets  # [N+1] into samples.safetensors
        self._shard_starts = shard_starts  # first global sample index of each hidden shard, + N at the end
        self._handles: dict[str, object] = {}
        self._pid = os.getpid()

    @classmethod
    def open(cls, root: Path | str, verify: bool = True) -> PreparedData:
        root = Path(root)
        if not root.is_dir():
            if has_partial(root):
                raise EagleScopeError(
                    f"{root} is not prepared yet: an interrupted run is kept at {partial_dir(root)}; rerun "
                    "`eaglescope prepare` with the same arguments to finish it."
                )
            raise EagleScopeError(f"{root} is not a directory; pass the --out directory of `eaglescope prepare`.")
        try:
            return cls._open(root, verify)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise EagleScopeError(f"{root / MANIFEST} is malformed ({type(e).__name__}: {e}).") from None

    @classmethod
    def _open(cls, root: Path, verify: bool) -> PreparedData:
        mpath = root / MANIFEST
        if not mpath.is_file():
            resumable = (root / PROGRESS).is_file()
            extra = " (an interrupted run: rerun `eaglescope prepare` to finish it)" if resumable else ""
            raise EagleScopeError(f"{root} is not a prepared data directory: {MANIFEST} is missing{extra}.")
        manifest = read_object(mpath, EagleScopeError)
        if manifest.get("format_version") != FORMAT_VERSION:
            raise EagleScopeError(
                f"{mpath} has format_version {manifest.get('format_version')!r}; this eaglescope reads "
                f"{FORMAT_VERSION}."
            )
        n = int(manifest["num_samples"])
        spath = check_file(root, manifest["samples_file"], verify)
        h = open_safetensors(spath)
        total = int(manifest["num_tokens"])
        for key in ("input_ids", "loss_mask"):
            if shape_of(h, spath, key) != [total]:
                raise EagleScopeError(f"{spath}: {key} should hold {total} tokens.")
        offsets = read_offsets(h, spath, n, total)
        vpath = check_file(root, manifest["vocab_file"], verify)
        hv = open_safetensors(vpath)
        vocab = int(manifest["target"]["vocab_size"])
        for key, shape in (("d2t", [manifest["draft_vocab_size"]]), ("t2d", [vocab]), ("token_counts", [vocab])):
            if shape_of(hv, vpath, key) != shape:
                raise EagleScopeError(f"{vpath}: {key} should have shape {shape}.")
        starts = [0]
        if manifest.get("hidden_states"):
            nH = int(manifest["aux_width"])
            H = int(manifest["target"]["hidden_size"])
            for entry in manifest["shards"]:
                path = check_file(root, entry, verify)
                hs = open_safetensors(path)
                a, m = starts[-1], int(entry["num_samples"])
                if a + m > n:
                    raise EagleScopeError(f"{path}: the shards hold more samples than the manifest's {n}.")
                off = read_offsets(hs, path, m)
                rows = int(off[-1])
                for key, shape in (("aux", [rows, nH]), ("final_hidden", [rows, H])):
                    if shape_of(hs, path, key) != shape:
                        raise EagleScopeError(f"{path}: {key} should have shape {shape}.")
                if not torch.equal(off.diff(), offsets[a + 1 : a + m + 1] - offsets[a : a + m]):
                    raise EagleScopeError(f"{path}: sample lengths disagree with {SAMPLES}.")
                starts.append(a + m)
            if starts[-1] != n:
                raise EagleScopeError(f"the hidden-state shards hold {starts[-1]} samples; the manifest says {n}.")
        return cls(root, manifest, offsets, starts)

    # -- metadata
    @property
    def num_samples(self) -> int:
        return int(self.manifest["num_samples"])

    def __len__(self) -> int:
        return self.num_samples

    @property
    def has_hidden_states(self) -> bool:
        return bool(self.manifest.get("hidden_states"))

    @property
    def taps(self) -> TapContract | None:
        t = self.manifest.get("taps")
        return None if t is None else TapContract.from_dict(t)

    def lengths(self) -> torch.Tensor:
        """[N] int64 sample lengths (for length-grouped batching)."""
        return self._offsets.diff()

    # -- data
    def _handle(self, name: str):
        if os.getpid() != self._pid:  # a forked DataLoader worker: open its own maps
            self._handles, self._pid = {}, os.getpid()
        if name not in self._handles:
            self._handles[name] = open_safetensors(self.root / name)
        return self._handles[name]

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        n = self.num_samples
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        i %= n
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        h = self._handle(SAMPLES)
        out = {
            "input_ids": h.get_slice("input_ids")[a:b].to(torch.int64),
            "loss_mask": h.get_slice("loss_mask")[a:b].to(torch.int64),
        }
        if self.has_hidden_states:
            k = bisect.bisect_right(self._shard_starts, i) - 1
            hs = self._handle(self.manifest["shards"][k]["file"])
            j = i - self._shard_starts[k]
            off = hs.get_slice("offsets")[j : j + 2]
            s, e = int(off[0]), int(off[1])
            out["aux"] = hs.get_slice("aux")[s:e]
            out["final_hidden"] = hs.get_slice("final_hidden")[s:e]
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.sample(i)

    def vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d2t int64 [N_draft] offsets, t2d bool [V])."""
        h = self._handle(VOCAB)
        return h.get_tensor("d2t"), h.get_tensor("t2d")

    def token_counts(self) -> torch.Tensor:
        return self._handle(VOCAB).get_tensor("token_counts")
