"""Draft checkpoints as the field writes them, read as written.

Which format a directory holds, its config.json turned into the one flat layout `DraftConfig.from_hf_config` reads,
its weights under eaglescope's names, and a record of what its files DECLARE about how the draft was trained and
what they leave ASSUMED or UNKNOWN (docs/drafts.md, "Formats read"):

    eaglescope    LlamaForCausalLMEagle3 layout with an `eaglescope` section (what train and export write)
    eagle3        the same layout without one: official EAGLE-3 (whose config may name plain LlamaForCausalLM),
                  SpecForge, vLLM-style `layers.0.*` weights
    eagle3-mla    Eagle3DeepseekV2ForCausalLM / Eagle3DeepseekV3ForCausalLM (SGLang kimi_k25_eagle3.py, vLLM
                  deepseek_eagle3.py): the same draft with DeepSeek's multi-head latent attention
    speculators   `speculators_model_type: eagle3` (speculators 0.9.0 models/eagle3/config.py: what `speculators
                  train` and `speculators convert` write and vLLM serves natively): `speculators_config`,
                  `transformer_layer_config`, weights `layers.0.*`

Every config key is either used, or listed below as understood and irrelevant to the function the draft computes
(bookkeeping, training-only, generation defaults); any other key is refused in one line naming it, so nothing a
file says is silently dropped. Weights are read with safetensors or torch.load(weights_only=True) only
(models/targets/loading.py); a tensor the draft has no place for is refused the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.loading import check_dir, load_state_dict, read_config

FORMATS = ("eaglescope", "eagle3", "eagle3-mla", "speculators")

# -- config keys ------------------------------------------------------------------------------------------------
# Read by DraftConfig.from_hf_config / the contract (eagle_config, eaglescope) or checked here for their value.
_LAYER_KEYS = {
    "architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta",
    "rope_scaling", "rope_parameters", "vocab_size", "attention_bias", "mlp_bias", "tie_word_embeddings",
    "torch_dtype", "dtype",
    # a training-time attention window (speculators trains its draft layer with one by default; vLLM serves it):
    # recorded and reported, see sliding_window_note
    "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
}  # fmt: skip
_EAGLE_KEYS = {
    "draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
    "logit_scale", "eagle_config", "eaglescope", "eagle_aux_hidden_state_layer_ids",
}  # fmt: skip
_MLA_KEYS = {
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
    "qk_head_dim", "use_aux_norm",  # SGLang kimi_k25_eagle3.py: the legacy name of fc_norm
    "bias",  # SGLang kimi_k25_eagle3.py: a bias on fc (checked: must be off)
}  # fmt: skip
# Understood and irrelevant to what the draft computes: transformers' PretrainedConfig bookkeeping and generation
# defaults (4.x and 5.x), training-only settings, and the MoE shape of a DeepSeek config, whose one-layer draft has
# a dense MLP (SGLang kimi_k25_eagle3.py and vLLM deepseek_eagle3.py build DeepseekV2MLP from intermediate_size).
IRRELEVANT_KEYS = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "initializer_range", "use_cache", "pretraining_tp", "attention_dropout",
    "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward", "id2label", "label2id",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
    "problem_type", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "finetuning_task",
    "tokenizer_class", "prefix", "task_specific_params", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "output_router_logits", "router_aux_loss_coef", "use_return_dict",
    # training-only
    "embed_requires_grad", "attention_implementation", "_attn_implementation",
    # MoE shape of DeepSeek configs (the draft's MLP is dense)
    "moe_intermediate_size", "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
    "num_experts_per_tok", "routed_scaling_factor", "topk_group", "topk_method", "scoring_func",
    "first_k_dense_replace", "moe_layer_freq", "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers",
    # vLLM's own additions when it rewrites a speculators config (transformers_utils/configs/speculators/algos.py)
    "num_lookahead_tokens",
})  # fmt: skip
_EAGLE_CONFIG_KEYS = {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "norm_before_fc"}
# speculators 0.9.0: SpeculatorModelConfig + Eagle3SpeculatorConfig fields (models/eagle3/config.py, config.py)
_SPECULATORS_KEYS = {
    "speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
    "architectures", "draft_vocab_size", "norm_before_residual", "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm", "norm_output", "torch_dtype", "dtype",
    # the draft's lm_head is its own weight (draft vocabulary), whatever this says
    "tie_word_embeddings",
    # names speculators' config class in the config.py it saves beside the weights, for transformers'
    # trust_remote_code; eaglescope never runs it (the keys above say all the class holds)
    "auto_map",
}  # fmt: skip
_SPECULATORS_CONFIG_KEYS = {"algorithm", "proposal_methods", "default_proposal_method", "verifier"}
_PROPOSAL_KEYS = {"proposal_type", "speculative_tokens", "verifier_accept_k", "accept_tolerance"}
_VERIFIER_KEYS = {"name_or_path", "architectures"}
LLAMA_DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
MLA_DRAFT_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


def _refuse_unknown(d: dict, allowed: set | frozenset, where: str, path: Path) -> None:
    for key in d:
        if key not in allowed and key not in IRRELEVANT_KEYS:
            raise EagleScopeError(
                f"{path}/config.json: key {where + key!r} is not understood by eaglescope (it may change what the "
                "draft computes); refusing rather than ignoring it (docs/drafts.md lists the keys read)"
            )


def _check_values(flat: dict, path: Path, where: str = "") -> None:
    """Keys whose *value* changes the draft's function in a way eaglescope's draft layer does not implement."""
    act = flat.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise EagleScopeError(
            f"{path}/config.json: {where}hidden_act {act!r} is not supported (the draft's MLP is SwiGLU)"
        )
    for key in ("attention_bias", "mlp_bias", "bias"):
        if flat.get(key):
            raise EagleScopeError(f"{path}/config.json: {where}{key} is true; eaglescope's draft layer has no biases")
    n = flat.get("num_hidden_layers", 1)
    if n != 1:
        raise EagleScopeError(
            f"{path}/config.json: {where}num_hidden_layers is {n}; eaglescope reads one-layer EAGLE-3 drafts only"
        )
    eagle = flat.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise EagleScopeError(f"{path}/config.json: eagle_config must be an object")
    _refuse_unknown(eagle, _EAGLE_CONFIG_KEYS, "eagle_config.", path)
    if eagle.get("use_aux_hidden_state") is False:
        raise EagleScopeError(
            f"{path}/config.json: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 draft without fc over the "
            "target's taps); eaglescope reads EAGLE-3 drafts"
        )


# -- what the files declare ----------------------------------------------------------------------------------------
DECLARED, ASSUMED, UNKNOWN = "declared", "assumed", "unknown"


@dataclass
class Property:
    """One training property of a draft: what its files say about it (status DECLARED, with `source`), or what
    eaglescope takes it to be without a statement (ASSUMED) or cannot know from the files (UNKNOWN); `measure` is the
    command that measures it from the draft's behaviour, where one does."""

    name: str
    status: str
    value: Any
    source: str
    measure: str | None = None


@dataclass
class Declaration:
    format: str
    properties: list[Property] = field(default_factory=list)

    def get(self, name: str) -> Property | None:
        return next((p for p in self.properties if p.name == name), None)

    def to_dict(self) -> dict:
        return {"format": self.format, "properties": [asdict(p) for p in self.properties]}


def measure_commands(draft: Path | str, target: str | None = None) -> dict[str, str]:
    """The doctor commands that measure what a draft's files only declare (TARGET, DATA, TRACE: the user's)."""
    d, t = str(draft), target or "TARGET"
    base = f"eaglescope doctor --target {t} --draft {d}"
    return {
        # the teacher-forced wiring search: taps, their order, embedding, shift, final norm (issue 59's item 2)
        "wiring": f"{base} --data DATA.jsonl --measure-wiring",
        # behaviour: predicted α_k per position against served acceptance (NO_TTT vs UNDERTRAINED)
        "behaviour": f"{base} --data DATA.jsonl",
        # an engine's trace against the golden replay (EAGLE31_NORM, VOCAB_MAP, ...)
        "trace": f"{base} --trace TRACE",
        # static: fingerprint, vocabulary map, saved embedding against the target's
        "static": f"{base}",
    }


# -- the read ------------------------------------------------------------------------------------------------------
@dataclass
class DraftFiles:
    """A draft directory as read: `config` is the flat LlamaForCausalLMEagle3-layout dict DraftConfig reads (tap ids
    in `eagle_config`, in the convention `tap_convention` names), `raw_config` the file as written, `state_dict` the
    weights under eaglescope's names (`midlayer.*`, `fc.weight`, ...)."""

    path: Path
    format: str
    config: dict
    raw_config: dict
    state_dict: dict[str, torch.Tensor]
    tap_ids: list[int] | None
    tap_convention: str  # an engine of taps.ENGINES: how to read `tap_ids`
    ttt_length: int | None = None
    verifier: dict | None = None
    notes: list[str] = field(default_factory=list)


def detect_format(cfg: dict) -> str:
    if "speculators_model_type" in cfg:
        return "speculators"
    if "eaglescope" in cfg:
        return "eaglescope"
    archs = cfg.get("architectures") or []
    if any(a in MLA_DRAFT_ARCHITECTURES for a in archs) or "kv_lora_rank" in cfg:
        return "eagle3-mla"
    return "eagle3"


def canonical_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights under eaglescope's names: no leading "model.", the draft layer as `midlayer.` (vLLM and speculators
    write `layers.0.`)."""
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    return {("midlayer." + k[len("layers.0.") :]) if k.startswith("layers.0.") else k: v for k, v in sd.items()}


# speculators saves these beside the draft in some versions; they feed only its training loss (models/eagle3/core.py)
TRAINING_ONLY_WEIGHTS = ("verifier_norm.weight", "verifier_lm_head.weight")


def read_draft_files(path: Path | str) -> DraftFiles:
    """Read any supported draft directory (module docstring); refuse in one line what is not understood."""
    path = check_dir(path, "draft")
    raw = read_config(path)
    fmt = detect_format(raw)
    if fmt == "speculators":
        files = _read_speculators(path, raw)
    else:
        files = _read_eagle3(path, raw, fmt)
    sd = canonical_names(load_state_dict(path))
    for name in TRAINING_ONLY_WEIGHTS:
        sd.pop(name, None)
    if "fc.weight" not in sd:
        raise EagleScopeError(f"{path} has no fc.weight: not an EAGLE-3 draft checkpoint")
    files.state_dict = sd
    return files


def _read_eagle3(path: Path, raw: dict, fmt: str) -> DraftFiles:
    archs = raw.get("architectures") or []
    known = (*LLAMA_DRAFT_ARCHITECTURES, *MLA_DRAFT_ARCHITECTURES)
    if archs and not any(a in known for a in archs):
        raise EagleScopeError(
            f"{path} holds a {archs[0]} checkpoint, not an EAGLE-3 draft (one of {', '.join(known)}, or speculators' "
            "format)"
        )
    is_mla = "kv_lora_rank" in raw or any(a in MLA_DRAFT_ARCHITECTURES for a in archs)
    # MLA keys are understood on any config: read when the layer is MLA; beside Llama weights doctor names the
    # mismatch (DRAFT_ARCH_MISMATCH) rather than the reader refusing it
    allowed = _LAYER_KEYS | _EAGLE_KEYS | _MLA_KEYS
    if raw.get("num_hidden_layers", 1) != 1 and archs == ["LlamaForCausalLM"]:
        n = raw["num_hidden_layers"]
        raise EagleScopeError(f"{path} holds a LlamaForCausalLM with {n} layers (a target), not an EAGLE-3 draft")
    _refuse_unknown(raw, allowed, "", path)
    _check_values(raw, path)
    flat = dict(raw)
    if is_mla and raw.get("use_aux_norm") and "fc_norm" not in raw:
        flat["fc_norm"] = True
    ids = raw.get("eagle_aux_hidden_state_layer_ids")  # vLLM reads a top-level key first (export.config_tap_ids)
    if ids is None:
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = _int_list(ids, "eagle_aux_hidden_state_layer_ids", path)
    if ids is not None:
        flat["eagle_config"] = {**(raw.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": ids}
    # Without an eaglescope section explicit ids are read as "output of layer i" (SpecForge's convention, what
    # SGLang-era checkpoints mean); an eaglescope section records its taps itself.
    return DraftFiles(path, fmt, flat, raw, {}, ids, "specforge" if ids is not None else "vllm")


def _int_list(ids: Any, key: str, path: Path) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise EagleScopeError(f"{path}/config.json: {key} must be a list of integers, got {ids!r:.80}")
    return list(ids)


def _read_speculators(path: Path, raw: dict) -> DraftFiles:
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise EagleScopeError(
            f"{path} is a speculators {kind!r} checkpoint; eaglescope reads speculators' eagle3 drafts only"
        )
    _refuse_unknown(raw, _SPECULATORS_KEYS, "", path)
    spec = raw.get("speculators_config")
    layer = raw.get("transformer_layer_config")
    if not isinstance(spec, dict) or not isinstance(layer, dict):
        raise EagleScopeError(f"{path}/config.json: speculators_config and transformer_layer_config must be objects")
    _refuse_unknown(spec, _SPECULATORS_CONFIG_KEYS, "speculators_config.", path)
    verifier = spec.get("verifier") or {}
    if not isinstance(verifier, dict):
        raise EagleScopeError(f"{path}/config.json: speculators_config.verifier must be an object")
    _refuse_unknown(verifier, _VERIFIER_KEYS, "speculators_config.verifier.", path)
    methods = spec.get("proposal_methods") or []
    if not isinstance(methods, list) or not all(isinstance(m, dict) for m in methods):
        raise EagleScopeError(f"{path}/config.json: speculators_config.proposal_methods must be a list of objects")
    for m in methods:
        _refuse_unknown(m, _PROPOSAL_KEYS, "speculators_config.proposal_methods[].", path)
    if spec.get("algorithm", "eagle3") != "eagle3":
        raise EagleScopeError(f"{path}/config.json: speculators_config.algorithm is {spec['algorithm']!r}, not eagle3")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        # speculators' qwen3 draft layer normalises q and k per head (q_norm, k_norm): a layer eaglescope lacks
        raise EagleScopeError(
            f"{path}/config.json: transformer_layer_config.model_type is {model_type!r}; eaglescope reads speculators "
            "drafts with a llama decoder layer (speculators train --draft-arch llama)"
        )
    _refuse_unknown(layer, _LAYER_KEYS, "transformer_layer_config.", path)
    _check_values(layer, path, "transformer_layer_config.")
    ids = _int_list(raw.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids", path)
    flat = {k: v for k, v in layer.items() if k != "architectures"}
    flat |= {k: raw[k] for k in ("torch_dtype", "dtype") if raw.get(k)}  # the weights' dtype, for export
    flat |= {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "draft_vocab_size": raw.get("draft_vocab_size", 32000),  # Eagle3SpeculatorConfig's default
        "target_hidden_size": raw.get("target_hidden_size"),
        # speculators' own default is False; vLLM 0.32 (algos.py update_eagle3) reads a missing key as True
        "norm_before_residual": bool(raw.get("norm_before_residual", False)),
        "norm_before_fc": bool(raw.get("norm_before_fc", False)),
        "fc_norm": bool(raw.get("fc_norm", False)),
        "norm_output": bool(raw.get("norm_output", False)),
        "eagle_config": {"use_aux_hidden_state": True}
        | ({"eagle_aux_hidden_state_layer_ids": ids} if ids is not None else {}),
    }
    if flat["norm_before_fc"] and flat["fc_norm"]:
        raise EagleScopeError(f"{path}/config.json: norm_before_fc and fc_norm are both set (speculators refuses that)")
    ttt = None
    if methods and methods[0].get("speculative_tokens") is not None:
        ttt = methods[0]["speculative_tokens"]
        if type(ttt) is not int or ttt < 1:
            raise EagleScopeError(f"{path}/config.json: speculative_tokens must be a positive integer, got {ttt!r}")
    notes = []
    if "norm_before_residual" not in raw:
        notes.append(
            "config.json does not say norm_before_residual: speculators reads it as false, vLLM 0.32 as true "
            "(transformers_utils/configs/speculators/algos.py); the draft is read as speculators trained it (false)"
        )
    # ids are vLLM's (speculators generates its training data with vLLM, which uses them as-is)
    return DraftFiles(path, "speculators", flat, raw, {}, ids, "vllm", ttt, verifier, notes)


_SOURCES = {
    "eaglescope": "the eaglescope section (recorded by eaglescope train)",
    "speculators": "speculators' config.json",
    "eagle3": "config.json",
    "eagle3-mla": "config.json",
}


def declare(files: DraftFiles, contract: Any, has_embedding: bool, target: str | None = None) -> Declaration:
    """What `files` declare about the draft's training, property by property, and the command that measures each
    (docs/drafts.md, "What a draft's files declare"). `contract`: the DraftContract load_draft made of them."""
    fmt, raw, cfg, sd = files.format, files.raw_config, files.config, files.state_dict
    m = measure_commands(files.path, target)
    ours = fmt == "eaglescope"
    src = _SOURCES[fmt]
    taps = list(contract.taps.layers)
    out: list[Property] = []
    # taps and their convention
    if ours:
        out.append(Property("taps", DECLARED, taps, src, m["wiring"]))
        out.append(Property("tap_convention", DECLARED, "hf_output_hidden_states", src, m["wiring"]))
    elif files.tap_ids is not None:
        key = "eagle_aux_hidden_state_layer_ids" + (" (top level)" if fmt == "speculators" else "")
        out.append(Property("taps", DECLARED, taps, f"{key} = {files.tap_ids}", m["wiring"]))
        if fmt == "speculators":
            how = "speculators' ids are vLLM's, used as-is (hs[i]): its training data is generated by vLLM"
            out.append(Property("tap_convention", DECLARED, "vllm", f"the speculators format: {how}", m["wiring"]))
        else:
            how = "no eaglescope section: ids read as SpecForge's 'output of layer i' (hs[i+1])"
            out.append(Property("tap_convention", ASSUMED, "specforge", how, m["wiring"]))
    else:
        out.append(Property("taps", ASSUMED, taps, "config.json names no ids: the engines' default [2, L//2, L-3]",
                            m["wiring"]))  # fmt: skip
        out.append(Property("tap_convention", ASSUMED, "engine default", "no ids to read", m["wiring"]))
    # the EAGLE 3.1 norm flags
    keys = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
    flags = {k: bool(cfg.get(k) or (cfg.get("eagle_config") or {}).get(k)) for k in keys}
    said = [k for k in keys if k in raw or k in (raw.get("eagle_config") or {})]
    weights = [w for w in ("input_norm.weight", "fc_norm.0.weight") if w in sd]
    cfg_name = "speculators' config.json" if fmt == "speculators" else "config.json"
    where = f"{', '.join(said)} in {cfg_name}" if said else "no flag in config.json: plain EAGLE-3 (all off)"
    if weights:
        where += f"; the weights hold {', '.join(weights)}"
    out.append(Property("norm_flags", DECLARED if said or ours else ASSUMED, flags, where, m["trace"]))
    # the vocabulary map
    V, N = cfg.get("vocab_size"), cfg.get("draft_vocab_size") or cfg.get("vocab_size")
    if "d2t" in sd:
        out.append(Property("vocab_map", DECLARED, f"{N} draft ids of {V}", "d2t/t2d saved in the weights",
                            m["static"]))  # fmt: skip
    else:
        out.append(Property("vocab_map", DECLARED if N == V else UNKNOWN, "identity" if N == V else "missing",
                            "no d2t saved" + ("; draft vocabulary = target vocabulary" if N == V else ""),
                            m["static"]))  # fmt: skip
    # TTT length
    if ours and contract.ttt_length is not None:
        out.append(Property("ttt_length", DECLARED, contract.ttt_length, src, m["behaviour"]))
    elif files.ttt_length is not None:
        out.append(Property("ttt_length", DECLARED, files.ttt_length,
                            "speculators_config.proposal_methods[0].speculative_tokens (speculators train writes its "
                            "--ttt-steps there; speculators convert always writes 3)", m["behaviour"]))  # fmt: skip
    else:
        out.append(Property("ttt_length", UNKNOWN, None, "not in the files", m["behaviour"]))
    # embedding
    compare = f"eaglescope inspect {files.path} --target {target or 'TARGET'}" if has_embedding else None
    saved = "saved" if has_embedding else "not saved (engines use the target's)"
    where = "embed_tokens.weight " + ("in" if has_embedding else "not in") + " the weights"
    out.append(Property("embedding", DECLARED, saved, where, compare))
    # target fingerprint
    if ours and contract.target is not None:
        out.append(Property("target", DECLARED, contract.target.to_dict(), src, m["static"]))
    elif files.verifier:
        v = {"name_or_path": files.verifier.get("name_or_path"), "architectures": files.verifier.get("architectures")}
        out.append(Property("target", DECLARED, v, "speculators_config.verifier (a path and architecture; no layer "
                            "count, tokenizer or template hash)", m["static"]))  # fmt: skip
    else:
        out.append(Property("target", UNKNOWN, None, "not in the files (fc's width and the vocabulary size constrain "
                            "it)", m["static"]))  # fmt: skip
    # how features, tokens and the loss mask were paired
    if ours and contract.loss_mask_shift is not None:
        out.append(Property("shift", DECLARED, contract.loss_mask_shift, src + " (loss_mask_shift)", m["wiring"]))
    elif fmt == "speculators":
        out.append(Property("shift", ASSUMED, "g_t with x_(t+1)", "speculators' trainer (models/eagle3/data.py "
                            "shift_batch); the file does not record the data pipeline", m["wiring"]))  # fmt: skip
    else:
        out.append(Property("shift", UNKNOWN, None, "not in the files", m["wiring"]))
    note = sliding_window_note(cfg)
    if note:
        out.append(Property("attention_window", DECLARED, cfg.get("sliding_window"), note, None))
    return Declaration(fmt, out)


def sliding_window_note(cfg: dict) -> str | None:
    """A training-time attention window the draft's config declares, in words (None when the layer is full
    attention). eaglescope's draft attends over the whole context; vLLM 0.32 applies the window (llama.py reads
    layer_types and sliding_window per layer): the two agree on contexts up to the window."""
    types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    windowed = (types and types[0] == "sliding_attention") if types else bool(cfg.get("use_sliding_window"))
    if not windowed or not window:
        return None
    return (
        f"the draft layer was trained with a {window}-token sliding attention window (layer_types): vLLM applies it, "
        f"eaglescope attends over the whole context; they agree on contexts up to {window} tokens"
    )


__all__ = [
    "ASSUMED",
    "DECLARED",
    "FORMATS",
    "IRRELEVANT_KEYS",
    "UNKNOWN",
    "Declaration",
    "DraftFiles",
    "Property",
    "canonical_names",
    "declare",
    "detect_format",
    "measure_commands",
    "read_draft_files",
    "sliding_window_note",
]
