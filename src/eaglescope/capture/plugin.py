"""The vLLM general plugin behind `eaglescope capture` (entry point `vllm.general_plugins` in pyproject.toml).

vLLM calls `register()` in every process it starts (the front end, EngineCore, each worker) and in the order it
likes. It must cost nothing when no capture was asked for, so it reads one environment variable and returns;
everything else (torch, vLLM's model runner, the trace recorder) is imported only in the process that runs the
model, when that process imports vLLM's model runner module: the hooks are installed from an import hook on
that module rather than by importing it here, which would pull the whole model runner into the front end.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType

from eaglescope.capture import HOOKED, LOADED, REFUSED, _staging, log, note, unsupported_line
from eaglescope.log import configure as configure_logging

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def _touch(name: str) -> None:
    staging = _staging()
    if staging is not None:
        try:
            (staging / name).touch()
        except OSError:
            pass


def register() -> None:
    """vLLM's plugin entry point: a no-op unless `eaglescope capture` set its switch."""
    staging = _staging()
    if staging is None:
        return
    configure_logging()  # no eaglescope command runs in this process to install the handler
    try:
        _touch(LOADED.format(pid=os.getpid()))
        import vllm  # lazy: this reads the version without loading the engine

        refused = unsupported_line(str(getattr(vllm, "__version__", "unknown")))
        if refused is not None:
            # Written once (every vLLM process runs this); the command ends the run and prints this line.
            try:
                with open(staging / REFUSED, "x", encoding="utf-8") as f:
                    f.write(refused + "\n")
                log.info("capture: %s", refused)  # the command itself ends with the one error line
            except FileExistsError:
                pass
            return
        if RUNNER_MODULE in sys.modules:
            _install(sys.modules[RUNNER_MODULE])
        elif not any(isinstance(f, _HookOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _HookOnImport())
    except Exception as e:  # noqa: BLE001 - a capture that cannot start must never stop the user's serving
        note(f"the vLLM plugin could not start: {type(e).__name__}: {e}")


def _install(module: ModuleType) -> None:
    try:
        from eaglescope.capture import vllm_hooks

        vllm_hooks.install(module)
        _touch(HOOKED.format(pid=os.getpid()))
    except Exception as e:  # noqa: BLE001 - as above: report, and let vLLM serve uncaptured
        note(f"could not install the vLLM hooks: {type(e).__name__}: {e}")


class _HookOnImport(importlib.abc.MetaPathFinder):
    """Finds vLLM's model runner module like the other finders would, and installs the hooks once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != RUNNER_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot, and the search below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenInstall(spec.loader)
        return spec


class _ThenInstall(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _install(module)

    def __getattr__(self, name: str):  # get_source, get_filename …: what tracebacks and inspect ask a loader
        return getattr(self._inner, name)
