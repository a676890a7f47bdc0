"""Drafts in the layouts other tools write (models/drafts/formats.py), read as written, and what is refused: the
official EAGLE-3 layout (a plain `LlamaForCausalLM` config with `draft_vocab_size`, transformers 4.x keys), SGLang's
Kimi MLA draft config (`Eagle3DeepseekV2ForCausalLM` with the target's MoE keys and `use_aux_norm`), a config key
that is not understood, a tensor the draft has no place for, and a pickled weight file that would run code.

speculators' own format, written by speculators' own code: tests/test_speculators_drafts.py."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
from pathlib import Path

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint
from safetensors.torch import load_file, save_file

from eaglescope.cli import main
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import load_draft, save_draft
from eaglescope.taps import TapContract

L = 8  # tests/models.py TINY


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("formats") / "target")


def edited(src: Path, out: Path, edit_cfg=None, edit_sd=None) -> Path:
    """A copy of a draft directory with its config and weights edited, as another tool would have written them."""
    out.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    if edit_cfg:
        edit_cfg(cfg)
    if edit_sd:
        edit_sd(sd)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(out / "model.safetensors"))
    return out


def official(cfg: dict) -> None:
    """The official EAGLE-3 release layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config.json): architectures
    LlamaForCausalLM, transformers 4.28 keys, no eagle_config, no eaglescope section."""
    cfg.pop("eaglescope")
    cfg.pop("eagle_config")
    cfg.pop("target_hidden_size")
    cfg.pop("head_dim")
    cfg |= {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "initializer_range": 0.02,
        "pad_token_id": 0,
        "transformers_version": "4.28.1",
        "use_cache": True,
        "pretraining_tp": 1,
        "torch_dtype": "float16",
    }


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory) -> Path:
    model, contract = make_draft(target, draft_vocab_size=48)
    return save_draft(model, contract, tmp_path_factory.mktemp("formats") / "draft")


def test_the_official_eagle3_layout_is_read_with_its_taps_assumed(draft, target, tmp_path):
    d = edited(draft, tmp_path / "official", official)
    ours, theirs = load_draft(draft, L), load_draft(d, L)
    assert theirs.format == "eagle3" and ours.format == "eaglescope"
    assert list(theirs.contract.taps.layers) == [2, L // 2, L - 3] and theirs.contract.inferred
    for (k, a), (k2, b) in zip(ours.model.state_dict().items(), theirs.model.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    declared = {p.name: p for p in theirs.declared.properties}
    assert declared["taps"].status == "assumed" and "--measure-wiring" in declared["taps"].measure
    assert declared["ttt_length"].status == "unknown" and declared["shift"].status == "unknown"
    assert declared["vocab_map"].status == "declared"


def test_inspect_json_says_what_is_declared_and_how_to_measure_the_rest(draft, target):
    rc, out, err = cli(["inspect", str(draft), "--target", str(target), "--json"])
    assert rc == 0, err
    d = json.loads(out)
    assert d["format"] == "eaglescope"
    props = {p["name"]: p for p in d["declared"]["properties"]}
    assert set(props) >= {"taps", "tap_convention", "norm_flags", "vocab_map", "ttt_length", "embedding", "target",
                          "shift"}  # fmt: skip
    assert props["taps"]["status"] == "declared" and props["ttt_length"]["value"] == 7
    assert props["taps"]["measure"] == (
        f"eaglescope doctor --target {target} --draft {draft} --data DATA.jsonl --measure-wiring"
    )


def test_sglangs_kimi_mla_draft_config_is_read(tmp_path):
    t = make_checkpoint("deepseek_v3", tmp_path / "ds")
    model, contract = make_draft(t, draft_vocab_size=48, arch="mla", fc_norm=True, random_norms=True)
    d = save_draft(model, contract, tmp_path / "mla")

    def sglang_kimi(cfg: dict) -> None:
        # kimi_k25_eagle3.py reads fc_norm under its legacy name; the target's MoE keys ride along in the config
        cfg.pop("eaglescope")
        cfg.pop("fc_norm")
        cfg |= {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "use_aux_norm": True, "n_routed_experts": 384,
                "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
                "routed_scaling_factor": 2.827, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}  # fmt: skip

    def layers_0(sd: dict) -> None:  # the public Kimi MLA drafts name the layer layers.0 (kimi_k25_eagle3.py)
        for k in [k for k in sd if k.startswith("midlayer.")]:
            sd["layers.0." + k.removeprefix("midlayer.")] = sd.pop(k)

    kimi = edited(d, tmp_path / "kimi", sglang_kimi, layers_0)
    n = json.loads((t / "config.json").read_text())["num_hidden_layers"]
    ours, theirs = load_draft(d, n), load_draft(kimi, n)
    assert theirs.format == "eagle3-mla" and theirs.model.config.arch == "mla" and theirs.model.config.fc_norm
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, 5, theirs.model.config.num_aux * theirs.model.config.target_hidden_size, generator=g)
    assert torch.equal(ours.model.project(aux), theirs.model.project(aux))


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda c: c.update(use_parallel_residual=True), "'use_parallel_residual'"),
        (lambda c: c["eagle_config"].update(mystery_option=1), "'eagle_config.mystery_option'"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
        (lambda c: c.update(attention_bias=True), "attention_bias"),
        (lambda c: c.update(num_hidden_layers=2), "num_hidden_layers is 2"),
        (lambda c: c["eagle_config"].update(use_aux_hidden_state=False), "use_aux_hidden_state"),
    ],
    ids=["top-level", "eagle_config", "hidden_act", "attention_bias", "two-layers", "no-aux"],
)
def test_a_config_key_not_understood_is_refused_in_one_line_naming_it(draft, tmp_path, edit, named):
    d = edited(draft, tmp_path / "bad", edit)
    rc, out, err = cli(["inspect", str(d), "--json"])
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert named in err and "Traceback" not in err


def test_a_tensor_the_draft_has_no_place_for_is_refused_not_skipped(draft, tmp_path):
    d = edited(
        draft, tmp_path / "extra", edit_sd=lambda sd: sd.update({"midlayer.self_attn.q_norm.weight": torch.ones(16)})
    )
    with pytest.raises(EagleScopeError, match="'midlayer.self_attn.q_norm.weight'.*no place"):
        load_draft(d, L)


class _Trap:
    """Unpickling this runs code: pathlib.Path.touch(marker). torch.load(weights_only=True) must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_pickled_weight_file_is_refused_in_one_line_and_never_unpickled(draft, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text((draft / "config.json").read_text())
    sd = load_file(str(draft / "model.safetensors"))
    marker = tmp_path / "code-ran"
    torch.save({**sd, "trap": _Trap(marker)}, d / "pytorch_model.bin")
    for argv in (["inspect", str(d)], ["export", "--draft", str(d), "--to", "vllm", "--out", str(tmp_path / "e")]):
        rc, out, err = cli(argv)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert "not a plain tensor checkpoint" in err and "without running pickled code" in err
    assert not marker.exists()
    # the same tensors without the trap: a plain .bin is read (weights_only)
    torch.save(sd, d / "pytorch_model.bin")
    assert load_draft(d, L).format == "eaglescope"


# Draft configs SpecForge ships (sgl-project/SpecForge configs/*.json, its train scripts' --draft-model-config; a
# trained draft's config.json is this file as saved): every key of each, with the tiny draft's shapes put in place of
# the real ones.
SPECFORGE = {
    "kimi-k25-eagle3.json": {
        "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 163584, "draft_vocab_size": 32000, "dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
        "eos_token_id": 163585, "head_dim": 128, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
        "intermediate_size": 18432, "max_position_embeddings": 131072, "max_window_layers": 48, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 64, "num_hidden_layers": 1, "num_key_value_heads": 64,
        "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.57.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 163840,
    },
    "qwen3-30B-A3B-eagle3.1.json": {
        "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "fc_norm": True, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 2048,
        "max_window_layers": 48, "model_type": "llama", "norm_output": True, "num_attention_heads": 32,
        "num_hidden_layers": 1, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.53.2", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
        "draft_vocab_size": 32000,
    },
    "deepseek-v3-671b-eagle3.json": {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 7168,
        "initializer_range": 0.02, "intermediate_size": 40960, "max_position_embeddings": 163840, "model_type": "llama",
        "num_attention_heads": 56, "num_key_value_heads": 8, "num_hidden_layers": 1, "pad_token_id": 0,
        "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
        "use_cache": True, "vocab_size": 129280, "draft_vocab_size": 32000,
    },
}  # fmt: skip
SHAPES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
          "draft_vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling")  # fmt: skip


@pytest.mark.parametrize("name", list(SPECFORGE))
def test_specforges_draft_configs_are_understood_key_by_key(target, tmp_path, name):
    theirs = SPECFORGE[name]
    flags = {k: bool(theirs.get(k)) for k in ("fc_norm", "norm_output")}
    model, contract = make_draft(target, draft_vocab_size=48, taps=TapContract((2, 4, 6), L), **flags)
    d = save_draft(model, contract, tmp_path / "ours", tap_ids=[1, 3, 5])  # SpecForge's "output of layer" ids

    def as_specforge(cfg: dict) -> None:
        ours = {k: cfg[k] for k in SHAPES if k in cfg}
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        cfg.clear()
        cfg |= theirs | ours
        if "eagle_config" in theirs:
            cfg["eagle_config"] = {**theirs["eagle_config"], "eagle_aux_hidden_state_layer_ids": ids}

    loaded = load_draft(edited(d, tmp_path / "specforge", as_specforge), L)
    assert loaded.format == "eagle3" and loaded.model.config.eagle31 == model.config.eagle31
    # with ids: read as SpecForge's "output of layer i"; without: the engines' default
    assert list(loaded.contract.taps.layers) == ([2, 4, 6] if "eagle_config" in theirs else [2, L // 2, L - 3])
