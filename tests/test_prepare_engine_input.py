"""`prepare --engine` refuses what it cannot run with one line, before or when the engine starts (no engine needed:
these never get as far as one)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from models import WIDE_HEADS, make_checkpoint

from eaglescope.cli import main
from eaglescope.corpus import COMPLETION_TEMPLATE, train_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-input")
    tok = train_tokenizer(["abcdefgh"], 258, root / "target", COMPLETION_TEMPLATE)
    make_checkpoint("llama", root / "target", vocab_size=len(tok), **WIDE_HEADS, eos_token_id=tok.eos_token_id)
    turns = [{"role": "user", "content": "abcabc"}, {"role": "assistant", "content": "defdef"}]
    (root / "data.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    return root


def _prepare(root, *extra: str, engine: str = "vllm", taps: str = "2,4,6") -> tuple[int, list[str]]:
    err = io.StringIO()
    argv = ["prepare", "--target", str(root / "target"), "--data", str(root / "data.jsonl"), "--out",
            str(root / "out"), "--taps", taps, "--device", "cpu", "--engine", engine, *extra]  # fmt: skip
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, [ln for ln in err.getvalue().splitlines() if ln.startswith("eaglescope: error")]


@pytest.mark.parametrize(
    "extra, phrase",
    [
        (["--regenerate"], "--regenerate with --engine is not supported yet"),
        (["--engine-args", "{not json"], "--engine-args is not JSON"),
        (["--engine-args", "[1, 2]"], "--engine-args must be a JSON object"),
        (["--engine-python", "/nonexistent/python"], "cannot run --engine-python '/nonexistent/python'"),
        (["--engine-python", "/bin/false"], "vLLM exited (1) before it could start"),
    ],
)
def test_bad_engine_input_is_one_line(setup, extra, phrase):
    rc, errors = _prepare(setup, *extra)
    assert rc == 2 and len(errors) == 1 and phrase in errors[0], errors
    assert not (setup / "out").exists()


@pytest.mark.parametrize(
    "extra, taps, phrase",
    [
        (["--engine-python", "/bin/false"], "2,4,6", "SGLang exited (1) before it could start"),
        # llama.py reads every id as "output of layer i": the embedding output cannot be asked for
        ([], "0,4,6", "ids mean 'output of layer i'; the embedding (tap 0) cannot be expressed"),
    ],
)
def test_bad_sglang_engine_input_is_one_line(setup, extra, taps, phrase):
    # --overwrite: the vLLM cases above leave their interrupted preparation (other inputs) beside --out
    rc, errors = _prepare(setup, *extra, "--overwrite", engine="sglang", taps=taps)
    assert rc == 2 and len(errors) == 1 and phrase in errors[0], errors
    assert not (setup / "out").exists()
