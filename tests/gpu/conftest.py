"""tests/gpu: the user's commands on a GPU, through the command line (`eaglescope.cli.main`), run on the GPU machine
since CI has none; each run's pytest summary and commit are committed as bench/results/gpu-tests-*.txt.

Without CUDA the whole directory is one skipped line. Every test here carries the `gpu` marker (`-m gpu`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device: tests/gpu runs on a GPU machine (results in bench/results/gpu-tests-*.txt)"

if not CUDA:
    # The directory is one skipped line: its modules are not even imported (they build models at import time).
    collect_ignore_glob = ["test_*.py"]

    class _NoDevice(pytest.Item):
        def runtest(self) -> None:
            pytest.skip(NO_CUDA)

    class _Directory(pytest.File):
        def collect(self):
            yield _NoDevice.from_parent(self, name="tests/gpu")

    def pytest_collect_file(file_path, parent):
        if file_path == HERE / "conftest.py":
            return _Directory.from_parent(parent, path=file_path)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not CUDA and not isinstance(item, _NoDevice):  # a module named on the command line
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    # Overrides the CPU suite's one-thread rule: here the host's part (loading an 8B checkpoint, the comparisons)
    # runs as it does for a user, on every core.
    yield


class Cli:
    """The product's own entry point (`eaglescope.cli.main`) in this process, as `eaglescope ...` runs it minus the
    interpreter's start. EAGLESCOPE_DEBUG=1: an internal error fails the test with its traceback."""

    def __init__(self, capsys) -> None:
        self.capsys = capsys

    def __call__(self, *argv) -> tuple[int, object, str]:
        """→ (exit code, stdout parsed as JSON where it is JSON, else the text, stderr)."""
        from eaglescope.cli import main

        self.capsys.readouterr()
        rc = main([str(a) for a in argv])
        out, err = self.capsys.readouterr()
        try:
            return rc, json.loads(out), err
        except json.JSONDecodeError:
            return rc, out, err

    def doctor(self, target, draft, trace, *extra) -> tuple[int, dict, tuple[str, str, int] | None]:
        """doctor --json on a trace → (exit code, the report, (code, stage, round) of its top finding or None)."""
        rc, report, err = self("doctor", "--target", target, "--draft", draft, "--trace", trace, "--json", *extra)
        assert isinstance(report, dict), err
        f = report["findings"][0] if report["findings"] else None
        return rc, report, None if f is None else (f["code"], f["stage"], f["round"])


@pytest.fixture(scope="session")
def run_cli():
    """`run_cli(*argv)` → exit code: the CLI in this process for module-scoped fixtures (output not captured),
    an internal error raised with its traceback."""
    from eaglescope.cli import main

    def run(*argv) -> int:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EAGLESCOPE_DEBUG", "1")
            return main([str(a) for a in argv])

    return run


@pytest.fixture
def cli(capsys, monkeypatch) -> Cli:
    monkeypatch.setenv("EAGLESCOPE_DEBUG", "1")
    return Cli(capsys)
