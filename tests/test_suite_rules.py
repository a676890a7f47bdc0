"""The suite's own pass rule (tests/suite_rules.py), run on small test trees in a separate pytest process: a skip
that is not one of the allowed reasons fails the run with one line naming it; the allowed ones, strict xfails and a
clean run pass; the engine suites' counts are printed above pytest's closing line, and where the time went (each
pytest-xdist worker's busy and wall time with the scopes it ran, the slowest modules) above them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_tree(root: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")} | {"PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_rules", "-p", "no:cacheprovider",
                           "--rootdir", str(root), *args, str(root)], capture_output=True, text=True, env=env, cwd=root,
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


# A scheduler as tests/conftest.py's: two modules in one scope, the rest a scope each
SCHEDULER = """
from xdist.scheduler import LoadScopeScheduling

def pytest_xdist_make_scheduler(config, log):
    class Paired(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return "pair" if path.startswith("tests/test_pair_") else path

    return Paired(config, log)
"""


def test_the_summary_says_where_each_workers_time_went(tmp_path):
    sleeps = "import time\nimport pytest\n"
    p = run_tree(tmp_path, {
        "conftest.py": SCHEDULER,
        # a module fixture's setup counts toward its module: 1.0 s + 0.5 s
        "tests/test_pair_a.py": sleeps + ("@pytest.fixture(scope='module')\ndef slow():\n    time.sleep(1.0)\n\n"
                                     "def test_a(slow):\n    time.sleep(0.5)\n"),
        "tests/test_pair_b.py": sleeps + "def test_b():\n    time.sleep(1.0)\n",
        "tests/test_c.py": sleeps + "def test_c():\n    time.sleep(0.3)\n",
        "tests/test_d.py": "def test_d1():\n    pass\n\ndef test_d2():\n    pass\n",
    }, "-n", "2", "--dist", "loadscope")  # fmt: skip
    assert p.returncode == 0, p.stdout
    lines = p.stdout.splitlines()
    workers = next(ln for ln in lines if ln.startswith("suite time: workers: "))
    slowest = next(ln for ln in lines if ln.startswith("suite time: slowest modules: "))
    assert lines.index(workers) < lines.index(slowest) < len(lines) - 2  # then the engine suites, then pytest's line
    # "gw0 2 s busy of 3 s (pair 2 s, tests/test_c.py 0 s)": each worker, its busy and wall seconds, its scopes
    found = re.findall(r"(gw\d) (\d+) s busy of (\d+) s \(([^)]*)\)", workers)
    assert sorted(w for w, *_ in found) == ["gw0", "gw1"], workers
    scopes = {s.rsplit(" ", 2)[0]: int(s.rsplit(" ", 2)[1]) for *_, named in found for s in named.split(", ")}
    assert set(scopes) == {"pair", "tests/test_c.py", "tests/test_d.py"}, workers  # the scheduler's scopes
    assert 2 <= scopes["pair"] <= 4, workers
    assert all(int(busy) <= int(wall) for _, busy, wall, _ in found), workers
    named = re.findall(r"(tests/\S+) (\d+) s", slowest.removeprefix("suite time: slowest modules: "))
    assert [m for m, _ in named] == [
        "tests/test_pair_a.py",
        "tests/test_pair_b.py",
        "tests/test_c.py",
        "tests/test_d.py",
    ]
    assert 1 <= int(named[0][1]) <= 3, slowest


def test_a_run_without_workers_reports_its_time_as_one(tmp_path):
    p = run_tree(tmp_path, {"tests/test_e.py": "def test_e():\n    pass\n"})
    assert p.returncode == 0, p.stdout
    assert re.search(r"^suite time: workers: main 0 s busy of \d+ s \(tests/test_e.py 0 s\)$", p.stdout, re.M)
    assert "suite time: slowest modules: tests/test_e.py 0 s" in p.stdout
