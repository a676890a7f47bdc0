"""`eaglescope inspect` and `eaglescope export`: what a draft checkpoint says, and what an engine will do with it.

The dangerous field of a draft checkpoint is `eagle_config.eagle_aux_hidden_state_layer_ids`: SGLang and vLLM
read the same ids as different hidden states (docs/field.md §1), silently, and SGLang's rule even depends on the
*target's* architecture (docs/sglang.md). `inspect` states, for each engine, which tensors it will capture and
whether they are the taps the draft was trained on; `export` writes ids in one engine's convention (or none, when
the taps are every engine's default) and says how to convert the export with vLLM's `speculators` library without
losing the taps. What each engine reads from the checkpoint, with citations: docs/engines.md.

Weight names: the checkpoint keeps `midlayer.*` for every engine. vLLM's Llama EAGLE-3 loader renames
`midlayer.` → `layers.0.` itself, SGLang's loader does too (its legacy name map), `speculators convert` renames them,
and the public EAGLE-3 checkpoints (and SpecForge's) ship `midlayer.*`, so one set of names loads unchanged everywhere.
"""

from __future__ import annotations

import json
import shlex
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eaglescope.errors import EagleScopeError
from eaglescope.jsonfile import read_object
from eaglescope.models.draft import (
    DraftContract,
    LoadedDraft,
    check_draft_matches_target,
    eaglescope_section,
    load_draft,
    weight_names,
)
from eaglescope.models.drafts.config import SGLANG_MLA_ARCHITECTURE
from eaglescope.models.targets.base import TargetFingerprint
from eaglescope.models.targets.loading import check_dir, fingerprint_of, load_state_dict, load_tensors, read_config
from eaglescope.models.vocab import validate_vocab_map
from eaglescope.outputs import check_destination, dir_kind, staged_dir
from eaglescope.taps import (
    SERVING_ENGINES,
    SGLANG_VERSION_READ,
    TapContract,
    default_tap_layers,
    engine_capture,
    sglang_convention,
)

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
SPECULATORS_VERSION = "0.9.0"


def trained_on(contract: DraftContract) -> str:
    """What the draft was trained on, as the rest of a sentence "… but the draft …": a fact only when the checkpoint
    records it. An inferred contract's taps are the engines' reading of its config and are said to be inferred
    wherever they are shown (inspect, export, doctor), so that no report states such a guess as a fact."""
    taps = list(contract.taps.layers)
    if contract.inferred:
        source = contract.extra.get("inferred_from", "engine default")
        return f"records no training taps: {taps} is INFERRED from the {source} (config.json has no eaglescope section)"
    return f"was trained on {taps}"


def _sglang_rule(convention: str) -> str:
    if convention == "sglang":
        return "+1 only when the first id is 1 (DeepSeek-V2/V3-family targets)"
    return "+1 to every id (Llama, Qwen, Mistral and most other targets)"


def choose_engine_ids(
    taps: TapContract, engine: str, architecture: str | None = None
) -> tuple[list[int] | None, list[str]]:
    """Ids to write so that `engine` captures exactly `taps` (None = omit the key), plus warnings.

    For "sglang" the ids are chosen for the SGLang rule of the target's `architecture`, and to mean the same under
    both SGLang rules where such ids exist; an unknown architecture is taken to add +1 to every id (what most
    targets do), with a warning saying what a DeepSeek-V2/V3-family target would capture instead.
    """
    if engine not in SERVING_ENGINES:
        raise EagleScopeError(f"cannot export for {engine!r}; choose one of {', '.join(SERVING_ENGINES)}")
    L = taps.num_layers
    # With no ids every engine captures its default, which equals the EAGLE default: the safest file.
    if taps.is_default:
        return None, []
    if engine in ("vllm", "sglang-legacy"):
        return taps.to_engine_ids(engine), []
    if 0 not in taps.layers:
        both = taps.to_engine_ids("sglang-legacy")
        if engine_capture(both, "sglang", L) == list(taps.layers):
            return both, []
    convention = sglang_convention(architecture)
    rule = convention or "sglang-legacy"
    try:
        ids = taps.to_engine_ids(rule)
    except EagleScopeError as e:
        who = f"a {architecture} target" if architecture else "a target of unknown architecture (pass --target)"
        raise EagleScopeError(
            f"SGLang {SGLANG_VERSION_READ} adds {_sglang_rule(rule)} for {who}, so these taps "
            f"{list(taps.layers)} cannot be captured ({e}); serve with vLLM"
        ) from None
    if convention is not None:
        return ids, []
    other = engine_capture(ids, "sglang", L)
    return ids, [
        f"the target's architecture is unknown (no fingerprint; pass --target): ids {ids} assume SGLang's "
        f"{_sglang_rule('sglang-legacy')}; a DeepSeek-V2/V3-family target would capture {other} instead of "
        f"{list(taps.layers)}"
    ]


def _architecture(loaded: LoadedDraft, target_fp: TargetFingerprint | None) -> str | None:
    fp = target_fp or loaded.contract.target
    return fp.architecture if fp is not None else None


# -- inspect --------------------------------------------------------------------------------------
def config_tap_ids(hf_config: dict) -> list[int] | None:
    """The layer ids a checkpoint names. vLLM 0.32 reads a top-level key before eagle_config's (PR 25961; the
    speculators format writes it there); SGLang reads only eagle_config's, which every eaglescope export writes."""
    ids = hf_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def saved_weight_names(path: Path) -> set[str]:
    """Tensor names a checkpoint directory holds (without a leading "model."), read from headers where it can:
    what an engine finds in the file, which load_draft's defaults (an identity d2t/t2d) no longer show."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    try:
        if single.is_file():
            with safe_open(str(single), "pt") as f:
                names = set(f.keys())
        elif index.is_file():
            names = set(read_object(index, ValueError)["weight_map"])
        else:
            names = set(load_state_dict(path))
    except (SafetensorError, OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise EagleScopeError(f"could not list the tensors of {path} ({e})") from None
    return {n.removeprefix("model.") for n in names}


def _vocab_map_report(loaded: LoadedDraft, saved: set[str]) -> tuple[dict, list[str]]:
    m, c = loaded.model, loaded.model.config
    d2t, t2d = m.d2t.detach().cpu(), m.t2d.detach().cpu()
    full = c.draft_vocab_size == c.vocab_size
    out: dict = {"draft_vocab_size": c.draft_vocab_size, "vocab_size": c.vocab_size, "saved": "d2t" in saved}
    warns: list[str] = []
    try:
        validate_vocab_map(d2t.long(), t2d.bool(), c.vocab_size, c.draft_vocab_size)
    except EagleScopeError as e:
        return out | {"ok": False, "error": str(e), "engines": {}}, [f"vocabulary map is broken: {e}"]
    target_ids = d2t.long() + torch.arange(c.draft_vocab_size)
    first_only = bool((d2t == 0).all()) and not full
    # What each engine does with the map it finds (docs/engines.md): vLLM 0.32 llama_eagle3.py, SGLang 0.5.23
    # llama_eagle3.py load_weights, speculators 0.9.0 eagle3_converter.py.
    if full:
        engines = {
            "vllm": "FAILS TO LOAD: vLLM 0.32 has no draft_id_to_target_id at full vocabulary but loads a saved d2t "
            "into it"
            if out["saved"]
            else "no map at full vocabulary: draft ids are target ids",
            "sglang": "hot_token_id = d2t + arange (the identity here)"
            if out["saved"]
            else "no hot_token_id: draft ids are target ids",
            "speculators": "full vocabulary: the converted model keeps no map, draft ids are target ids",
        }
    else:
        engines = {
            "vllm": "draft_id_to_target_id = d2t: draft id i proposes target id i + d2t[i]",
            "sglang": "hot_token_id = d2t + arange (t2d is not read)",
            "speculators": "the converter keeps d2t and t2d (the target vocabulary size is taken from t2d)",
        }
    out |= {
        "ok": True,
        "identity": full,
        "first_ids_only": first_only,
        "target_id_min": int(target_ids.min()),
        "target_id_max": int(target_ids.max()),
        "engines": engines,
    }
    if first_only:
        warns.append(
            f"d2t is all zeros: draft ids map to the first {c.draft_vocab_size} target ids; unless that is the"
            " intended vocabulary the map was lost and acceptance will collapse (NeMo PR 2447)"
        )
    if full and out["saved"]:
        warns.append(
            "VOCAB_MAP_FULL: a full-vocabulary draft with a saved d2t: vLLM 0.32 refuses to load it (no "
            "draft_id_to_target_id parameter when the vocabularies are equal); re-export with --to vllm, which "
            "leaves the identity map out"
        )
    return out, warns


def _speculators_report(loaded: LoadedDraft) -> tuple[dict, list[str]]:
    """What `speculators convert` (0.9.0) makes of this checkpoint, and the kwargs that keep the taps."""
    taps, c = loaded.contract.taps, loaded.model.config
    plain = list(default_tap_layers(taps.num_layers))
    kwargs = speculators_kwargs(loaded)
    out = {
        "version": SPECULATORS_VERSION,
        "plain_convert_captures": plain,
        "plain_convert_keeps_taps": plain == list(taps.layers),
        "algorithm_kwargs": kwargs,
        "embedding_saved": loaded.has_embedding,
        "problems": speculators_problems(loaded, loaded.has_embedding),
        "already_speculators_format": loaded.format == "speculators",
    }
    if out["already_speculators_format"]:  # nothing to convert: the files are what speculators wrote
        return out, []
    warns = []
    if not out["plain_convert_keeps_taps"]:
        warns.append(
            f"SPECULATORS_TAPS: speculators convert ignores eagle_config.eagle_aux_hidden_state_layer_ids: without "
            f"--algorithm-kwargs '{json.dumps(kwargs)}' the converted draft captures {plain} instead of "
            f"{list(taps.layers)} (eaglescope export prints the whole command)"
        )
    warns += [f"SPECULATORS: {p}" for p in out["problems"]]
    if c.norm_before_residual:
        warns.append(
            "norm_before_residual: SGLang 0.5.23 ignores it (its EAGLE-3 layer always keeps the un-normed feature "
            "as the residual), and speculators convert takes it only from --algorithm-kwargs"
        )
    return out, warns


def engine_options(c, engine: str) -> dict:
    """What `engine` (at the version read) does with the draft's layer architecture and EAGLE 3.1 options →
    {"serves": bool, "ignores": [option, ...], "notes": [...]}. An ignored option means the engine computes another
    function than the one trained: accept length near 1 (SGLang issue 32226 / PR 32334: norm_before_fc ignored)."""
    ignores, notes = [], []
    serves = True
    if engine == "vllm":
        if c.arch == "mla":
            notes.append(
                "vLLM 0.32 serves it as Eagle3DeepseekV3ForCausalLM (model_executor/models/deepseek_eagle3.py)"
            )
            if c.norm_before_fc:
                ignores.append("norm_before_fc")  # deepseek_eagle3.py has fc_norm, norm_output, no input_norm
        if c.logit_scale != 1.0:
            notes.append(f"logit_scale {c.logit_scale}: vLLM's LogitsProcessor scales the logits")
    elif engine.startswith("sglang"):
        if c.norm_before_residual:
            ignores.append("norm_before_residual")
        if c.arch == "mla":
            notes.append(f"SGLang {SGLANG_VERSION_READ} serves it as {SGLANG_MLA_ARCHITECTURE} "
                         "(srt/models/kimi_k25_eagle3.py, since PR 25454)")  # fmt: skip
    elif engine == "speculators":
        if c.arch == "mla":
            serves = False
            notes.append(f"speculators {SPECULATORS_VERSION} converts Llama-attention EAGLE-3 drafts only")
    return {"serves": serves, "ignores": ignores, "notes": notes}


def describe_draft(
    loaded: LoadedDraft,
    target_fp: TargetFingerprint | None = None,
    target_embedding: torch.Tensor | None = None,
    target_dir: Path | None = None,
) -> dict:
    """Everything `inspect` reports, as a JSON-able dict. Stable keys (`inspect --json`):

    path, architectures, format (models/drafts/formats.py FORMATS); declared {format, properties: [{name, status
    (declared | assumed | unknown), value, source, measure (the command that measures it, or null)}]};
    contract {taps, tap_names, index_convention, num_layers, is_default, inferred,
    inferred_from, target, ttt_length, loss_mask_shift, draft_vocab_source}; config {hidden_size,
    intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size, draft_vocab_size, target_hidden_size,
    num_aux, rope_theta, norm_before_residual}; embedding {saved, matches_target}; vocab_map {ok, saved, identity,
    first_ids_only, target_id_min, target_id_max, engines {vllm|sglang|speculators: what it does with the map}, …};
    config_tap_ids; engines {sglang|sglang-legacy|vllm: {captures, captures_names, matches_contract,
    applies_to_target}}; sglang_rule {architecture, convention}; speculators {version, plain_convert_captures,
    plain_convert_keeps_taps, algorithm_kwargs, embedding_saved, problems, already_speculators_format};
    target {matches, reason, fingerprint} or
    null; warnings.

    The two SGLang rows are SGLang's two rules for reading ids; which one applies depends on the target's
    architecture (`applies_to_target`, None when it is unknown). A row that does not apply raises no warning.
    """
    ct, c = loaded.contract, loaded.model.config
    warns: list[str] = []
    if ct.inferred:
        warns.append(
            f"no eaglescope section: taps {list(ct.taps.layers)} inferred from the "
            f"{ct.extra.get('inferred_from', 'engine default')}; the real training taps are unknown"
        )
    arch = _architecture(loaded, target_fp)
    sglang_rule = sglang_convention(arch)
    ids = config_tap_ids(loaded.hf_config)
    engines = _engine_rows(ct, ids, sglang_rule, warns)
    vocab, vocab_warns = _vocab_map_report(loaded, saved_weight_names(loaded.path))
    warns += vocab_warns
    embedding = _embedding_report(loaded, target_embedding, warns)
    spec, spec_warns = _speculators_report(loaded)
    warns += spec_warns
    for engine in (*SERVING_ENGINES, "speculators"):
        r = engine_options(c, engine)
        if r["ignores"]:
            warns.append(
                f"EAGLE31: {engine} ignores this draft's {', '.join(r['ignores'])}: it would draft with another "
                "function than the one trained (accept length near 1, SGLang issue 32226)"
            )
    target = None
    if target_fp is not None:
        try:
            check_draft_matches_target(ct, target_fp)
            target = {"matches": True, "reason": None, "fingerprint": target_fp.to_dict()}
        except EagleScopeError as e:
            target = {"matches": False, "reason": str(e), "fingerprint": target_fp.to_dict()}
            warns.append(f"target mismatch: {e}")
    warns += [f"READ: {n}" for n in loaded.notes]
    return {
        "path": str(loaded.path),
        "architectures": (loaded.raw_config or loaded.hf_config).get("architectures") or [],
        "format": loaded.format,
        "declared": _declared_report(loaded, target_dir),
        "contract": _contract_report(ct),
        "config": _config_report(c),
        "engine_options": {e: engine_options(c, e) for e in (*SERVING_ENGINES, "speculators")},
        "embedding": embedding,
        "vocab_map": vocab,
        "config_tap_ids": ids,
        "engines": engines,
        "sglang_rule": {"architecture": arch, "convention": sglang_rule},
        "speculators": spec,
        "target": target,
        "warnings": warns,
    }


def _declared_report(loaded: LoadedDraft, target_dir: Path | None) -> dict | None:
    """What the draft's files declare, property by property, with the measuring commands naming the target given."""
    if loaded.declared is None:
        return None
    d = loaded.declared.to_dict()
    if target_dir is not None:
        for p in d["properties"]:
            if p["measure"]:
                p["measure"] = p["measure"].replace("--target TARGET", f"--target {shlex.quote(str(target_dir))}")
    return d


def _format_declared(d: dict) -> list[str]:
    """The declared/measurable table of `inspect`: one row per property, its measuring command beneath."""
    lines = ["declared   what the files say about training, and what doctor measures instead of trusting them:"]
    for p in d["properties"]:
        value = p["value"]
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items() if v not in (None, False)) or "none"
        lines.append(f"  {p['name']:<16} {p['status'].upper():<9} {value}  ({p['source']})")
        if p["measure"]:
            lines.append(f"  {'':<16} measure:  {p['measure']}")
    return lines


def _engine_rows(ct: DraftContract, ids, sglang_rule: str | None, warns: list[str]) -> dict:
    """Per serving engine (and SGLang rule): what it will capture from `ids`, and whether that is the contract's
    taps; a row that applies and does not match adds a warning with the fix."""
    taps = ct.taps
    L = taps.num_layers
    engines = {}
    for engine in SERVING_ENGINES:
        cap = engine_capture(ids, engine, L)
        ok = cap == list(taps.layers)
        applies = True if engine == "vllm" else (None if sglang_rule is None else engine == sglang_rule)
        engines[engine] = {
            "captures": cap,
            "captures_names": _names(cap, L),
            "matches_contract": ok,
            "applies_to_target": applies,
        }
        if ok or applies is False:
            continue
        try:
            taps.to_engine_ids(engine)  # can this row's rule say these taps at all?
            fix = f"re-export with --to {'sglang' if engine.startswith('sglang') else engine}"
            if applies is None:
                fix += " --target TARGET (SGLang's rule depends on the target's architecture)"
        except EagleScopeError as e:
            fix = f"{engine} cannot capture these taps ({e})"
        warns.append(
            f"ENGINE_TAP_CONVENTION: {engine} will capture {cap} ({'; '.join(_names(cap, L))}) but the draft "
            f"{trained_on(ct)}; {fix}"
        )
    return engines


def _embedding_report(loaded: LoadedDraft, target_embedding: torch.Tensor | None, warns: list[str]) -> dict:
    """Whether the draft saves an embedding, and whether it is the target's (when the target's is given)."""
    embedding: dict = {"saved": loaded.has_embedding, "matches_target": None}
    if loaded.has_embedding and target_embedding is not None:
        w = loaded.model.embed_tokens.weight.detach().cpu()
        same = tuple(w.shape) == tuple(target_embedding.shape) and torch.equal(w, target_embedding.to(w.dtype))
        embedding["matches_target"] = same
        if not same:
            warns.append(
                "the saved embedding differs from the target's: vLLM and speculators use a saved embedding, so "
                "drafting would read wrong token vectors (TorchSpec issue 38; SGLang replaces it with the "
                "target's); re-export without --with-embedding, or with it and --target"
            )
    return embedding


def _contract_report(ct: DraftContract) -> dict:
    taps = ct.taps
    return {
        "taps": list(taps.layers),
        "tap_names": taps.describe(),
        "index_convention": taps.to_dict()["index_convention"],
        "num_layers": taps.num_layers,
        "is_default": taps.is_default,
        "inferred": ct.inferred,
        "inferred_from": ct.extra.get("inferred_from") if ct.inferred else None,
        "target": ct.target.to_dict() if ct.target else None,
        "ttt_length": ct.ttt_length,
        "loss_mask_shift": ct.loss_mask_shift,
        "draft_vocab_source": ct.draft_vocab_source,
    }


def _config_report(c) -> dict:
    return {
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
        "draft_arch": c.arch,
        "mla": None if c.mla is None else vars(c.mla),
        "eagle31": c.eagle31,
        "logit_scale": c.logit_scale,
    }


def format_description(d: dict) -> str:
    ct, c = d["contract"], d["config"]
    L = ct["num_layers"]
    lines = [f"draft      {d['path']}  ({', '.join(d['architectures']) or 'no architectures'}; {d['format']} format)"]
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
    if ct["inferred"]:
        lines.append("training   unknown: no eaglescope section records it (the taps above are INFERRED)")
    else:
        lines.append(
            f"training   TTT length {ct['ttt_length']}, loss mask {ct['loss_mask_shift']}, "
            f"draft vocab from {ct['draft_vocab_source']}"
        )
    lines.append(
        f"config     hidden {c['hidden_size']}, heads {c['num_heads']} ({c['num_kv_heads']} kv, dim {c['head_dim']}), "
        f"FFN {c['intermediate_size']}, fc {c['num_aux']}×{c['target_hidden_size']} → {c['hidden_size']}, "
        f"draft vocab {c['draft_vocab_size']} of {c['vocab_size']}"
    )
    flags = [k for k, v in c["eagle31"].items() if v] + (["norm_before_residual"] if c["norm_before_residual"] else [])
    layer = "multi-head latent attention (MLA)" if c["draft_arch"] == "mla" else "Llama attention"
    lines.append(f"layer      {layer}; EAGLE 3.1 options: {', '.join(flags) or 'none (plain EAGLE-3)'}")
    for engine, r in d["engine_options"].items():
        if r["ignores"] or r["notes"] or not r["serves"]:
            what = (
                "cannot serve it"
                if not r["serves"]
                else (f"IGNORES {', '.join(r['ignores'])}" if r["ignores"] else "ok")
            )
            lines.append(f"  {engine:<14} {what}{'; ' + '; '.join(r['notes']) if r['notes'] else ''}")
    e = d["embedding"]
    if not e["saved"]:
        lines.append("embedding  not saved (engines use the target's)")
    else:
        m = {None: "not compared (pass --target)", True: "equals the target's", False: "DIFFERS from the target's"}
        lines.append(f"embedding  saved; {m[e['matches_target']]}")
    v = d["vocab_map"]
    if v["ok"]:
        kind = "identity" if v["identity"] else f"target ids {v['target_id_min']}..{v['target_id_max']}"
        saved = "saved" if v["saved"] else "not saved"
        lines.append(f"vocab map  ok: {v['draft_vocab_size']} draft ids → {kind} (d2t {saved})")
        lines += [f"  {engine:<14} {what}" for engine, what in v["engines"].items()]
    else:
        lines.append(f"vocab map  BROKEN: {v['error']}")
    if d["target"] is not None:
        lines.append("target     " + ("matches" if d["target"]["matches"] else f"MISMATCH: {d['target']['reason']}"))
    if d.get("declared"):
        lines += _format_declared(d["declared"])
    ids = d["config_tap_ids"]
    lines.append(f"engines    config.json ids: {ids if ids is not None else 'none (engine default)'}")
    rule = d["sglang_rule"]
    for engine, r in d["engines"].items():
        mark = "ok" if r["matches_contract"] else "MISMATCH"
        note = ""
        if engine.startswith("sglang"):
            note = f"  (SGLang's {_sglang_rule(engine)}"
            if r["applies_to_target"] is not None:
                note += f": {'applies to' if r['applies_to_target'] else 'not'} {rule['architecture']})"
            else:
                note += "; target architecture unknown)"
        lines.append(f"  {engine:<14} captures {r['captures']}  {mark}{note}")
    sp = d["speculators"]
    keeps = "keeps the taps" if sp["plain_convert_keeps_taps"] else f"captures {sp['plain_convert_captures']}"
    if sp.get("already_speculators_format"):
        lines.append("speculators: these files are in speculators' own format, which vLLM serves as they are")
    else:
        lines.append(
            f"speculators {sp['version']}: a plain convert {keeps}; --algorithm-kwargs "
            f"'{json.dumps(sp['algorithm_kwargs'])}' keeps them; "
            + ("ready" if not sp["problems"] else "not ready (see warnings)")
        )
    lines += [f"WARNING: {w}" for w in d["warnings"]]
    return "\n".join(lines)


# -- export ---------------------------------------------------------------------------------------
def speculators_kwargs(loaded: LoadedDraft) -> dict:
    """`--algorithm-kwargs` for `speculators convert` that keep what its converter would otherwise drop.

    speculators 0.9.0 (convert/eagle/eagle3_converter.py) takes eagle_aux_hidden_state_layer_ids and
    norm_before_residual only from these kwargs, never from the checkpoint's config.json; its ids are vLLM's
    (used as-is, = eaglescope's HF indices), so the taps are written unchanged."""
    kwargs: dict = {"eagle_aux_hidden_state_layer_ids": list(loaded.contract.taps.layers)}
    if loaded.model.config.norm_before_residual:
        kwargs["norm_before_residual"] = True
    return kwargs


def speculators_problems(loaded: LoadedDraft, embedding_saved: bool) -> list[str]:
    """Why a `speculators convert` of this checkpoint would not reproduce the draft (empty when it would)."""
    c = loaded.model.config
    out = []
    if not embedding_saved:
        out.append(
            f"no embedding saved: speculators {SPECULATORS_VERSION} loads a converted checkpoint without one with "
            "uninitialised memory for it (it fills it from the verifier only where that memory happens to hold a "
            "NaN); export with --with-embedding --target TARGET before converting"
        )
    if c.num_aux != 3:
        out.append(
            f"speculators {SPECULATORS_VERSION}'s converter builds fc for exactly 3 taps, this draft has {c.num_aux}"
        )
    if c.target_hidden_size != c.hidden_size:
        out.append(
            f"speculators {SPECULATORS_VERSION} sizes fc from the draft's hidden size ({c.hidden_size}), not the "
            f"target's ({c.target_hidden_size})"
        )
    return out


def speculators_command(export_dir: Path, target_dir: Path | None, kwargs: dict) -> list[str]:
    """The `speculators convert` argv for an export. Absolute paths: the converted config records the verifier's
    path and speculators loads the verifier's weights from it later."""
    out = export_dir.resolve()
    return [
        "speculators",
        "convert",
        str(out),
        "--algorithm",
        "eagle3",
        "--verifier",
        str(target_dir.resolve()) if target_dir is not None else "TARGET",
        "--output-path",
        str(out.with_name(out.name + "-speculators")),
        "--algorithm-kwargs",
        json.dumps(kwargs),
    ]


def _check_exportable(c, engine: str, with_embedding: bool, target_embedding: torch.Tensor | None) -> None:
    """Refuse an export `engine` would serve as another function than the one trained, or with a wrong embedding."""
    if engine.startswith("sglang") and c.norm_before_residual:
        raise EagleScopeError(
            f"the draft uses norm_before_residual, which SGLang {SGLANG_VERSION_READ} does not implement (its "
            "EAGLE-3 layer always keeps the un-normed feature as the residual): serve it with vLLM"
        )
    dropped = engine_options(c, engine)["ignores"]
    if dropped:
        raise EagleScopeError(
            f"{engine} would ignore the draft's {', '.join(dropped)} ({c.architecture}) and draft with another "
            "function than the one trained (accept length near 1, as in SGLang issue 32226): serve it elsewhere"
        )
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


def _export_weights(loaded: LoadedDraft, engine: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft's tensors as the export saves them: weights in `dtype`, the vocabulary map in its own types."""
    model, c = loaded.model, loaded.model.config
    state = model.state_dict()
    sd: dict[str, torch.Tensor] = {}
    for k in weight_names(model):
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
    return sd


def export_draft(
    loaded: LoadedDraft,
    engine: str,
    out: Path | str,
    with_embedding: bool = False,
    target_embedding: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    architecture: str | None = None,
    target_dir: Path | None = None,
) -> dict:
    """Write a checkpoint directory `engine` loads unchanged; return a report of what was written.

    `architecture` is the target's (for SGLang's rule; default: the contract's fingerprint), `target_dir` only
    goes into the printed `speculators convert` command.

    The embedding is saved only when asked (`with_embedding`, from the real target): vLLM drafts with a saved one
    instead of the target's (so it can only be wrong, never better), SGLang replaces it with the target's; only
    `speculators convert` needs it in the file (see speculators_problems).
    """
    architecture = architecture or _architecture(loaded, None)
    ids, warns = choose_engine_ids(loaded.contract.taps, engine, architecture)
    c = loaded.model.config
    _check_exportable(c, engine, with_embedding, target_embedding)
    dtype = dtype or loaded.model.fc.weight.dtype
    sd = _export_weights(loaded, engine, dtype)
    if with_embedding:
        sd["embed_tokens.weight"] = target_embedding.detach().cpu().to(dtype).contiguous()
    cfg = c.to_hf_config(ids)
    if engine.startswith("sglang") and c.arch == "mla":
        # SGLang 0.5.23 registers the MLA draft class under this name only (srt/models/kimi_k25_eagle3.py, its one
        # EntryClass); a config naming vLLM's Eagle3DeepseekV3ForCausalLM is refused ("Cannot find model module").
        cfg["architectures"] = [SGLANG_MLA_ARCHITECTURE]
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
    check = ["sglang", "sglang-legacy"] if engine == "sglang" else [engine]
    captures = {e: engine_capture(ids, e, L) for e in check}
    # The rule this export was written for (choose_engine_ids guarantees it captures the taps; a bug otherwise).
    rule = (sglang_convention(architecture) or "sglang-legacy") if engine == "sglang" else engine
    if captures[rule] != list(loaded.contract.taps.layers):
        raise RuntimeError(f"export chose ids {ids} that {rule} reads as {captures[rule]}")
    if loaded.has_embedding and not with_embedding:
        warns.append("the source checkpoint's saved embedding was dropped: engines use the target's own")
    if loaded.contract.inferred:
        warns.append(
            f"the draft {trained_on(loaded.contract)}: the ids written are for those taps, and the exported "
            "eaglescope section keeps them marked as inferred"
        )
    return {
        "engine": engine,
        "out": str(out),
        "files": ["config.json", "model.safetensors"],
        "weights": sorted(sd),
        "dtype": cfg["torch_dtype"],
        "tap_ids": ids,
        "tap_ids_omitted": ids is None,
        "taps": list(loaded.contract.taps.layers),
        "taps_inferred": loaded.contract.inferred,
        "default_taps": list(default_tap_layers(L)),
        "captures": captures,
        "captures_names": {e: _names(cap, L) for e, cap in captures.items()},
        "sglang_rule": {"architecture": architecture, "convention": rule} if engine == "sglang" else None,
        "embedding_saved": with_embedding,
        "speculators": _speculators_conversion(loaded, out, target_dir, with_embedding),
        "warnings": warns,
    }


def _speculators_conversion(loaded: LoadedDraft, out: Path, target_dir: Path | None, with_embedding: bool) -> dict:
    """The `speculators convert` command that turns the export into a speculators checkpoint with the same taps."""
    kwargs = speculators_kwargs(loaded)
    argv = speculators_command(out, target_dir, kwargs)
    problems = speculators_problems(loaded, with_embedding)
    if target_dir is None:
        problems.append("no --target given: replace TARGET with the target's directory")
    return {
        "version": SPECULATORS_VERSION,
        "argv": argv,
        "command": shlex.join(argv),
        "algorithm_kwargs": kwargs,
        "embedding_required": True,
        "ready": not problems,
        "problems": problems,
    }


def format_export_report(r: dict) -> str:
    ids = r["tap_ids"]
    lines = [
        f"wrote {r['out']} for {r['engine']}: {', '.join(r['files'])} ({len(r['weights'])} tensors, {r['dtype']})",
        "eagle_aux_hidden_state_layer_ids: "
        + (f"omitted (taps are the engines' default {r['default_taps']})" if ids is None else str(ids)),
    ]
    rule = r["sglang_rule"]
    which = "INFERRED taps" if r.get("taps_inferred") else "trained taps"
    for e, cap in r["captures"].items():
        mark = f"= {which}" if cap == r["taps"] else f"≠ {which} {r['taps']}"
        who = ""
        if rule is not None:
            applies = e == rule["convention"]
            who = f" ({_sglang_rule(e)}{': this target' if applies and rule['architecture'] else ''})"
        lines.append(f"{e}{who} will capture {cap} {mark}: {'; '.join(r['captures_names'][e])}")
    lines.append(
        "embedding: " + ("the target's, saved" if r["embedding_saved"] else "not saved (engine uses target's)")
    )
    sp = r["speculators"]
    lines.append(f"speculators {sp['version']} (keeps the taps): {sp['command']}")
    if sp["problems"]:
        lines.append("  not ready for speculators: " + "; ".join(sp["problems"]))
    lines += [f"WARNING: {w}" for w in r["warnings"]]
    return "\n".join(lines)


# -- target helpers -------------------------------------------------------------------------------
_EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")


def load_target_embedding(target_dir: Path) -> torch.Tensor:
    """Only the target's input embedding: a 671B target need not be read whole to export a draft."""
    found = load_tensors(target_dir, {"embedding": (*_EMBED_KEYS, ".embed_tokens.weight")})
    if "embedding" not in found:
        raise EagleScopeError(f"{target_dir} has no embed_tokens.weight to save with the draft")
    return found["embedding"]


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


# -- the two commands' work ---------------------------------------------------------------------
def inspect_checkpoint(draft: str, target: str | None = None) -> dict:
    """`eaglescope inspect`: what the draft at `draft` says (describe_draft), checked against `target` if given."""
    tdir, fp = _target_info(target)
    loaded = _load(draft, fp)
    emb = load_target_embedding(tdir) if tdir is not None and loaded.has_embedding else None
    return describe_draft(loaded, fp, emb, tdir)


def export_checkpoint(
    draft: str,
    to: str,
    out: str,
    target: str | None = None,
    with_embedding: bool = False,
    dtype: str | None = None,
) -> dict:
    """`eaglescope export`: the draft written at `out` in engine `to`'s convention → the export report.
    `dtype` is a name in _DTYPES; None keeps the source's."""
    check_destination(out, EXPORT, inputs=[draft, target])
    tdir, fp = _target_info(target)
    loaded = _load(draft, fp)
    if fp is not None:
        check_draft_matches_target(loaded.contract, fp)
    emb = load_target_embedding(tdir) if with_embedding and tdir is not None else None
    if dtype is None:
        dtype = loaded.hf_config.get("torch_dtype") or loaded.hf_config.get("dtype") or "float32"
    arch = fp.architecture if fp is not None else None
    return export_draft(loaded, to, out, with_embedding, emb, _DTYPES.get(dtype, torch.float32), arch, tdir)
