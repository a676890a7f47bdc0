"""What makes a run of the suite a pass, beyond pytest's own verdict (a pytest plugin, loaded by conftest.py).

A judge that cannot run fails the run. Every skip must be one of the few named in ALLOWED_SKIPS (a machine without
what no CI machine has); any other skip (an engine environment missing or not importing, a compiler or a torch
feature missing) turns the run's exit status into a failure, with one line per reason. Strict xfails are not skips:
they are known misses that turn into failures the day they are fixed.

The summary also says, just above pytest's closing line, how many tests of each real-engine suite passed, failed and
were skipped, so a run's own output shows that the judges ran; and, above that, where the run's time went: each
pytest-xdist worker's busy time (its tests' setup, call and teardown) against its wall time, with the scopes it ran
(the scheduler's own units: tests/conftest.py's "engines", "foreign", a module), and the five slowest modules.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

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
_seconds: defaultdict = defaultdict(float)  # (worker, nodeid) → seconds of setup, call and teardown
_last_stop: dict[str, float] = {}  # worker → when its last report ended (epoch seconds)
_session_start: list[float] = []
SLOWEST = 5  # modules named in the summary
SCOPES_PER_WORKER = 3  # scopes named per worker; the rest are counted


def allowed(reason: str) -> bool:
    return any(text in reason for _, text in ALLOWED_SKIPS)


def _suite(nodeid: str) -> str | None:
    return next((name for name, path in ENGINE_SUITES if nodeid.startswith(path)), None)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_sessionstart(session: pytest.Session) -> None:
    _session_start.append(time.time())


def _worker(report: pytest.TestReport) -> str:
    node = getattr(report, "node", None)  # pytest-xdist's controller sets it to the worker that ran the test
    return node.gateway.id if node is not None else "main"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker = _worker(report)
    _seconds[worker, report.nodeid] += report.duration
    _last_stop[worker] = max(_last_stop.get(worker, 0.0), getattr(report, "stop", 0.0) or time.time())
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


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _scope_of(config: pytest.Config):
    """nodeid → the scheduler's unit of work: the one pytest-xdist's loadscope scheduler (tests/conftest.py's) used."""
    sched = getattr(config.pluginmanager.getplugin("dsession"), "sched", None)
    return getattr(sched, "_split_scope", _module)


def time_lines(config: pytest.Config) -> list[str]:
    """Where the run's time went: per worker, busy seconds over wall seconds and its scopes, largest first; then the
    slowest modules (their tests' setup, call and teardown summed, whichever worker ran them)."""
    if not _seconds:
        return []
    scope_of, start = _scope_of(config), _session_start[0] if _session_start else time.time()
    per_worker: defaultdict = defaultdict(lambda: defaultdict(float))
    per_module: defaultdict = defaultdict(float)
    for (worker, nodeid), seconds in _seconds.items():
        per_worker[worker][scope_of(nodeid)] += seconds
        per_module[_module(nodeid)] += seconds
    workers = []
    for worker in sorted(per_worker):
        scopes = sorted(per_worker[worker].items(), key=lambda kv: -kv[1])
        named = [f"{scope} {seconds:.0f} s" for scope, seconds in scopes[:SCOPES_PER_WORKER]]
        if rest := scopes[SCOPES_PER_WORKER:]:
            named.append(f"+{len(rest)} more {sum(s for _, s in rest):.0f} s")
        busy, wall = sum(per_worker[worker].values()), _last_stop[worker] - start
        workers.append(f"{worker} {busy:.0f} s busy of {wall:.0f} s ({', '.join(named)})")
    slowest = sorted(per_module.items(), key=lambda kv: -kv[1])[:SLOWEST]
    return ["suite time: workers: " + "; ".join(workers),
            "suite time: slowest modules: " + ", ".join(f"{m} {s:.0f} s" for m, s in slowest)]  # fmt: skip


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _controller(config):
        return
    for line in time_lines(config):
        terminalreporter.write_line(line)
    for reason, n in sorted(_unexpected.items()):
        terminalreporter.write_line(f"suite: error: {n} test(s) skipped for a reason that fails the run: {reason}",
                                    red=True)  # fmt: skip
    counts = []
    for name, _ in ENGINE_SUITES:
        parts = [f"{_outcomes[name, o]} {o}" for o in ("passed", "failed", "skipped", "xfailed") if _outcomes[name, o]]
        counts.append(f"{name} {', '.join(parts) if parts else 'not selected'}")
    terminalreporter.write_line("engine suites: " + "; ".join(counts))
