"""bench/compare_commits.py on the CPU: two copies of this package give identical decisions (exit 0); a copy whose
acceptance was changed inside the package's own code (no proposed token accepted: still lossless, so only the
decisions show it) is reported field by field (exit 1); bad versions are one line and exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench import make_bench_env

REPO = Path(__file__).parents[1]
SCRIPT = REPO / "bench" / "compare_commits.py"
FAULT = ("key = torch.where(ok, depths, -1)", "key = torch.where(ok & (depths <= 0), depths, -1)")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_bench_env(tmp_path_factory.mktemp("compare"))


def compare(env, *versions: str, out: Path) -> subprocess.CompletedProcess:
    _, target, draft, prompts = env
    cmd = [sys.executable, str(SCRIPT), "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    cmd += ["--max-new-tokens", "24", "--method", "vanilla", "--method", "ngram=3", "--method", "chain=3"]
    cmd += ["--device", "cpu", "--out", str(out)]
    for v in versions:
        cmd += ["--version", v]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_identical_versions_and_a_changed_acceptance(env, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "src", copy, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    broken = tmp_path / "broken"
    shutil.copytree(copy, broken)
    verify = broken / "eaglescope" / "decode" / "verify.py"
    text = verify.read_text()
    assert text.count(FAULT[0]) == 1
    verify.write_text(text.replace(*FAULT))

    same = compare(env, f"a={REPO / 'src'}", f"b={copy}", out=tmp_path / "same")
    assert same.returncode == 0, same.stderr
    report = json.loads(same.stdout)
    assert report["identical_decisions"] and report["differences"] == []
    rows = report["rows"]["a"]
    assert [r["method"] for r in rows] == ["vanilla", "ngram=3", "chain=3"]
    assert all(r["identical_to_vanilla"] == 2 for r in rows)
    # prompt lookup accepts tokens on this random target (it repeats itself); its random draft accepts none
    assert rows[1]["accept_length"] > 1 and rows[2]["accept_length"] == 1
    assert len(list((tmp_path / "same").glob("compare-commits-*.json"))) == 1

    changed = compare(env, f"a={REPO / 'src'}", f"b={broken}", out=tmp_path / "changed")
    assert changed.returncode == 1, changed.stderr
    report = json.loads(changed.stdout)
    assert not report["identical_decisions"]
    fields = {(d["method"], d["field"]) for d in report["differences"]}
    assert {("ngram=3", "accept_length"), ("ngram=3", "rounds"), ("ngram=3", "alpha")} <= fields
    # the rows the fault cannot change (nothing accepted, or no proposer) are not reported
    assert {d["method"] for d in report["differences"]} == {"ngram=3"}
    # still lossless: the outputs equal vanilla's, only the decisions moved
    assert all(r["identical_to_vanilla"] == 2 for r in report["rows"]["b"])
    assert all(r["accept_length"] in (None, 1.0) for r in report["rows"]["b"])


@pytest.mark.parametrize(
    "versions, match",
    [
        (["only=src"], "at least two"),
        (["a", "b=src"], "NAME=REV or NAME=DIR"),
        (["a=src", "a=src"], "must differ"),
        (["a=src", "b=no-such-revision-or-dir"], "neither a directory"),
    ],
)
def test_bad_versions_are_one_line(env, tmp_path, versions, match):
    done = compare(env, *versions, out=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0] and lines[0].startswith("compare_commits: ")
