"""`prepare --engine` refuses what it cannot run with one line, before or when the engine starts (no engine needed:
these never get as far as one)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import threading

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
        (["--engine-url", "http://127.0.0.1:1"], "cannot reach vLLM at http://127.0.0.1:1"),
        (["--engine-url", "http://127.0.0.1:1", "--engine-args", "{}"], "do not apply to a running server"),
        (["--engine-log", "vllm.log"], "--engine-log is the log of the server given by --engine-url"),
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
        (["--engine-url", "http://127.0.0.1:1"], "2,4,6", "--engine-url needs --engine vllm"),
    ],
)
def test_bad_sglang_engine_input_is_one_line(setup, extra, taps, phrase):
    # --overwrite: the vLLM cases above leave their interrupted preparation (other inputs) beside --out
    rc, errors = _prepare(setup, *extra, "--overwrite", engine="sglang", taps=taps)
    assert rc == 2 and len(errors) == 1 and phrase in errors[0], errors
    assert not (setup / "out").exists()


def test_a_server_that_is_not_vllm_is_named_in_one_line(setup, tmp_path):
    # An HTTP server that answers, but not vLLM's API (a static file server: /version is 404)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        rc, errors = _prepare(setup, "--engine-url", url, "--overwrite")
    finally:
        server.shutdown()
    assert rc == 2 and len(errors) == 1 and f"vLLM at {url} answered /version with 404" in errors[0], errors
    assert not (setup / "out").exists()
