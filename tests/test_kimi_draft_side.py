"""doctor at the seed's shape without the target's layers: bench/kimi_draft_side.py's case, with fewer embedding rows.

A Kimi-K2.5-shaped target (hidden 7168, 61 layers, DeepSeek-V3 architecture keys, MLA and MoE settings) of which only
config.json, a tokenizer and the embedding and lm_head shards exist, an MLA draft, and traces written by the bench's
synthetic engine, its faults made in that engine's proposer hooks (the bench script's docstring says how, and how
independent that is). The full shape (163,840 rows, the draft's 18,432-wide MLP) is the script's, with its measured
time and memory committed under bench/results/; here the vocabulary is 4096 rows and the draft's MLP 1024 wide, so the
case fits the test suite's time.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from eaglescope.detective.doctor import run_doctor
from eaglescope.detective.draft_replay import DRAFT_SIDE

BENCH = Path(__file__).parents[1] / "bench" / "kimi_draft_side.py"


def _bench():
    spec = importlib.util.spec_from_file_location("kimi_draft_side", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kimi_draft_side"] = mod
    spec.loader.exec_module(mod)
    return mod


kimi = _bench()
CFG = {**kimi.KIMI, "vocab_size": 4096, "intermediate_size": 1024}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    target = kimi.build_target(root / "target", CFG)
    draft = kimi.build_draft(root / "draft", CFG, draft_vocab=1024)
    return target, draft, kimi.write_traces(target, draft, root / "traces", kimi.CASES)


def test_the_target_has_no_layer_and_the_seeds_shape(case):
    target, draft, _ = case
    cfg = json.loads((target / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["architectures"]) == (7168, 61, ["DeepseekV3ForCausalLM"])
    names = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(names) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert (target / "tokenizer.json").is_file()
    dcfg = json.loads((draft / "config.json").read_text())
    assert dcfg["kv_lora_rank"] == 512 and dcfg["eaglescope"]["taps"]["layers"] == list(kimi.TAPS)


@pytest.mark.parametrize("name", list(kimi.CASES))
def test_draft_side_doctor_names_each_fault(case, name):
    target, draft, traces = case
    trace, expected = traces[name]
    report = run_doctor(target, draft, trace=trace, device="cpu", dtype="bfloat16")
    assert report.context["replay"]["mode"] == DRAFT_SIDE and report.context["replay"]["layers_on_disk"] == 0
    got = "healthy" if report.healthy else (lambda f: f"{f.code}@{f.stage} r{f.round}")(report.findings[0])
    assert got == expected, [f.verdict for f in report.findings[:1]]
    if not report.healthy:
        assert report.findings[0].evidence["clean_score"] > 1.0 >= report.findings[0].evidence["score"]
