"""Finding the vLLM environment (scripts/vllm_env.sh) and running its interpreter, for tests/vllm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUNNER = HERE / "vllm_runner.py"
MARKER = ".eaglescope-vllm-complete"  # written by scripts/vllm_env.sh after vLLM imported there
FAILED = ".eaglescope-vllm-error"  # scripts/vllm_env.sh's one-line error when it could not install or import vLLM
PROBE_TIMEOUT_S = 180


def find_vllm_python() -> tuple[str | None, str]:
    """(the vLLM environment's python, "") or (None, why there is none). EAGLESCOPE_VLLM_PYTHON names one
    directly; otherwise it is EAGLESCOPE_VLLM_VENV (default .venv-vllm) as scripts/vllm_env.sh left it."""
    explicit = os.environ.get("EAGLESCOPE_VLLM_PYTHON")
    if explicit:
        if not os.access(explicit, os.X_OK):
            return None, f"EAGLESCOPE_VLLM_PYTHON={explicit} is not an executable"
        return explicit, ""
    venv = Path(os.environ.get("EAGLESCOPE_VLLM_VENV") or REPO / ".venv-vllm")
    if not (venv / "bin" / "python").exists():
        return None, f"no vLLM environment at {venv} (run `bash scripts/vllm_env.sh`)"
    if not (venv / MARKER).exists():
        failed = venv / FAILED
        why = failed.read_text().strip() if failed.exists() else "its install did not finish"
        return None, f"the vLLM environment at {venv} is incomplete: {why} (run `bash scripts/vllm_env.sh`)"
    return str(venv / "bin" / "python"), ""


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
    """ "" when `from vllm import LLM` works in `python`, else one line saying why (`import vllm` alone is lazy)."""
    try:
        p = subprocess.run(
            [python, "-c", "from vllm import LLM"],
            capture_output=True,
            text=True,
            env=runner_env(),
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not run {python}: {e}"
    if p.returncode == 0:
        return ""
    lines = [ln.strip() for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
    return f"vLLM does not import in {python}: {lines[-1] if lines else f'exit code {p.returncode}'}"
