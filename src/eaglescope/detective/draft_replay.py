"""Draft-side replay: the golden draft stages of a trace when the target's layers are not at hand.

A 1T-parameter target (Kimi-K2.5, DeepSeek-V3) does not run in one debugging process, and its decoder layers may not
even be on the machine. Everything the draft computes still follows from what the engine handed it: the features
(the trace's own `target.aux` of every round), the tokens and the verify decisions, plus the target's input
embedding (read tensor by tensor from the shards). `RecordedTarget` is a Target that plays the traced run's target
back from those: its forward returns the recorded `target.aux` of the round, so the one replay (replay.py) and the
one diagnosis (diagnose/) run unchanged on top of it. Every draft-side cause is named as with the full target.

What this mode cannot name: whether `target.aux` holds the contract's taps (TAP_OFF_BY_ONE, TAP_WRONG_LAYER,
TAP_ORDER, TAP_EMBEDDING, TAP_NORMED, EAGLE-2 wiring's final normed state) — that needs the hidden states the target
computes, from the target's layers (a full replay) or from per-layer fingerprints the engine recorded. The capture is
taken as recorded, and doctor says so.

The lm_head is not read: the verify decisions (accepted path, bonus token) are the trace's, so no target logits are
needed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eaglescope import trace as T
from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import Target, TargetFingerprint, TargetOutput
from eaglescope.models.targets.head import EMBEDDING_NAMES, read_fingerprint
from eaglescope.models.targets.loading import _first_name, _inside, check_dir, check_finite, check_index, load_tensors

FULL = "full replay"
DRAFT_SIDE = "draft-side replay"
REPLAY_CHOICES = {"auto": None, "full": FULL, "draft-side": DRAFT_SIDE}  # doctor --replay
# What a draft-side replay cannot name: causes in the target's capture, told only by the hidden states it computes.
TARGET_SIDE_CODES = ("TAP_OFF_BY_ONE", "TAP_WRONG_LAYER", "TAP_ORDER", "TAP_EMBEDDING", "TAP_NORMED", "FC_SKIPPED")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# -- which mode --------------------------------------------------------------------------------------------------
def tensor_names(model_dir: Path) -> set[str] | None:
    """Names of the tensors the checkpoint's files hold (headers only; a sharded index counts a tensor only when its
    shard is on disk). None for a pytorch_model.bin, which cannot be listed without reading it whole."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    try:
        if single.is_file():
            with safe_open(str(single), "pt") as f:
                return set(f.keys())
        if index.is_file():
            return {k for k, v in check_index(model_dir).items() if _inside(model_dir, v, index).is_file()}
    except (SafetensorError, OSError, ValueError) as e:
        raise EagleScopeError(f"could not read the tensor names of {model_dir} ({e})") from None
    return None if (model_dir / "pytorch_model.bin").is_file() else set()


def layers_on_disk(model_dir: Path, num_layers: int) -> int:
    """How many of the target's decoder layers have tensors on disk (an MTP layer past the last one is not counted;
    a .bin checkpoint counts as whole: its full load judges it)."""
    names = tensor_names(model_dir)
    if names is None:
        return num_layers
    return len({i for n in names if (m := _LAYER.search(n)) and (i := int(m.group(1))) < num_layers})


@dataclass(frozen=True)
class ReplayMode:
    """Which golden replay doctor ran, why, and what it cannot name (for the report and --json's context)."""

    mode: str  # FULL or DRAFT_SIDE
    why: str
    layers_on_disk: int
    num_layers: int

    def cannot_name(self) -> list[str]:
        return [] if self.mode == FULL else list(TARGET_SIDE_CODES)

    def missing(self) -> list[str]:
        """What would let doctor name the target-side causes this mode cannot (empty for a full replay)."""
        if self.mode == FULL:
            return []
        # Per-layer fingerprints (the hidden state of every layer, recorded by the engine) would name the tap causes
        # without a target forward; a trace that carries them is read by the fingerprints check, not by this mode.
        return ["the target's decoder layers (--target with its weights: a full replay)",
                "per-layer fingerprints of the target's hidden states in the trace"]  # fmt: skip

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "why": self.why,
            "layers_on_disk": self.layers_on_disk,
            "num_layers": self.num_layers,
            "cannot_name": self.cannot_name(),
            "missing": self.missing(),
        }

    def line(self) -> str:
        text = f"replay     {self.mode}: {self.why}"
        if self.mode == DRAFT_SIDE:
            text += (
                f"; the capture (target.aux) is taken as recorded, so {', '.join(TARGET_SIDE_CODES[:5])} and EAGLE-2 "
                f"wiring's FC_SKIPPED cannot be named: that needs {' or '.join(self.missing())}"
            )
        return text


def choose_replay(target_dir: Path | str, requested: str = "auto") -> ReplayMode:
    """The replay doctor runs for --replay `requested`: auto is a full replay when every decoder layer of the target
    has its tensors on disk, else a draft-side replay."""
    if requested not in REPLAY_CHOICES:
        raise EagleScopeError(f"--replay must be one of {', '.join(REPLAY_CHOICES)}, got {requested!r}")
    target_dir = check_dir(target_dir)
    L = read_fingerprint(target_dir)[1].num_layers
    have = layers_on_disk(target_dir, L)
    if requested == "full":
        if have < L:  # refused before minutes of loading
            raise EagleScopeError(
                f"--replay full needs the target's layers: {have} of its {L} decoder layers are in {target_dir} "
                "(--replay draft-side replays the draft from the trace's own capture)"
            )
        return ReplayMode(FULL, "asked for (--replay full)", have, L)
    if requested == "draft-side":
        return ReplayMode(DRAFT_SIDE, "asked for (--replay draft-side)", have, L)
    if have == L:
        return ReplayMode(FULL, f"the target's {L} decoder layers are on disk", have, L)
    return ReplayMode(DRAFT_SIDE, f"{have} of the target's {L} decoder layers are on disk", have, L)


# -- the target played back from the trace ------------------------------------------------------------------------
class RecordedTarget(Target):
    """The traced run's target, played back: forward i returns the trace's `target.aux` of its i-th round (round 0
    the prefill, then each verify), no logits (the replay follows the trace's decisions), and a cache that only
    counts positions. It holds the target's input embedding, which is all the draft reads of the target itself."""

    computes_layers = False  # replay.py: no other hidden state than the recorded capture

    def __init__(self, fingerprint: TargetFingerprint, max_positions: int, embedding: torch.Tensor, trace: T.Trace,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        self.fingerprint, self.max_positions, self.embedding = fingerprint, max_positions, embedding
        self.trace, self.device, self.dtype = trace, device, dtype
        self.taps = None
        self.eos_token_ids: list[int] = []
        self.tokenizer = None
        self._rounds = sorted(trace.rounds())
        self._next = self._len = self._pending = 0

    def reset(self, max_len: int) -> None:
        self._next = self._len = self._pending = 0

    @property
    def cache_len(self) -> int:
        return self._len

    def forward(self, tokens, positions=None, tree_mask=None) -> TargetOutput:
        if self._next >= len(self._rounds):
            raise EagleScopeError("the replay ran past the trace's last round")
        rnd = self._rounds[self._next]
        self._next += 1
        aux = recorded_aux(self.trace, rnd)
        if aux.shape[0] != tokens.shape[0]:
            raise EagleScopeError(
                f"trace round {rnd}: target.aux has {aux.shape[0]} rows for the {tokens.shape[0]} tokens the target "
                "processed that round (the prompt, or the verified tree): a draft-side replay cannot pair them"
            )
        self._pending = int(tokens.shape[0])
        return TargetOutput(torch.empty(aux.shape[0], 0, device=self.device), aux.to(self.device))

    def commit(self, keep: torch.Tensor | None = None) -> None:
        self._len += self._pending if keep is None else int(keep.numel())
        self._pending = 0

    def hidden_states(self, input_ids, attention_mask=None) -> TargetOutput:
        raise EagleScopeError("the target's layers are not loaded (draft-side replay): no hidden states to compute")


def recorded_aux(trace: T.Trace, rnd: int) -> torch.Tensor:
    """The trace's target.aux of round `rnd`, in full (what a draft-side replay feeds the draft)."""
    try:
        aux = trace.get(T.TARGET_AUX, rnd)
    except KeyError:
        raise EagleScopeError(
            f"the trace has no target.aux in round {rnd}: a draft-side replay feeds the draft the features the engine "
            "recorded (record target.aux every round, or give --target with its layers for a full replay)"
        ) from None
    if not isinstance(aux, torch.Tensor):
        raise EagleScopeError(
            f"the trace's target.aux (round {rnd}) is a fingerprint: a draft-side replay needs the features the draft "
            "received in full (record target.aux with full=True, e.g. rec.record(TARGET_AUX, aux, full=True), or "
            "give --target with its layers for a full replay)"
        )
    return aux


def check_capture_width(trace: T.Trace, num_taps: int, hidden_size: int) -> tuple[str, int] | None:
    """(why, round) the trace's capture cannot feed this draft's fc (None when it can): another width than the
    contract's taps is a capture fault that only the target's hidden states can name."""
    for rnd in sorted(trace.rounds()):
        if (T.TARGET_AUX, rnd) not in {(e.stage, e.round) for e in trace.events}:
            continue
        width = recorded_aux(trace, rnd).shape[-1]
        if width != num_taps * hidden_size:
            return (
                f"target.aux (round {rnd}) is {width} wide; the draft's fc reads {num_taps} taps of {hidden_size}: "
                "the engine captured something other than the contract's taps",
                rnd,
            )
    return None


def load_recorded_target(target_dir: Path | str, trace: T.Trace, table: torch.Tensor, device: torch.device,
                         dtype: torch.dtype) -> RecordedTarget:  # fmt: skip
    """The target of a draft-side replay: fingerprint and context from config.json, and its input embedding read into
    `table` (the draft's own [V, H] table, which the replay computes with), a block of rows at a time: a 163840 x 7168
    table is 2.35 GB in bf16, and it is never held twice."""
    target_dir = check_dir(target_dir)
    _, fp, max_positions = read_fingerprint(target_dir)
    if tuple(table.shape) != (fp.vocab_size, fp.hidden_size):
        raise EagleScopeError(
            f"the draft's embedding is {list(table.shape)}; {target_dir}/config.json says "
            f"[{fp.vocab_size}, {fp.hidden_size}]"
        )
    read_embedding_into(target_dir, table)
    return RecordedTarget(fp, max_positions, table, trace, device, dtype)


_ROWS = 4096  # rows read at once
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def read_embedding_into(target_dir: Path, table: torch.Tensor) -> None:
    """Copy the checkpoint's embed_tokens.weight into `table`, checked finite block by block. Safetensors shards are
    read with plain reads at the tensor's offsets, not mapped, so only one block is ever resident beside `table`."""
    single, index = target_dir / "model.safetensors", target_dir / "model.safetensors.index.json"
    if single.is_file():
        files = {k: single for k in _header(single)[0] if k != "__metadata__"}
    elif index.is_file():
        files = {k: _inside(target_dir, v, index) for k, v in check_index(target_dir).items()}
    else:  # a pytorch_model.bin is read whole
        found = load_tensors(target_dir, {"embedding": EMBEDDING_NAMES})
        if "embedding" not in found:
            raise EagleScopeError(f"{target_dir} has no embed_tokens.weight: a draft-side replay needs the embedding")
        _copy_rows(found["embedding"], table, target_dir)
        return
    key = _first_name(files, EMBEDDING_NAMES)
    if key is None:
        raise EagleScopeError(f"{target_dir} has no embed_tokens.weight: a draft-side replay needs the embedding")
    path = files[key]
    try:
        header, start = _header(path)
        info = header[key]
        src_dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        shape, (begin, end) = tuple(info["shape"]), info["data_offsets"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EagleScopeError(f"could not read {key} from {path} ({e})") from None
    if shape != tuple(table.shape):
        raise EagleScopeError(f"{target_dir}: {key} has shape {list(shape)}, the draft's table {list(table.shape)}")
    row_bytes = (end - begin) // shape[0]
    with path.open("rb") as f:
        for i in range(0, shape[0], _ROWS):
            n = min(_ROWS, shape[0] - i)
            f.seek(start + begin + i * row_bytes)
            buf = bytearray(n * row_bytes)
            if f.readinto(buf) != len(buf):
                raise EagleScopeError(f"{path} is truncated: {key} ends past the file")
            rows = torch.frombuffer(buf, dtype=src_dtype).view(n, shape[1])
            _copy_rows(rows, table[i : i + n], target_dir)


def _header(path: Path) -> tuple[dict, int]:
    """(a safetensors file's JSON header, the offset its data starts at)."""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _copy_rows(rows: torch.Tensor, out: torch.Tensor, where: Path) -> None:
    check_finite({"embed_tokens.weight": rows}, where)
    with torch.no_grad():
        out.copy_(rows)
