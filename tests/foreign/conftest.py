"""tests/foreign: drafts and training data made by code eaglescope did not write (pipeline.py). The judges are real:
vLLM extracts the hidden states and serves the drafts, speculators trains them. Where either environment is missing
the tests fail (a judge that cannot run is a failure, never a green skip)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline  # noqa: E402
from vllm_support import ENV, probe_import  # noqa: E402

_BUILT: dict = {}


def vllm_python_or_fail() -> str:
    python, why = ENV.find_python()
    if python is None:
        pytest.fail(f"vLLM is required for the foreign pipeline: {why}", pytrace=False)
    why = probe_import(python)
    if why:
        pytest.fail(f"vLLM is required for the foreign pipeline: {why}", pytrace=False)
    return python


@pytest.fixture(scope="session")
def foreign_pipeline(tmp_path_factory: pytest.TempPathFactory) -> pipeline.Pipeline:
    """The target, its vLLM-extracted data (clean and faulty), the five speculators drafts and their served τ, built
    once per session."""
    if "p" not in _BUILT:
        kept = os.environ.get("EAGLESCOPE_FOREIGN_DIR")
        if kept and (built := pipeline.load(Path(kept))) is not None:
            _BUILT["p"] = built
            return built
        python = vllm_python_or_fail()
        try:
            pipeline.speculators_bin()
        except RuntimeError as e:
            pytest.fail(f"speculators is required for the foreign pipeline: {e}", pytrace=False)
        root = Path(kept) if kept else tmp_path_factory.mktemp("foreign")
        root.mkdir(parents=True, exist_ok=True)
        _BUILT["p"] = pipeline.build(root, python)
    return _BUILT["p"]
