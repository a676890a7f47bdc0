"""tests/vllm run only where vLLM runs: found and imported once, after selection, and only when one of these tests
was selected (the import probe costs ~6 s). Where it does not, each test gets the same skip marker, which pytest's
-ra summary folds into one line; EAGLESCOPE_REQUIRE_VLLM=1 turns that into a failure of every test instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_support import HERE, find_vllm_python, probe_import

_STATE = pytest.StashKey[tuple[str | None, str]]()


def _required() -> bool:
    return os.environ.get("EAGLESCOPE_REQUIRE_VLLM") == "1"


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: probe only for tests that will run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if HERE in Path(item.path).resolve().parents]
    if not ours or config.option.collectonly:
        return
    python, why = find_vllm_python()
    if python is not None:
        why = probe_import(python)
    config.stash[_STATE] = (python, why)
    if why and not _required():
        marker = pytest.mark.skip(reason=f"vLLM unavailable: {why}")
        for item in ours:
            item.add_marker(marker)


@pytest.fixture(scope="session")
def vllm_python(request: pytest.FixtureRequest) -> str:
    """The vLLM environment's python; fails (EAGLESCOPE_REQUIRE_VLLM=1) where the tests were not skipped for it."""
    python, why = request.config.stash.get(_STATE, (None, "not probed"))
    if why or python is None:
        pytest.fail(f"vLLM required (EAGLESCOPE_REQUIRE_VLLM=1) but unavailable: {why}", pytrace=False)
    return python
