"""Finding the vLLM environment (scripts/vllm_env.sh) and running its interpreter, for tests/vllm."""

from __future__ import annotations

import os
from pathlib import Path

from engine_envs import EngineEnv

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUNNER = HERE / "vllm_runner.py"
PROBE_TIMEOUT_S = 180
ENV = EngineEnv("vLLM", "VLLM", ".venv-vllm", ".eaglescope-vllm-complete", ".eaglescope-vllm-error",
                "scripts/vllm_env.sh")  # fmt: skip


def runner_env() -> dict[str, str]:
    """The environment for vLLM's interpreter: ours, less what belongs to eaglescope's environment, offline."""
    env = dict(os.environ)
    # TRITON_INTERPRET (tests/conftest.py sets it for the batch-invariant kernels) would make vLLM believe Triton
    # runs here; eaglescope's venv and paths have no business in vLLM's interpreter.
    for key in ("TRITON_INTERPRET", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(key, None)
    # This checkout's eaglescope, whichever one the environment's editable install points at (the capture hooks and
    # the plugin run in vLLM's processes: they must be the code under test).
    env["PYTHONPATH"] = str(REPO / "src")
    # Nothing may reach the network: no hub look-ups, no usage reports.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def probe_import(python: str) -> str:
    """ "" when `from vllm import LLM` works in `python`, else one line saying why."""
    return ENV.probe(python, "from vllm import LLM", runner_env(), PROBE_TIMEOUT_S)
