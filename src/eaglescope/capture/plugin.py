"""The engines' general plugins behind `eaglescope capture` (entry points in pyproject.toml): `register` for vLLM
(`vllm.general_plugins`), `register_sglang` for SGLang (`sglang.srt.plugins`).

Each engine calls its plugin in every process it starts, in the order it likes: vLLM in the front end, EngineCore and
each worker; SGLang 0.5.23 in the engine's own process and in each scheduler process it spawns (`srt/plugins`
`load_plugins`, called by `run_scheduler_process`), which is where its model runs. A plugin must cost nothing when no
capture was asked for, so it reads one environment variable and returns; everything else (torch, the engine's model
code, the trace recorder) is imported only in the process that runs the model, when that process imports the module
the hooks wrap: they are installed from an import hook on that module rather than by importing it here, which would
pull the whole model runner into the engine's front end.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType

from eaglescope.capture import (
    ENV_ENGINE,
    ENV_FEATURES,
    HOOKED,
    LOADED,
    REFUSED,
    _staging,
    log,
    note,
    unsupported_line,
)
from eaglescope.log import configure as configure_logging

# engine → the module whose import means "this process runs the model", where that engine's hooks are installed
HOOKED_MODULES = {
    "vllm": "vllm.v1.worker.gpu_model_runner",  # GPUModelRunner (the worker; the main process without multiprocessing)
    "sglang": "sglang.srt.speculative.eagle_worker_v2",  # EAGLEWorkerV2 (the scheduler process)
}
RUNNER_MODULE = HOOKED_MODULES["vllm"]
# `prepare --engine sglang` (ENV_FEATURES): no draft is served, so no EAGLE worker is imported; the hooks are installed
# where the target's ModelRunner is defined (capture/sglang_features.py)
FEATURES_MODULES = {"sglang": "sglang.srt.model_executor.model_runner"}


def _touch(name: str) -> None:
    staging = _staging()
    if staging is not None:
        try:
            (staging / name).touch()
        except OSError:
            pass


def register() -> None:
    """vLLM's plugin entry point: a no-op unless `eaglescope capture --engine vllm` set its switch."""
    _start("vllm")


def register_sglang() -> None:
    """SGLang's plugin entry point: a no-op unless `eaglescope capture --engine sglang` set its switch."""
    _start("sglang")


def _start(engine: str) -> None:
    staging = _staging()
    if staging is None or os.environ.get(ENV_ENGINE, "vllm") != engine:
        return
    configure_logging()  # no eaglescope command runs in this process to install the handler
    try:
        _touch(LOADED.format(pid=os.getpid()))
        package = importlib.import_module(engine)  # already imported: the engine is calling its plugins
        refused = unsupported_line(str(getattr(package, "__version__", "unknown")), engine)
        if refused is not None:
            # Written once (every engine process runs this); the command ends the run and prints this line.
            try:
                with open(staging / REFUSED, "x", encoding="utf-8") as f:
                    f.write(refused + "\n")
                log.info("capture: %s", refused)  # the command itself ends with the one error line
            except FileExistsError:
                pass
            return
        hooks = f"{engine}_hooks"
        module = HOOKED_MODULES[engine]
        if os.environ.get(ENV_FEATURES) == "1" and engine in FEATURES_MODULES:
            hooks, module = f"{engine}_features", FEATURES_MODULES[engine]
        if module in sys.modules:
            _install(engine, sys.modules[module], hooks)
        elif not any(isinstance(f, _HookOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _HookOnImport(engine, module, hooks))
    except Exception as e:  # noqa: BLE001 - a capture that cannot start must never stop the user's serving
        note(f"the {engine} plugin could not start: {type(e).__name__}: {e}")


def _install(engine: str, module: ModuleType, hooks: str | None = None) -> None:
    try:
        importlib.import_module(f"eaglescope.capture.{hooks or engine + '_hooks'}").install(module)
        _touch(HOOKED.format(pid=os.getpid()))
    except Exception as e:  # noqa: BLE001 - as above: report, and let the engine serve uncaptured
        note(f"could not install the {engine} hooks: {type(e).__name__}: {e}")


class _HookOnImport(importlib.abc.MetaPathFinder):
    """Finds the hooked module like the other finders would, and installs the hooks once it has run."""

    def __init__(self, engine: str, module: str, hooks: str) -> None:
        self.engine, self.module, self.hooks = engine, module, hooks

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)  # one shot, and the search below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenInstall(spec.loader, self.engine, self.hooks)
        return spec


class _ThenInstall(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, engine: str, hooks: str) -> None:
        self._inner, self._engine, self._hooks = inner, engine, hooks

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _install(self._engine, module, self._hooks)

    def __getattr__(self, name: str):  # get_source, get_filename …: what tracebacks and inspect ask a loader
        return getattr(self._inner, name)
