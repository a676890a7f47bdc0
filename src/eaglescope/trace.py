"""Trace recorder: the common language in which engines and eaglescope's replay describe one decode.

A trace is a directory: ``manifest.json`` + one or more ``*.safetensors`` (format: docs/trace-format.md).
This file depends only on torch, safetensors, json and the standard library, so a user can copy it into
SGLang, vLLM or their own engine and drop ``rec.record(stage, tensor)`` calls into the decoding loop:

    with TraceRecorder("trace/", mode="fingerprint", producer="my-engine") as rec:
        rec.set_meta(prompt_ids=ids, taps=[2, 16, 29])
        rec.record(TARGET_AUX, aux, segments=3)   # [T, 3H]
        ...
        rec.next_round()

Rounds: round 0 is prefill (target.tap.*, target.aux over the prompt, verify.bonus = first token,
next.hidden_in); each round r >= 1 is one cycle draft (draft.*) → tree (verify.tokens/parents) → target
verify forward (target.tap.*, target.aux over the tree) → verify.accepted/bonus → next.hidden_in.

Fingerprint mode stores, instead of a float tensor, a few small statistics and a fixed-seed random
projection of every row, so that a 671B-parameter engine can afford to record and two traces can still
be compared (``compare``) without the full tensors.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

try:  # inside eaglescope: its one rule for outputs; a standalone copy in an engine keeps the simple rule below
    from eaglescope import outputs as _outputs
    from eaglescope.errors import EagleScopeError as _ErrorBase  # the CLI's one-line user errors
except ImportError:
    _outputs, _ErrorBase = None, Exception

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODES = ("full", "fingerprint")

# ---------------------------------------------------------------------------------------------------------
# Canonical stage names, defined once. Shapes: T positions processed by the target this round, n draft
# tokens in a step, H hidden size, nH the concatenation of n taps.
TARGET_AUX = "target.aux"  # [T, nH] the concatenation fed to the draft (taps low to high)
DRAFT_FC_OUT = "draft.fc.out"  # [T, H]
VERIFY_TOKENS = "verify.tokens"  # [N] candidate tokens sent to the target (tree order)
VERIFY_PARENTS = "verify.parents"  # [N] parent index of each candidate (-1 = root)
VERIFY_ACCEPTED = "verify.accepted"  # [a] indices into verify.tokens of the accepted path
VERIFY_BONUS = "verify.bonus"  # [1] the target's own token after the accepted path
NEXT_HIDDEN_IN = "next.hidden_in"  # [a+1, nH|H] features handed to the next round
TOPK_IDS = "ids"  # part names of draft.step<k>.topk
TOPK_LOGPROBS = "logprobs"

# Meta key: which tree nodes a draft tree step's rows attend, the engine's own layout (the replay follows it). A chain
# is the same under both. TREE_ANCESTORS (the default when the key is absent): each node attends its ancestors, as
# EAGLE-2's tree does (eaglescope, vLLM). TREE_COLUMN: the frontier's row j (its top-k column, rows best first) of
# step k attends the rows j of steps 1..k and nothing else of the tree, whoever its parent: SGLang lays its draft KV
# out per top-k column (sglang kernels/ops/speculative/cache_locs.py generate_draft_decode_kv_indices).
DRAFT_TREE_ATTENTION = "draft_tree_attention"
TREE_ANCESTORS = "ancestors"
TREE_COLUMN = "column"
TREE_ATTENTIONS = (TREE_ANCESTORS, TREE_COLUMN)


def target_tap(i: int) -> str:
    """[T, H] hidden state with HF ``output_hidden_states`` index i (0 = embedding output)."""
    return f"target.tap.{int(i)}"


def target_layer(i: int) -> str:
    """[T, H] the prefill's hidden state with HF ``output_hidden_states`` index i, for every i = 0..L: 0 the
    embedding output, i the residual stream entering layer i, L the final normed state (what lm_head reads).
    Recorded by ``TraceRecorder.record_layers``, always as a fingerprint."""
    return f"target.layer.{int(i)}"


def target_layer_normed(i: int) -> str:
    """[T, H] layer i's input RMSNorm applied to ``target.layer.<i>`` (what layer i's attention reads), i < L."""
    return f"target.layer.{int(i)}.normed"


def draft_embed_in(k: int) -> str:
    """[n, H] token embeddings entering draft step k."""
    return f"draft.step{int(k)}.embed_in"


def draft_hidden_in(k: int) -> str:
    """[n, H|nH] features entering draft step k (fc output at k=0, the draft's own hidden_out after)."""
    return f"draft.step{int(k)}.hidden_in"


def draft_hidden_out(k: int) -> str:
    """[n, H] pre-norm output of draft step k (what step k+1 receives)."""
    return f"draft.step{int(k)}.hidden_out"


def draft_tokens(k: int) -> str:
    """[n] int64 token ids (target vocabulary) draft step k reads, one per row: what embed_in embeds."""
    return f"draft.step{int(k)}.tokens"


def draft_positions(k: int) -> str:
    """[n] int64 RoPE positions draft step k runs its rows at."""
    return f"draft.step{int(k)}.positions"


def draft_topk(k: int) -> str:
    """Top-k of draft step k: recorded as one stage with two parts, ``ids`` [n, K] and ``logprobs`` [n, K]."""
    return f"draft.step{int(k)}.topk"


_NAME = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
_TAP = re.compile(r"^target\.tap\.(\d+)$")
_LAYER = re.compile(r"^target\.layer\.(\d+)(\.normed)?$")
_STEP = re.compile(r"^draft\.step(\d+)\.(.+)$")
# Every stage family a trace may hold, in the order a round makes them (a target's layers, its taps and their
# concatenation; fc; the draft steps' inputs and outputs; verify; the features handed to the next round).
STAGE_FAMILIES = (
    "target.layer",
    "target.layer.normed",
    "target.tap",
    TARGET_AUX,
    DRAFT_FC_OUT,
    "draft.tokens",
    "draft.positions",
    "draft.embed_in",
    "draft.hidden_in",
    "draft.hidden_out",
    "draft.topk",
    VERIFY_TOKENS,
    VERIFY_PARENTS,
    VERIFY_ACCEPTED,
    VERIFY_BONUS,
    NEXT_HIDDEN_IN,
)
_CANONICAL_FAMILIES = set(STAGE_FAMILIES)


def parse_stage(name: str) -> tuple[str, int | None]:
    """``target.tap.3`` → ("target.tap", 3); ``target.layer.3.normed`` → ("target.layer.normed", 3);
    ``draft.step2.hidden_in`` → ("draft.hidden_in", 2);
    anything else → (name, None). Non-canonical names are allowed (see ``is_canonical``)."""
    if m := _TAP.match(name):
        return "target.tap", int(m.group(1))
    if m := _LAYER.match(name):
        return "target.layer" + (".normed" if m.group(2) else ""), int(m.group(1))
    if m := _STEP.match(name):
        return f"draft.{m.group(2)}", int(m.group(1))
    return name, None


def is_canonical(name: str) -> bool:
    return parse_stage(name)[0] in _CANONICAL_FAMILIES


class TraceError(_ErrorBase):
    """A malformed trace, or a recorder used wrongly. (The eaglescope CLI reports it as one line.)"""


# ---------------------------------------------------------------------------------------------------------
# Fingerprints

PROJ_DIM = 16
HEAD = 8
_FP_FIELDS = ("row_norm", "seg_mean", "seg_std", "seg_norm", "head", "proj", "proj_check")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def projection_matrix(width: int, seed: int = 0) -> torch.Tensor:
    """[width, 16] float32, N(0, 1/16) entries: E||x @ P||² = ||x||². Drawn on the CPU from a
    torch.Generator seeded with ``seed * 1_000_003 + width`` so independent recorders agree. Cached: an engine
    recording every round would otherwise draw the same matrix thousands of times (most of a capture's cost)."""
    return _projection(int(width), int(seed)).clone()


@functools.lru_cache(maxsize=64)
def _projection(width: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + width)
    return torch.randn(width, PROJ_DIM, generator=g, dtype=torch.float32) / math.sqrt(PROJ_DIM)


@dataclass
class Fingerprint:
    """Summary of a tensor viewed as rows [R, D] (all leading dims flattened), D split into S segments.

    row_norm [R]; seg_mean, seg_std, seg_norm [R, S]; head [min(R,1)*2, S, h] the first h = min(8, D/S)
    values of each segment of row 0 and of the last row; proj [R, S, 16] each segment times
    ``projection_matrix(D/S, seed)``; proj_check [4] the first four entries of that matrix, so that a
    torch whose generator differs is detected instead of silently disagreeing.
    """

    shape: tuple[int, ...]
    dtype: str
    segments: int
    seed: int
    row_norm: torch.Tensor
    seg_mean: torch.Tensor
    seg_std: torch.Tensor
    seg_norm: torch.Tensor
    head: torch.Tensor
    proj: torch.Tensor
    proj_check: torch.Tensor = field(repr=False)

    @property
    def rows(self) -> int:
        return self.row_norm.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in _FP_FIELDS}

    def segment(self, j: int) -> Fingerprint:
        """The fingerprint of segment j alone (what ``fingerprint(x[..., seg_j])`` gives, up to rounding),
        so that e.g. one third of ``target.aux`` can be compared with a ``target.tap.<i>``."""
        if not 0 <= j < self.segments:
            raise TraceError(f"segment {j} out of range for a fingerprint with {self.segments} segments")
        sl = slice(j, j + 1)
        shape = (*self.shape[:-1], self.shape[-1] // self.segments) if self.shape else (1,)
        return Fingerprint(
            shape=shape,
            dtype=self.dtype,
            segments=1,
            seed=self.seed,
            row_norm=self.seg_norm[:, j].clone(),
            seg_mean=self.seg_mean[:, sl].clone(),
            seg_std=self.seg_std[:, sl].clone(),
            seg_norm=self.seg_norm[:, sl].clone(),
            head=self.head[:, sl].clone(),
            proj=self.proj[:, sl].clone(),
            proj_check=self.proj_check.clone(),
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] → [R, D] float32 on the CPU (a 0-d tensor is one row of one, a 1-d tensor one row)."""
    t = t.detach().to("cpu", torch.float32)
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(-1, t.shape[-1])


def fingerprint(tensor: torch.Tensor, segments: int = 1, seed: int = 0) -> Fingerprint:
    """Fingerprint of ``tensor`` (any dtype; computed in float32 on the CPU for reproducibility)."""
    x = _rows(tensor)
    R, D = x.shape
    if segments < 1 or D % segments:
        raise TraceError(f"cannot split a last dimension of {D} into {segments} equal segments")
    w = D // segments
    xs = x.reshape(R, segments, w)  # [R, S, w]
    seg_norm = xs.norm(dim=-1)
    seg_mean = xs.sum(-1) / max(w, 1)
    seg_std = (xs - seg_mean.unsqueeze(-1)).square().sum(-1).div(max(w, 1)).sqrt()
    P = projection_matrix(w, seed)
    h = min(HEAD, w)
    head = xs[[0, R - 1], :, :h] if R else xs.new_zeros(0, segments, h)
    return Fingerprint(
        shape=tuple(tensor.shape),
        dtype=_dtype_name(tensor.dtype),
        segments=segments,
        seed=int(seed),
        row_norm=x.norm(dim=-1),
        seg_mean=seg_mean,
        seg_std=seg_std,
        seg_norm=seg_norm,
        head=head.contiguous(),
        proj=(xs @ P).contiguous(),  # [R, S, 16]
        proj_check=P.flatten()[:4].clone(),
    )


def projection(tensor: torch.Tensor, segments: int = 1, seed: int = 0) -> torch.Tensor:
    """``fingerprint(tensor, segments, seed).proj`` alone [R, S, 16] (float32, on the host), computed where ``tensor``
    is: the part of a fingerprint by which another tensor is compared with it. One product on the tensor's own device
    (an engine's GPU), where a whole fingerprint is several passes over a host copy: comparing a replay's tensors with
    a fingerprinted trace cost doctor tens of seconds at 8B that way."""
    x = tensor.detach()
    x = x.reshape(1, 1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])
    R, D = x.shape
    if segments < 1 or D % segments:
        raise TraceError(f"cannot split a last dimension of {D} into {segments} equal segments")
    w = D // segments
    P = _projection(w, int(seed)).to(x.device)
    return (x.float().reshape(R * segments, w) @ P).reshape(R, segments, PROJ_DIM).cpu()


# ---------------------------------------------------------------------------------------------------------
# Comparison

_EPS = 1e-30


def _rel(diff: torch.Tensor, ref: torch.Tensor, dim=None) -> torch.Tensor:
    """||diff|| / ||ref|| in float64, 0 when both are 0 and inf when only the reference is 0."""
    d = diff.double().norm(dim=dim) if dim is not None else diff.double().norm()
    r = ref.double().norm(dim=dim) if dim is not None else ref.double().norm()
    out = d / r.clamp_min(_EPS)
    return torch.where(r > _EPS, out, torch.where(d > _EPS, torch.full_like(d, math.inf), torch.zeros_like(d)))


def _cos(a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Cosine in float64; 1 when both are zero, 0 when exactly one is."""
    a, b = a.double(), b.double()
    na, nb = a.norm(dim=dim), b.norm(dim=dim)
    c = ((a * b).sum(dim) / (na * nb).clamp_min(_EPS)).clamp(-1.0, 1.0)
    both0, one0 = (na <= _EPS) & (nb <= _EPS), (na <= _EPS) ^ (nb <= _EPS)
    return torch.where(both0, torch.ones_like(c), torch.where(one0, torch.zeros_like(c), c))


def _ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double(), b.double()
    out = a / b.clamp_min(_EPS)
    return torch.where(b > _EPS, out, torch.where(a > _EPS, torch.full_like(a, math.inf), torch.ones_like(a)))


def _fl(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.flatten().tolist()]


def _exact_measures(a: torch.Tensor, b: torch.Tensor, S: int) -> dict:
    """compare's measures from the full tensors."""
    xa, xb = _rows(a).double(), _rows(b).double()
    d = xa - xb
    R = xa.shape[0]
    return {
        "exact": a.dtype == b.dtype and bool(torch.equal(a.detach().cpu(), b.detach().cpu())),
        "rel_l2": float(_rel(d, xb)),
        "cos": float(_cos(xa.flatten(), xb.flatten(), dim=0)),
        "max_abs_diff": float(d.abs().max()) if d.numel() else 0.0,
        "row_rel_err": _fl(_rel(d, xb, dim=-1)),
        "row_cos": _fl(_cos(xa, xb)),
        "seg_rel_err": _fl(
            _rel(
                d.reshape(R, S, -1).transpose(0, 1).reshape(S, -1),
                xb.reshape(R, S, -1).transpose(0, 1).reshape(S, -1),
                dim=-1,
            )
        ),
    }


def _projected_measures(pa: Fingerprint, pb: Fingerprint, S: int) -> dict:
    """compare's measures estimated from the 16-dim projections (Johnson-Lindenstrauss); identical inputs give 0."""
    d = pa.proj.double() - pb.proj.double()  # [R, S, 16]
    R = d.shape[0]
    return {
        "rel_l2": float(_rel(d, pb.proj)),
        "cos": float(_cos(pa.proj.flatten(), pb.proj.flatten(), dim=0)),
        "row_rel_err": _fl(_rel(d.reshape(R, -1), pb.proj.reshape(R, -1), dim=-1)),
        "row_cos": _fl(_cos(pa.proj.reshape(R, -1), pb.proj.reshape(R, -1))),
        "seg_rel_err": _fl(_rel(d.transpose(0, 1).reshape(S, -1), pb.proj.transpose(0, 1).reshape(S, -1), dim=-1)),
        "max_abs_diff": float((pa.head - pb.head).abs().max()) if pa.head.numel() else 0.0,
        "exact": None,
    }


def compare(
    a: torch.Tensor | Fingerprint,
    b: torch.Tensor | Fingerprint,
    segments: int | None = None,
    tol: float = 2e-2,
) -> dict:
    """Similarity of ``a`` (e.g. the engine's) to ``b`` (the reference), full or fingerprint on either side.

    If either side is a fingerprint the other is fingerprinted with the same segments and seed and the
    measures come from the projections (``method = "fingerprint"``); otherwise they are exact
    (``method = "full"``). Relative errors are ||a-b|| / ||b||. Keys (docs/trace-format.md):
    method, shape_match, shape_a, shape_b, dtype_a, dtype_b, exact, rel_l2, cos, max_abs_diff,
    norm_ratio, row_rel_err, row_cos, row_norm_ratio, seg_rel_err, seg_norm_ratio, first_bad_row, match.
    """
    fa, fb = isinstance(a, Fingerprint), isinstance(b, Fingerprint)
    if fa and fb and (a.segments, a.seed) != (b.segments, b.seed):
        raise TraceError(
            f"cannot compare fingerprints with segments/seed {a.segments}/{a.seed} and {b.segments}/{b.seed}"
        )
    if fa or fb:
        ref = a if fa else b
        S, seed = ref.segments, ref.seed
    else:
        S, seed = segments or 1, 0
    shape_a, shape_b = tuple(a.shape), tuple(b.shape)
    out: dict = {
        "method": "fingerprint" if fa or fb else "full",
        "shape_match": shape_a == shape_b,
        "shape_a": list(shape_a),
        "shape_b": list(shape_b),
        "dtype_a": a.dtype if fa else _dtype_name(a.dtype),
        "dtype_b": b.dtype if fb else _dtype_name(b.dtype),
        "exact": None,
        "rel_l2": None,
        "cos": None,
        "max_abs_diff": None,
        "norm_ratio": None,
        "row_rel_err": None,
        "row_cos": None,
        "row_norm_ratio": None,
        "seg_rel_err": None,
        "seg_norm_ratio": None,
        "first_bad_row": None,
        "match": False,
    }
    if not out["shape_match"]:
        return out
    pa = a if fa else fingerprint(a, S, seed)
    pb = b if fb else fingerprint(b, S, seed)
    if fa and fb and not torch.equal(pa.proj_check, pb.proj_check):
        raise TraceError("the two fingerprints were made with different projection matrices (torch RNG differs)")
    out["row_norm_ratio"] = _fl(_ratio(pa.row_norm, pb.row_norm))
    out["norm_ratio"] = float(_ratio(pa.row_norm.double().norm(), pb.row_norm.double().norm()))
    out["seg_norm_ratio"] = _fl(_ratio(pa.seg_norm.double().norm(dim=0), pb.seg_norm.double().norm(dim=0)))
    out |= _exact_measures(a, b, S) if out["method"] == "full" else _projected_measures(pa, pb, S)
    bad = [i for i, e in enumerate(out["row_rel_err"]) if not e <= tol]
    out["first_bad_row"] = bad[0] if bad else None
    norm_ok = all(abs(r - 1.0) <= tol for r in out["row_norm_ratio"])
    out["match"] = bool(out["rel_l2"] <= tol and norm_ok and not bad)
    return out


# ---------------------------------------------------------------------------------------------------------
# Recording

_RESERVED = {"round", "stage", "part", "key", "file", "shape", "dtype", "kind", "segments", "seed", "extra"}


def _jsonable(value, what: str):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif isinstance(value, Mapping):
        value = {str(k): _jsonable(v, what) for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        value = [_jsonable(v, what) for v in value]
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{what} must be JSON-serializable: {e}") from None
    return value


def _event_key(round: int, stage: str, part: str | None) -> str:
    return f"{round}/{stage}" if part is None else f"{round}/{stage}/{part}"


def trace_kind(producer: str):
    """The output kind of traces written by `producer` (what a TraceRecorder of that producer may replace)."""

    def written_by_producer(p: Path) -> bool:
        return (_outputs.read_json(p / MANIFEST) or {}).get("producer") == producer

    return _outputs.dir_kind(
        f"trace written by {producer}",
        markers=[MANIFEST],
        entries=[MANIFEST, "trace-*.safetensors"],
        check=written_by_producer,
    )


class TraceRecorder:
    """Collects events and writes the trace directory atomically on ``close()``.

    mode "full" keeps every tensor (detached, on the CPU, in its own dtype). mode "fingerprint" keeps
    fingerprints of floating tensors and integer/bool tensors (tokens, parents, ids) in full; pass
    ``full=True`` to ``record`` to keep a particular float tensor whole. Buffered tensors are flushed to a
    new shard in the hidden temp directory once they exceed ``shard_bytes``, so memory stays bounded.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        mode: str = "full",
        producer: str = "unknown",
        meta: dict | None = None,
        seed: int = 0,
        shard_bytes: int = 1 << 30,
        inputs: tuple = (),
        flag: str = "trace directory",
    ) -> None:
        if mode not in MODES:
            raise TraceError(f"trace mode must be one of {MODES}, got {mode!r}")
        self.out_dir = Path(out_dir)
        if _outputs is not None:
            # Only a trace this producer wrote is replaced: never an engine's capture, a directory of other files,
            # or one of the command's inputs (`inputs`, e.g. the trace being replayed).
            _outputs.check_destination(self.out_dir, trace_kind(str(producer)), inputs=inputs, flag=flag)
        elif self.out_dir.exists() and (
            not self.out_dir.is_dir() or (any(self.out_dir.iterdir()) and not (self.out_dir / MANIFEST).is_file())
        ):
            # Replacing it on close would delete something that is not a trace.
            raise TraceError(f"{self.out_dir} exists and is not a trace directory; refusing to overwrite it")
        self.mode, self.producer, self.seed, self.shard_bytes = mode, str(producer), int(seed), int(shard_bytes)
        self.meta: dict = {}
        self.round = 0
        self.events: list[dict] = []
        self._seen: set[str] = set()
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards = 0
        self._tmp: Path | None = None
        self._closed = False
        if meta:
            self.set_meta(**meta)

    # -- public API --------------------------------------------------------------------------------------
    def set_meta(self, **kw) -> None:
        """Prompt token ids, decoding settings, taps, model fingerprints …; tensors become lists."""
        for k, v in kw.items():
            self.meta[k] = _jsonable(v, f"meta[{k!r}]")

    def next_round(self) -> int:
        self.round += 1
        return self.round

    def record(
        self,
        stage: str,
        tensor: torch.Tensor | Mapping[str, torch.Tensor],
        round: int | None = None,
        segments: int = 1,
        full: bool = False,
        compact: bool = False,
        **extra,
    ) -> None:
        """Record ``tensor`` (or ``{part: tensor}``, e.g. topk ids and logprobs) as ``stage`` of ``round``
        (default: the current round). ``segments`` splits the last dim for fingerprints (3 for a 3-tap
        target.aux); ``full`` keeps a float tensor whole in fingerprint mode, ``compact`` fingerprints it in full
        mode; ``extra`` is any JSON-serializable annotation kept in the event."""
        if self._closed:
            raise TraceError("record() after close(): this trace has already been written")
        if not isinstance(stage, str) or not _NAME.match(stage):
            raise TraceError(f"stage names are dot-separated [A-Za-z0-9_-] words, got {stage!r}")
        clash = _RESERVED & extra.keys()
        if clash:
            raise TraceError(f"extra fields {sorted(clash)} clash with event fields")
        extra = _jsonable(extra, "extra")
        r = self.round if round is None else int(round)
        parts = tensor.items() if isinstance(tensor, Mapping) else [(None, tensor)]
        for part, t in parts:
            if part is not None and not _NAME.match(str(part)):
                raise TraceError(f"part names are [A-Za-z0-9_-] words, got {part!r}")
            if not isinstance(t, torch.Tensor):
                raise TraceError(f"{stage}: expected a torch.Tensor, got {type(t).__name__}")
            key = _event_key(r, stage, part)
            if key in self._seen:
                raise TraceError(f"stage {stage!r} recorded twice in round {r}: call next_round() between rounds")
            self._add(r, stage, part, key, t, segments, full, extra, compact)
            self._seen.add(key)

    def record_layers(
        self,
        states: Sequence[torch.Tensor],
        final: torch.Tensor | None = None,
        normed: Sequence[torch.Tensor] | None = None,
        round: int = 0,
    ) -> None:
        """Every hidden state of one target forward (the prefill: round 0), as fingerprints whatever the mode (the
        full states of every layer would outweigh the rest of the trace). ``states``: the L tensors [T, H] entering
        layers 0..L-1 (HF ``output_hidden_states[0..L-1]``: 0 the embedding output) → ``target.layer.<i>``;
        ``final``: the final normed state (``output_hidden_states[L]``, what lm_head reads) → ``target.layer.<L>``;
        ``normed``: layer i's input RMSNorm of ``states[i]`` → ``target.layer.<i>.normed``. With them doctor tells
        which state each segment of ``target.aux`` holds without the target's weights; without ``final`` it cannot
        tell the final normed state, without ``normed`` a normed tap."""
        if not states:
            raise TraceError("record_layers needs the hidden states entering each layer, got none")
        if normed is not None and len(normed) != len(states):
            raise TraceError(f"record_layers: {len(normed)} normed states for {len(states)} layers")
        for i, t in enumerate(states):
            self.record(target_layer(i), t, round=round, compact=True)
        if final is not None:
            self.record(target_layer(len(states)), final, round=round, compact=True)
        for i, t in enumerate(normed or ()):
            self.record(target_layer_normed(i), t, round=round, compact=True)

    def close(self) -> Path:
        """Write the manifest and the remaining tensors, then swap the directory in. Idempotent."""
        if self._closed:
            return self.out_dir
        try:
            self._flush(force=True)
            manifest = {
                "format_version": FORMAT_VERSION,
                "producer": self.producer,
                "mode": self.mode,
                "meta": self.meta,
                "events": self.events,
            }
            (self._tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            self._swap_in()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self.out_dir

    def abort(self) -> None:
        """Drop everything recorded; an existing trace at out_dir is left as it was."""
        self._closed = True
        self._buffer.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals ---------------------------------------------------------------------------------------
    def _add(self, r, stage, part, key, t, segments, full, extra, compact=False) -> None:
        ev = {"round": r, "stage": stage, "part": part, "key": key, "file": None}
        width = t.shape[-1] if t.dim() else 1
        if segments < 1 or width % segments:
            raise TraceError(f"{stage}: cannot split a last dimension of {width} into {segments} equal segments")
        ev |= {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "segments": int(segments)}
        keep_full = (self.mode == "full" and not compact) or full or not t.is_floating_point()
        if keep_full:
            # A copy even on the CPU: engines reuse buffers, and a view would drag its whole storage along.
            self._put(key, t.detach().to("cpu", copy=True).contiguous())
            ev["kind"] = "full"
        else:
            fp = fingerprint(t, segments, self.seed)
            for name, v in fp.tensors().items():
                self._put(f"{key}:{name}", v.contiguous())
            ev |= {"kind": "fingerprint", "seed": fp.seed}
        ev["extra"] = extra
        self.events.append(ev)
        self._flush()

    def _put(self, name: str, t: torch.Tensor) -> None:
        self._buffer[name] = t
        self._buffer_bytes += t.numel() * t.element_size()

    def _flush(self, force: bool = False) -> None:
        if not force and self._buffer_bytes < self.shard_bytes:
            return
        if not self._buffer and self._shards:
            return
        if self._tmp is None:
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)
            tag = _outputs.TMP_TAG if _outputs is not None else ".tmp-"
            self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}{tag}", suffix=f"-{os.getpid()}",
                                              dir=self.out_dir.parent))  # fmt: skip
        fname = f"trace-{self._shards:05d}.safetensors"
        save_file(self._buffer, str(self._tmp / fname), metadata={"format": "pt", "eaglescope_trace": "1"})
        for ev in self.events:
            if ev["file"] is None:
                ev["file"] = fname
        self._shards += 1
        self._buffer, self._buffer_bytes = {}, 0

    def _swap_in(self) -> None:
        if _outputs is not None:
            _outputs.swap_in(self._tmp, self.out_dir)
            self._tmp = None
            return
        # Never a half-written trace where a good one stood: the old one moves aside only once the new one
        # is complete, and comes back if the final rename fails.
        old = None
        if self.out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.old-", dir=self.out_dir.parent))
            os.rmdir(old)
            os.rename(self.out_dir, old)
        try:
            os.rename(self._tmp, self.out_dir)
        except BaseException:
            if old is not None:
                os.rename(old, self.out_dir)
            raise
        self._tmp = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class TraceEvent:
    round: int
    stage: str
    part: str | None
    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    segments: int = 1
    seed: int = 0
    extra: dict = field(default_factory=dict)


class Trace:
    """A loaded trace. Tensors are read lazily; the structure is validated on load."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise TraceError(f"{self.path} is not a trace: no {MANIFEST}")
        try:
            manifest = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TraceError(f"{mpath} is not valid JSON: {e}") from None
        if not isinstance(manifest, dict):
            raise TraceError(f"{mpath} must hold a JSON object")
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise TraceError(f"{mpath} has trace format_version {version!r}; this reader knows {FORMAT_VERSION}")
        if manifest.get("mode") not in MODES or not isinstance(manifest.get("events"), list):
            raise TraceError(f"{mpath} lacks a valid 'mode' or 'events' list")
        self.manifest = manifest
        try:
            self.events = [
                TraceEvent(
                    round=int(e["round"]),
                    stage=str(e["stage"]),
                    part=e.get("part"),
                    key=str(e["key"]),
                    file=str(e["file"]),
                    shape=tuple(int(s) for s in e["shape"]),
                    dtype=str(e["dtype"]),
                    kind=str(e["kind"]),
                    segments=int(e.get("segments", 1)),
                    seed=int(e.get("seed", 0)),
                    extra=dict(e.get("extra") or {}),
                )
                for e in manifest["events"]
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{mpath} has a malformed event: {e!r}") from None
        self._index: dict[tuple[str, int], list[TraceEvent]] = {}
        # Each tensor file is opened once and kept open (a memory map): a replay and its diagnosis read thousands of
        # tensors, and opening the file again for each one (its header parsed anew) cost most of doctor's time.
        self._files: dict[str, safe_open] = {}
        files: dict[str, list[str]] = {}
        for ev in self.events:
            if ev.kind not in ("full", "fingerprint"):
                raise TraceError(f"{mpath}: event {ev.key} has unknown kind {ev.kind!r}")
            if Path(ev.file).name != ev.file:
                raise TraceError(f"{mpath}: event {ev.key} names a file outside the trace: {ev.file!r}")
            names = [ev.key] if ev.kind == "full" else [f"{ev.key}:{f}" for f in _FP_FIELDS]
            files.setdefault(ev.file, []).extend(names)
            self._index.setdefault((ev.stage, ev.round), []).append(ev)
        for fname, names in files.items():
            fpath = self.path / fname
            if not fpath.is_file():
                raise TraceError(f"{self.path}: tensor file {fname} named in the manifest is missing")
            try:
                self._files[fname] = f = safe_open(str(fpath), framework="pt")
                have = set(f.keys())
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise TraceError(f"{fpath} is not a readable safetensors file: {e}") from None
            missing = [n for n in names if n not in have]
            if missing:
                raise TraceError(f"{fpath} lacks tensor {missing[0]!r} named in the manifest")

    @property
    def meta(self) -> dict:
        return self.manifest.get("meta") or {}

    @property
    def producer(self) -> str:
        return self.manifest.get("producer", "unknown")

    @property
    def mode(self) -> str:
        return self.manifest["mode"]

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def __contains__(self, item) -> bool:
        stage, round = item if isinstance(item, tuple) else (item, None)
        return any(s == stage and (round is None or r == round) for s, r in self._index)

    def stages(self) -> list[str]:
        return list(dict.fromkeys(ev.stage for ev in self.events))

    def rounds(self) -> list[int]:
        return sorted({ev.round for ev in self.events})

    def load(self, ev: TraceEvent) -> torch.Tensor | Fingerprint:
        try:
            f = self._files[ev.file]
            if ev.kind == "full":
                return f.get_tensor(ev.key)
            ts = {name: f.get_tensor(f"{ev.key}:{name}") for name in _FP_FIELDS}
        except Exception as e:
            raise TraceError(f"{self.path / ev.file}: cannot read {ev.key}: {e}") from None
        return Fingerprint(shape=ev.shape, dtype=ev.dtype, segments=ev.segments, seed=ev.seed, **ts)

    def get(
        self, stage: str, round: int | None = None, part: str | None = None
    ) -> torch.Tensor | Fingerprint | dict[str, torch.Tensor | Fingerprint]:
        """The value of ``stage`` in ``round`` (may be omitted when the stage occurs in one round only).
        A stage recorded with parts (draft.step<k>.topk) gives ``{part: value}`` unless ``part`` is named."""
        if round is None:
            rounds = sorted(r for s, r in self._index if s == stage)
            if len(rounds) != 1:
                raise KeyError(f"stage {stage!r} occurs in rounds {rounds}: name one")
            round = rounds[0]
        evs = self._index.get((stage, int(round)))
        if not evs:
            raise KeyError(f"no stage {stage!r} in round {round}")
        if part is not None:
            evs = [e for e in evs if e.part == part]
            if not evs:
                raise KeyError(f"stage {stage!r} of round {round} has no part {part!r}")
            return self.load(evs[0])
        if len(evs) == 1 and evs[0].part is None:
            return self.load(evs[0])
        return {e.part: self.load(e) for e in evs}


def load_trace(path: str | os.PathLike) -> Trace:
    return Trace(path)
