"""`eaglescope inspect` and `eaglescope export`: what a draft checkpoint says, and what an engine will do with it.

The dangerous field of a draft checkpoint is `eagle_config.eagle_aux_hidden_state_layer_ids`: SGLang (newer
and legacy) and vLLM read the same ids as different hidden states (FIELD.md §1), silently. `inspect` states,
for each engine, which tensors it will capture and whether they are the taps the draft was trained on;
`export` writes ids in one engine's convention (or none, when the taps are every engine's default).

Weight names: the checkpoint keeps `midlayer.*` for every engine. vLLM's Llama EAGLE-3 loader renames
`midlayer.` → `layers.0.` itself, SGLang's draft module is named `midlayer`, and the public EAGLE-3
checkpoints (and SpecForge's) ship `midlayer.*`, so one set of names loads unchanged everywhere.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eaglescope.data.vocab import validate_vocab_map
from eaglescope.draft import WEIGHT_NAMES, LoadedDraft, check_draft_matches_target, eaglescope_section, load_draft
from eaglescope.errors import EagleScopeError
from eaglescope.outputs import check_destination, dir_kind, staged_dir
from eaglescope.taps import SERVING_ENGINES, TapContract, default_tap_layers, engine_capture
from eaglescope.target.base import TargetFingerprint
from eaglescope.target.loading import check_dir, fingerprint_of, load_state_dict, read_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# What `export --out` may replace without asking: an earlier export (its config names the engine it was written
# for), holding nothing else. Never a trained draft (training state, metrics), a target, or anything else.
EXPORT = dir_kind(
    "draft export",
    markers=["config.json"],
    entries=["config.json", "model.safetensors"],
    check=lambda p: "exported_for" in (eaglescope_section(p) or {}),
)


# -- words for hidden-state indices --------------------------------------------------------------
def tap_name(i: int, num_layers: int) -> str:
    """Human name of hs[i]; unlike TapContract.describe it also names what an engine may wrongly capture."""
    if i == 0:
        return "embedding output"
    if 0 < i < num_layers:
        return f"input of layer {i} (output of layer {i - 1})"
    if i == num_layers:
        return f"output of the last layer {num_layers - 1} (not a valid tap)"
    return f"hs[{i}] (does not exist in a {num_layers}-layer target)"


def _names(indices: list[int], num_layers: int) -> list[str]:
    return [tap_name(i, num_layers) for i in indices]


# -- choosing ids ----------------------------------------------------------------------------------
def choose_engine_ids(taps: TapContract, engine: str) -> tuple[list[int] | None, list[str]]:
    """Ids to write so that `engine` captures exactly `taps` (None = omit the key), plus warnings.

    For "sglang" the ids are chosen to be right for newer *and* legacy SGLang when such ids exist;
    otherwise they are right for newer SGLang and a warning says what legacy SGLang would capture.
    """
    if engine not in SERVING_ENGINES:
        raise EagleScopeError(f"cannot export for {engine!r}; choose one of {', '.join(SERVING_ENGINES)}")
    L = taps.num_layers
    # With no ids every engine captures its default, which equals the EAGLE default: the safest file.
    if taps.is_default:
        return None, []
    if engine in ("vllm", "sglang-legacy"):
        return taps.to_engine_ids(engine), []
    legacy_ok = None
    if 0 not in taps.layers:
        legacy_ids = taps.to_engine_ids("sglang-legacy")
        if engine_capture(legacy_ids, "sglang", L) == list(taps.layers):
            legacy_ok = legacy_ids
    if legacy_ok is not None:
        return legacy_ok, []
    ids = taps.to_engine_ids("sglang")
    legacy = engine_capture(ids, "sglang-legacy", L)
    if 0 in taps.layers:
        why = "legacy SGLang cannot capture the embedding output at all: serve with newer SGLang or vLLM"
    else:
        why = "no ids mean the same to both versions: export with --to sglang-legacy for an old SGLang"
    return ids, [
        f"ids {ids} are for newer SGLang; legacy SGLang (always +1) would capture {legacy} instead of "
        f"{list(taps.layers)}; {why}"
    ]


# -- inspect --------------------------------------------------------------------------------------
def config_tap_ids(hf_config: dict) -> list[int] | None:
    ids = (hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def _vocab_map_report(loaded: LoadedDraft) -> tuple[dict, list[str]]:
    m, c = loaded.model, loaded.model.config
    d2t, t2d = m.d2t.detach().cpu(), m.t2d.detach().cpu()
    out: dict = {"draft_vocab_size": c.draft_vocab_size, "vocab_size": c.vocab_size}
    warns: list[str] = []
    try:
        validate_vocab_map(d2t.long(), t2d.bool(), c.vocab_size, c.draft_vocab_size)
    except EagleScopeError as e:
        return out | {"ok": False, "error": str(e)}, [f"vocabulary map is broken: {e}"]
    target_ids = d2t.long() + torch.arange(c.draft_vocab_size)
    first_only = bool((d2t == 0).all()) and c.draft_vocab_size < c.vocab_size
    out |= {
        "ok": True,
        "identity": c.draft_vocab_size == c.vocab_size,
        "first_ids_only": first_only,
        "target_id_min": int(target_ids.min()),
        "target_id_max": int(target_ids.max()),
    }
    if first_only:
        warns.append(
            f"d2t is all zeros: draft ids map to the first {c.draft_vocab_size} target ids; unless that is the"
            " intended vocabulary the map was lost and acceptance will collapse (NeMo PR 2447)"
        )
    return out, warns


def describe_draft(
    loaded: LoadedDraft,
    target_fp: TargetFingerprint | None = None,
    target_embedding: torch.Tensor | None = None,
) -> dict:
    """Everything `inspect` reports, as a JSON-able dict. Stable keys (`inspect --json`):

    path, architectures; contract {taps, tap_names, index_convention, num_layers, is_default, inferred,
    inferred_from, target, ttt_length, loss_mask_shift, draft_vocab_source}; config {hidden_size,
    intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size, draft_vocab_size, target_hidden_size,
    num_aux, rope_theta, norm_before_residual}; embedding {saved, matches_target}; vocab_map {ok, identity,
    first_ids_only, target_id_min, target_id_max, …}; config_tap_ids; engines {sglang|sglang-legacy|vllm:
    {captures, captures_names, matches_contract}}; target {matches, reason, fingerprint} or null; warnings.
    """
    ct, c = loaded.contract, loaded.model.config
    taps = ct.taps
    L = taps.num_layers
    warns: list[str] = []
    if ct.inferred:
        warns.append(
            f"no eaglescope section: taps {list(taps.layers)} inferred from the "
            f"{ct.extra.get('inferred_from', 'engine default')}; the real training taps are unknown"
        )
    ids = config_tap_ids(loaded.hf_config)
    engines = {}
    for engine in SERVING_ENGINES:
        cap = engine_capture(ids, engine, L)
        ok = cap == list(taps.layers)
        engines[engine] = {"captures": cap, "captures_names": _names(cap, L), "matches_contract": ok}
        if not ok:
            try:
                choose_engine_ids(taps, engine)
                fix = f"re-export with --to {engine}"
            except EagleScopeError as e:
                fix = f"{engine} cannot capture these taps ({e})"
            warns.append(
                f"ENGINE_TAP_CONVENTION: {engine} will capture {cap} ({'; '.join(_names(cap, L))}) but the draft "
                f"was trained on {list(taps.layers)}; {fix}"
            )
    vocab, vocab_warns = _vocab_map_report(loaded)
    warns += vocab_warns
    embedding: dict = {"saved": loaded.has_embedding, "matches_target": None}
    if loaded.has_embedding and target_embedding is not None:
        w = loaded.model.embed_tokens.weight.detach().cpu()
        same = tuple(w.shape) == tuple(target_embedding.shape) and torch.equal(w, target_embedding.to(w.dtype))
        embedding["matches_target"] = same
        if not same:
            warns.append(
                "the saved embedding differs from the target's: vLLM uses a saved embedding, so drafting would read"
                " wrong token vectors (TorchSpec issue 38); re-export without --with-embedding"
            )
    target = None
    if target_fp is not None:
        try:
            check_draft_matches_target(ct, target_fp)
            target = {"matches": True, "reason": None, "fingerprint": target_fp.to_dict()}
        except EagleScopeError as e:
            target = {"matches": False, "reason": str(e), "fingerprint": target_fp.to_dict()}
            warns.append(f"target mismatch: {e}")
    return {
        "path": str(loaded.path),
        "architectures": loaded.hf_config.get("architectures") or [],
        "contract": {
            "taps": list(taps.layers),
            "tap_names": taps.describe(),
            "index_convention": taps.to_dict()["index_convention"],
            "num_layers": L,
            "is_default": taps.is_default,
            "inferred": ct.inferred,
            "inferred_from": ct.extra.get("inferred_from") if ct.inferred else None,
            "target": ct.target.to_dict() if ct.target else None,
            "ttt_length": ct.ttt_length,
            "loss_mask_shift": ct.loss_mask_shift,
            "draft_vocab_source": ct.draft_vocab_source,
        },
        "config": {
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_heads": c.num_heads,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab_size,
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "num_aux": c.num_aux,
            "rope_theta": c.rope.theta,
            "norm_before_residual": c.norm_before_residual,
        },
        "embedding": embedding,
        "vocab_map": vocab,
        "config_tap_ids": ids,
        "engines": engines,
        "target": target,
        "warnings": warns,
    }


def format_description(d: dict) -> str:
    ct, c = d["contract"], d["config"]
    L = ct["num_layers"]
    lines = [f"draft      {d['path']}  ({', '.join(d['architectures']) or 'no architectures'})"]
    how = "default" if ct["is_default"] else "non-default"
    if ct["inferred"]:
        how += f", INFERRED from the {ct['inferred_from']}"
    lines.append(f"taps       {ct['taps']} of a target with {L} layers ({how}), HF output_hidden_states indices")
    lines += [f"             hs[{i}]  {n}" for i, n in zip(ct["taps"], ct["tap_names"], strict=True)]
    fp = ct["target"]
    if fp:
        tok = (fp.get("tokenizer_sha256") or "none")[:12]
        lines.append(
            f"trained on {fp['architecture']}, {fp['num_layers']} layers, hidden {fp['hidden_size']}, "
            f"vocab {fp['vocab_size']}, tokenizer sha256 {tok}"
        )
    else:
        lines.append("trained on (no target fingerprint recorded)")
    lines.append(
        f"training   TTT length {ct['ttt_length']}, loss mask {ct['loss_mask_shift']}, "
        f"draft vocab from {ct['draft_vocab_source']}"
    )
    lines.append(
        f"config     hidden {c['hidden_size']}, heads {c['num_heads']} ({c['num_kv_heads']} kv, dim {c['head_dim']}), "
        f"FFN {c['intermediate_size']}, fc {c['num_aux']}×{c['target_hidden_size']} → {c['hidden_size']}, "
        f"draft vocab {c['draft_vocab_size']} of {c['vocab_size']}"
    )
    e = d["embedding"]
    if not e["saved"]:
        lines.append("embedding  not saved (engines use the target's)")
    else:
        m = {None: "not compared (pass --target)", True: "equals the target's", False: "DIFFERS from the target's"}
        lines.append(f"embedding  saved; {m[e['matches_target']]}")
    v = d["vocab_map"]
    if v["ok"]:
        kind = "identity" if v["identity"] else f"target ids {v['target_id_min']}..{v['target_id_max']}"
        lines.append(f"vocab map  ok: {v['draft_vocab_size']} draft ids → {kind}")
    else:
        lines.append(f"vocab map  BROKEN: {v['error']}")
    if d["target"] is not None:
        lines.append("target     " + ("matches" if d["target"]["matches"] else f"MISMATCH: {d['target']['reason']}"))
    ids = d["config_tap_ids"]
    lines.append(f"engines    config.json ids: {ids if ids is not None else 'none (engine default)'}")
    for engine, r in d["engines"].items():
        mark = "ok" if r["matches_contract"] else "MISMATCH"
        lines.append(f"  {engine:<14} captures {r['captures']}  {mark}")
    lines += [f"WARNING: {w}" for w in d["warnings"]]
    return "\n".join(lines)


# -- export ---------------------------------------------------------------------------------------
def export_draft(
    loaded: LoadedDraft,
    engine: str,
    out: Path | str,
    with_embedding: bool = False,
    target_embedding: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> dict:
    """Write a checkpoint directory `engine` loads unchanged; return a report of what was written."""
    ids, warns = choose_engine_ids(loaded.contract.taps, engine)
    model, c = loaded.model, loaded.model.config
    if with_embedding:
        if target_embedding is None:
            raise EagleScopeError(
                "--with-embedding needs the target's real embedding (pass --target): a saved random or stale "
                "embedding is used by vLLM and breaks drafting (TorchSpec issue 38)"
            )
        if tuple(target_embedding.shape) != (c.vocab_size, c.hidden_size):
            raise EagleScopeError(
                f"the target's embedding has shape {tuple(target_embedding.shape)}, the draft expects "
                f"{(c.vocab_size, c.hidden_size)}"
            )
    dtype = dtype or model.fc.weight.dtype
    state = model.state_dict()
    sd: dict[str, torch.Tensor] = {}
    for k in WEIGHT_NAMES:
        t = state[k].detach().cpu()
        if k == "d2t":
            t = t.to(torch.int64)  # offsets: target_id = draft_id + d2t[draft_id]
        elif k == "t2d":
            t = t.to(torch.bool)
        else:
            t = t.to(dtype)
        sd[k] = t.contiguous()
    validate_vocab_map(sd["d2t"], sd["t2d"], c.vocab_size, c.draft_vocab_size)
    if engine == "vllm" and c.draft_vocab_size == c.vocab_size:
        # vLLM 0.32 (model_executor/models/llama_eagle3.py) creates `draft_id_to_target_id` only when the draft
        # vocabulary is smaller than the target's, yet always loads a saved d2t into it: a full-vocabulary export
        # with d2t fails to load. At full size the map is the identity (validate_vocab_map: strictly increasing
        # target ids), which is also what every loader assumes when d2t is absent.
        del sd["d2t"], sd["t2d"]
    if with_embedding:
        sd["embed_tokens.weight"] = target_embedding.detach().cpu().to(dtype).contiguous()
    cfg = c.to_hf_config(ids)
    cfg["torch_dtype"] = {v: k for k, v in _DTYPES.items()}.get(dtype, str(dtype).removeprefix("torch."))
    # Engines ignore unknown keys; the section keeps the training contract for eaglescope and for humans.
    section = loaded.contract.to_dict()
    section["exported_for"] = engine
    cfg["eaglescope"] = section

    out = Path(out)
    with staged_dir(out) as tmp:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    L = loaded.contract.taps.num_layers
    check = [engine] + (["sglang-legacy"] if engine == "sglang" else [])
    captures = {e: engine_capture(ids, e, L) for e in check}
    if captures[engine] != list(loaded.contract.taps.layers):  # choose_engine_ids guarantees this; a bug otherwise
        raise RuntimeError(f"export chose ids {ids} that {engine} reads as {captures[engine]}")
    if loaded.has_embedding and not with_embedding:
        warns.append("the source checkpoint's saved embedding was dropped: engines use the target's own")
    return {
        "engine": engine,
        "out": str(out),
        "files": ["config.json", "model.safetensors"],
        "weights": sorted(sd),
        "dtype": cfg["torch_dtype"],
        "tap_ids": ids,
        "tap_ids_omitted": ids is None,
        "taps": list(loaded.contract.taps.layers),
        "default_taps": list(default_tap_layers(L)),
        "captures": captures,
        "captures_names": {e: _names(cap, L) for e, cap in captures.items()},
        "embedding_saved": with_embedding,
        "warnings": warns,
    }


def format_export_report(r: dict) -> str:
    ids = r["tap_ids"]
    lines = [
        f"wrote {r['out']} for {r['engine']}: {', '.join(r['files'])} ({len(r['weights'])} tensors, {r['dtype']})",
        "eagle_aux_hidden_state_layer_ids: "
        + (f"omitted (taps are the engines' default {r['default_taps']})" if ids is None else str(ids)),
    ]
    for e, cap in r["captures"].items():
        mark = "= trained taps" if cap == r["taps"] else f"≠ trained taps {r['taps']}"
        lines.append(f"{e} will capture {cap} {mark}: {'; '.join(r['captures_names'][e])}")
    lines.append(
        "embedding: " + ("the target's, saved" if r["embedding_saved"] else "not saved (engine uses target's)")
    )
    lines += [f"WARNING: {w}" for w in r["warnings"]]
    return "\n".join(lines)


# -- target helpers -------------------------------------------------------------------------------
_EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")


def load_target_embedding(target_dir: Path) -> torch.Tensor:
    """Only the target's input embedding: a 671B target need not be read whole to export a draft."""
    single, index = target_dir / "model.safetensors", target_dir / "model.safetensors.index.json"
    files: dict[str, Path] = {}
    try:
        if single.is_file():
            with safe_open(str(single), "pt") as f:
                files = {k: single for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
        elif index.is_file():
            files = {k: target_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            sd = load_state_dict(target_dir)
            files = {k: target_dir for k in sd}
        key = next((k for k in _EMBED_KEYS if k in files), None) or next(
            (k for k in files if k.endswith("embed_tokens.weight")), None
        )
        if key is None:
            raise EagleScopeError(f"{target_dir} has no embed_tokens.weight to save with the draft")
        if files[key].is_dir():
            return load_state_dict(target_dir)[key]
        with safe_open(str(files[key]), "pt") as f:
            return f.get_tensor(key)
    except (SafetensorError, OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise EagleScopeError(f"could not read the target's embedding from {target_dir} ({e})") from None


def _target_info(target: str | None) -> tuple[Path | None, TargetFingerprint | None]:
    if target is None:
        return None, None
    tdir = check_dir(target)
    try:
        return tdir, fingerprint_of(tdir, read_config(tdir))
    except (KeyError, ValueError, TypeError) as e:
        raise EagleScopeError(f"target config.json is malformed: {e}") from None


def _load(draft: str, target_fp: TargetFingerprint | None) -> LoadedDraft:
    # The "contract inferred" warning is reported by describe_draft as a line of its own.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_draft(draft, target_num_layers=target_fp.num_layers if target_fp else None)


# -- command line ---------------------------------------------------------------------------------
def cmd_inspect(args) -> int:
    tdir, fp = _target_info(args.target)
    loaded = _load(args.draft_dir, fp)
    emb = load_target_embedding(tdir) if tdir is not None and loaded.has_embedding else None
    d = describe_draft(loaded, fp, emb)
    print(json.dumps(d, indent=2) if args.json else format_description(d))
    return 0


def cmd_export(args) -> int:
    check_destination(args.out, EXPORT, inputs=[args.draft, args.target])
    tdir, fp = _target_info(args.target)
    loaded = _load(args.draft, fp)
    if fp is not None:
        check_draft_matches_target(loaded.contract, fp)
    emb = load_target_embedding(tdir) if args.with_embedding and tdir is not None else None
    if args.dtype is None:
        name = loaded.hf_config.get("torch_dtype") or loaded.hf_config.get("dtype") or "float32"
        dtype = _DTYPES.get(name, torch.float32)
    else:
        dtype = _DTYPES[args.dtype]
    report = export_draft(loaded, args.to, args.out, args.with_embedding, emb, dtype)
    if args.json:
        print(json.dumps(report, indent=2))
        for w in report["warnings"]:  # JSON on stdout stays machine-readable; people still see warnings
            print(f"eaglescope: warning: {w}", file=sys.stderr)
    else:
        print(format_export_report(report))
    return 0
