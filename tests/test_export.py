"""`export` writes each engine's own layer-id convention; `inspect` says what every engine will capture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from drafts import make_draft as full_vocab_draft
from hypothesis import given, settings
from hypothesis import strategies as st
from models import make_checkpoint
from safetensors import safe_open
from test_draft_io import L, make_draft, official_state, write_raw

from eaglescope.cli import main
from eaglescope.errors import EagleScopeError
from eaglescope.export import choose_engine_ids, describe_draft, export_draft, load_target_embedding
from eaglescope.models.draft import WEIGHT_NAMES, load_draft, save_draft
from eaglescope.models.targets.base import TargetFingerprint
from eaglescope.taps import SGLANG_FIRST_ID_ONE_ARCHITECTURES, TapContract, engine_capture

LLAMA, DEEPSEEK = "LlamaForCausalLM", "DeepseekV3ForCausalLM"  # SGLang 0.5.23: +1 to every id / +1 if first id is 1

# config.json keys of docs/field.md §2, plus the few every HF Llama config carries and our own section.
FIELD_REQUIRED = {
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
    "tie_word_embeddings",
    "target_hidden_size",
    "eagle_config",
    "norm_before_residual",
}
ALLOWED_EXTRA = {"head_dim", "hidden_act", "torch_dtype", "eaglescope"}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("target") / "llama")


def saved(target_dir: Path, tmp_path: Path, taps=None, name="src", arch: str | None = LLAMA, **kw) -> Path:
    """A random draft for the tiny (Llama) target, its fingerprint recorded. Another `arch` records a fingerprint
    of that architecture and the tiny target's shape, None none at all: the architecture decides the SGLang rule
    export writes for."""
    model, contract = make_draft(target_dir, taps=taps)
    if arch is None:
        contract.target = None
    elif arch != LLAMA:
        contract.target = TargetFingerprint(arch, L, 64, 96)
    return save_draft(model, contract, tmp_path / name, **kw)


def exported(tmp_path: Path, src: Path, engine: str, **kw) -> tuple[dict, dict, dict]:
    """(report, config.json, {name: tensor}) of `src` exported for `engine`."""
    report = export_draft(load_draft(src), engine, tmp_path / f"out-{engine}", **kw)
    out = Path(report["out"])
    cfg = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return report, cfg, sd


def test_vllm_export_has_exactly_the_field_format(target_dir, tmp_path):
    taps = [1, 4, 6]
    report, cfg, sd = exported(tmp_path, saved(target_dir, tmp_path, taps=tuple(taps)), "vllm")
    assert set(sd) == set(WEIGHT_NAMES)  # midlayer.* names: vLLM's loader renames them to layers.0.* itself
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert FIELD_REQUIRED <= set(cfg) <= FIELD_REQUIRED | ALLOWED_EXTRA
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"]) == (48, 96, 64)
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert engine_capture(ids, "vllm", L) == taps == report["captures"]["vllm"]
    assert cfg["eaglescope"]["taps"]["layers"] == taps and cfg["eaglescope"]["exported_for"] == "vllm"
    assert report["captures_names"]["vllm"][0] == "input of layer 1 (output of layer 0)"
    assert not report["embedding_saved"] and report["warnings"] == []


def test_sglang_export_uses_ids_both_sglang_rules_agree_on_when_they_exist(target_dir, tmp_path):
    taps = [2, 3, 6]  # first tap 2: ids [1, 2, 5] mean the same under both SGLang rules, whatever the target
    for arch in (None, LLAMA, DEEPSEEK):
        src = saved(target_dir, tmp_path, taps=tuple(taps), name=f"src-{arch}", arch=arch)
        report, cfg, sd = exported(tmp_path, src, "sglang")
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert ids == [1, 2, 5]
        assert report["captures"] == {"sglang": taps, "sglang-legacy": taps} and report["warnings"] == []
        assert set(sd) == set(WEIGHT_NAMES)


def test_sglang_export_follows_the_rule_of_the_targets_architecture(target_dir, tmp_path):
    """SGLang 0.5.23 reads the ids in the target model: llama.py adds 1 to every id, deepseek_v2.py only when the
    first id is 1. Taps [3, 4, 6] have no ids both rules agree on, so the target's architecture decides."""
    taps = [3, 4, 6]
    report, cfg, _ = exported(
        tmp_path, saved(target_dir, tmp_path, taps=tuple(taps), name="llama", arch=LLAMA), "sglang"
    )
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    assert report["captures"]["sglang-legacy"] == taps and report["captures"]["sglang"] == [2, 3, 5]
    assert report["sglang_rule"] == {"architecture": LLAMA, "convention": "sglang-legacy"}
    assert report["warnings"] == []
    report, cfg, _ = exported(
        tmp_path, saved(target_dir, tmp_path, taps=tuple(taps), name="ds", arch=DEEPSEEK), "sglang"
    )
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == taps
    assert report["captures"]["sglang"] == taps and report["sglang_rule"]["convention"] == "sglang"
    assert report["warnings"] == []
    # unknown target: the common +1-to-every-id rule, and a warning naming what a DeepSeek-family target reads
    report, cfg, _ = exported(
        tmp_path, saved(target_dir, tmp_path, taps=tuple(taps), name="unknown", arch=None), "sglang"
    )
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    assert len(report["warnings"]) == 1 and "DeepSeek" in report["warnings"][0] and "[2, 3, 5]" in report["warnings"][0]
    # an explicit legacy export is exact for the +1 rule
    _, cfg, _ = exported(tmp_path, saved(target_dir, tmp_path, taps=tuple(taps), name="src2"), "sglang-legacy")
    assert engine_capture(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], "sglang-legacy", L) == taps


def test_sglang_architectures_of_the_first_id_rule_are_the_deepseek_family():
    assert {DEEPSEEK, "DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration"} <= SGLANG_FIRST_ID_ONE_ARCHITECTURES
    assert not {LLAMA, "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"} & SGLANG_FIRST_ID_ONE_ARCHITECTURES


@pytest.mark.parametrize("engine", ["sglang", "sglang-legacy", "vllm"])
def test_default_taps_omit_the_ids(target_dir, tmp_path, engine):
    report, cfg, _ = exported(tmp_path, saved(target_dir, tmp_path), engine)
    assert "eagle_aux_hidden_state_layer_ids" not in cfg["eagle_config"]
    assert report["tap_ids_omitted"] and report["tap_ids"] is None
    for e, cap in report["captures"].items():
        assert cap == [2, L // 2, L - 3] == engine_capture(None, e, L)
    assert report["warnings"] == []


def test_embedding_tap_for_sglang_only_on_a_deepseek_family_target(target_dir, tmp_path):
    taps = [0, 3, L - 2]  # the Kimi-K2.5 shape: embedding output, a low and a high layer
    src = saved(target_dir, tmp_path, taps=tuple(taps), arch=DEEPSEEK)
    report, cfg, _ = exported(tmp_path, src, "sglang")
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert engine_capture(ids, "sglang", L) == taps and report["warnings"] == []
    with pytest.raises(EagleScopeError, match="embedding"):
        export_draft(load_draft(src), "sglang-legacy", tmp_path / "legacy")
    assert not (tmp_path / "legacy").exists()
    # a Llama target (or an unknown one, taken to add 1 to every id) cannot capture hs[0] in SGLang at all
    for arch in (LLAMA, None):
        other = saved(target_dir, tmp_path, taps=tuple(taps), name=f"src-{arch}", arch=arch)
        with pytest.raises(EagleScopeError, match="cannot be captured.*serve with vLLM"):
            export_draft(load_draft(other), "sglang", tmp_path / "no")
        assert not (tmp_path / "no").exists()
    _, cfg, _ = exported(tmp_path, src, "vllm")
    assert engine_capture(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], "vllm", L) == taps


def test_first_tap_one_cannot_be_expressed_for_a_deepseek_family_target(target_dir, tmp_path):
    src = saved(target_dir, tmp_path, taps=(1, 4, 6), arch=DEEPSEEK)
    with pytest.raises(EagleScopeError, match="cannot be captured"):
        export_draft(load_draft(src), "sglang", tmp_path / "out")
    # id 0 under the +1-to-every-id rule is hs[1]: a Llama target can
    report, cfg, _ = exported(tmp_path, saved(target_dir, tmp_path, taps=(1, 4, 6), name="llama", arch=LLAMA), "sglang")
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 5] and report["warnings"] == []


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_chosen_ids_make_the_engine_capture_the_taps(data):
    n = data.draw(st.integers(7, 96))
    k = data.draw(st.integers(1, 5))
    layers = tuple(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=k, max_size=k))))
    arch = data.draw(st.sampled_from([None, LLAMA, DEEPSEEK]))
    taps = TapContract(layers, n)
    for engine in ("vllm", "sglang", "sglang-legacy"):
        # the rule the ids must satisfy: SGLang's for this target's architecture (unknown: +1 to every id)
        rule = engine if engine != "sglang" else ("sglang" if arch == DEEPSEEK else "sglang-legacy")
        try:
            ids, warns = choose_engine_ids(taps, engine, arch)
        except EagleScopeError:
            # only what the rule truly cannot say is refused
            assert (rule == "sglang-legacy" and layers[0] == 0) or (rule == "sglang" and layers[0] == 1)
            continue
        assert engine_capture(ids, rule, n) == list(layers)
        assert (ids is None) == taps.is_default
        if engine == "sglang":
            both = engine_capture(ids, "sglang", n) == engine_capture(ids, "sglang-legacy", n)
            assert bool(warns) == (arch is None and not both)


def test_export_round_trips_to_identical_weights(target_dir, tmp_path):
    src = saved(target_dir, tmp_path, taps=(3, 4, 6))
    for engine in ("sglang", "vllm"):
        report, _, _ = exported(tmp_path, src, engine)
        a, b = load_draft(src), load_draft(report["out"])
        for k in WEIGHT_NAMES:
            assert torch.equal(a.model.state_dict()[k], b.model.state_dict()[k]), (engine, k)
        assert b.contract.taps == a.contract.taps and b.contract.target == a.contract.target
        assert not b.has_embedding


def test_bf16_export_halves_weights_but_keeps_the_map(target_dir, tmp_path):
    report, cfg, sd = exported(tmp_path, saved(target_dir, tmp_path), "sglang", dtype=torch.bfloat16)
    assert cfg["torch_dtype"] == "bfloat16" and sd["fc.weight"].dtype == torch.bfloat16
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool


def test_full_vocabulary_vllm_export_omits_the_identity_map(target_dir, tmp_path):
    """vLLM has no parameter to load d2t into when the vocabularies are equal; the map is the identity there, and
    eaglescope reads an export without one back as the identity."""
    model, contract = full_vocab_draft(target_dir)
    src = save_draft(model, contract, tmp_path / "full")
    assert model.config.draft_vocab_size == model.config.vocab_size
    report, _, sd = exported(tmp_path, src, "vllm")
    assert "d2t" not in sd and "t2d" not in sd
    back = load_draft(report["out"]).model
    assert torch.equal(back.d2t, torch.zeros_like(back.d2t)) and bool(back.t2d.all())


def test_embedding_only_from_the_real_target(target_dir, tmp_path):
    src = saved(target_dir, tmp_path)
    with pytest.raises(EagleScopeError, match="TorchSpec issue 38"):
        export_draft(load_draft(src), "vllm", tmp_path / "out", with_embedding=True)
    emb = load_target_embedding(target_dir)
    report, _, sd = exported(tmp_path, src, "vllm", with_embedding=True, target_embedding=emb)
    assert report["embedding_saved"] and torch.equal(sd["embed_tokens.weight"], emb)
    loaded = load_draft(report["out"])
    assert loaded.has_embedding and torch.equal(loaded.model.embed_tokens.weight, emb)
    d = describe_draft(loaded, target_embedding=emb)
    assert d["embedding"] == {"saved": True, "matches_target": True}


def test_describe_flags_a_random_saved_embedding(target_dir, tmp_path):
    src = saved(target_dir, tmp_path, save_embedding=True)  # make_draft's embedding is random
    d = describe_draft(load_draft(src), target_embedding=load_target_embedding(target_dir))
    assert d["embedding"]["matches_target"] is False
    assert any("TorchSpec issue 38" in w for w in d["warnings"])


# -- command line -----------------------------------------------------------------------------
INSPECT_KEYS = {
    "path",
    "architectures",
    "contract",
    "config",
    "embedding",
    "vocab_map",
    "config_tap_ids",
    "engines",
    "engine_options",
    "sglang_rule",
    "speculators",
    "target",
    "warnings",
    "format",  # which of the field's draft formats the files are (models/drafts/formats.py)
    "declared",  # per property: declared by the files, assumed or unknown, and the command that measures it
}


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_save_draft_leaves_default_taps_unwritten_so_every_engine_agrees(target_dir, tmp_path, capsys):
    src = saved(target_dir, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in cfg["eagle_config"]
    rc, out, _ = run_cli(capsys, ["inspect", str(src), "--json", "--target", str(target_dir)])
    d = json.loads(out)
    assert rc == 0 and all(e["matches_contract"] for e in d["engines"].values())
    assert not any(w.startswith("ENGINE_TAP_CONVENTION") for w in d["warnings"])


def test_inspect_json_keys_and_engine_captures(target_dir, tmp_path, capsys):
    # Explicit vLLM-style ids: correct for vLLM and for SGLang's first-id-1 rule, but SGLang adds 1 to every id for
    # this Llama target, so inspect must say so loudly.
    src = saved(target_dir, tmp_path, tap_ids=[2, 4, 5])
    rc, out, _ = run_cli(capsys, ["inspect", str(src), "--json", "--target", str(target_dir)])
    assert rc == 0
    d = json.loads(out)
    assert set(d) == INSPECT_KEYS
    assert set(d["contract"]) >= {"taps", "tap_names", "num_layers", "inferred", "target", "ttt_length"}
    assert set(d["config"]) >= {"hidden_size", "num_heads", "draft_vocab_size", "vocab_size", "num_aux"}
    assert d["contract"]["taps"] == [2, 4, 5] and not d["contract"]["inferred"]
    assert d["vocab_map"]["ok"] and not d["vocab_map"]["first_ids_only"]
    assert d["target"]["matches"] is True
    assert d["engines"]["vllm"]["matches_contract"] and d["engines"]["sglang"]["matches_contract"]
    assert d["engines"]["sglang-legacy"] == {
        "captures": [3, 5, 6],
        "captures_names": [
            "input of layer 3 (output of layer 2)",
            "input of layer 5 (output of layer 4)",
            "input of layer 6 (output of layer 5)",
        ],
        "matches_contract": False,
        "applies_to_target": True,  # a Llama target: SGLang 0.5.23 adds 1 to every id
    }
    assert d["engines"]["sglang"]["applies_to_target"] is False
    assert any(w.startswith("ENGINE_TAP_CONVENTION: sglang-legacy") for w in d["warnings"])
    rc, out, _ = run_cli(capsys, ["inspect", str(src)])
    assert rc == 0 and "sglang-legacy  captures [3, 5, 6]  MISMATCH" in out and "WARNING: ENGINE_TAP" in out


def test_inspect_official_checkpoint_needs_target_then_infers(target_dir, tmp_path, capsys):
    model, _ = make_draft(target_dir)
    ids = [1, L // 2 - 1, L - 4]  # SpecForge's ids for the default taps
    ckpt = write_raw(tmp_path / "specforge", model.config.to_hf_config(ids), official_state(model))
    rc, _, err = run_cli(capsys, ["inspect", str(ckpt)])
    assert rc == 2 and "pass --target" in err and len(err.strip().splitlines()) == 1
    rc, out, _ = run_cli(capsys, ["inspect", str(ckpt), "--json", "--target", str(target_dir)])
    d = json.loads(out)
    assert rc == 0 and d["contract"]["inferred"] and d["contract"]["taps"] == [2, 4, 5]
    # newer SGLang (first id 1 → +1) and legacy SGLang read these ids right; vLLM takes them as-is
    assert d["engines"]["sglang"]["matches_contract"] and d["engines"]["sglang-legacy"]["matches_contract"]
    assert d["engines"]["vllm"]["captures"] == ids and not d["engines"]["vllm"]["matches_contract"]
    assert any("inferred" in w for w in d["warnings"])


def test_describe_warns_about_a_lost_vocab_map(target_dir, tmp_path):
    model, contract = make_draft(target_dir)
    d2t = torch.zeros_like(model.d2t)
    t2d = torch.zeros_like(model.t2d)
    t2d[: d2t.numel()] = True
    model.set_vocab_map(d2t, t2d)  # "first N target ids": valid, but the classic lost-map symptom
    d = describe_draft(load_draft(save_draft(model, contract, tmp_path / "d")))
    assert d["vocab_map"]["first_ids_only"] and any("NeMo PR 2447" in w for w in d["warnings"])


def test_export_cli_reports_and_replaces_only_its_own_output(target_dir, tmp_path, capsys):
    src = saved(target_dir, tmp_path, taps=(0, 3, 6), arch=DEEPSEEK)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    rc, _, err = run_cli(capsys, ["export", "--draft", str(src), "--to", "sglang", "--out", str(out)])
    assert rc == 2 and "notes.txt" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "the user's"
    (out / "notes.txt").unlink()
    rc, text, _ = run_cli(capsys, ["export", "--draft", str(src), "--to", "sglang", "--out", str(out)])
    assert rc == 0
    assert (
        "sglang (+1 only when the first id is 1 (DeepSeek-V2/V3-family targets): this target) will capture "
        "[0, 3, 6] = trained taps: embedding output" in text
    )
    assert "sglang-legacy (+1 to every id (Llama, Qwen, Mistral and most other targets)) will capture [1, 4, 7]" in text
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    rc, _, err = run_cli(capsys, ["export", "--draft", str(src), "--to", "sglang-legacy", "--out", str(out)])
    assert rc == 2 and "embedding" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # previous export intact
    rc, _, _ = run_cli(capsys, ["export", "--draft", str(src), "--to", "vllm", "--out", str(out)])
    assert rc == 0 and json.loads((out / "config.json").read_text())["eaglescope"]["exported_for"] == "vllm"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left beside it


def test_export_cli_refuses_a_draft_for_another_target(target_dir, tmp_path, capsys):
    other = make_checkpoint("llama", tmp_path / "other", vocab_size=100)
    src = saved(target_dir, tmp_path)
    argv = ["export", "--draft", str(src), "--to", "vllm", "--out", str(tmp_path / "o"), "--target", str(other)]
    rc, _, err = run_cli(capsys, argv)
    assert rc == 2 and "vocab_size=96" in err and not (tmp_path / "o").exists()


def test_export_cli_with_embedding(target_dir, tmp_path, capsys):
    src = saved(target_dir, tmp_path)
    base = ["export", "--draft", str(src), "--to", "vllm", "--out", str(tmp_path / "o"), "--with-embedding"]
    rc, _, err = run_cli(capsys, base)
    assert rc == 2 and "pass --target" in err
    rc, out, _ = run_cli(capsys, base + ["--target", str(target_dir), "--json"])
    assert rc == 0 and json.loads(out)["embedding_saved"] is True


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{missing}"],
        ["export", "--draft", "{missing}", "--to", "vllm", "--out", "{tmp}/o"],
        ["inspect", "{tmp}", "--target", "{missing}"],
    ],
)
def test_cli_missing_directory_is_one_line(tmp_path, capsys, argv):
    argv = [a.format(missing=tmp_path / "nope", tmp=tmp_path) for a in argv]
    rc, out, err = run_cli(capsys, argv)
    assert rc == 2 and out == ""
    assert err.startswith("eaglescope: error:") and "does not exist" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# -- inspect warns about what each engine will do ---------------------------------------------------
def warned(d: dict, code: str) -> list[str]:
    return [w for w in d["warnings"] if w.startswith(code)]


def test_inspect_says_what_each_engine_does_with_a_full_vocabulary_map(target_dir, tmp_path):
    model, contract = full_vocab_draft(target_dir)
    src = save_draft(model, contract, tmp_path / "full")  # a trained draft keeps its (identity) d2t/t2d
    d = describe_draft(load_draft(src))
    assert d["vocab_map"]["identity"] and d["vocab_map"]["saved"]
    assert d["vocab_map"]["engines"]["vllm"].startswith("FAILS TO LOAD")
    assert "identity" in d["vocab_map"]["engines"]["sglang"]
    assert len(warned(d, "VOCAB_MAP_FULL")) == 1 and "--to vllm" in warned(d, "VOCAB_MAP_FULL")[0]
    # the vLLM export leaves the map out, and inspect then has nothing to warn about
    report, _, _ = exported(tmp_path, src, "vllm")
    d = describe_draft(load_draft(report["out"]))
    assert not d["vocab_map"]["saved"] and not warned(d, "VOCAB_MAP_FULL")
    assert d["vocab_map"]["engines"]["vllm"] == "no map at full vocabulary: draft ids are target ids"
    assert d["vocab_map"]["engines"]["sglang"] == "no hot_token_id: draft ids are target ids"
    # a reduced vocabulary: every engine reads d2t as offsets
    d = describe_draft(load_draft(saved(target_dir, tmp_path)))
    assert not d["vocab_map"]["identity"] and "i + d2t[i]" in d["vocab_map"]["engines"]["vllm"]
    assert not warned(d, "VOCAB_MAP_FULL")


def test_inspect_warns_that_speculators_needs_the_embedding(target_dir, tmp_path):
    src = saved(target_dir, tmp_path)
    d = describe_draft(load_draft(src))
    assert not d["embedding"]["saved"] and not d["speculators"]["embedding_saved"]
    (w,) = warned(d, "SPECULATORS: no embedding saved")
    assert "--with-embedding --target" in w and "uninitialised" in w
    report, _, _ = exported(
        tmp_path, src, "vllm", with_embedding=True, target_embedding=load_target_embedding(target_dir)
    )
    d = describe_draft(load_draft(report["out"]), target_embedding=load_target_embedding(target_dir))
    assert d["speculators"]["embedding_saved"] and d["speculators"]["problems"] == []
    assert not warned(d, "SPECULATORS")  # default taps, the target's embedding: nothing to say


def test_inspect_warns_that_speculators_ignores_non_default_tap_ids(target_dir, tmp_path):
    d = describe_draft(load_draft(saved(target_dir, tmp_path, taps=(0, 3, 6))))
    assert d["speculators"]["plain_convert_captures"] == [2, 4, 5] and not d["speculators"]["plain_convert_keeps_taps"]
    assert d["speculators"]["algorithm_kwargs"] == {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}
    (w,) = warned(d, "SPECULATORS_TAPS")
    assert "[2, 4, 5] instead of [0, 3, 6]" in w and '{"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}' in w
    d = describe_draft(load_draft(saved(target_dir, tmp_path, name="default")))
    assert d["speculators"]["plain_convert_keeps_taps"] and not warned(d, "SPECULATORS_TAPS")


def test_inspect_warns_about_taps_an_engine_cannot_express(target_dir, tmp_path):
    # hs[0] with vLLM ids on a Llama target: SGLang (+1 to every id) can never reach the embedding output
    d = describe_draft(load_draft(saved(target_dir, tmp_path, taps=(0, 3, 6))))
    assert d["engines"]["sglang-legacy"]["applies_to_target"] is True
    assert d["engines"]["sglang"]["applies_to_target"] is False
    (w,) = warned(d, "ENGINE_TAP_CONVENTION")
    assert w.startswith("ENGINE_TAP_CONVENTION: sglang-legacy will capture [1, 4, 7]") and "cannot capture" in w
    # first tap hs[1] on a DeepSeek-family target: its first-id-1 rule cannot say it
    src = saved(target_dir, tmp_path, taps=(1, 4, 6), name="ds", arch=DEEPSEEK)
    d = describe_draft(load_draft(src))
    assert d["sglang_rule"] == {"architecture": DEEPSEEK, "convention": "sglang"}
    (w,) = warned(d, "ENGINE_TAP_CONVENTION")
    assert w.startswith("ENGINE_TAP_CONVENTION: sglang will capture") and "cannot capture these taps" in w
    # unknown target architecture: both SGLang rows may apply, and the fix asks for the target
    d = describe_draft(load_draft(saved(target_dir, tmp_path, taps=(3, 4, 6), name="unknown", arch=None)))
    assert d["engines"]["sglang"]["applies_to_target"] is None
    assert any("--target TARGET" in w for w in warned(d, "ENGINE_TAP_CONVENTION"))


def test_inspect_and_export_refuse_silent_norm_before_residual_for_sglang(target_dir, tmp_path):
    model, contract = make_draft(target_dir)
    model.config.norm_before_residual = True
    src = save_draft(model, contract, tmp_path / "nbr")
    loaded = load_draft(src)
    assert loaded.model.config.norm_before_residual
    d = describe_draft(loaded)
    assert warned(d, "norm_before_residual: SGLang 0.5.23 ignores it")
    assert d["speculators"]["algorithm_kwargs"]["norm_before_residual"] is True
    with pytest.raises(EagleScopeError, match="norm_before_residual"):
        export_draft(loaded, "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_saved_embedding_that_differs_is_flagged_for_vllm_and_speculators(target_dir, tmp_path):
    src = saved(target_dir, tmp_path, save_embedding=True)  # make_draft's embedding is random
    d = describe_draft(load_draft(src), target_embedding=load_target_embedding(target_dir))
    (w,) = [w for w in d["warnings"] if "differs from the target's" in w]
    assert "vLLM and speculators use a saved embedding" in w and "SGLang replaces it" in w


def test_export_report_prints_the_speculators_command_that_keeps_the_taps(target_dir, tmp_path, capsys):
    src = saved(target_dir, tmp_path, taps=(0, 3, 6))
    out = tmp_path / "exp"
    argv = ["export", "--draft", str(src), "--to", "vllm", "--out", str(out), "--target", str(target_dir)]
    rc, text, err = run_cli(capsys, argv + ["--json"])
    assert rc == 0, err
    sp = json.loads(text)["speculators"]
    assert sp["argv"] == [
        "speculators",
        "convert",
        str(out.resolve()),
        "--algorithm",
        "eagle3",
        "--verifier",
        str(target_dir.resolve()),
        "--output-path",
        str(out.resolve()) + "-speculators",
        "--algorithm-kwargs",
        '{"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}',
    ]
    assert not sp["ready"] and "--with-embedding" in sp["problems"][0]
    rc, text, _ = run_cli(capsys, argv + ["--with-embedding"])
    assert rc == 0
    assert f"speculators 0.9.0 (keeps the taps): speculators convert {out.resolve()} --algorithm eagle3" in text
    assert "--algorithm-kwargs '{\"eagle_aux_hidden_state_layer_ids\": [0, 3, 6]}'" in text
    assert "not ready for speculators" not in text
    # without --target the command has a placeholder and says so
    rc, text, _ = run_cli(capsys, argv[:-2] + ["--json"])
    sp = json.loads(text)["speculators"]
    assert sp["argv"][6] == "TARGET" and any("--target" in p for p in sp["problems"])


def test_inspect_and_export_know_what_each_engine_does_with_eagle31_and_mla(tmp_path):
    """A 3.1 MLA draft with norm_before_fc: vLLM 0.32's DeepSeek EAGLE-3 model has no input_norm, so it would ignore
    the norm; inspect says so, and export refuses to write a checkpoint vLLM would serve wrongly."""
    ds = make_checkpoint("deepseek_v3", tmp_path / "ds")
    model, contract = full_vocab_draft(ds, draft_vocab_size=48, arch="mla", norm_before_fc=True, norm_output=True)
    src = save_draft(model, contract, tmp_path / "mla31")
    d = describe_draft(load_draft(src))
    assert d["config"]["draft_arch"] == "mla" and d["config"]["eagle31"]["norm_before_fc"]
    assert d["engine_options"]["vllm"]["ignores"] == ["norm_before_fc"]
    assert not d["engine_options"]["speculators"]["serves"]
    assert any(w.startswith("EAGLE31: vllm ignores") for w in d["warnings"])
    with pytest.raises(EagleScopeError, match="vllm would ignore the draft's norm_before_fc"):
        export_draft(load_draft(src), "vllm", tmp_path / "out")
    # without that one option vLLM serves it: the export names the MLA architecture and vLLM's weight names
    model, contract = full_vocab_draft(ds, draft_vocab_size=48, arch="mla", fc_norm=True, norm_output=True)
    report = export_draft(load_draft(save_draft(model, contract, tmp_path / "mla")), "vllm", tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and (cfg["model_type"], cfg["n_routed_experts"]) == (
        "deepseek_v2",
        0,
    )
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["kv_lora_rank"] == 16
    assert {"fc_norm.0.weight", "midlayer.self_attn.kv_a_proj_with_mqa.weight"} <= set(report["weights"])
    back = load_draft(tmp_path / "out").model
    assert back.config.arch == "mla" and back.config.fc_norm and back.config.norm_output
