"""Static checks: what the checkpoint files alone say is wrong, before anything runs.

The draft is read raw (config.json + weights) rather than through `load_draft`, because the faults looked
for here — a lost vocabulary map, a contract for another target — are exactly what `load_draft` refuses
to load; a doctor must describe them, not stop at them. Layer indices come only from `taps.py`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from eaglescope.detective.findings import Finding
from eaglescope.errors import EagleScopeError
from eaglescope.export import (
    choose_engine_ids,
    config_tap_ids,
    engine_options,
    load_target_embedding,
    tap_name,
    trained_on,
)
from eaglescope.models.draft import DraftContract, contract_of
from eaglescope.models.drafts import DraftConfig
from eaglescope.models.drafts.formats import read_draft_files
from eaglescope.models.targets.base import TargetFingerprint
from eaglescope.models.targets.loading import check_dir, fingerprint_of, read_config
from eaglescope.models.vocab import validate_vocab_map
from eaglescope.taps import ENGINES, TapContract, engine_capture, sglang_convention

# Engines a served draft is checked against by default. Legacy SGLang (+1 always) is reported in the context
# only: a draft saved for newer SGLang/vLLM is legitimately wrong for it, and a healthy pipeline must stay quiet.
DEFAULT_ENGINES = ("sglang", "vllm")
# A saved embedding "equals" the target's when the relative error is below this: bf16 storage of an fp32
# embedding rounds at ~2^-8 relative, a random or stale embedding is off by ~1.
EMBED_REL_TOL = 1e-2
# An all-zero d2t on a reduced vocabulary is legitimate only if the first N ids happen to be the N most
# frequent; that is rare enough (byte/special tokens come first in BPE vocabularies) to call it likely lost.
IDENTITY_MAP_WEIGHT = 0.8


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def read_draft_raw(draft_dir: Path | str, num_layers: int) -> tuple[dict, dict[str, torch.Tensor], DraftContract]:
    """(config.json in the flat layout, weights with canonical names, contract) without the checks `load_draft`
    makes: any format load_draft reads (models/drafts/formats.py), through the same reader."""
    files = read_draft_files(draft_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        contract = contract_of(files, num_layers)
    return files.config, files.state_dict, contract


# -- individual checks -----------------------------------------------------------------------------------
def check_contract(contract: DraftContract, fp: TargetFingerprint, fc_in: int) -> list[Finding]:
    """CONTRACT_MISMATCH: the draft's recorded target fingerprint (and its fc width) against this target."""
    diffs: dict = {}
    if contract.taps.num_layers != fp.num_layers:
        diffs["num_layers"] = [contract.taps.num_layers, fp.num_layers]
    rec = contract.target
    if rec is not None:
        for name in ("num_layers", "hidden_size", "vocab_size", "architecture", "tokenizer_sha256"):
            a, b = getattr(rec, name), getattr(fp, name)
            if a is not None and b is not None and a != b:
                diffs[name] = [a, b]
    if fc_in != contract.taps.count * fp.hidden_size:
        diffs["fc_in_features"] = [fc_in, contract.taps.count * fp.hidden_size]
    if not diffs:
        return []
    # Only the architecture name differing (e.g. a re-saved checkpoint's class name) is weak evidence.
    conf = 0.5 if set(diffs) == {"architecture"} else 1.0
    what = ", ".join(f"{k} {v[0]} vs {v[1]}" for k, v in diffs.items())
    # Without a record (an inferred contract) the draft's own fc width is the evidence, not a training record.
    said = (
        f"the draft does not fit this target ({what}; the draft's fc vs its INFERRED taps on this target)"
        if contract.inferred
        else f"the draft was trained for a different target ({what}; draft's record vs this target)"
    )
    return [
        Finding(
            "CONTRACT_MISMATCH",
            "static",
            said,
            {"differs": diffs, "recorded": rec.to_dict() if rec else None, "target": fp.to_dict()},
            "serve the draft with the target it was trained on, or retrain it on this target",
            conf,
            support="declared",
        )
    ]


def check_template(contract: DraftContract, fp: TargetFingerprint) -> list[Finding]:
    """TEMPLATE_MISMATCH: the chat template hash the draft was trained under vs the one serving will use."""
    rec = contract.target.chat_template_sha256 if contract.target else None
    if rec is None or rec == fp.chat_template_sha256:
        return []
    missing = fp.chat_template_sha256 is None
    verdict = (
        "the target has no chat template but the draft was trained on chat-rendered data"
        if missing
        else "the target's chat template differs from the one the draft's training data was rendered with"
    )
    return [
        Finding(
            "TEMPLATE_MISMATCH",
            "static",
            verdict,
            {"trained_sha256": rec, "target_sha256": fp.chat_template_sha256},
            "re-render (eaglescope prepare) and retrain with the serving template, or serve with the trained one",
            0.6 if missing else 0.9,
            support="declared",
        )
    ]


def check_engines(
    hf_config: dict,
    contract: DraftContract,
    engines: tuple[str, ...] = DEFAULT_ENGINES,
    architecture: str | None = None,
) -> tuple[list[Finding], dict]:
    """ENGINE_TAP_CONVENTION: what each engine captures for the checkpoint's ids vs the trained taps. Both SGLang
    rows are reported. Given the target's `architecture` (the served engine is known to be SGLang), "sglang" in
    `engines` is judged by the rule SGLang applies to that target (+1 to every id for Llama-like targets, +1 only
    when the first id is 1 for the DeepSeek-V2 family), never by the other family's; without it, by the first-id-1
    row (a draft saved for either family stays quiet)."""
    taps = contract.taps
    L = taps.num_layers
    ids = config_tap_ids(hf_config)
    rule = sglang_convention(architecture)
    judged = {rule if e == "sglang" and rule else e for e in engines}
    captures = {}
    findings = []
    for engine in dict.fromkeys((*engines, "sglang", "sglang-legacy")):
        try:
            cap = engine_capture(ids, engine, L)
        except EagleScopeError:
            cap = None
        ok = cap == list(taps.layers)
        captures[engine] = {"captures": cap, "matches_contract": ok}
        if ok or engine not in judged:
            continue
        try:
            choose_engine_ids(taps, engine)
            fix = f"eaglescope export --draft DRAFT --to {engine} --out DIR (writes ids {engine} reads correctly)"
        except EagleScopeError as e:
            fix = f"{engine} cannot capture these taps ({e}); serve with another engine"
        shift = sorted({c - t for c, t in zip(cap or [], taps.layers, strict=False)})
        names = "; ".join(tap_name(i, L) for i in cap or [])
        evidence = {
            "engine": engine,
            "config_ids": ids,
            "captures": cap,
            "trained_taps": list(taps.layers),
            "offset": shift[0] if len(shift) == 1 else None,
            "contract_inferred": contract.inferred,
        }
        # An inferred contract only guesses the training taps, so the mismatch is a guess too, and is worded as one.
        conf = 0.5 if contract.inferred else 0.95
        verdict = (
            f"{engine} reads eagle_aux_hidden_state_layer_ids {ids} as taps {cap} ({names}), "
            f"but the draft {trained_on(contract)}"
        )
        # Ids that some engine's convention reads as the trained taps (or no ids at all) were written for another
        # engine: a convention mix-up. Ids that no convention reads as them are simply wrong ids, named by what
        # they make this engine capture.
        which = "inferred" if contract.inferred else "trained"
        right_for = [e for e in ENGINES if e != engine and _capture_or_none(ids, e, L) == list(taps.layers)]
        evidence["ids_right_for"] = right_for
        if ids is not None and not right_for and cap is not None and len(cap) == len(taps.layers):
            code = "TAP_OFF_BY_ONE" if all(abs(c - t) <= 1 for c, t in zip(cap, taps.layers)) else "TAP_WRONG_LAYER"
            findings.append(Finding(code, "target.aux", verdict + f"; no engine reads these ids as the {which} taps",
                                    evidence, fix, conf, support="declared"))  # fmt: skip
            continue
        if right_for:
            verdict += f"; these ids are {' and '.join(right_for)}'s convention"
        findings.append(
            Finding("ENGINE_TAP_CONVENTION", "target.aux", verdict, evidence, fix, conf, support="declared")
        )
    return findings, {"config_ids": ids, **captures}


def _capture_or_none(ids: list[int] | None, engine: str, num_layers: int) -> list[int] | None:
    try:
        return engine_capture(ids, engine, num_layers)
    except EagleScopeError:
        return None


def check_vocab_map(hf_config: dict, sd: dict[str, torch.Tensor]) -> tuple[list[Finding], dict]:
    """VOCAB_MAP: d2t/t2d missing on a reduced vocabulary, an all-zero (identity) d2t there, or an invalid map."""
    V = int(hf_config.get("vocab_size") or 0)
    lm_rows = int(sd["lm_head.weight"].shape[0]) if "lm_head.weight" in sd else None
    N = int(hf_config.get("draft_vocab_size") or lm_rows or V)
    info: dict = {"vocab_size": V, "draft_vocab_size": N, "has_d2t": "d2t" in sd, "has_t2d": "t2d" in sd}
    fix = "save d2t (offsets) and t2d from the training data's vocabulary (eaglescope train writes them)"
    reduced = N < V
    if lm_rows is not None and lm_rows != N:
        info["lm_head_rows"] = lm_rows
        v = f"lm_head has {lm_rows} rows but config.json says draft_vocab_size={N}"
        return [
            Finding(
                "VOCAB_MAP", "draft.step0.topk", v, info, "make draft_vocab_size match lm_head", 1.0, support="declared"
            )
        ], info
    if "d2t" not in sd or "t2d" not in sd:
        if not reduced:
            return [], info | {"kind": "identity (full vocabulary)"}
        v = (
            f"the draft predicts {N} of {V} tokens but the checkpoint has no d2t/t2d: engines map draft id i to "
            f"target id i, so most drafted tokens are wrong"
        )
        return [Finding("VOCAB_MAP", "draft.step0.topk", v, info, fix, 1.0, support="declared")], info
    d2t, t2d = sd["d2t"].long(), sd["t2d"].bool()
    try:
        validate_vocab_map(d2t, t2d, V, N)
    except EagleScopeError as e:
        info["error"] = str(e)
        return [
            Finding(
                "VOCAB_MAP",
                "draft.step0.topk",
                f"the vocabulary map is invalid: {e}",
                info,
                fix,
                1.0,
                support="declared",
            )
        ], info
    zeros = bool((d2t == 0).all())
    info["d2t_all_zero"] = zeros
    if reduced and zeros:
        v = (
            f"d2t is all zeros on a reduced vocabulary: draft ids map to the first {N} of {V} target ids, which is"
            " what a lost map looks like"
        )
        return [Finding("VOCAB_MAP", "draft.step0.topk", v, info, fix, IDENTITY_MAP_WEIGHT, support="declared")], info
    return [], info


def check_embedding(sd: dict[str, torch.Tensor], target_dir: Path) -> tuple[list[Finding], dict]:
    """EMBEDDING_MISMATCH: a saved embedding that is not the target's (vLLM uses a saved one; SGLang swaps)."""
    w = sd.get("embed_tokens.weight")
    if w is None:
        return [], {"saved": False}
    ref = load_target_embedding(target_dir)
    info: dict = {"saved": True, "shape": list(w.shape), "target_shape": list(ref.shape)}
    if tuple(w.shape) != tuple(ref.shape):
        rel = None
    else:
        rel = _rel_err(w, ref)
        info["rel_err"] = rel
        info["cosine"] = float(torch.nn.functional.cosine_similarity(w.double().flatten(), ref.double().flatten(), 0))
        if rel <= EMBED_REL_TOL:
            return [], info | {"matches_target": True}
    info["matches_target"] = False
    what = "has a different shape than" if rel is None else f"differs from (relative error {rel:.3g})"
    return [
        Finding(
            "EMBEDDING_MISMATCH",
            "draft.step0.embed_in",
            f"the draft's saved embedding {what} the target's; vLLM drafts with the saved one (SGLang swaps it)",
            info,
            "re-export without --with-embedding, or with the target's own embedding (eaglescope export --target)",
            0.95,
            support="declared",
        )
    ], info


# -- all of them ----------------------------------------------------------------------------------------------
_MLA_WEIGHTS = ("midlayer.self_attn.kv_a_proj_with_mqa.weight", "midlayer.self_attn.kv_b_proj.weight")
_LLAMA_WEIGHTS = ("midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight")
_EAGLE31_WEIGHTS = {"norm_before_fc": "input_norm.weight", "fc_norm": "fc_norm.0.weight"}


def check_layer(hf_config: dict, sd: dict[str, torch.Tensor], engines: tuple[str, ...]) -> tuple[list[Finding], dict]:
    """The draft layer and EAGLE 3.1 options its config names, against the weights it holds (a Llama-attention
    config over an MLA layer, a 3.1 norm whose flag was lost), and what each engine does with them."""
    says_mla = "kv_lora_rank" in hf_config or any("Deepseek" in a for a in hf_config.get("architectures") or [])
    has_mla, has_llama = all(k in sd for k in _MLA_WEIGHTS), all(k in sd for k in _LLAMA_WEIGHTS)
    findings: list[Finding] = []
    info: dict = {"config_layer": "mla" if says_mla else "llama", "weights_layer": "mla" if has_mla else "llama"}
    if (says_mla and has_llama) or (not says_mla and has_mla):
        names = ("multi-head latent attention (MLA)", "Llama attention")
        cfg_says, weights_are = names if says_mla else names[::-1]
        v = f"config.json names a {cfg_says} draft layer, but the weights are a {weights_are} layer"
        fix = "serve the checkpoint with the config it was trained with (export it again with eaglescope export)"
        findings.append(Finding("DRAFT_ARCH_MISMATCH", "static", v, info, fix, 1.0, support="declared"))
        return findings, info
    flags = {"norm_before_fc": bool((hf_config.get("eagle_config") or {}).get("norm_before_fc",
                                                                                hf_config.get("norm_before_fc"))),
             "fc_norm": bool(hf_config.get("fc_norm"))}  # fmt: skip
    for flag, weight in _EAGLE31_WEIGHTS.items():
        if (weight in sd) != flags[flag]:
            v = (f"the weights hold {weight} but config.json does not set {flag}: an engine skips that norm"
                 if weight in sd else f"config.json sets {flag} but the weights hold no {weight}")  # fmt: skip
            fix = f"set {flag} as trained (eaglescope export writes it where vLLM and SGLang read it)"
            findings.append(
                Finding(
                    "EAGLE31_IGNORED",
                    "draft.fc.out",
                    v,
                    {"flag": flag, "weight": weight},
                    fix,
                    0.95,
                    support="declared",
                )
            )
    try:
        c = DraftConfig.from_hf_config(hf_config, fc_in=int(sd["fc.weight"].shape[1]))
    except EagleScopeError:
        return findings, info
    info["eagle31"] = c.eagle31
    for engine in engines:
        ignored = engine_options(c, engine)["ignores"]
        if ignored:
            v = f"{engine} ignores this draft's {', '.join(ignored)}: it drafts with another function than trained"
            fix = "serve it with an engine (version) that implements the option, or retrain without it"
            findings.append(
                Finding(
                    "EAGLE31_IGNORED", "static", v, {"engine": engine, "ignores": ignored}, fix, 0.9, support="declared"
                )
            )
    return findings, info


def static_checks(
    target_dir: Path | str,
    draft_dir: Path | str,
    engines: tuple[str, ...] = DEFAULT_ENGINES,
    sglang_rule_of_target: bool = False,
) -> tuple[list[Finding], dict]:
    """Every static check; returns (findings, context["static"]). `sglang_rule_of_target`: SGLang is known to
    serve this target, so its ids are judged by the rule of the target's architecture (check_engines)."""
    tdir = check_dir(target_dir)
    tcfg = read_config(tdir)
    try:
        fp = fingerprint_of(tdir, tcfg)
    except (KeyError, ValueError, TypeError) as e:
        raise EagleScopeError(f"target config.json is malformed: {e}") from None
    hf_cfg, sd, contract = read_draft_raw(draft_dir, fp.num_layers)
    findings = check_contract(contract, fp, int(sd["fc.weight"].shape[1]))
    findings += check_template(contract, fp)
    ctx: dict = {
        "target": fp.to_dict(),
        "contract": contract.to_dict()
        | {
            "inferred": contract.inferred,
            "inferred_from": contract.extra.get("inferred_from") if contract.inferred else None,
        },
        "taps": list(contract.taps.layers),
        "tap_names": contract.taps.describe(),
    }
    # Engine conventions need the contract's layer count to be this target's; a mismatch already said so.
    if contract.taps.num_layers == fp.num_layers:
        arch = fp.architecture if sglang_rule_of_target else None
        f, ctx["engines"] = check_engines(hf_cfg, contract, engines, arch)
        findings += f
    f, ctx["vocab_map"] = check_vocab_map(hf_cfg, sd)
    findings += f
    f, ctx["layer"] = check_layer(hf_cfg, sd, engines)
    findings += f
    f, ctx["embedding"] = check_embedding(sd, tdir)
    findings += f
    return findings, ctx


def contract_taps(draft_dir: Path | str, num_layers: int) -> TapContract:
    """The taps the draft was trained on (from its contract, or inferred: `.inferred` of read_draft_raw's contract)."""
    return read_draft_raw(draft_dir, num_layers)[2].taps
