"""What makes a run of the suite a pass, beyond pytest's own verdict (a pytest plugin, loaded by conftest.py).

A judge that cannot run fails the run. Every skip must be one of the few named in ALLOWED_SKIPS (a machine without
what no CI machine has); any other skip (an engine environment missing or not importing, a compiler or a torch
feature missing) turns the run's exit status into a failure, with one line per reason. Strict xfails are not skips:
they are known misses that turn into failures the day they are fixed.

The summary also says, just above pytest's closing line, how many tests of each real-engine suite passed, failed and
were skipped, so a run's own output shows that the judges ran.
"""

from __future__ import annotations

from collections import Counter

import pytest

# The only reasons a test may skip, in one place: (why it is allowed, text its skip reason contains)
ALLOWED_SKIPS = (
    ("no CUDA: tests/gpu runs on the GPU machine, its results are committed", "no CUDA device"),
    ("a GPU is present: a CPU-only bad-input case cannot be made", "a GPU is present"),
    ("no chromium: the HTML report's screenshot needs a browser", "needs chromium"),
)

# The real-engine suites, by the path their tests live under
ENGINE_SUITES = (
    ("vLLM", "tests/vllm/"),
    ("SGLang", "tests/sglang/"),
    ("speculators", "tests/test_speculators.py"),
    ("foreign pipeline (vLLM + speculators)", "tests/foreign/"),
)

_outcomes: Counter = Counter()  # (suite, outcome)
_unexpected: Counter = Counter()  # skip reason not allowed → how many tests


def allowed(reason: str) -> bool:
    return any(text in reason for _, text in ALLOWED_SKIPS)


def _suite(nodeid: str) -> str | None:
    return next((name for name, path in ENGINE_SUITES if nodeid.startswith(path)), None)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    xfailed = hasattr(report, "wasxfail")
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = "xfailed" if xfailed and report.skipped else report.outcome
        if suite := _suite(report.nodeid):
            _outcomes[suite, outcome] += 1
    if report.skipped and not xfailed and not allowed(reason := _skip_reason(report)):
        _unexpected[reason] += 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # a module that skips itself at collection (pytest.skip(allow_module_level=True))
    if report.skipped and not allowed(reason := _skip_reason(report)):
        _unexpected[reason] += 1


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # pytest-xdist's workers report to the controller, which judges


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # NO_TESTS_COLLECTED too: scripts/test.sh passes a run that selected nothing, not one whose judges skipped
    if _controller(session.config) and _unexpected and exitstatus in (0, 5):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _controller(config):
        return
    for reason, n in sorted(_unexpected.items()):
        terminalreporter.write_line(f"suite: error: {n} test(s) skipped for a reason that fails the run: {reason}",
                                    red=True)  # fmt: skip
    counts = []
    for name, _ in ENGINE_SUITES:
        parts = [f"{_outcomes[name, o]} {o}" for o in ("passed", "failed", "skipped", "xfailed") if _outcomes[name, o]]
        counts.append(f"{name} {', '.join(parts) if parts else 'not selected'}")
    terminalreporter.write_line("engine suites: " + "; ".join(counts))
