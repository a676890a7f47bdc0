"""The training half on a GPU, through the command line: prepare (regenerated answers and stored hidden states),
train a few steps (online and on the stored states), export for vLLM and SGLang, decode with the trained draft, and
doctor --data (teacher-forced and served acceptance on the GPU)."""

from __future__ import annotations

import json

import pytest
from badinput_fixtures import conversations, write_jsonl
from models import make_checkpoint
from safetensors import safe_open
from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir

STEPS = 4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-training")
    tok = load(make_tokenizer_dir(root / "tokenizer", LLAMA3, vocab_size=300))
    target = make_checkpoint("llama", root / "target", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                             bos_token_id=tok.bos_token_id)  # fmt: skip
    tok.save_pretrained(target)
    return root, target, write_jsonl(root / "data.jsonl", conversations(24))


@pytest.fixture(scope="module")
def prepared(work, run_cli):
    root, target, data = work
    out = {}
    for name, extra in (("online", []), ("stored", ["--hidden-states"])):
        out[name] = root / f"prep-{name}"
        argv = ["--regenerate", "--regen-max-new-tokens", 24, "--max-length", 96, "--draft-vocab-size", 64, *extra]
        assert run_cli("prepare", "--target", target, "--data", data, "--out", out[name], *argv) == 0
    return out


@pytest.fixture(scope="module")
def trained(work, prepared, run_cli):
    root, target, _ = work
    out = {}
    for name, prep in prepared.items():
        out[name] = root / f"draft-{name}"
        assert run_cli("train", "--target", target, "--data", prep, "--out", out[name], "--max-steps", STEPS,
                       "--batch-size", 4, "--max-length", 96, "--eval-fraction", 0.25) == 0  # fmt: skip
    return out


@pytest.mark.parametrize("name", ["online", "stored"])
def test_train_writes_a_draft_checkpoint_on_the_gpu(trained, name):
    draft = trained[name]
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        assert {"fc.weight", "d2t", "t2d", "lm_head.weight"} <= set(f.keys())
    assert json.loads((draft / "training_state" / "state.json").read_text())["step"] == STEPS
    metrics = json.loads((draft / "training_metrics.json").read_text())
    assert metrics["ttt_length"] == 7


def test_inspect_export_and_decode_with_the_trained_draft(cli, work, trained, tmp_path):
    root, target, _ = work
    draft = trained["stored"]
    rc, info, err = cli("inspect", draft, "--target", target, "--json")
    assert rc == 0, err
    for engine in ("vllm", "sglang"):
        rc, report, err = cli("export", "--draft", draft, "--to", engine, "--out", tmp_path / engine, "--json")
        assert rc == 0, err
        assert (tmp_path / engine / "config.json").is_file() and (tmp_path / engine / "model.safetensors").is_file()
    ids = "1,2,3,4,5,6"
    rc, vanilla, err = cli("generate", "--target", target, "--prompt-ids", ids, "--max-new-tokens", 16, "--json")
    assert rc == 0, err
    for shape in (["--chain", "3"], ["--tree", "3,2,6"]):
        rc, spec, err = cli("generate", "--target", target, "--draft", tmp_path / "vllm", "--prompt-ids", ids,
                            "--max-new-tokens", 16, "--json", *shape)  # fmt: skip
        assert rc == 0, err
        assert spec["token_ids"] == vanilla["token_ids"]


def test_doctor_with_data_measures_acceptance_on_the_gpu(cli, work, trained):
    root, target, data = work
    rc, report, err = cli("doctor", "--target", target, "--draft", trained["online"], "--data", data, "--json",
                          "--prompts", 2, "--max-new-tokens", 12, "--eval-samples", 8)  # fmt: skip
    assert rc in (0, 1), err
    acc = report["context"]["acceptance"]
    assert acc["predicted"] is not None and acc["served"] is not None, acc
    assert len(acc["predicted"]["alpha"]) >= 1
