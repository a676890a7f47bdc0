"""The separate environments of the real engines the suite drives (scripts/vllm_env.sh, scripts/sglang_env.sh):
finding one as its script left it, and turning "it is not there" into one skip reason for an engine's tests. That
reason is not one of suite_rules.ALLOWED_SKIPS, so a run in which an engine's suite skips fails, with that line."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class EngineEnv:
    engine: str  # "vLLM", "SGLang": as the messages name it
    key: str  # "VLLM", "SGLANG": EAGLESCOPE_<key>_PYTHON / _VENV
    venv: str  # the script's default directory, relative to the repository
    marker: str  # written by the script once the engine imported there
    failed: str  # the script's one-line error when it could not install the engine
    script: str

    def find_python(self) -> tuple[str | None, str]:
        """(the environment's python, "") or (None, why there is none). EAGLESCOPE_<KEY>_PYTHON names one
        directly; otherwise it is EAGLESCOPE_<KEY>_VENV (default `venv`) as the script left it."""
        explicit = os.environ.get(f"EAGLESCOPE_{self.key}_PYTHON")
        if explicit:
            if not os.access(explicit, os.X_OK):
                return None, f"EAGLESCOPE_{self.key}_PYTHON={explicit} is not an executable"
            return explicit, ""
        venv = Path(os.environ.get(f"EAGLESCOPE_{self.key}_VENV") or REPO / self.venv)
        if not (venv / "bin" / "python").exists():
            return None, f"no {self.engine} environment at {venv} (run `bash {self.script}`)"
        if not (venv / self.marker).exists():
            failed = venv / self.failed
            why = failed.read_text().strip() if failed.exists() else "its install did not finish"
            return None, f"the {self.engine} environment at {venv} is incomplete: {why} (run `bash {self.script}`)"
        return str(venv / "bin" / "python"), ""

    def probe(self, python: str, code: str, env: dict[str, str], timeout_s: float = 900) -> str:
        """ "" when `python -c code` succeeds in `env`, else one line saying why (the output's last line)."""
        try:
            p = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"could not run {python}: {e}"
        if p.returncode == 0:
            return ""
        lines = [ln.strip() for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
        return f"{self.engine} does not import in {python}: {lines[-1] if lines else f'exit code {p.returncode}'}"

    def mark_unavailable(self, config: pytest.Config, items: list[pytest.Item], here: Path,
                         probe: Callable[[str], str]) -> tuple[str | None, str] | None:  # fmt: skip
        """For the selected tests under `here`: (python, why not usable) after probing once; where it is not usable,
        each of those tests skipped with that reason (which fails the run: suite_rules.py). None when none of them
        was selected."""
        ours = [item for item in items if here in Path(item.path).resolve().parents]
        if not ours or config.option.collectonly:
            return None
        python, why = self.find_python()
        if python is not None:
            why = probe(python)
        if why:
            marker = pytest.mark.skip(reason=f"{self.engine} unavailable: {why}")
            for item in ours:
                item.add_marker(marker)
        return python, why

    def python_or_fail(self, state: tuple[str | None, str]) -> str:
        """The python `mark_unavailable` found; a failure where there is none (a test that was not skipped for it)."""
        python, why = state
        if why or python is None:
            pytest.fail(f"{self.engine} unavailable: {why}", pytrace=False)
        return python
