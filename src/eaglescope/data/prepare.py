"""`eaglescope prepare`: chat data → rendered samples, draft vocabulary and (optionally) the
target's tap features on disk, in the layout of eaglescope.data.shards.

Pipeline, per shard of `--shard-samples` conversations:
  1. `--regenerate`: each assistant turn is replaced, turn by turn, by the target's own greedy
     answer to the conversation so far (EAGLE-3 trains on the target's distribution, not on the
     dataset's). Batch 1 on the target's static-cache decoding path (generate_vanilla): simple
     and exact; batching across conversations is left for later.
  2. Render with the target tokenizer's chat template and build the assistant-only loss mask
     (eaglescope.data.chat), truncating to --max-length.
  3. `--hidden-states`: one batched, cache-free target forward per --batch-size samples (sorted
     by length to waste little on padding), storing aux [T, nH] and final_hidden [T, H].
Each finished shard is recorded with its sha256 in progress.json, so a rerun skips it. At the
end the token parts are merged into samples.safetensors, the draft vocabulary is counted over
loss-masked tokens, and prepare.json is written last (atomically): present means complete.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from eaglescope.config import PrepareConfig
from eaglescope.data.chat import _apply, chat_template_hash, read_conversations, render, rendered_messages
from eaglescope.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    PREPARED,
    PROGRESS,
    SAMPLES,
    VOCAB,
    PreparedData,
    check_file,
    open_safetensors,
    part_name,
    save_atomic,
    sha256_of,
    shard_name,
    write_json_atomic,
)
from eaglescope.decode.generation import SamplingConfig
from eaglescope.decode.vanilla import generate_vanilla, greedy_batch
from eaglescope.errors import EagleScopeError
from eaglescope.jsonfile import read_object
from eaglescope.models.targets import load_target, parse_device, parse_dtype
from eaglescope.models.targets.base import Target
from eaglescope.models.vocab import build_draft_vocab, count_tokens, validate_vocab_map
from eaglescope.outputs import check_destination, has_partial, open_partial, partial_dir, read_json, swap_in
from eaglescope.progress import Progress
from eaglescope.taps import TapContract

log = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)


def warn_unservable(taps: TapContract, architecture: str | None = None) -> None:
    """Say when the taps are chosen, not after training, which engines could not serve a draft trained on them
    (for SGLang, under the rule it applies to a target of `architecture`)."""
    for engine, why in taps.engines_that_cannot_serve(architecture).items():
        warnings.warn(f"taps {list(taps.layers)} cannot be written for {engine}: {why}", stacklevel=2)


# -- regeneration ----------------------------------------------------------------------------
def end_of_turn_ids(tokenizer) -> list[int]:
    """Control tokens the template writes after an assistant answer (e.g. <|eot_id|>, <|im_end|>):
    generation must stop at them even when config.json's eos is a different token."""
    user = [{"role": "user", "content": "x"}]
    try:
        prompt = _apply(tokenizer, user, add_generation_prompt=True)
        full = _apply(tokenizer, [*user, {"role": "assistant", "content": "y"}], add_generation_prompt=False)
    except EagleScopeError:
        return []  # a template that insists on other roles: fall back to the eos ids
    suffix = full[len(os.path.commonprefix([prompt, full])) :]
    special = set(tokenizer.all_special_ids)
    return [t for t in tokenizer(suffix, add_special_tokens=False)["input_ids"] if t in special]


def regenerate_conversation(
    target: Target, tokenizer, messages: list[dict], max_new_tokens: int, max_length: int, stop_ids: list[int]
) -> tuple[list[dict], bool]:
    """Replace each assistant turn by the target's greedy answer to the (regenerated) turns before it.

    → (messages, cut): cut is True when a prompt left no room within max_length and the
    conversation was ended before that turn.
    """
    stop = set(stop_ids)
    out: list[dict] = []
    limit = min(max_length, target.max_positions)
    for m in messages:
        if m["role"] != "assistant":
            out.append(m)
            continue
        if not out:
            continue  # a leading assistant turn answers nothing; render drops it too
        prompt = _apply(tokenizer, out, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # the template writes bos itself
        room = limit - len(ids)
        if room < 1:
            return out, True
        res = generate_vanilla(target, ids, min(max_new_tokens, room), SamplingConfig(), stop_ids)
        toks = res.token_ids
        if toks and toks[-1] in stop:
            toks = toks[:-1]  # the template writes the end-of-turn itself
        out.append({"role": "assistant", "content": tokenizer.decode(toks, skip_special_tokens=False)})
    return out, False


def regenerate_batch(
    target: Target,
    tokenizer,
    convs: list[list[dict]],
    max_new_tokens: int,
    max_length: int,
    stop_ids: list[int],
    batch_size: int,
) -> list[tuple[list[dict], bool] | None]:
    """Single-answer conversations (one assistant turn, last) regenerated in batched greedy decodes.

    Entries for other conversations are None (they go turn by turn through regenerate_conversation)."""
    results: list[tuple[list[dict], bool] | None] = [None] * len(convs)
    limit = min(max_length, target.max_positions)
    todo: list[tuple[int, list[dict], list[int]]] = []
    for i, conv in enumerate(convs):
        roles = [m["role"] for m in conv]
        if roles.count("assistant") != 1 or roles[-1] != "assistant" or len(conv) < 2:
            continue
        head = conv[:-1]
        try:
            ids = tokenizer(_apply(tokenizer, head, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        except EagleScopeError:
            continue  # the turn-by-turn path reports it
        if limit - len(ids) < 1:
            results[i] = (head, True)
            continue
        todo.append((i, head, ids))
    # similar lengths share a batch, so little is padded
    todo.sort(key=lambda t: len(t[2]))
    stop = set(stop_ids)
    for b in range(0, len(todo), batch_size):
        group = todo[b : b + batch_size]
        longest = max(len(ids) for _, _, ids in group)
        outs = greedy_batch(target, [ids for _, _, ids in group], min(max_new_tokens, limit - longest), stop_ids)
        for (i, head, _), toks in zip(group, outs):
            if toks and toks[-1] in stop:
                toks = toks[:-1]  # the template writes the end-of-turn itself
            results[i] = (
                head + [{"role": "assistant", "content": tokenizer.decode(toks, skip_special_tokens=False)}],
                False,
            )
    return results


# -- hidden states ---------------------------------------------------------------------------
def _hidden_for(target: Target, samples: list[list[int]], batch_size: int, acc: dict) -> dict[str, torch.Tensor]:
    """Tap features of `samples` (in order), concatenated; accumulates per-tap sum/sumsq/count into acc."""
    taps = target.taps.layers
    H = target.hidden_size
    aux_rows: list[torch.Tensor | None] = [None] * len(samples)
    fin_rows: list[torch.Tensor | None] = [None] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))  # similar lengths share a batch
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        T = len(samples[idx[0]])
        ids = torch.zeros(len(idx), T, dtype=torch.long)  # right padding; causal attention keeps pads unseen
        att = torch.zeros(len(idx), T, dtype=torch.long)
        for j, i in enumerate(idx):
            ids[j, : len(samples[i])] = torch.tensor(samples[i])
            att[j, : len(samples[i])] = 1
        out = target.hidden_states(ids, att, logits=False)  # the stored states only: no full-vocabulary logits
        if out.final_hidden is None:
            raise EagleScopeError("this target backend returns no final hidden state; use --backend native.")
        for j, i in enumerate(idx):
            n = len(samples[i])
            aux_rows[i] = out.aux[j, :n].cpu()
            fin_rows[i] = out.final_hidden[j, :n].to(out.aux.dtype).cpu()
    return shard_tensors(aux_rows, fin_rows, taps, H, target.dtype, acc)


def shard_tensors(aux_rows: list, fin_rows: list, taps: tuple[int, ...], H: int, dtype: torch.dtype, acc: dict):
    """One hidden-state shard's tensors from its samples' aux [T, nH] and final [T, H] rows (in sample order), with
    per-tap norms; accumulates per-tap sum/sumsq/count into acc."""
    aux = torch.cat(aux_rows) if aux_rows else torch.zeros(0, H * len(taps), dtype=dtype)
    fin = torch.cat(fin_rows) if fin_rows else torch.zeros(0, H, dtype=dtype)
    per_tap = aux.float().view(aux.shape[0], len(taps), H)
    norms = per_tap.norm(dim=-1)  # [T, n_taps]
    for j, t in enumerate(taps):
        x = per_tap[:, j].double()
        s = acc.setdefault(str(t), [0.0, 0.0, 0])
        s[0] += float(x.sum())
        s[1] += float((x * x).sum())
        s[2] += x.numel()
    lengths = torch.tensor([0] + [len(r) for r in aux_rows], dtype=torch.int64)
    return {"aux": aux, "final_hidden": fin, "norms": norms, "offsets": lengths.cumsum(0)}


def _percentile(sorted_x: torch.Tensor, q: float) -> float:
    """Linear-interpolation percentile of an ascending 1-D tensor (torch.quantile caps its input size)."""
    pos = q / 100 * (sorted_x.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(sorted_x[lo] + (sorted_x[hi] - sorted_x[lo]) * (pos - lo))


def tap_statistics(root: Path, shard_files: list[str], taps: tuple[int, ...], acc: dict) -> dict:
    norms = [open_safetensors(root / f).get_tensor("norms") for f in shard_files]
    norms = torch.cat(norms) if norms else torch.zeros(0, len(taps))
    stats = {}
    for j, t in enumerate(taps):
        s, ss, n = acc.get(str(t), [0.0, 0.0, 0])
        mean = s / n if n else 0.0
        entry = {"mean": mean, "std": math.sqrt(max(ss / n - mean * mean, 0.0)) if n else 0.0}
        col = torch.sort(norms[:, j]).values
        for q in PERCENTILES:
            entry[f"norm_p{q}"] = _percentile(col, q) if col.numel() else 0.0
        stats[str(t)] = entry
    return stats


# -- the driver ------------------------------------------------------------------------------
def _inputs(cfg: PrepareConfig, data: Path, target: Target, taps: TapContract | None, template_sha: str, L: int):
    """Everything the output depends on: a rerun with equal inputs may resume or be a no-op."""
    return {
        "data_sha256": sha256_of(data),
        "target": target.fingerprint.to_dict(),
        "chat_template_sha256": template_sha,
        "taps": None if taps is None else list(taps.layers),
        "max_length": L,
        "draft_vocab_size": cfg.draft_vocab_size,
        "regenerate": cfg.regenerate,
        "regen_max_new_tokens": cfg.regen_max_new_tokens if cfg.regenerate else None,
        "hidden_states": cfg.hidden_states,
        "dtype": str(target.dtype).removeprefix("torch."),
        "shard_samples": cfg.shard_samples,
        "limit": cfg.limit,
    } | ({"engine": cfg.engine} if cfg.engine else {})  # an engine's features are other inputs than in-process ones


def _differences(a: dict, b: dict) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(keys)


def _existing(out: Path, inputs: dict, overwrite: bool) -> dict | None:
    """→ the manifest if `out` already holds a sound preparation of these inputs (nothing to do). Refuses a
    preparation of other inputs unless --overwrite; check_destination then judges whatever else stands there."""
    if not (out.is_dir() and ((out / MANIFEST).is_file() or (out / PROGRESS).is_file())):
        return None
    old = read_json(out / MANIFEST)
    if old is None:
        if not overwrite:
            raise EagleScopeError(
                f"--out {out} holds an unfinished or unreadable preparation; pass --overwrite to redo it (the old "
                "files stay until the new preparation is complete)."
            )
        return None
    same = old.get("inputs") == inputs
    if not same and not overwrite:
        diff = _differences(old.get("inputs") or {}, inputs)
        raise EagleScopeError(
            f"--out {out} holds a preparation from different inputs ({diff}); pass --overwrite to replace it once "
            "the new one is complete."
        )
    if same and not overwrite:
        try:
            return PreparedData.open(out, verify=True).manifest
        except EagleScopeError as e:
            log.info(f"{e} Redoing what is damaged beside it; the old directory is replaced when that is complete.")
    return None


def _seed_from(out: Path, part: Path, inputs: dict) -> None:
    """Start the staging directory from the intact shards of `out` (same inputs, damaged elsewhere): hard links,
    so nothing is copied or recomputed; files are only ever replaced by rename, never rewritten in place."""
    prog = read_json(out / PROGRESS)
    if prog is None or prog.get("inputs") != inputs or (part / PROGRESS).is_file():
        return
    for entry in (prog.get("shards") or {}).values():
        for f in (entry.get("tokens"), entry.get("hidden")):
            if not isinstance(f, dict) or not (out / str(f.get("file"))).is_file():
                continue
            src, dst = out / f["file"], part / f["file"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
    write_json_atomic(prog, part / PROGRESS)


def _staging(out: Path, inputs: dict, overwrite: bool) -> Path:
    """The directory this run builds into: an interrupted run of the same inputs is resumed there."""
    part = partial_dir(out)
    fresh = False
    if has_partial(out):
        prog = read_json(part / PROGRESS)
        if prog is None or prog.get("inputs") != inputs:
            if not overwrite:
                raise EagleScopeError(
                    f"an interrupted preparation of other inputs is kept at {part}; pass --overwrite to discard it "
                    "and prepare these inputs."
                )
            fresh = True
    return open_partial(out, "prepare", fresh)


def _shard_done(out: Path, entry: dict | None) -> bool:
    """A shard counts as done only if every file it recorded is intact."""
    if entry is None:
        return False
    try:
        for f in (entry["tokens"], entry.get("hidden")):
            if f is not None:
                check_file(out, f, verify=True)
    except EagleScopeError as e:
        log.info(f"{e} Redoing that shard.")
        return False
    return True


def _load_target(cfg: PrepareConfig):
    if cfg.engine:
        return _load_engine_target(cfg)
    device = parse_device(cfg.device)
    target = load_target(cfg.target, device=device, dtype=parse_dtype(cfg.dtype, device), backend=cfg.backend)
    tok = getattr(target, "tokenizer", None)
    if tok is None:
        raise EagleScopeError(f"{cfg.target} has no tokenizer; data must be rendered with the target's own.")
    template_sha = chat_template_hash(tok)  # raises when the tokenizer has no chat template
    if len(tok) > target.vocab_size:
        raise EagleScopeError(
            f"the tokenizer has {len(tok)} tokens but the model's vocab_size is {target.vocab_size}: "
            "tokenizer and checkpoint do not belong together."
        )
    if cfg.taps is None and not cfg.hidden_states and target.num_layers < 7:
        taps = None  # nothing to capture now, and no default exists for so few layers
    else:
        taps = TapContract.parse(cfg.taps, target.num_layers)
        warn_unservable(taps, target.fingerprint.architecture)
    target.set_taps(taps if cfg.hidden_states else None)
    return target, tok, taps, template_sha


def _load_engine_target(cfg: PrepareConfig):
    """The target as `--engine` needs it here: tokenizer, fingerprint, head and final norm; the engine runs the rest."""
    from eaglescope.features.target import load_engine_target  # only with --engine

    target = load_engine_target(cfg.target, parse_dtype(cfg.dtype, parse_device(cfg.device)))
    tok = target.tokenizer
    if len(tok) > target.vocab_size:
        raise EagleScopeError(
            f"the tokenizer has {len(tok)} tokens but the model's vocab_size is {target.vocab_size}: "
            "tokenizer and checkpoint do not belong together."
        )
    taps = TapContract.parse(cfg.taps, target.num_layers)
    warn_unservable(taps, target.fingerprint.architecture)
    return target, tok, taps, chat_template_hash(tok)


def _engine_source(cfg: PrepareConfig, target, taps: TapContract):
    """The running engine that computes the features (started at its first shard)."""
    from eaglescope.features.sglang_engine import SglangFeatures  # only with --engine
    from eaglescope.features.vllm_engine import VllmFeatures

    if cfg.engine_url:
        from eaglescope.features.vllm_server import VllmServerFeatures

        return VllmServerFeatures(target, taps, cfg.engine_url, cfg.engine_log)
    env = {"vllm": "EAGLESCOPE_VLLM_PYTHON", "sglang": "EAGLESCOPE_SGLANG_PYTHON"}[cfg.engine]
    python = cfg.engine_python or os.environ.get(env) or "python"
    try:
        args = json.loads(cfg.engine_args) if cfg.engine_args else {}
    except json.JSONDecodeError as e:
        raise EagleScopeError(f"--engine-args is not JSON ({e.msg}): give an object of LLM keywords.") from None
    if not isinstance(args, dict):
        raise EagleScopeError("--engine-args must be a JSON object of the engine's own arguments.")
    return {"vllm": VllmFeatures, "sglang": SglangFeatures}[cfg.engine](target, taps, python, args)


def _render_chunk(cfg: PrepareConfig, target, tok, chunk: list, k: int, L: int, stop_ids, bar, entry: dict):
    """The rendered (ids, loss mask) pairs of one shard's conversations, regenerated first with --regenerate;
    counts what was skipped, truncated, cut or invalid into `entry`."""
    pairs: list[tuple[list[int], list[int], list[dict], int]] = []  # ids, mask, messages rendered, untruncated length
    batched = (
        regenerate_batch(target, tok, chunk, cfg.regen_max_new_tokens, L, stop_ids, cfg.batch_size)
        if cfg.regenerate
        else [None] * len(chunk)
    )
    for j, conv in enumerate(chunk):
        # One conversation the template rejects (e.g. "roles must alternate") is skipped and
        # counted, not allowed to abort a long run.
        try:
            if cfg.regenerate:
                conv, cut = batched[j] or regenerate_conversation(
                    target, tok, conv, cfg.regen_max_new_tokens, L, stop_ids
                )
                entry["regen_cut"] += cut
            r = render(conv, tok)
        except EagleScopeError as e:
            entry["invalid"] += 1
            entry["first_invalid"] = entry["first_invalid"] or f"conversation {k * cfg.shard_samples + j}: {e}"
            r = None
        if cfg.regenerate:
            bar.update(1)
        full = len(r.input_ids) if r is not None else 0
        if r is not None and len(r.input_ids) > L:
            entry["truncated"] += 1
            r.input_ids, r.loss_mask = r.input_ids[:L], r.loss_mask[:L]
        if r is None or not any(r.loss_mask):
            entry["skipped"] += 1
            continue
        pairs.append((r.input_ids, r.loss_mask, rendered_messages(conv), full))
    return pairs


def _engine_shard(engine, pairs: list, first: int, acc: dict) -> dict[str, torch.Tensor]:
    """A shard's tensors from the engine's features of its samples (checked against the capture contract there)."""
    from eaglescope.features.engine import Sample

    samples = [Sample(msgs, ids, full > len(ids), full) for ids, _, msgs, full in pairs]
    rows = engine.features(samples, first) if samples else []
    target = engine.target
    return shard_tensors([a for a, _ in rows], [f for _, f in rows], engine.taps.layers, target.hidden_size,
                         target.dtype, acc)  # fmt: skip


def _build_shard(cfg: PrepareConfig, target, tok, chunk: list, k: int, L: int, stop_ids, part: Path, bar,
                 engine=None) -> dict:  # fmt: skip
    """Shard k written into the staging directory: its token file (and hidden states); → its progress entry."""
    entry = {"skipped": 0, "truncated": 0, "regen_cut": 0, "invalid": 0, "first_invalid": None}
    pairs = _render_chunk(cfg, target, tok, chunk, k, L, stop_ids, bar, entry)
    samples = [p[0] for p in pairs]
    lengths = torch.tensor([0] + [len(s) for s in samples], dtype=torch.int64)
    entry["num_samples"] = len(samples)
    tokens = {
        "input_ids": torch.tensor([t for s in samples for t in s], dtype=torch.int32),
        "loss_mask": torch.tensor([m for p in pairs for m in p[1]], dtype=torch.uint8),
        "offsets": lengths.cumsum(0),
    }
    entry["tokens"] = {"file": part_name(k), **save_atomic(tokens, part / part_name(k))}
    entry["hidden"] = None
    if cfg.hidden_states:
        acc: dict = {}
        if engine is None:
            tensors = _hidden_for(target, samples, cfg.batch_size, acc)
        else:
            tensors = _engine_shard(engine, pairs, k * cfg.shard_samples, acc)
        entry["hidden"] = {"file": shard_name(k), **save_atomic(tensors, part / shard_name(k))}
        entry["tap_acc"] = acc
    if not cfg.regenerate:
        bar.update(len(chunk))
    return entry


def prepare(cfg: PrepareConfig, progress: bool = True, on_shard_done: Callable[[int], None] | None = None) -> dict:
    """Run the whole preparation into cfg.out; → the manifest. `on_shard_done(k)` runs after each new shard."""
    cfg.validate()
    data = Path(cfg.data)
    if not data.is_file():
        raise EagleScopeError(f"{data}: no such data file.")
    out = Path(cfg.out)
    convs = list(read_conversations(data))  # broken JSONL fails here, before the target is loaded
    if cfg.limit is not None:
        convs = convs[: cfg.limit]
    if not convs:
        raise EagleScopeError(f"{data} holds no conversations.")
    # What stands at --out is judged before the target is loaded (whether it may be replaced, below, once the
    # inputs are known): a refusal must not cost a 671B load.
    check_destination(out, PREPARED, inputs=[data, cfg.target], replace=True)
    target, tok, taps, template_sha = _load_target(cfg)
    if cfg.draft_vocab_size is None:
        cfg.draft_vocab_size = min(32000, target.vocab_size)
    if cfg.draft_vocab_size > target.vocab_size:
        raise EagleScopeError(
            f"--draft-vocab-size {cfg.draft_vocab_size} exceeds the target vocabulary of {target.vocab_size}."
        )
    L = min(cfg.max_length, target.max_positions)  # the manifest's max_length is this effective one
    inputs = _inputs(cfg, data, target, taps, template_sha, L)
    done = _existing(out, inputs, cfg.overwrite)
    if done is not None:
        log.info(f"{out} is already prepared from these inputs; nothing to do.")
        return done
    replace = out.is_dir() and (out / MANIFEST).is_file()  # _existing allowed it: same inputs damaged, or --overwrite
    check_destination(out, PREPARED, inputs=[data, cfg.target], replace=replace or cfg.overwrite)
    # Everything is built in the staging directory `part` and swapped in at the end.
    part = _staging(out, inputs, cfg.overwrite)
    if replace and not cfg.overwrite:
        _seed_from(out, part, inputs)
    num_shards = math.ceil(len(convs) / cfg.shard_samples)
    prog_path = part / PROGRESS
    prog = read_object(prog_path, EagleScopeError) if prog_path.is_file() else {"inputs": inputs, "shards": {}}
    if not prog_path.is_file():
        write_json_atomic(prog, prog_path)
    stop_ids = sorted(set(target.eos_token_ids) | set(end_of_turn_ids(tok)))

    bar = Progress(len(convs), "prepare", "conversations", enabled=progress)
    resumed = 0
    engine = _engine_source(cfg, target, taps) if cfg.engine else None  # started at the first shard it computes
    try:
        for k in range(num_shards):
            chunk = convs[k * cfg.shard_samples : (k + 1) * cfg.shard_samples]
            if _shard_done(part, prog["shards"].get(str(k))):
                resumed += 1
                bar.update(len(chunk))
                continue
            prog["shards"][str(k)] = _build_shard(cfg, target, tok, chunk, k, L, stop_ids, part, bar, engine)
            write_json_atomic(prog, prog_path)
            if on_shard_done is not None:
                on_shard_done(k)
    finally:
        if engine is not None:
            engine.close()
    bar.close()
    if engine is not None and engine.tokens:
        prog["engine"] = engine.stats()  # this run's engine (a resumed run's earlier shards may have had another)
        write_json_atomic(prog, prog_path)
    if resumed:
        log.info(f"resumed: {resumed} of {num_shards} shards were already done.")
    try:
        manifest = _finish(part, cfg, prog, num_shards, target, taps, template_sha, data, inputs, L)
    except EagleScopeError:
        shutil.rmtree(part, ignore_errors=True)  # final for these inputs ("no usable sample"): nothing to resume
        raise
    swap_in(part, check_destination(out, PREPARED, inputs=[data, cfg.target], replace=True))
    return manifest


def features_record(engine: str, stats: dict | None) -> dict:
    """How the stored features were made, stated in the manifest (features/contract.py holds the conventions)."""
    from eaglescope.features.contract import FINAL_STATE

    normed = FINAL_STATE[engine] == "pre-norm"
    # a running server (--engine-url) without its log cannot say which layers it captures
    ids_read = stats is None or stats.get("captured_layer_ids") is not None
    return {
        "source": engine,
        "engine": stats,
        "final_hidden": "post-norm: the target's final RMSNorm applied by eaglescope to the engine's pre-norm state"
        if normed
        else "post-norm, as the engine hands it on",
        "checked": (["layer ids captured"] if ids_read else [])
        + ["final-state norm convention", "final state predicts the engine's token",
           "token ids equal eaglescope's rendering", "no NaN / inf", "no all-zero layer", "lengths"]
        + (["prefill chunks cover the prompt once"] if engine == "sglang" else []),
    }  # fmt: skip


def _finish(out: Path, cfg, prog, num_shards, target, taps, template_sha, data, inputs, L) -> dict:
    entries = [prog["shards"][str(k)] for k in range(num_shards)]
    ids, masks, lengths = [], [], []
    for e in entries:
        h = open_safetensors(check_file(out, e["tokens"], verify=False))
        ids.append(h.get_tensor("input_ids"))
        masks.append(h.get_tensor("loss_mask"))
        lengths.append(h.get_tensor("offsets").diff())
    n = sum(e["num_samples"] for e in entries)
    skipped = sum(e["skipped"] for e in entries)
    invalid = sum(e["invalid"] for e in entries)
    first_invalid = next((e["first_invalid"] for e in entries if e["first_invalid"]), None)
    if n == 0:
        why = f"first: {first_invalid}" if first_invalid else f"no assistant turn within --max-length {L}"
        raise EagleScopeError(f"no usable sample: all {skipped} conversations have nothing to supervise ({why}).")
    if invalid:
        log.info(f"{invalid} conversations could not be rendered and were skipped; first: {first_invalid}")
    input_ids, loss_mask, lengths = torch.cat(ids), torch.cat(masks), torch.cat(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    samples_file = {
        "file": SAMPLES,
        **save_atomic({"input_ids": input_ids, "loss_mask": loss_mask, "offsets": offsets}, out / SAMPLES),
    }
    counts = count_tokens([(input_ids.long(), loss_mask)], target.vocab_size)
    d2t, t2d = build_draft_vocab(counts, cfg.draft_vocab_size)
    validate_vocab_map(d2t, t2d, target.vocab_size, cfg.draft_vocab_size)
    vocab_file = {"file": VOCAB, **save_atomic({"d2t": d2t, "t2d": t2d, "token_counts": counts}, out / VOCAB)}
    shards, tap_stats = [], {}
    if cfg.hidden_states:
        shards = [{**e["hidden"], "num_samples": e["num_samples"]} for e in entries]
        acc: dict = {}
        for e in entries:
            for t, (s, ss, c) in e["tap_acc"].items():
                a = acc.setdefault(t, [0.0, 0.0, 0])
                a[0], a[1], a[2] = a[0] + s, a[1] + ss, a[2] + c
        tap_stats = tap_statistics(out, [s["file"] for s in shards], taps.layers, acc)
    manifest = {
        "format_version": FORMAT_VERSION,
        "producer": "eaglescope prepare",
        "inputs": inputs,
        "target": target.fingerprint.to_dict(),
        "chat_template_sha256": template_sha,
        "taps": None if taps is None else taps.to_dict(),
        "num_samples": n,
        "num_tokens": int(input_ids.numel()),
        "num_supervised_tokens": int(loss_mask.sum()),
        "num_conversations": sum(e["num_samples"] + e["skipped"] for e in entries),
        "skipped": skipped,
        "invalid": invalid,
        "truncated": sum(e["truncated"] for e in entries),
        "regen_cut": sum(e["regen_cut"] for e in entries),
        "max_length": L,
        "regenerated": cfg.regenerate,
        "regen_max_new_tokens": cfg.regen_max_new_tokens if cfg.regenerate else None,
        "draft_vocab_size": cfg.draft_vocab_size,
        "source": {"path": str(data.resolve()), "sha256": inputs["data_sha256"]},
        "samples_file": samples_file,
        "vocab_file": vocab_file,
        "hidden_states": cfg.hidden_states,
        "dtype": inputs["dtype"],
        "aux_width": None if not cfg.hidden_states else target.hidden_size * taps.count,
        "shards": shards,
        "tap_stats": tap_stats,
    }
    if cfg.engine:
        manifest["features"] = features_record(cfg.engine, prog.get("engine"))
    write_json_atomic(manifest, out / MANIFEST)
    return manifest


__all__ = ["PrepareConfig", "prepare", "regenerate_conversation", "end_of_turn_ids"]
