"""`eaglescope prepare --engine sglang` on a real SGLang 0.5.23: the tap states and final state SGLang computes in its
own prefill (its EAGLE-3 capture on the target, read by eaglescope's capture plugin in SGLang's scheduler) equal
eaglescope's in-process features sample by sample (float32; SGLang's final state is after the final norm, as training
wants it); drafts trained from each reach the same held-out acc_k and are served by SGLang with the same acceptance;
and each capture-contract mismatch made on purpose, in SGLang's own arguments or in SGLang's own code (a private copy
of it, patched: tests/sglang/sglang_faults.py), is refused with one line.

The target, conversations and training settings are tests/vllm/test_vllm_features.py's (a tiny Llama trained on an
order-2 Markov chain, 8 layers; taps [2, 4, 6], asked of SGLang as ids [1, 3, 5], which llama.py reads as "output of
layer i"), and the tiny DeepSeek-V3 target (deepseek_v2.py's rule, latent attention). SGLang's own Python runs; its CPU
kernels are this project's plain-torch stand-ins (tests/sglang/stand_ins), on the `intel_amx` attention path the drafts
are served on (amx_python.py keeps it on this CPU without AMX).
The main preparation runs with SGLang's prefill chunked at 16 tokens (prompts up to 41), so the equality also proves
the chunks are joined right; the mismatch runs use SGLang's default chunk size.
"""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from models import fit_checkpoint, make_checkpoint
from sglang_faults import Fault, _p, private_sglang
from sglang_support import HERE, sglang_env

from eaglescope.data.shards import PreparedData

sys.path.insert(0, str(HERE.parent / "vllm"))  # tests/vllm's target, conversations and helpers are reused as they are
from test_vllm_features import (  # noqa: E402
    N_CONV,
    TOL,
    _other_template_tokenizer,
    conversations,
    drafts_agree,
    feature_table,
    prepare_argv,
    write_feature_table,
)
from test_vllm_serving import base, cli, order2_chain  # noqa: E402

RUNNER = HERE / "sglang_runner.py"
K = 3  # the drafts' TTT length and the chain SGLang serves
# SGLang's engine arguments on this CPU: its memory profiling is fooled by the other processes of a shared machine (a
# generous fraction, the KV pool capped at what the tests need); one greedy token per prompt needs no more.
# The attention backend the drafts are served on (amx_python.py keeps it on this CPU).
ENGINE_ARGS = {"device": "cpu", "attention_backend": "intel_amx", "mem_fraction_static": 0.5, "max_total_tokens": 8192,
               "log_level": "info"}  # fmt: skip
CHUNK = 16  # the main preparation's prefill chunk (tokens)
SWITCH = "EAGLESCOPE_SGLANG_FAULT_FILE"
# The final state handed on before the final norm: llama.py's final norm computed, the residual stream it normed kept
# (`final_norm`'s capture callback receives that sum) — vLLM's convention in SGLang's place.
PRE_NORM = Fault(
    "the target model hands on its final state before the final norm (llama.py LlamaModel.forward)",
    (
        _p(
            "srt/models/llama.py",
            """\
            hidden_states = residual_batch.final_norm(
                hidden_states, forward_batch, self.norm
            )
            """,
            """\
            _pre_norm = []
            residual_batch.final_norm(
                hidden_states, forward_batch, self.norm, capture=lambda r: _pre_norm.append(r.clone())
            )
            hidden_states = _pre_norm[0]
            """,
        ),
    ),
)


def engine_python(root: Path, python: str) -> str:
    """SGLang's interpreter running the worker through amx_python.py."""
    path = root / "sglang-python"
    path.write_text(f'#!/bin/sh\nexec "{python}" "{HERE / "amx_python.py"}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def engine_argv(python: str, engine_args: dict | None = None) -> list[str]:
    return ["--engine", "sglang", "--engine-python", python, "--engine-args",
            json.dumps({**ENGINE_ARGS, **(engine_args or {})})]  # fmt: skip


def sglang_environ(*front: Path) -> dict[str, str]:
    """What SGLang's interpreter needs in this process's environment (the worker inherits it): the stand-ins, offline,
    one thread; `front` first on the path (a private copy of SGLang)."""
    env = sglang_env()
    keep = ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DO_NOT_TRACK", "SGLANG_USE_CPU_ENGINE",
            "OMP_NUM_THREADS", "TORCH_COMPILE_DISABLE")  # fmt: skip
    out = {k: env[k] for k in keep}
    if front:
        out["PYTHONPATH"] = os.pathsep.join([*map(str, front), out["PYTHONPATH"]])
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, sglang_python: str) -> dict:
    root = tmp_path_factory.mktemp("sglang-features")
    b = base(tmp_path_factory)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(b["rng"], b["perm"], N_CONV)))
    inproc, engine = root / "prep-inproc", root / "prep-sglang"
    rc, _, err = cli(prepare_argv(b["target"], data, inproc, "--hidden-states"))
    assert rc == 0, err
    python = engine_python(root, sglang_python)
    t = time.perf_counter()
    with mock.patch.dict(os.environ, sglang_environ()):
        argv = engine_argv(python, {"chunked_prefill_size": CHUNK})
        rc, out, err = cli(prepare_argv(b["target"], data, engine, *argv))
    assert rc == 0, err
    sys.stderr.write(f"prepare --engine sglang: {time.perf_counter() - t:.1f} s\n")
    return {"root": root, "base": b, "data": data, "inproc": inproc, "sglang": engine, "sglang_python": sglang_python,
            "python": python}  # fmt: skip


def test_sglang_features_equal_in_process_features_per_sample(prepared):
    a, b = PreparedData.open(prepared["inproc"]), PreparedData.open(prepared["sglang"])
    assert len(a) == len(b) == N_CONV
    assert a.taps == b.taps and list(a.taps.layers) == [2, 4, 6]
    # the same contract record as an in-process preparation, plus how the features were made
    ma, mb = a.manifest, b.manifest
    for key in ("taps", "target", "chat_template_sha256", "aux_width", "num_tokens", "num_supervised_tokens"):
        assert ma[key] == mb[key], key
    feats = mb["features"]
    assert feats["source"] == "sglang" and feats["engine"]["captured_layer_ids"] == [2, 4, 6]
    # amx_python.py kept SGLang on intel_amx (a silent fallback to torch_native once went unnoticed here)
    assert feats["engine"]["attention_backend"] == "intel_amx"
    assert feats["engine"]["layer_ids"] == [1, 3, 5]  # llama.py reads id i as "output of layer i": hs[i + 1]
    assert feats["final_hidden"] == "post-norm, as the engine hands it on"
    rows = feature_table(a, b)
    write_feature_table(rows, prepared["root"] / "table.md")
    assert max(r["tokens"] for r in rows) > CHUNK  # prompts SGLang prefilled in more than one chunk
    worst = max(max(r["aux"], r["final"]) / r["scale"] for r in rows)
    assert worst < TOL, f"SGLang's features differ from in-process ones by {worst:.2e} (relative); table above"


def _served_tau(python: str, target: Path, drafts: dict[str, Path], prompts: list[list[int]], root: Path) -> dict:
    """Every draft served by SGLang (EAGLE-3 chain of K, greedy) in one runner process: τ per draft, bonus included,
    from SGLang's per-request histogram of drafts accepted per verify round."""
    spec = {"prompts": prompts, "max_tokens": 32, "num_steps": K, "complete": True,
            "runs": [{"name": n, "target": str(target), "draft": str(d)} for n, d in drafts.items()]}  # fmt: skip
    (root / "serve.json").write_text(json.dumps(spec))
    out = root / "served.json"
    with (root / "serve.log").open("w") as f:
        rc = subprocess.run([python, str(RUNNER), str(root / "serve.json"), str(out)], stdout=f,
                            stderr=subprocess.STDOUT, env=sglang_env(), timeout=900).returncode  # fmt: skip
    assert rc == 0, (root / "serve.log").read_text()[-3000:]
    runs = json.loads(out.read_text())["runs"]
    taus = {}
    for name in drafts:
        assert runs[name]["error"] is None, runs[name].get("traceback") or runs[name]["error"]
        hist = [sum(h) for h in zip(*(m["spec_correct_drafts_histogram"] for m in runs[name]["meta"]), strict=False)]
        taus[name] = sum((k + 1) * n for k, n in enumerate(hist)) / sum(hist)
    return taus


def test_drafts_trained_from_sglang_and_in_process_features_agree(prepared):
    drafts_agree(prepared, "sglang", "SGLang", prepared["sglang_python"], _served_tau)


# -- mismatches made on purpose ----------------------------------------------------------------------------------------
# fault → the phrase its one line says
FAULTS = {
    # the user's own SGLang arguments with the ids in vLLM's convention ("state entering layer i"): llama.py adds 1
    "ids-one-off": "the engine captures hs[3, 5, 7] (SGLang ids [2, 4, 6]), the taps asked are hs[2, 4, 6]",
    # SGLang's model patched to hand on the final state before the final norm (vLLM's convention)
    "pre-norm-final": "the engine's final state is not the final norm's output",
    # SGLang serving the target's tokenizer under another chat template (its tokenizer_path)
    "other-template": "the engine processed other token ids than eaglescope's rendering",
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_contract_mismatch_is_refused_with_one_line(prepared, fault, tmp_path):
    target, python = prepared["base"]["target"], prepared["python"]
    env = sglang_environ()
    engine_args: dict = {}
    if fault == "ids-one-off":
        engine_args["return_aux_hidden_state_layer_ids"] = [2, 4, 6]
    if fault == "other-template":
        engine_args["tokenizer_path"] = str(_other_template_tokenizer(tmp_path, target))
    if fault == "pre-norm-final":
        from test_sglang_code_faults import installed_package

        private_sglang(tmp_path / "shadow", installed_package(prepared["sglang_python"]), {fault: PRE_NORM})
        (tmp_path / "switch").write_text(fault)
        env = sglang_environ(tmp_path / "shadow") | {SWITCH: str(tmp_path / "switch")}
    with mock.patch.dict(os.environ, env):
        rc, out, err = cli(prepare_argv(target, prepared["data"], tmp_path / "prep", "--limit", "4",
                                        *engine_argv(python, engine_args)))  # fmt: skip
    assert rc == 2, err
    errors = [ln for ln in err.splitlines() if ln.startswith("eaglescope: error:")]
    assert len(errors) == 1 and FAULTS[fault] in errors[0], err
    assert not [ln for ln in err.splitlines() if "capture contract" in ln and ln not in errors], err
    assert not (tmp_path / "prep").exists()  # nothing written where the preparation would go
    sys.stderr.write(f"{fault}: {errors[0]}\n")


def test_the_tap_states_are_the_engines_own_and_not_copies(prepared):
    """The taps SGLang captured differ from one another and from the final state (a hook that read one tensor for all
    would pass the shape checks)."""
    d = PreparedData.open(prepared["sglang"]).sample(0)
    H = d["final_hidden"].shape[-1]
    taps = d["aux"].view(-1, 3, H)
    for i in range(3):
        assert not torch.allclose(taps[:, i], d["final_hidden"])
        for j in range(i):
            assert not torch.allclose(taps[:, i], taps[:, j])


DSV3_TAPS = "2,3,6"  # asked as ids [1, 2, 5]: deepseek_v2.py adds 1 to every id when the first is 1
# The DeepSeek-V3 target fitted to the Llama target's chain before use (about 15 s): drafts of a random target accept
# almost nothing (test_sglang_serving.py's: τ 1.06-1.08), so their equal acceptance would prove nothing.
DSV3_FIT_STEPS = 150


def dsv3_target(tok, root: Path) -> Path:
    """The tiny DeepSeek-V3 target with the config keys SGLang's deepseek_v2.py reads from real DeepSeek-V3 configs
    (test_sglang_serving.py's)."""
    target = make_checkpoint("deepseek_v3", root / "dsv3-target", vocab_size=len(tok), topk_method="noaux_tc",
                             eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(moe_layer_freq=1, scoring_func="sigmoid")
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def dsv3_prepared(prepared) -> dict:
    """The tiny DeepSeek-V3 target (MLA, MoE after the first layer, YaRN RoPE; tests/models.py, with the config keys
    SGLang's deepseek_v2.py reads), fitted to the chain, and the conversations prepared from it in process and by
    SGLang, in the layout drafts_agree reads."""
    b = prepared["base"]
    root = prepared["root"] / "dsv3"
    target = dsv3_target(b["tok"], root)
    fit_checkpoint(target, torch.tensor(b["tok"](order2_chain(random.Random(1), b["perm"], 20_000))["input_ids"]),
                   DSV3_FIT_STEPS)  # fmt: skip
    argv = prepare_argv(target, prepared["data"], root / "prep-inproc", "--hidden-states")
    argv[argv.index("--taps") + 1] = DSV3_TAPS
    rc, _, err = cli(argv)
    assert rc == 0, err
    t = time.perf_counter()
    argv = prepare_argv(target, prepared["data"], root / "prep-sglang", *engine_argv(prepared["python"]))
    argv[argv.index("--taps") + 1] = DSV3_TAPS
    with mock.patch.dict(os.environ, sglang_environ()):
        rc, _, err = cli(argv)
    assert rc == 0, err
    sys.stderr.write(f"prepare --engine sglang (DeepSeek-V3 target): {time.perf_counter() - t:.1f} s\n")
    return {"base": {**b, "target": target}, "root": root, "inproc": root / "prep-inproc",
            "sglang": root / "prep-sglang"}  # fmt: skip


def test_deepseek_v3_target_features_equal_in_process_features(dsv3_prepared):
    """The DeepSeek-V3 target through the same path: SGLang's deepseek_v2.py capture rule, its latent attention on the
    CPU (intel_amx: its prefill runs as multi-head attention, deepseek_v2's MHA method; on torch_native, SGLang's
    fallback on a CPU without AMX, these features were uncorrelated with in-process ones), its final norm."""
    a, b = PreparedData.open(dsv3_prepared["inproc"]), PreparedData.open(dsv3_prepared["sglang"])
    feats = b.manifest["features"]["engine"]
    assert feats["captured_layer_ids"] == [2, 3, 6] and feats["layer_ids"] == [1, 2, 5]
    assert feats["attention_backend"] == "intel_amx"
    rows = feature_table(a, b)
    write_feature_table(rows, dsv3_prepared["root"] / "table.md", "DeepSeek-V3 target:\n")
    assert len(rows) == N_CONV
    worst = max(max(r["aux"], r["final"]) / r["scale"] for r in rows)
    assert worst < TOL, f"SGLang's DeepSeek-V3 features differ from in-process ones by {worst:.2e} (relative)"


def test_mla_drafts_trained_from_sglang_and_in_process_deepseek_v3_features_agree(dsv3_prepared, prepared):
    """MLA drafts (as DeepSeek-V3 / Kimi-K2 targets' drafts are: SGLang serves them as Eagle3DeepseekV2ForCausalLM)
    trained from each preparation of the DeepSeek-V3 target, exported for SGLang and served by it with that target."""
    drafts_agree(dsv3_prepared, "sglang", "SGLang", prepared["sglang_python"], _served_tau, draft_arch="mla")


def test_latent_attention_on_torch_native_is_refused(prepared, tmp_path):
    """SGLang 0.5.23 on a CPU without AMX swaps the asked intel_amx backend for torch_native
    (srt/arg_groups/overrides.py _attention_backend_platform_fallbacks) and, without a draft, runs on: its extend
    attention reads keys and values from the KV cache only, while deepseek_v2's multi-head prefill passes them uncached
    (forward_mha.py: attn_mha(..., save_kv_cache=False)), so the DeepSeek-V3 target's states come out wrong (measured:
    max |Δ| 6 to 13 on the taps, values up to about 9, against in-process ones; SGLang's own next token follows them,
    so no other check sees it). Started on SGLang's own interpreter (not amx_python.py), SGLang falls back as a user's
    would: refused with one line, nothing written."""
    target = dsv3_target(prepared["base"]["tok"], tmp_path)
    argv = prepare_argv(target, prepared["data"], tmp_path / "prep", "--limit", "2",
                        *engine_argv(prepared["sglang_python"]))  # fmt: skip
    argv[argv.index("--taps") + 1] = DSV3_TAPS
    with mock.patch.dict(os.environ, sglang_environ()):
        rc, _, err = cli(argv)
    assert rc == 2, err
    errors = [ln for ln in err.splitlines() if ln.startswith("eaglescope: error:")]
    assert len(errors) == 1 and "torch_native" in errors[0] and "latent attention" in errors[0], err
    assert not (tmp_path / "prep").exists()
    sys.stderr.write(f"torch_native: {errors[0]}\n")
