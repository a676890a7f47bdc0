"""Training data against serving: which features a draft was trained on, read from the training data itself and
measured against the target's own states for the same tokens (`doctor --training-data DIR`).

A draft learns whatever its data holds. Three pipelines write that data, each with its own layout and its own idea
of the final state:

    speculators   hs_<i>.safetensors, as vLLM's ExampleHiddenStatesConnector writes them for speculators'
                  generate-offline-data: hidden_states [T, n, H] (the aux layers, then the final state) and
                  token_ids [T]. The final state is vLLM's layer id L, the residual stream before the target's final
                  norm: speculators' trainer applies the target's norm itself (verifier_norm) before its lm_head.
    SpecForge     one torch file per sample (*.ckpt / *.pt): input_ids, loss_mask, aux_hidden_state [1, T, nH],
                  hidden_state [1, T, H]. Its TargetHead is the lm_head alone: the final state must be the normed
                  one. Read with torch.load(weights_only=True) and nothing else.
    eaglescope    a prepared directory (`prepare --hidden-states`): aux [T, nH] and final_hidden, the normed state.

Each segment of each sample's aux (and its final state) is matched against every layer state of the target for the
same token ids, at its own position and one position either side: the state it equals (relative error below
MATCH_TOL) is the layer the training data holds. Set against what the serving engine feeds (the ids the draft's
config declares, read through the engine's convention: taps.engine_capture), that names

    DATA_TAP_MISMATCH   a segment holds another layer than the served config declares (or the right layers in
                        another order)
    DATA_SHIFT          the features stored at position t are the target's state at another position
    DATA_FINAL_NORM     the final state is normed where the trainer normalises it again, or raw where the trainer
                        applies the lm_head to it directly
    DATA_UNMATCHED      a segment equals no state of this target for these tokens (another target, another
                        precision path, a corrupted file): nothing named rather than something guessed

What this cannot see: how the trainer pairs features with tokens (speculators' shift_batch) and how many TTT steps it
ran: both happen after the data, in the trainer (the wiring search measures them from the draft's behaviour). The
loss mask is read and its length checked against the tokens, not its alignment.

The target's states come from a forward in this process (its layers must be on disk).
"""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eaglescope.data.shards import MANIFEST, PreparedData
from eaglescope.detective.findings import DoctorReport, Finding, rank
from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import TargetOutput
from eaglescope.models.targets.layer_states import forward_all_layers
from eaglescope.taps import engine_capture, sglang_convention

STAGE = "training_data"
MATCH_TOL = 0.05  # relative error of a row that still equals a state (float32 ~1e-6, bf16 storage ~1e-2)
SHIFTS = (0, -1, 1)  # position offsets tried: features at t equal the state at t + shift
FINAL = "final"  # candidate names beside the layer indices 0..L-1
FINAL_NORMED = "final.normed"
# what each format's trainer expects in the final-state slot
EXPECTED_FINAL = {"speculators": FINAL, "specforge": FINAL_NORMED, "eaglescope": FINAL_NORMED}


@dataclass
class Sample:
    input_ids: torch.Tensor  # [T] int64
    aux: torch.Tensor  # [T, n*H] float32
    final: torch.Tensor | None  # [T, H] float32
    loss_mask: torch.Tensor | None  # [T]
    name: str


@dataclass
class TrainingData:
    format: str  # "speculators" | "specforge" | "eaglescope"
    path: Path
    samples: list[Sample]
    total: int  # samples in the directory (only `samples` are read)
    notes: list[str] = field(default_factory=list)


# -- reading the three layouts --------------------------------------------------------------------------------------
def read_training_data(path: Path | str, limit: int = 8) -> TrainingData:
    """The first `limit` samples of a training-data directory, whichever of the three layouts it is."""
    path = Path(path)
    if not path.is_dir():
        raise EagleScopeError(f"--training-data {path} is not a directory")
    if (path / MANIFEST).is_file():
        return _read_eaglescope(path, limit)
    for d in (path, path / "hidden_states"):
        files = _numbered(d.glob("hs_*.safetensors"))
        if files:
            return _read_speculators(path, files, limit)
    files = sorted(p for p in path.rglob("*") if p.suffix in (".ckpt", ".pt") and p.is_file())
    if files:
        return _read_specforge(path, files, limit)
    raise EagleScopeError(
        f"--training-data {path} holds no training data eaglescope reads: speculators' hs_<i>.safetensors, "
        "SpecForge's *.ckpt samples or an eaglescope prepared directory"
    )


def _numbered(files) -> list[Path]:
    def index(p: Path) -> int:
        try:
            return int(p.stem[3:])
        except ValueError:
            return -1

    return sorted((p for p in files if index(p) >= 0), key=index)


def _read_speculators(path: Path, files: list[Path], limit: int) -> TrainingData:
    samples = []
    for f in files[:limit]:
        try:
            d = load_file(str(f))
        except (SafetensorError, OSError) as e:
            raise EagleScopeError(f"{f} is not a readable safetensors file ({e})") from None
        hs, ids = d.get("hidden_states"), d.get("token_ids")
        if hs is None or ids is None or hs.dim() != 3 or hs.shape[0] != ids.shape[0] or hs.shape[1] < 2:
            raise EagleScopeError(
                f"{f} is not a hidden-states file of vLLM's extract_hidden_states: expected hidden_states "
                f"[T, layers, H] and token_ids [T], got {sorted(d)}"
            )
        hs = hs.float()
        aux = hs[:, :-1].flatten(1)  # what speculators' ArrowDataset hands its trainer
        samples.append(Sample(ids.long(), aux, hs[:, -1], None, f.name))
    notes = ["the loss masks are in speculators' Arrow dataset, which is not read here"]
    return TrainingData("speculators", path, samples, len(files), notes)


def _torch_load(f: Path) -> dict:
    try:
        obj = torch.load(f, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError) as e:
        what = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        why = f" (it pickles {what.group(1)})" if what else ""
        raise EagleScopeError(
            f"{f} needs more than torch.load(weights_only=True) to read{why}; eaglescope does not unpickle arbitrary "
            "objects: re-save the sample as a dict of tensors"
        ) from None
    except OSError as e:
        raise EagleScopeError(f"{f} cannot be read ({e})") from None
    if not isinstance(obj, dict):
        raise EagleScopeError(f"{f} holds a {type(obj).__name__}, not a dict of tensors")
    return obj


def _read_specforge(path: Path, files: list[Path], limit: int) -> TrainingData:
    samples = []
    for f in files[:limit]:
        d = _torch_load(f)
        missing = [k for k in ("input_ids", "aux_hidden_state") if not isinstance(d.get(k), torch.Tensor)]
        if missing:
            raise EagleScopeError(f"{f} lacks {', '.join(missing)}: not a SpecForge EAGLE-3 sample")
        ids = d["input_ids"].reshape(-1).long()
        aux = d["aux_hidden_state"].reshape(ids.shape[0], -1).float()
        final = d.get("hidden_state")
        final = final.reshape(ids.shape[0], -1).float() if isinstance(final, torch.Tensor) else None
        mask = d.get("loss_mask")
        mask = mask.reshape(-1) if isinstance(mask, torch.Tensor) else None
        samples.append(Sample(ids, aux, final, mask, f.name))
    return TrainingData("specforge", path, samples, len(files))


def _read_eaglescope(path: Path, limit: int) -> TrainingData:
    data = PreparedData.open(path, verify=False)
    if not data.has_hidden_states:
        raise EagleScopeError(f"{path} was prepared without --hidden-states: it holds no features to compare")
    samples = []
    for i in range(min(limit, data.num_samples)):
        s = data.sample(i)
        samples.append(Sample(s["input_ids"], s["aux"].float(), s["final_hidden"].float(), s["loss_mask"], f"{i}"))
    taps = data.taps
    notes = [f"the data declares taps {list(taps.layers)}"] if taps is not None else []
    return TrainingData("eaglescope", path, samples, data.num_samples, notes)


# -- the target's own states ----------------------------------------------------------------------------------------
def final_norm(target) -> torch.nn.Module | None:
    body = getattr(getattr(target, "model", None), "model", None)
    return getattr(body, "norm", None)


@torch.no_grad()
def target_states(target, ids: torch.Tensor) -> dict:
    """{0..L-1: hs[i] [T, H], FINAL: the raw final residual (vLLM's id L), FINAL_NORMED: what the lm_head reads}."""
    norm = final_norm(target)
    raw: list[torch.Tensor] = []
    hook = norm.register_forward_pre_hook(lambda m, args: raw.append(args[0])) if norm is not None else None
    normed: list[torch.Tensor] = []

    def one() -> TargetOutput:  # batch 1 as rows [T, ...], what forward_all_layers slices
        out = target.hidden_states(ids[None], logits=False)
        normed.append(out.final_hidden[0])
        return TargetOutput(None, out.aux[0])

    try:
        _, states, _ = forward_all_layers(target, one)
    finally:
        if hook is not None:
            hook.remove()
    out: dict = {i: s.float() for i, s in enumerate(states)}
    if raw:
        out[FINAL] = raw[-1].reshape(-1, raw[-1].shape[-1]).float()
    out[FINAL_NORMED] = normed[-1].float()
    return out


# -- matching -------------------------------------------------------------------------------------------------------
def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Median over rows of |x - ref| / |ref|."""
    return float(((x - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)).median())


def shifted(x: torch.Tensor, ref: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x at t against ref at t + shift, over the positions both have."""
    T = x.shape[0]
    if shift >= 0:
        return x[: T - shift], ref[shift:]
    return x[-shift:], ref[: T + shift]


def best_match(x: torch.Tensor, states: dict) -> dict:
    """The (state, shift) x equals best, with its relative error; `state` None when none is within MATCH_TOL."""
    best = {"state": None, "shift": 0, "rel_err": float("inf")}
    for shift in SHIFTS:
        for name, ref in states.items():
            a, b = shifted(x, ref, shift)
            if a.shape[0] < 2:
                continue
            err = rel_err(a, b)
            if err < best["rel_err"] - 1e-9:
                best = {"state": name, "shift": shift, "rel_err": err}
    if best["rel_err"] > MATCH_TOL:
        best["state"] = None
    return best


def vote(matches: list[dict]) -> dict:
    """The (state, shift) most samples agree on, with the share that does and the worst error among them."""
    keys = [(m["state"], m["shift"]) for m in matches]
    top = max(set(keys), key=keys.count)
    agree = [m for m in matches if (m["state"], m["shift"]) == top]
    return {"state": top[0], "shift": top[1], "share": len(agree) / len(matches),
            "rel_err": max(m["rel_err"] for m in agree)}  # fmt: skip


def label(state) -> str:
    if state is None:
        return "no state of this target"
    if state == FINAL:
        return "the final state before the norm"
    if state == FINAL_NORMED:
        return "the final normed state"
    return "the embedding output (id 0)" if state == 0 else f"layer id {state}"


# -- what serving feeds ---------------------------------------------------------------------------------------------
def served_ids(draft: Path | None, num_layers: int, engine: str) -> tuple[list[int] | None, str]:
    """The taps `engine` captures for this draft (HF hidden-state indices, eaglescope's convention, which is vLLM's
    id convention too) and where the ids came from.

    Reads config.json's ids where each format writes them: speculators' top level, the LlamaForCausalLMEagle3 /
    SpecForge `eagle_config`, eaglescope's own contract. (The speculators-format reader, eaglescope.models.draft,
    is where this belongs once it reads that format.)"""
    if draft is None:
        return None, "no --draft: nothing to compare the data's layers with"
    cfg_path = Path(draft) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise EagleScopeError(f"cannot read {cfg_path}: {e}") from None
    section = cfg.get("eaglescope") or {}
    if isinstance(section.get("taps"), dict) and "layers" in section["taps"]:
        return [int(i) for i in section["taps"]["layers"]], "the draft's eaglescope contract"
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        how = f"eagle_aux_hidden_state_layer_ids {ids}" if ids is not None else "no ids: the engine's default"
        return list(engine_capture(ids, "vllm", num_layers)), f"the speculators config ({how}), vLLM's convention"
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    arch = (cfg.get("architectures") or [None])[0]
    convention = engine if engine != "sglang" else (sglang_convention(arch) or engine)
    how = f"eagle_config ids {ids}" if ids is not None else "no ids: the engine's default"
    return list(engine_capture(ids, convention, num_layers)), f"the draft's config ({how}), {convention}'s convention"


# -- the check ------------------------------------------------------------------------------------------------------
def check_training_data(target, data: TrainingData, draft: Path | None = None, engine: str = "vllm") -> DoctorReport:
    """Match every segment of the data against the target's states for the same tokens; findings per mismatch."""
    L, H = target.num_layers, target.hidden_size
    if not data.samples:
        raise EagleScopeError(f"--training-data {data.path} holds no samples")
    n_seg = data.samples[0].aux.shape[-1] // H
    for s in data.samples:
        if s.aux.shape[-1] != n_seg * H or s.aux.shape[-1] % H:
            raise EagleScopeError(
                f"sample {s.name}: aux width {s.aux.shape[-1]} is not a multiple of the target's hidden size {H} "
                "(another target's data?)"
            )
        if s.loss_mask is not None and s.loss_mask.shape[0] != s.input_ids.shape[0]:
            raise EagleScopeError(f"sample {s.name}: loss_mask has {s.loss_mask.shape[0]} positions, "
                                  f"input_ids {s.input_ids.shape[0]}")  # fmt: skip
    per_seg: list[list[dict]] = [[] for _ in range(n_seg)]
    per_final: list[dict] = []
    for s in data.samples:
        states = target_states(target, s.input_ids)
        for j in range(n_seg):
            per_seg[j].append(best_match(s.aux[:, j * H : (j + 1) * H], states))
        if s.final is not None:
            per_final.append(best_match(s.final, states))
    segments = [vote(m) for m in per_seg]
    final = vote(per_final) if per_final else None
    served, source = served_ids(draft, L, engine)
    if served is not None and len(served) != n_seg:
        raise EagleScopeError(
            f"the data holds {n_seg} aux segments per token but the draft's config declares {len(served)} layers"
        )
    findings = _findings(data, segments, final, served, source)
    context = {
        "mode": "training data",
        "format": data.format,
        "path": str(data.path),
        "samples_read": len(data.samples),
        "samples_total": data.total,
        "segments": [{"segment": j, **m, "holds": label(m["state"])} for j, m in enumerate(segments)],
        "final": final and {**final, "holds": label(final["state"]), "expected": label(EXPECTED_FINAL[data.format])},
        "served_taps": served,
        "served_from": source,
        "engine": engine,
        "cannot_see": "the trainer's pairing of features with tokens (shift_batch) and its TTT steps",
        "notes": data.notes,
    }
    return DoctorReport(healthy=not findings, findings=rank(findings), context=context)


def _findings(data: TrainingData, segments: list[dict], final: dict | None, served, source: str) -> list[Finding]:
    out: list[Finding] = []
    held = [m["state"] for m in segments]
    unmatched = [j for j, m in enumerate(segments) if m["state"] is None]
    if final is not None and final["state"] is None:
        unmatched.append("final")
    if unmatched:
        out.append(Finding(
            "DATA_UNMATCHED", STAGE,
            f"training segment(s) {unmatched} equal no hidden state of this target for the same tokens (best relative "
            f"error {min(m['rel_err'] for m in [*segments, *([final] if final else [])] if m['state'] is None):.3g})",
            {"segments": segments, "final": final},
            "check that the data was generated by this target (same weights, same tokenizer) and read back intact",
            weight=0.8, support="unexplained",
        ))  # fmt: skip
    shifts = sorted({m["shift"] for m in [*segments, *([final] if final else [])] if m["state"] is not None} - {0})
    if shifts:
        which = [j for j, m in enumerate(segments) if m["state"] is not None and m["shift"]]
        if final is not None and final["state"] is not None and final["shift"]:
            which.append("final")
        out.append(Finding(
            "DATA_SHIFT", STAGE,
            f"the features stored at position t are the target's state at t{shifts[0]:+d} (segments {which}): "
            "features and tokens are one position apart before the trainer pairs them",
            {"shifts": shifts, "segments": which, "matches": segments, "final": final},
            "store each position's features with its own token (row t = the state after tokens[0..t]); the trainer "
            "pairs them with the next token itself (speculators' shift_batch, eaglescope's TTT)",
            weight=0.95, support="measured",
        ))  # fmt: skip
    if served is not None and all(h is not None for h in held) and held != list(served):
        names = [h if isinstance(h, int) else label(h) for h in held]
        order = sorted(map(str, held)) == sorted(map(str, served))
        out.append(Finding(
            "DATA_TAP_MISMATCH", STAGE,
            f"the draft was trained on layer ids {names} but is served {list(served)} ({source})"
            + (": the same layers in another order" if order else ""),
            {"trained_on": held, "served": list(served), "served_from": source, "segments": segments},
            f"regenerate the hidden states at ids {list(served)} and retrain, or declare the ids the data holds "
            f"({names}) in the draft's config before serving (speculators train --target-layer-ids)",
            weight=0.95, support="measured",
        ))  # fmt: skip
    if final is not None and final["state"] is not None and final["state"] != EXPECTED_FINAL[data.format]:
        want = EXPECTED_FINAL[data.format]
        if final["state"] in (FINAL, FINAL_NORMED):
            why = ("its trainer applies the target's final norm again before the lm_head" if want == FINAL
                   else "its trainer applies the lm_head to it directly, with no norm")  # fmt: skip
            out.append(Finding(
                "DATA_FINAL_NORM", STAGE,
                f"the final state in this {data.format} data is {label(final['state'])}; {why}, so the teacher "
                f"logits it trained on are not the target's",
                {"holds": final["state"], "expected": want, "rel_err": final["rel_err"], "share": final["share"]},
                f"store {label(want)} ({'vLLM layer id L, the residual before the norm' if want == FINAL else 'the input of the lm_head'}) and retrain",  # noqa: E501
                weight=0.95, support="measured",
            ))  # fmt: skip
        else:
            out.append(Finding(
                "DATA_TAP_MISMATCH", STAGE,
                f"the final-state slot holds {label(final['state'])}, not the target's final state",
                {"holds": final["state"], "expected": want},
                "extract the final state (vLLM layer id L) last, after the aux layers",
                weight=0.9, support="measured",
            ))  # fmt: skip
    return out


def format_training_data(report: DoctorReport) -> str:
    c = report.context
    lines = [
        "healthy: the training data holds what serving feeds" if report.healthy
        else f"NOT HEALTHY: {len(report.findings)} finding(s); most likely {report.findings[0].code}",
    ]  # fmt: skip
    for i, f in enumerate(report.findings, 1):
        lines += [f"{i}. {f.code}  [{f.stage}, {f.support}]", f"   {f.verdict}", f"   fix: {f.fix}"]
    lines.append(f"data       {c['format']} at {c['path']}: {c['samples_read']} of {c['samples_total']} samples read")
    for s in c["segments"]:
        at = "" if s["shift"] == 0 else f" at position t{s['shift']:+d}"
        lines.append(f"segment {s['segment']}  {s['holds']}{at} (rel. error {s['rel_err']:.2g}, {s['share']:.0%} of "
                     "samples)")  # fmt: skip
    if (f := c["final"]) is not None:
        at = "" if f["shift"] == 0 else f" at position t{f['shift']:+d}"
        lines.append(
            f"final      {f['holds']}{at} (rel. error {f['rel_err']:.2g}); the trainer expects {f['expected']}"
        )
    served = c["served_taps"]
    lines.append(
        f"served     {served} ({c['served_from']})" if served is not None else "served     " + c["served_from"]
    )
    lines.append(f"not seen   {c['cannot_see']}")
    lines += [f"note       {n}" for n in c["notes"]]
    return "\n".join(lines)
