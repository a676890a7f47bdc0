"""The suite's own pass rule (tests/suite_rules.py), run on small test trees in a separate pytest process: a skip
that is not one of the allowed reasons fails the run with one line naming it; the allowed ones, strict xfails and a
clean run pass; the engine suites' counts are printed above pytest's closing line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_tree(root: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")} | {"PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_rules", "-p", "no:cacheprovider",
                           "--rootdir", str(root), str(root)], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)  # fmt: skip


def test_an_engine_suite_that_skips_fails_the_run(tmp_path):
    p = run_tree(tmp_path, {"tests/vllm/test_served.py": (
        "import pytest\n\n@pytest.mark.skip(reason='vLLM unavailable: no vLLM environment')\n"
        "def test_served():\n    pass\n\ndef test_other():\n    pass\n")})  # fmt: skip
    assert p.returncode == 1, p.stdout
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("suite: error:")]
    assert lines == ["suite: error: 1 test(s) skipped for a reason that fails the run: vLLM unavailable: "
                     "no vLLM environment"]  # fmt: skip
    summary = "engine suites: vLLM 1 passed, 1 skipped; SGLang not selected; speculators not selected; foreign pipeline"
    assert summary in p.stdout


def test_a_module_that_skips_itself_fails_the_run(tmp_path):
    skip = "pytest.skip('speculators unavailable: nothing built', allow_module_level=True)"
    p = run_tree(tmp_path, {"tests/test_speculators.py": f"import pytest\n{skip}\n"})
    assert p.returncode == 1, p.stdout
    assert "fails the run: speculators unavailable: nothing built" in p.stdout


def test_allowed_skips_and_strict_xfails_pass(tmp_path):
    p = run_tree(tmp_path, {"tests/test_a.py": (
        "import pytest\n\n@pytest.mark.skip(reason='needs chromium (apt-get install chromium)')\n"
        "def test_png():\n    pass\n\n@pytest.mark.xfail(strict=True, reason='a known miss')\n"
        "def test_miss():\n    assert False\n\ndef test_ok():\n    pass\n")})  # fmt: skip
    assert p.returncode == 0, p.stdout
    assert "suite: error" not in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("1 passed, 1 skipped, 1 xfailed")


def test_the_real_suite_names_only_allowed_skips():
    # every skip reason written in the suite's own files is one the rule allows, or one the rule is meant to fail
    import suite_rules

    assert suite_rules.allowed("no CUDA device: tests/gpu runs on a GPU machine (results in bench/results/…)")
    assert not suite_rules.allowed("vLLM unavailable: no vLLM environment at .venv-vllm")
    assert not suite_rules.allowed("inductor's CPU backend needs a C++ compiler")
