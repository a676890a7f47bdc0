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
from eaglescope.draft import WEIGHT_NAMES, load_draft, save_draft
from eaglescope.errors import EagleScopeError
from eaglescope.export import choose_engine_ids, describe_draft, export_draft, load_target_embedding
from eaglescope.taps import TapContract, engine_capture

# config.json keys of FIELD.md §2, plus the few every HF Llama config carries and our own section.
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


def saved(target_dir: Path, tmp_path: Path, taps=None, name="src", **kw) -> Path:
    model, contract = make_draft(target_dir, taps=taps)
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


def test_sglang_export_works_for_newer_and_legacy_when_possible(target_dir, tmp_path):
    taps = [2, 3, 6]  # first tap 2: ids [1, 2, 5] mean the same to both SGLang versions
    report, cfg, sd = exported(tmp_path, saved(target_dir, tmp_path, taps=tuple(taps)), "sglang")
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [1, 2, 5]
    assert engine_capture(ids, "sglang", L) == taps
    assert engine_capture(ids, "sglang-legacy", L) == taps
    assert report["captures"] == {"sglang": taps, "sglang-legacy": taps} and report["warnings"] == []
    assert set(sd) == set(WEIGHT_NAMES)


def test_sglang_export_prefers_newer_sglang_and_warns_about_legacy(target_dir, tmp_path):
    taps = [3, 4, 6]
    report, cfg, _ = exported(tmp_path, saved(target_dir, tmp_path, taps=tuple(taps)), "sglang")
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert engine_capture(ids, "sglang", L) == taps
    assert report["captures"]["sglang-legacy"] == [4, 5, 7]
    assert len(report["warnings"]) == 1 and "legacy SGLang" in report["warnings"][0]
    # an explicit legacy export is exact for legacy SGLang
    _, cfg, _ = exported(tmp_path, saved(target_dir, tmp_path, taps=tuple(taps), name="src2"), "sglang-legacy")
    assert engine_capture(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], "sglang-legacy", L) == taps


@pytest.mark.parametrize("engine", ["sglang", "sglang-legacy", "vllm"])
def test_default_taps_omit_the_ids(target_dir, tmp_path, engine):
    report, cfg, _ = exported(tmp_path, saved(target_dir, tmp_path), engine)
    assert "eagle_aux_hidden_state_layer_ids" not in cfg["eagle_config"]
    assert report["tap_ids_omitted"] and report["tap_ids"] is None
    for e, cap in report["captures"].items():
        assert cap == [2, L // 2, L - 3] == engine_capture(None, e, L)
    assert report["warnings"] == []


def test_embedding_tap_for_sglang_newer_ok_legacy_refused(target_dir, tmp_path):
    taps = [0, 3, L - 2]  # the Kimi-K2.5 shape: embedding output, a low and a high layer
    src = saved(target_dir, tmp_path, taps=tuple(taps))
    report, cfg, _ = exported(tmp_path, src, "sglang")
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert engine_capture(ids, "sglang", L) == taps
    assert "cannot capture the embedding" in report["warnings"][0]
    with pytest.raises(EagleScopeError, match="embedding"):
        export_draft(load_draft(src), "sglang-legacy", tmp_path / "legacy")
    assert not (tmp_path / "legacy").exists()
    _, cfg, _ = exported(tmp_path, src, "vllm")
    assert engine_capture(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], "vllm", L) == taps


def test_first_tap_one_cannot_be_expressed_for_newer_sglang(target_dir, tmp_path):
    src = saved(target_dir, tmp_path, taps=(1, 4, 6))
    with pytest.raises(EagleScopeError, match="cannot be expressed"):
        export_draft(load_draft(src), "sglang", tmp_path / "out")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_chosen_ids_make_the_engine_capture_the_taps(data):
    n = data.draw(st.integers(7, 96))
    k = data.draw(st.integers(1, 5))
    layers = tuple(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=k, max_size=k))))
    taps = TapContract(layers, n)
    for engine in ("vllm", "sglang", "sglang-legacy"):
        try:
            ids, warns = choose_engine_ids(taps, engine)
        except EagleScopeError:
            # only what the engine's convention truly cannot say is refused
            assert (engine == "sglang-legacy" and layers[0] == 0) or (engine == "sglang" and layers[0] == 1)
            continue
        assert engine_capture(ids, engine, n) == list(layers)
        assert (ids is None) == taps.is_default
        if engine == "sglang":
            assert (engine_capture(ids, "sglang-legacy", n) == list(layers)) == (not warns)


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
    "target",
    "warnings",
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
    # Explicit vLLM-style ids: correct for vLLM and newer SGLang, but legacy SGLang adds 1 to each, so
    # inspect must say so loudly.
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
    }
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
    src = saved(target_dir, tmp_path, taps=(0, 3, 6))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    rc, _, err = run_cli(capsys, ["export", "--draft", str(src), "--to", "sglang", "--out", str(out)])
    assert rc == 2 and "notes.txt" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "the user's"
    (out / "notes.txt").unlink()
    rc, text, _ = run_cli(capsys, ["export", "--draft", str(src), "--to", "sglang", "--out", str(out)])
    assert rc == 0
    assert "sglang will capture [0, 3, 6] = trained taps: embedding output" in text
    assert "sglang-legacy will capture [1, 4, 7]" in text and "WARNING" in text
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
