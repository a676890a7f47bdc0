"""A plain `pip install .` has no triton (it is only in the `[test]` extra, and CPU builds of torch do not pull it in).
Every command must still run: the fast path's kernels load only where they run. Here triton is made unimportable
(a package of that name first on the path whose import raises ImportError, as a missing one does) and the user's
commands run as processes, the way a user runs them: prepare → train → generate with the draft → doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from badinput_fixtures import DRAFT_VOCAB, MAX_LEN, PROMPT, conversations, write_jsonl
from models import make_checkpoint
from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir

SRC = Path(__file__).resolve().parents[1] / "src"
CPU = ["--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def no_triton(tmp_path_factory) -> dict[str, str]:
    """An environment in which `import triton` fails as it does where triton is not installed."""
    root = tmp_path_factory.mktemp("no-triton")
    (root / "triton").mkdir()
    (root / "triton" / "__init__.py").write_text("raise ImportError(\"No module named 'triton'\")\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    return env | {"PYTHONPATH": os.pathsep.join([str(root), str(SRC)])}


def eaglescope(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eaglescope", *argv], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip


def test_triton_is_really_unimportable_there(no_triton):
    probe = "import importlib.util, sys\ntry:\n import triton\nexcept ImportError:\n sys.exit(0)\nsys.exit(1)"
    assert subprocess.run([sys.executable, "-c", probe], env=no_triton).returncode == 0


def test_every_command_runs_without_triton(no_triton, tmp_path):
    tok_dir = make_tokenizer_dir(tmp_path / "tok", LLAMA3, vocab_size=300)
    tok = load(tok_dir)
    target = make_checkpoint("llama", tmp_path / "target", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                             bos_token_id=tok.bos_token_id)  # fmt: skip
    tok.save_pretrained(target)
    data = write_jsonl(tmp_path / "data.jsonl", conversations())
    prep, draft, trace = tmp_path / "prep", tmp_path / "draft", tmp_path / "trace"

    sizes = ["--max-length", str(MAX_LEN), "--draft-vocab-size", str(DRAFT_VOCAB)]
    p = eaglescope(no_triton, "prepare", "--target", str(target), "--data", str(data), "--out", str(prep), *sizes,
                   "--hidden-states", *CPU)  # fmt: skip
    assert p.returncode == 0, p.stderr
    p = eaglescope(no_triton, "train", "--target", str(target), "--data", str(prep), "--out", str(draft),
                   "--max-steps", "3", "--batch-size", "2", "--eval-fraction", "0.25", "--max-length", str(MAX_LEN),
                   *CPU)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert (draft / "model.safetensors").is_file() and (draft / "config.json").is_file()

    common = ["generate", "--target", str(target), "--prompt-ids", PROMPT, "--max-new-tokens", "12", "--json", *CPU]
    vanilla = eaglescope(no_triton, *common)
    assert vanilla.returncode == 0, vanilla.stderr
    for decoder in ([], ["--fast"]):
        spec = eaglescope(no_triton, *common, "--draft", str(draft), "--chain", "3", *decoder,
                          *(["--trace", str(trace)] if not decoder else []))  # fmt: skip
        assert spec.returncode == 0, spec.stderr
        # greedy speculative decoding is lossless: the same tokens as vanilla, on either decoder
        assert json.loads(spec.stdout)["token_ids"] == json.loads(vanilla.stdout)["token_ids"]

    p = eaglescope(no_triton, "doctor", "--target", str(target), "--draft", str(draft), "--trace", str(trace),
                   "--json", *CPU)  # fmt: skip
    assert p.returncode == 0, p.stderr  # eaglescope's own decode, replayed: healthy (1 would be findings)
    report = json.loads(p.stdout)
    assert report["healthy"] and report["findings"] == [] and report["context"]["replay"]["mode"] == "full replay"
