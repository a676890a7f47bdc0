"""tests/sglang run only where SGLang runs: found and imported once, after selection, and only when one of these tests
was selected. Where it does not, each test gets the same skip marker, which pytest's -ra summary folds into one line;
that skip fails the run (tests/suite_rules.py: a judge that cannot run fails)."""

from __future__ import annotations

import pytest
from sglang_support import ENV, HERE, probe_import

_STATE = pytest.StashKey[tuple[str | None, str]]()

# The stand-ins and the SGLang-side runners are not tests of this environment (they import sglang)
collect_ignore = ["stand_ins", "kernel_check.py", "sglang_runner.py", "sglang_server.py"]


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: probe only for tests that will run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = ENV.mark_unavailable(config, items, HERE, probe_import)
    if state is not None:
        config.stash[_STATE] = state


@pytest.fixture(scope="session")
def sglang_python(request: pytest.FixtureRequest) -> str:
    """The SGLang environment's python; a failure where there is none."""
    return ENV.python_or_fail(request.config.stash.get(_STATE, (None, "not probed")))
