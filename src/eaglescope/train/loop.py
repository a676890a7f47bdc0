"""`eaglescope train`: the EAGLE-3 training loop around the TTT core (train/ttt.py).

    data   = PreparedData (eaglescope prepare). With stored hidden states, aux comes from disk and
             the teacher logits are the target's head on the stored final state (only the target's
             embedding and head are read: models/targets/head.py); otherwise the target runs online on each
             padded batch (right padding).
    model  = Eagle3Draft with the target's frozen embedding and the prepared draft vocabulary.
    step   = ttt_unroll + ttt_loss per sample, averaged over the global batch; AdamW (0.9, 0.95),
             linear warmup + cosine decay, gradient clipping, bf16 autocast on GPU.
    out    = OUT/ is the draft checkpoint itself (config.json + model.safetensors, loadable as is),
             OUT/training_state/ holds what --resume needs, OUT/training_metrics.json the final
             held-out acc_k / α_k / predicted τ and the run's speed (train/speed.py: tokens/s, model FLOPs,
             fraction of the GPU's peak, peak memory; also train's closing stderr line), OUT/tb/ the
             TensorBoard scalars.

Determinism. The data order is a pure function of (seed, step): epoch e shuffles the training split
with a generator seeded from (seed, e), and step s takes the (s mod steps_per_epoch)-th global
batch of it. So resuming needs only the step (plus weights, optimizer moments and RNG states), and a
torchrun job sees the same global batches as one process: global batch = batch_size × world ×
grad_accum samples, micro-batch a, rank r takes its slice [a·B·W + r·B, a·B·W + (r+1)·B).

Time budget (--max-seconds). After FIT_AFTER optimizer steps (the first one untimed: it pays one-off costs) the
run's length is fitted once: the steps done plus those that fit in the seconds left at the measured time per step,
never more than --max-steps / --epochs give. The cosine decay then ends at that step (and a --warmup-ratio warmup
is taken of it; --warmup-steps >= FIT_AFTER leaves the steps before the fit on the final schedule), so a run on
a slower machine gets fewer steps, not a truncated schedule. Only the steps count: loading, evaluation and saving
come on top. The fitted length is saved with every checkpoint, so --resume continues to the same step count on the
same schedule whatever the clock says then (bit for bit the run that was not interrupted); a run interrupted before
its fit fits on resume, with the seconds it had already spent.

Loss normalisation. ttt_loss averages over the positions of the batch it is given; we call it per
sample and average over samples, so the mean over a global batch is the same whether the samples sit
in one process or are spread over ranks and accumulation steps (token-mean per rank would weight
ranks by their token counts differently from one big batch).

Metric indexing: acc_k and loss_k use the TTT step k = 0..K-1; alpha_k uses the draft position
k = 1..K (as decode.stats does): alpha_1 is the first drafted token.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from eaglescope.config import RESUME_KEYS, TrainConfig
from eaglescope.data.prepare import warn_unservable
from eaglescope.data.shards import PreparedData
from eaglescope.decode.speculative import target_embedding
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import DraftConfig, DraftContract, Eagle3Draft, eaglescope_section, save_draft
from eaglescope.models.targets import load_target, parse_device, parse_dtype
from eaglescope.models.targets.base import Target
from eaglescope.models.targets.head import TargetHead, load_target_head
from eaglescope.models.targets.loading import read_config
from eaglescope.models.vocab import build_draft_vocab
from eaglescope.outputs import check_destination, dir_kind, has_partial, open_partial, partial_dir, staged_dir, swap_in
from eaglescope.progress import Progress
from eaglescope.taps import TapContract
from eaglescope.train.attention import default_attention
from eaglescope.train.compiled import compile_training
from eaglescope.train.metrics import Batch, evaluate
from eaglescope.train.packing import collate_packed, to_packed
from eaglescope.train.speed import FlopModel, Throughput
from eaglescope.train.ttt import (
    LOSS_MASK_SHIFT,
    Unrolled,
    draft_vocab_ids,
    teacher_from_head,
    teacher_of,
    ttt_loss,
    ttt_unroll,
)

log = logging.getLogger(__name__)

STATE_DIR = "training_state"
METRICS_FILE = "training_metrics.json"
SPLIT_SEED = 0x5EED  # the held-out split does not depend on --seed: runs with different seeds compare
FIT_AFTER = 5  # --max-seconds: optimizer steps before the run's length is fitted to the time left
_clock = time.perf_counter  # the time budget's clock (a test replaces it with a deterministic one)

# What `train --out` may replace (with --overwrite) or continue (with --resume): a draft this command trained,
# holding nothing else. An export, a target or a directory of other files is never replaced.
TRAINED = dir_kind(
    "trained draft",
    markers=["config.json", f"{STATE_DIR}/state.json"],
    entries=["config.json", "model.safetensors", METRICS_FILE, STATE_DIR, "tb", ".draft-staging", ".eaglescope-stage"],
    replace_flag="--resume to continue it, or --overwrite",
    resumable=True,
    check=lambda p: (
        (p / STATE_DIR).is_dir()
        or (eaglescope_section(p) is not None and "exported_for" not in (eaglescope_section(p) or {}))
    ),
)


@dataclass
class TrainResult:
    out: Path
    steps: int
    metrics: dict  # final evaluation (metrics.evaluate) + "split"
    history: list[dict] = field(default_factory=list)  # per optimizer step: step, loss, acc, lr


# -- distributed ---------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this run started the process group (and so ends it)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def _setup(cfg: TrainConfig) -> tuple[Dist, torch.device]:
    """Under torchrun (WORLD_SIZE > 1): one process per device, gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(), parse_device(cfg.device)
    d = Dist(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    kind = parse_device(cfg.device).type
    if kind == "cuda" and d.local_rank >= torch.cuda.device_count():
        # Each process trains on its own GPU; NCCL refuses two ranks on one device, and CUDA's own error for a
        # missing ordinal names neither torchrun nor the fix.
        raise EagleScopeError(
            f"torchrun started local rank {d.local_rank} on a node with {torch.cuda.device_count()} visible GPU(s): "
            "--nproc-per-node must be at most the number of GPUs"
        )
    device = torch.device("cuda", d.local_rank) if kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        d.owns_group = True
    return d, device


# Settings a rank may give differently from rank 0: paths (another machine may mount the same files elsewhere; what
# they hold is compared instead) and the device (each rank takes its own local GPU).
_PATHS = ("target", "data", "out", "log_dir", "device")


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name} {t.dtype} {t.numel()};".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def _job_facts(cfg: TrainConfig, data: PreparedData, target, draft: Eagle3Draft) -> dict[str, tuple[str, str]]:
    """What every rank of a job must share → {what: (value compared, where it comes from)}: the settings (all but
    the paths), the prepared data (its manifest, which holds every file's sha256), the target (fingerprint and
    config.json) and the draft as this run starts it (initial or resumed weights, vocabulary map, the target's
    frozen embedding)."""
    facts = {f"--{k.replace('_', '-')}": (repr(v), "") for k, v in asdict(cfg).items() if k not in _PATHS}
    manifest = json.dumps(data.manifest, sort_keys=True).encode()
    facts["prepared data"] = (f"manifest sha256 {hashlib.sha256(manifest).hexdigest()[:12]}", f"--data {cfg.data}")
    config = (Path(cfg.target) / "config.json").read_bytes()
    fp = json.dumps([target.fingerprint.to_dict(), hashlib.sha256(config).hexdigest()], sort_keys=True).encode()
    facts["target"] = (f"fingerprint sha256 {hashlib.sha256(fp).hexdigest()[:12]}", f"--target {cfg.target}")
    facts["draft's starting weights"] = (f"sha256 {_digest(draft.state_dict())[:12]}", "")
    return facts


def _check_ranks_agree(facts: dict[str, tuple[str, str]], d: Dist) -> None:
    """Every rank's facts against rank 0's, before the first step (a rank training on other data or settings
    would otherwise train silently on a mixture, or hang when its step count differs). On a difference every
    rank raises: rank 0 names each differing rank and what differs, the others what differs on them."""
    every: list = [None] * d.world
    try:
        dist.all_gather_object(every, facts)
    except RuntimeError:  # a rank that stopped on its own input closed its connections (gloo: "Connection closed")
        raise EagleScopeError(
            f"rank {d.rank} of {d.world} stops: another rank of this job stopped before training; its line says why."
        ) from None

    def differences(r: int) -> list[str]:
        out = []
        for what, (value, where) in every[0].items():
            theirs, their_where = every[r].get(what, ("missing", ""))
            if theirs != value:
                out.append(
                    f"{what} {theirs}{f' ({their_where})' if their_where else ''} on rank {r}, "
                    f"{value}{f' ({where})' if where else ''} on rank 0"
                )
        return out

    found = [x for r in range(1, d.world) for x in differences(r)]
    if not found:
        return
    # Every rank stops. all_gather_object's tensors are freed on gloo's worker thread, which takes the GIL for
    # that; a rank exiting before it has can abort after its line ("terminate called without an active
    # exception"). Waiting in a barrier (the GIL released) lets it finish first.
    dist.barrier()
    if d.main:
        more = f" (and {len(found) - 6} more)" if len(found) > 6 else ""
        raise EagleScopeError(
            f"the {d.world} ranks of this job disagree, so it stops before training: {'; '.join(found[:6])}{more}. "
            "Start every rank with the same settings, prepared data and target."
        )
    mine = "; ".join(differences(d.rank)) or "this rank agrees with rank 0, another does not"
    raise EagleScopeError(f"rank {d.rank} of {d.world} stops: the ranks disagree ({mine}); rank 0 names them all.")


class _Unroll(nn.Module):
    """What DDP wraps: its forward is the TTT unroll, so gradient sync follows the real graph."""

    def __init__(self, draft: Eagle3Draft, ttt_length: int, attention: str = "dense") -> None:
        super().__init__()
        self.draft, self.ttt_length, self.attention = draft, ttt_length, attention

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor | None = None,
                doc: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
        unrolled = ttt_unroll(self.draft, input_ids, aux, self.ttt_length, self.attention, None, positions, doc)
        return tuple(unrolled.logits)


# -- data ----------------------------------------------------------------------------------------
def split_indices(n: int, eval_fraction: float) -> tuple[list[int], list[int]]:
    """Deterministic held-out split by sample → (train, eval), each sorted."""
    n_eval = 0 if eval_fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * eval_fraction)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def collate(samples: list[dict[str, torch.Tensor]], max_length: int) -> dict[str, torch.Tensor]:
    """Pad to the longest sample (right padding), after truncating to max_length."""
    samples = [{k: v[:max_length] for k, v in s.items()} for s in samples]
    B, T = len(samples), max(len(s["input_ids"]) for s in samples)
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.long),
        "valid": torch.zeros(B, T, dtype=torch.long),
    }
    for key in ("aux", "final_hidden"):
        if key in samples[0]:
            ref = samples[0][key]
            out[key] = torch.zeros(B, T, ref.shape[-1], dtype=ref.dtype)
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        out["input_ids"][b, :n] = s["input_ids"]
        out["loss_mask"][b, :n] = s["loss_mask"]
        out["valid"][b, :n] = 1
        for key in ("aux", "final_hidden"):
            if key in s:
                out[key][b, :n] = s[key]
    return out


def make_batch(
    target, raw: dict[str, torch.Tensor], device: torch.device, aux_dtype: torch.dtype, vocab_ids: torch.Tensor
) -> Batch:
    """Teacher and aux for a collated batch (collate, or packing.collate_packed): from stored hidden states or the
    target online (without its output head: teacher_from_head applies it a chunk of rows at a time). vocab_ids: the
    draft vocabulary's target ids."""
    ids = raw["input_ids"].to(device)
    valid = raw["valid"].to(device)
    layout = raw.get("layout")
    if "aux" in raw:
        aux, final, logits = raw["aux"].to(device), raw["final_hidden"].to(device), None
    elif layout is not None:
        aux, final, logits = _packed_target_states(target, raw, device)
    else:
        out = target.hidden_states(ids, valid, logits=False)
        aux, final, logits = out.aux, out.final_hidden, out.logits
    if logits is None:
        teacher = teacher_from_head(target.head, final, vocab_ids, target.fingerprint.vocab_size)
    else:  # a target that computes its logits anyway (transformers' models); new tensors, outside inference mode
        teacher = teacher_of(vocab_ids, logits)
    # The target runs under inference_mode; cloning outside it gives tensors autograd may save.
    batch = Batch(ids, raw["loss_mask"].to(device), valid, aux.to(aux_dtype).clone(), teacher)
    if layout is not None:
        batch.doc, batch.positions = raw["doc"].to(device), raw["positions"].to(device)
        batch.doc_lengths = layout.lengths
    return batch


def _packed_target_states(target, raw: dict, device: torch.device):
    """The target's (aux, final state, logits or None) for a packed batch: a native target runs the documents of each
    row itself (causal within each); another (transformers' models) runs the samples padded, one per row, and its
    states are moved into the packed layout."""
    layout = raw["layout"]
    if hasattr(target, "packed_hidden_states"):
        out = target.packed_hidden_states(raw["input_ids"], raw["positions"], layout.segments, logits=False)
        return out.aux, out.final_hidden, out.logits
    lengths = layout.lengths
    padded_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    padded_valid = torch.zeros_like(padded_ids)
    for i, (r, a, b) in zip(layout.order, layout.segments, strict=True):
        padded_ids[i, : b - a] = raw["input_ids"][r, a:b]
        padded_valid[i, : b - a] = 1
    out = target.hidden_states(padded_ids.to(device), padded_valid.to(device), logits=False)
    packed = [None if t is None else to_packed(t, layout) for t in (out.aux, out.final_hidden, out.logits)]
    return tuple(packed)


# -- schedule ------------------------------------------------------------------------------------
def fit_total(done: int, per_step: float, left: float, nominal: int) -> int:
    """A time-budgeted run's length: the `done` steps plus those that fit in `left` seconds at `per_step` seconds
    each, at most `nominal` (what --max-steps / --epochs give)."""
    more = int(max(0.0, left) / per_step) if per_step > 0 else nominal
    return max(done, min(nominal, done + more))


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total` (step is 0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# -- checkpoints ---------------------------------------------------------------------------------
def _trainable_state(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    # The embedding is the target's, frozen: reloaded from the target, never saved.
    return {k: v.detach().cpu().clone() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}


def save_training_state(
    out: Path, draft, opt, step: int, cfg: TrainConfig, world: int, fit: dict | None = None
) -> Path:
    """OUT/training_state/ via a temp directory and a rename: a crash leaves the previous one whole. `fit`: the
    run's length under --max-seconds ({"total", "fitted", "seconds"}: seconds of steps so far)."""
    path = out / STATE_DIR
    with staged_dir(path) as tmp:
        state = {
            "step": step,
            "fit": fit,
            "model": _trainable_state(draft),
            "optimizer": opt.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "config": asdict(cfg),
            "world_size": world,
        }
        torch.save(state, tmp / "state.pt")
        meta = {"step": step, "world_size": world, "fit": fit, "config": asdict(cfg)}
        (tmp / "state.json").write_text(json.dumps(meta) + "\n")
    return path


def save_checkpoint(out: Path, draft, contract: DraftContract, metrics: dict | None) -> None:
    """The draft files in OUT/: staged by save_draft, then each renamed into place, so OUT/ itself
    (which also holds training_state/ and tb/) is never replaced as a whole."""
    stage = out / ".draft-staging"
    shutil.rmtree(stage, ignore_errors=True)
    extra = {METRICS_FILE: json.dumps(metrics, indent=2) + "\n"} if metrics is not None else None
    save_draft(draft, contract, stage, extra_files=extra)
    for f in sorted(stage.iterdir(), key=lambda p: p.name != "model.safetensors"):  # weights first
        os.replace(f, out / f.name)
    stage.rmdir()


def load_training_state(out: Path) -> dict:
    path = out / STATE_DIR / "state.pt"
    if not path.is_file():
        raise EagleScopeError(f"--resume: {out} has no {STATE_DIR}/state.pt to resume from.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file is a user-facing problem
        raise EagleScopeError(f"--resume: {path} could not be loaded ({e}).") from None


def _check_resume(saved: dict, cfg: TrainConfig, world: int) -> None:
    # keys a run saved before they existed mean their defaults (an older run resumes as it was trained)
    old = {k: TrainConfig.__dataclass_fields__[k].default for k in RESUME_KEYS} | saved["config"]
    for key in RESUME_KEYS:
        if old.get(key) != getattr(cfg, key):
            raise EagleScopeError(
                f"--resume: --{key.replace('_', '-')} is {getattr(cfg, key)!r} but the run being resumed used "
                f"{old.get(key)!r}."
            )
    if old["batch_size"] * saved["world_size"] != cfg.batch_size * world:
        raise EagleScopeError(
            f"--resume: batch-size × processes is {cfg.batch_size * world}, the run being resumed used "
            f"{old['batch_size'] * saved['world_size']}: the data order would change."
        )


def _plan_out(out: Path, cfg: TrainConfig) -> tuple[Path | None, bool]:
    """Decide, before anything is written, where this run works and what it resumes.

    → (resume_from, fresh): the directory whose training_state to resume (None: start from scratch) and whether
    the staging directory beside OUT must be started over. Every rank computes the same answer."""
    check_destination(out, TRAINED, inputs=[cfg.target, cfg.data], replace=cfg.overwrite or cfg.resume)
    if cfg.log_dir is not None:
        log = Path(cfg.log_dir)
        if (log.exists() and not log.is_dir()) or any(a.exists() and not a.is_dir() for a in log.parents):
            raise EagleScopeError(f"--log-dir {log} is (or lies under) a file, not a directory.")
    part = partial_dir(out)
    interrupted = has_partial(out) and (part / STATE_DIR / "state.pt").is_file()
    if cfg.resume:
        if interrupted:
            return part, False
        if (out / STATE_DIR / "state.pt").is_file():
            return out, True
        raise EagleScopeError(f"--resume: neither {out} nor {part} holds a {STATE_DIR}/state.pt to resume from.")
    if interrupted and not cfg.overwrite:
        raise EagleScopeError(
            f"an interrupted training run for {out} is kept at {part}; pass --resume to continue it or --overwrite "
            "to start over."
        )
    return None, True


# -- the loop ------------------------------------------------------------------------------------
def _resolve_data(cfg: TrainConfig, data, target_fp, num_layers: int) -> tuple[TapContract, torch.Tensor, torch.Tensor]:
    """Taps and vocabulary map from the prepared data, checked against the flags and the target."""
    m = data.manifest
    prepared_fp = m.get("target") or {}
    for key in ("num_layers", "hidden_size", "vocab_size", "tokenizer_sha256"):
        if prepared_fp.get(key) != getattr(target_fp, key):
            raise EagleScopeError(
                f"{cfg.data} was prepared for a target with {key}={prepared_fp.get(key)!r}; this target has "
                f"{getattr(target_fp, key)!r}."
            )
    n_vocab = int(m["draft_vocab_size"])
    if data.has_hidden_states:
        taps = data.taps
        if cfg.taps is not None and TapContract.parse(cfg.taps, num_layers) != taps:
            raise EagleScopeError(
                f"--taps {cfg.taps} conflicts with the hidden states stored in {cfg.data}, captured at taps "
                f"{list(taps.layers)}; drop --taps or prepare again."
            )
        if cfg.draft_vocab_size is not None and cfg.draft_vocab_size != n_vocab:
            raise EagleScopeError(
                f"--draft-vocab-size {cfg.draft_vocab_size} conflicts with the prepared data's draft vocabulary of "
                f"{n_vocab}; drop the flag or prepare again."
            )
        d2t, t2d = data.vocab()
        return taps, d2t, t2d
    if cfg.taps is not None:
        taps = TapContract.parse(cfg.taps, num_layers)
        warn_unservable(taps, target_fp.architecture)
    else:
        taps = data.taps or TapContract.default(num_layers)
    if cfg.draft_vocab_size is None or cfg.draft_vocab_size == n_vocab:
        d2t, t2d = data.vocab()
    else:
        if not 1 <= cfg.draft_vocab_size <= target_fp.vocab_size:
            raise EagleScopeError(
                f"--draft-vocab-size must be in 1..{target_fp.vocab_size} (the target vocabulary), "
                f"got {cfg.draft_vocab_size}."
            )
        d2t, t2d = build_draft_vocab(data.token_counts(), cfg.draft_vocab_size)
    return taps, d2t, t2d


def _summed(values: list[int], device: torch.device) -> list[int]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return [int(x) for x in t.tolist()]


def _from_rank0(x: int, d: Dist, device: torch.device) -> int:
    if d.world == 1:
        return x
    t = torch.tensor([x], dtype=torch.long, device=device)
    torch.distributed.broadcast(t, 0)
    return int(t.item())


def _nonfinite(loss: torch.Tensor, d: Dist) -> bool:
    bad = (~torch.isfinite(loss.detach())).float().reshape(1)
    if d.world > 1:  # every rank must stop together, or the others hang in the next all-reduce
        torch.distributed.all_reduce(bad)
    return bool(bad.item() > 0)


@dataclass
class _Inputs:
    """What a run trains from, each checked before anything is written."""

    data: PreparedData
    target: Target | TargetHead  # the whole target (online) or its embedding and head (stored hidden states)
    target_cfg: dict
    taps: TapContract
    d2t: torch.Tensor
    t2d: torch.Tensor
    dtype: torch.dtype
    amp: bool  # autocast to `dtype` (a GPU and a 16-bit dtype); else float32 throughout
    max_length: int

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype if self.amp else torch.float32


def _open_inputs(cfg: TrainConfig, d: Dist, device: torch.device) -> _Inputs:
    data = PreparedData.open(cfg.data, verify=d.main)
    dtype = parse_dtype(cfg.dtype, device)
    # With stored hidden states only the target's embedding and head are used: read just those (a target too large
    # for this GPU can still have its draft trained here); otherwise the whole target runs online.
    if data.has_hidden_states:
        target = load_target_head(cfg.target, device, dtype)
    else:
        target = load_target(cfg.target, device=device, dtype=dtype, backend=cfg.backend)
    taps, d2t, t2d = _resolve_data(cfg, data, target.fingerprint, target.num_layers)
    if not data.has_hidden_states:
        target.set_taps(taps)
    amp = device.type == "cuda" and dtype != torch.float32
    max_length = min(cfg.max_length, target.max_positions)
    return _Inputs(data, target, read_config(Path(cfg.target)), taps, d2t, t2d, dtype, amp, max_length)


def _new_draft(cfg: TrainConfig, inputs: _Inputs, device: torch.device) -> Eagle3Draft:
    """The draft as --seed initialises it, with the prepared vocabulary map and the target's frozen embedding."""
    torch.manual_seed(cfg.seed)
    dcfg = DraftConfig.for_target(
        inputs.target_cfg,
        inputs.taps,
        int(inputs.d2t.numel()),
        arch=cfg.draft_arch,
        norm_before_fc=cfg.norm_before_fc,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
    )
    draft = Eagle3Draft(dcfg)
    draft.set_vocab_map(inputs.d2t, inputs.t2d)
    target = inputs.target
    embedding = target.embedding if isinstance(target, TargetHead) else target_embedding(target)
    draft.load_target_embedding(embedding.detach().float().cpu())
    draft = draft.to(device).train()
    if inputs.amp:  # the frozen embedding holds the target's `dtype` values: float32 would only take twice the memory
        draft.embed_tokens.to(inputs.dtype)
    return draft


def _contract(cfg: TrainConfig, inputs: _Inputs) -> DraftContract:
    data, m = inputs.data, inputs.data.manifest
    return DraftContract(
        taps=inputs.taps,
        target=inputs.target.fingerprint,
        ttt_length=cfg.ttt_length,
        loss_mask_shift=LOSS_MASK_SHIFT,
        draft_vocab_source=f"prepared data token frequencies, {data.num_samples} samples",
        extra={
            "training": {
                "data_chat_template_sha256": m.get("chat_template_sha256"),
                "data_regenerated": m.get("regenerated"),
                "data_hidden_states": data.has_hidden_states,
            }
        },
    )


class _Order:
    """Which samples each step takes: a pure function of (seed, step), as the module docstring says."""

    def __init__(self, cfg: TrainConfig, num_samples: int, world: int) -> None:
        self.train_idx, self.eval_idx = split_indices(num_samples, cfg.eval_fraction)
        self.B, self.W, self.A = cfg.batch_size, world, cfg.grad_accum
        self.G = self.B * self.W * self.A
        self.steps_per_epoch = len(self.train_idx) // self.G
        if self.steps_per_epoch == 0:
            raise EagleScopeError(
                f"the training split has {len(self.train_idx)} samples, fewer than one global batch of {self.G} "
                f"(batch size {self.B} × {self.W} processes × grad-accum {self.A}); use a smaller --batch-size or "
                "more data."
            )
        self.seed = cfg.seed
        self._perm: dict[int, list[int]] = {}

    def global_batch(self, step: int) -> list[int]:
        epoch, pos = divmod(step, self.steps_per_epoch)
        if epoch not in self._perm:
            self._perm.clear()
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm[epoch] = torch.randperm(len(self.train_idx), generator=g).tolist()
        return [self.train_idx[j] for j in self._perm[epoch][pos * self.G : (pos + 1) * self.G]]

    def share(self, indices: list[int], micro: int, rank: int) -> list[int]:
        """Rank `rank`'s samples of accumulation step `micro`."""
        first = micro * self.B * self.W + rank * self.B
        return indices[first : first + self.B]


@dataclass
class _Length:
    """How many optimizer steps the run takes; under --max-seconds fitted once to the time left."""

    total: int
    warmup_steps: int | None
    warmup_ratio: float
    fitted: bool
    spent: float = 0.0  # seconds of steps before this process (a resumed run)

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else round(self.warmup_ratio * self.total)


@dataclass
class _StepSums:
    """A step's per-sample losses and TTT-step hits, summed over this rank's samples (the global mean needs the
    count: module docstring, loss normalisation)."""

    loss: float
    samples: int
    loss_k: list[float]
    hits_k: list[float]
    count_k: list[int]

    @classmethod
    def zeros(cls, K: int) -> _StepSums:
        return cls(0.0, 0, [0.0] * K, [0.0] * K, [0] * K)

    def add(self, res, n: int) -> None:
        """`res`: ttt_loss's per-sample result over `n` samples."""
        for k in range(len(self.loss_k)):
            self.loss_k[k] += res.step_loss[k] * n
            if res.step_count[k]:
                self.hits_k[k] += res.step_acc[k] * res.step_count[k]
                self.count_k[k] += res.step_count[k]
        self.loss += float(res.loss.detach()) * n
        self.samples += n

    def over_ranks(self, device: torch.device) -> _StepSums:
        """The sums over the whole global batch, not this rank's share of it: the loss and acc_k a job logs are then
        the ones one process with the same global batch logs (float64, so the sums of counts stay exact)."""
        K = len(self.loss_k)
        t = torch.tensor([self.loss, self.samples, *self.loss_k, *self.hits_k, *self.count_k], dtype=torch.float64,
                         device=device)  # fmt: skip
        dist.all_reduce(t)
        v = t.tolist()
        return _StepSums(v[0], int(v[1]), v[2 : 2 + K], v[2 + K : 2 + 2 * K], [int(x) for x in v[2 + 2 * K :]])

    def logs(self, step: int, lr: float) -> dict:
        n = max(1, self.samples)
        return {
            "step": step,
            "loss": self.loss / n,
            "loss_k": [x / n for x in self.loss_k],
            "acc": [h / c if c else math.nan for h, c in zip(self.hits_k, self.count_k, strict=True)],
            "lr": lr,
        }


class _Run:
    """One training run: what `train` sets up, then steps, evaluates and saves. Every input is checked here, before
    the staging directory exists: a corrupt shard or a bad target costs nothing."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.d, self.device = _setup(cfg)
        self.out = Path(cfg.out)
        self.resume_from, self.fresh = _plan_out(self.out, cfg)
        saved = load_training_state(self.resume_from) if self.resume_from is not None else None
        if saved is not None:
            _check_resume(saved, cfg, self.d.world)
        self.inputs = _open_inputs(cfg, self.d, self.device)
        self.draft = _new_draft(cfg, self.inputs, self.device)
        self.contract = _contract(cfg, self.inputs)
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        # fused on a GPU: a few kernels over all parameters instead of foreach's pass per operation (foreach took
        # 8.4 ms of a 487 ms step at 8B shape, batch 4); the same update and state dict, so --resume works across them
        fused = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                     fused=fused)  # fmt: skip
        self.order = _Order(cfg, self.inputs.data.num_samples, self.d.world)
        per_epoch = self.order.steps_per_epoch
        total = cfg.max_steps if cfg.max_steps is not None else math.ceil((cfg.epochs or 1.0) * per_epoch)
        self.length = _Length(total, cfg.warmup_steps, cfg.warmup_ratio, fitted=cfg.max_seconds is None)
        self.vocab_ids = draft_vocab_ids(self.draft)
        self.step, self.resumed = 0, saved is not None
        self.last_ckpt: tuple[Path, int] | None = None
        if saved is not None:
            self._resume(saved)
        del saved  # the saved weights and moments are in the draft and the optimizer now: not kept twice
        self.attention = default_attention(self.draft, self.device)  # flex for long batches on a GPU (attention.py)
        if cfg.compile:
            for region in compile_training(self.inputs.target, self.draft):
                log.info("train --compile: %s", region)
        self.fwd = self._forward_module()
        self.autocast = torch.autocast("cuda", dtype=self.inputs.dtype) if self.inputs.amp else contextlib.nullcontext()
        self.history: list[dict] = []
        self.metrics: dict = {}
        self.writer = self.bar = None

    def _resume(self, saved: dict) -> None:
        missing, unexpected = self.draft.load_state_dict(saved["model"], strict=False)
        if unexpected or [k for k in missing if k != "embed_tokens.weight"]:
            raise EagleScopeError(f"--resume: {self.out / STATE_DIR} holds weights of a different draft shape.")
        self.opt.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng_cpu"])
        if saved["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["rng_cuda"])
        self.step = int(saved["step"])
        fit = saved.get("fit")
        if self.cfg.max_seconds is not None and fit is not None:
            length = self.length
            length.total, length.fitted, length.spent = int(fit["total"]), bool(fit["fitted"]), float(fit["seconds"])

    def _forward_module(self) -> nn.Module:
        """The TTT unroll, wrapped in DDP under torchrun once every rank is found to hold the same job."""
        fwd: nn.Module = _Unroll(self.draft, self.cfg.ttt_length, self.attention)
        if self.d.world == 1:
            return fwd
        _check_ranks_agree(_job_facts(self.cfg, self.inputs.data, self.inputs.target, self.draft), self.d)
        # No buffer broadcast before each forward: the buffers (vocab map, RoPE tables) never change, and the check
        # above found them equal on every rank. Newer torch (2.13 here) renamed the switch and warns about the old one.
        renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
        no_sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
        return DDP(fwd, device_ids=[self.device.index] if self.device.type == "cuda" else None, **no_sync)

    def open_output(self, progress: bool) -> None:
        """The staging directory beside OUT (swapped in when complete: OUT, an earlier draft, perhaps a week's work,
        stands untouched until then, whatever stops this run), the TensorBoard writer, the progress bar, the meter."""
        cfg, d, out = self.cfg, self.d, self.out
        self.work = partial_dir(out)
        if d.main:
            self.work = open_partial(out, "train", self.fresh)
            if self.resume_from == out and (out / "tb").is_dir() and not (self.work / "tb").exists():
                shutil.copytree(out / "tb", self.work / "tb")  # the resumed run's curves continue the old ones
        d.barrier()
        if self.resumed:
            self.last_ckpt = (self.work / STATE_DIR, self.step)
        if d.main:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard (about a second): rank 0 only

            log_dir = cfg.log_dir or str(self.work / "tb")
            self.writer = SummaryWriter(log_dir, purge_step=self.step + 1 if self.resumed else None)
        self.bar = Progress(self.length.total, "train", "steps", initial=self.step, enabled=progress and d.main)
        inp = self.inputs
        flops = FlopModel.of(inp.target, inp.target_cfg, self.draft, cfg.ttt_length, not inp.data.has_hidden_states)
        self.meter = Throughput(self.device, flops)
        self.t_loop, self.t_first, self.ran = _clock(), 0.0, 0  # ran: steps this process took

    # -- a step ---------------------------------------------------------------------------------------------------
    def _batch(self, indices: list[int]) -> Batch:
        inp = self.inputs
        samples = [inp.data.sample(i) for i in indices]
        if self.cfg.pack:  # flex: one row (its cost is each document's); dense: rows of --max-length (packing.py)
            raw = collate_packed(samples, inp.max_length, None if self.attention != "dense" else inp.max_length)
        else:
            raw = collate(samples, inp.max_length)
        return make_batch(inp.target, raw, self.device, inp.compute_dtype, self.vocab_ids)

    def _micro_step(self, mine: list[int], micro: int, sums: _StepSums) -> None:
        """Forward, loss and backward over this rank's samples of one accumulation step."""
        order = self.order
        batch = self._batch(mine)
        self.meter.add(batch.lengths())
        last = micro == order.A - 1
        with self.fwd.no_sync() if (order.W > 1 and not last) else contextlib.nullcontext():
            with self.autocast:
                logits = self.fwd(batch.input_ids, batch.aux, batch.positions, batch.doc)
            unrolled = Unrolled(list(logits), [])
            res = ttt_loss(self.draft, unrolled, batch.teacher, batch.loss_mask, batch.valid, per_sample=True,
                           doc=batch.doc)  # fmt: skip
            # per-sample means, summed over this process's samples: the global mean needs B·A below
            loss = res.loss * len(mine) / (order.B * order.A)
            if _nonfinite(loss, self.d):
                raise self.fail("loss", loss.detach())
            loss.backward()
        sums.add(res, len(mine))

    def optimizer_step(self) -> dict:
        """One optimizer step over the step's global batch → its logs (over every rank's samples)."""
        cfg = self.cfg
        self.meter.start()
        lr = cfg.lr * lr_factor(self.step, self.length.warmup, self.length.total)
        for group in self.opt.param_groups:
            group["lr"] = lr
        indices = self.order.global_batch(self.step)
        sums = _StepSums.zeros(cfg.ttt_length)
        for micro in range(self.order.A):
            self._micro_step(self.order.share(indices, micro, self.d.rank), micro, sums)
        if cfg.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.clip)
            if not bool(torch.isfinite(norm)):
                raise self.fail("gradient norm", norm.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.meter.stop()
        self.step += 1
        self.ran += 1
        if not self.length.fitted:
            self._fit_length()
        if self.d.world > 1:
            sums = sums.over_ranks(self.device)
        return sums.logs(self.step, lr)

    def _fit_length(self) -> None:
        """--max-seconds: the run's length, fitted once the first steps are timed (every rank takes rank 0's)."""
        now = _clock()
        self.t_first = now if self.ran == 1 else self.t_first
        elapsed = self.length.spent + now - self.t_loop
        new_total = -1
        if self.ran >= FIT_AFTER or elapsed >= self.cfg.max_seconds:
            per_step = (now - self.t_first) / (self.ran - 1) if self.ran > 1 else now - self.t_loop
            new_total = fit_total(self.step, per_step, self.cfg.max_seconds - elapsed, self.length.total)
        new_total = _from_rank0(new_total, self.d, self.device)
        if new_total >= 0:
            self.length.total, self.length.fitted = new_total, True
            self.bar.set_total(new_total)

    def after_step(self, logs: dict, on_step: Callable[[int, dict], None] | None) -> None:
        """Log the step, then evaluate and checkpoint where --eval-every / --save-every fall."""
        cfg, step = self.cfg, self.step
        self.history.append(logs)
        if self.writer is not None:
            self.writer.add_scalar("train/loss", logs["loss"], step)
            self.writer.add_scalar("lr", logs["lr"], step)
            for k in range(cfg.ttt_length):
                self.writer.add_scalar(f"train/loss_{k}", logs["loss_k"][k], step)
                self.writer.add_scalar(f"train/acc_{k}", logs["acc"][k], step)
        self.bar.set_postfix(loss=f"{logs['loss']:.3f}", acc_0=f"{logs['acc'][0]:.3f}")
        self.bar.update(1)
        if on_step is not None:
            on_step(step, logs)
        if step < self.length.total and cfg.eval_every and step % cfg.eval_every == 0:
            if self.d.main:
                self.run_eval()
            self.d.barrier()
        if step < self.length.total and cfg.save_every and step % cfg.save_every == 0:
            self.checkpoint(None)

    # -- evaluation, checkpoints, the end -------------------------------------------------------------------------
    def run_eval(self) -> dict:
        order, inp = self.order, self.inputs
        indices, split = (order.eval_idx, "held-out") if order.eval_idx else (order.train_idx, "train")
        batches = (self._batch(indices[i : i + order.B]) for i in range(0, len(indices), order.B))
        res = evaluate(self.draft, batches, self.cfg.ttt_length, inp.compute_dtype if inp.amp else None, self.attention)
        res["split"], res["num_samples"], res["step"] = split, len(indices), self.step
        if self.writer is not None:
            for k, a in enumerate(res["acc"]):
                self.writer.add_scalar(f"eval/acc_{k}", a, self.step)
            for k, a in enumerate(res["alpha"]):
                self.writer.add_scalar(f"eval/alpha_{k + 1}", a, self.step)
            self.writer.add_scalar("eval/simulated_tau", res["predicted_accept_length"], self.step)
        return res

    def checkpoint(self, metrics: dict | None) -> None:
        if self.d.main:
            fit = {"total": self.length.total, "fitted": self.length.fitted,
                   "seconds": self.length.spent + _clock() - self.t_loop}  # fmt: skip
            save_training_state(self.work, self.draft, self.opt, self.step, self.cfg, self.d.world, fit)
            save_checkpoint(self.work, self.draft, self.contract, metrics)
        self.d.barrier()
        self.last_ckpt = (self.work / STATE_DIR, self.step)

    def fail(self, what: str, value: torch.Tensor) -> EagleScopeError:
        kind = "nan" if bool(torch.isnan(value).any()) else "inf"
        last = self.last_ckpt
        where = f"{last[0]} (step {last[1]})" if last else "none (no checkpoint was saved yet)"
        return EagleScopeError(f"{what} became {kind} at step {self.step + 1}; last good checkpoint: {where}")

    def finish(self) -> None:
        """The final evaluation and checkpoint, then OUT swapped for the staging directory."""
        d = self.d
        speed = self.meter.report(d.world, (lambda xs: _summed(xs, self.device)) if d.world > 1 else None)
        metrics = self.run_eval() if d.main else {}
        metrics["ttt_length"] = self.cfg.ttt_length
        metrics["speed"] = speed | {"compiled": self.cfg.compile}
        self.checkpoint(metrics)
        self.close_writer()
        if d.main:
            inputs = [self.cfg.target, self.cfg.data]
            swap_in(self.work, check_destination(self.out, TRAINED, inputs=inputs, replace=True))
        d.barrier()
        self.metrics = metrics

    def discard(self) -> None:
        """A run that failed before its first checkpoint leaves nothing worth resuming beside OUT."""
        if self.d.main and not (self.work / STATE_DIR).is_dir():
            shutil.rmtree(self.work, ignore_errors=True)

    def close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def train(cfg: TrainConfig, progress: bool = True, on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Train a draft as `cfg` says; → TrainResult. `on_step(step, logs)` runs after each optimizer step."""
    cfg.validate()
    run = _Run(cfg)
    run.open_output(progress)
    try:
        while run.step < run.length.total:
            run.after_step(run.optimizer_step(), on_step)
        run.finish()
    except BaseException:
        run.discard()
        raise
    finally:
        run.bar.close()
        run.close_writer()
    if run.d.owns_group:
        # Frees the group's registry entries. It does not end gloo's threads where DDP wrapped the model (DDP's C++
        # reducer keeps the group alive), so the CLI also ends a torchrun rank without the interpreter's teardown,
        # where those threads can abort it (cli._exit_with). Only after success: on an error the other ranks may be
        # gone, and ending an NCCL group then may wait for them.
        dist.destroy_process_group()
    return TrainResult(run.out, run.step, run.metrics, run.history)


__all__ = ["TrainConfig", "TrainResult", "train", "collate", "make_batch", "lr_factor"]
