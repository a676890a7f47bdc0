"""`eaglescope capture`: canonical traces (docs/trace-format.md) recorded inside an unmodified serving engine.

Two halves, in two Python environments:

    command.py      the CLI command, in eaglescope's environment: checks --out, runs the user's own command with
                    the switch below set, and moves the complete traces into place when it ends (standard library).
    plugin.py       the engine's general plugin (entry points `vllm.general_plugins`, `sglang.srt.plugins`), in the
                    engine's environment: a no-op unless the switch is set for that engine; otherwise it checks the
                    engine's version and arranges for the engine's hooks module to wrap its methods in whichever
                    process imports the module the engine runs its model from.
    vllm_hooks.py   the wrappers, one module per engine: they read what the engine computes (never change it) and
    sglang_hooks.py write one trace per request with eaglescope's TraceRecorder.
    sglang_features.py  the same plugin's other use (`prepare --engine sglang`): each prefill's tap states and final
                    state, from SGLang's own EAGLE-3 capture on a target served without a draft.
    slots.py        what the hooks of every engine share: request slots across processes, the target's fingerprint.

This module holds only the names both halves share, so that importing it costs nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

# The switch: the staging directory the traces are written into (set by `eaglescope capture` only).
ENV_DIR = "EAGLESCOPE_CAPTURE_DIR"
ENV_REQUESTS = "EAGLESCOPE_CAPTURE_REQUESTS"  # how many requests to trace (the first N the engine starts)
ENV_MODE = "EAGLESCOPE_CAPTURE_MODE"  # "full" | "fingerprint"
ENV_ENGINE = "EAGLESCOPE_CAPTURE_ENGINE"  # "vllm" | "sglang": only that engine's plugin acts
ENV_LAYERS = "EAGLESCOPE_CAPTURE_LAYERS"  # "1": also every layer's state of each prefill (target.layer.*)
# "1": training features instead of traces (`prepare --engine sglang`: capture/sglang_features.py, no draft served)
ENV_FEATURES = "EAGLESCOPE_CAPTURE_FEATURES"

# Files the engine side leaves in the staging directory for the command to read.
REFUSED = "refused.txt"  # one line: this engine version is not supported (nothing was hooked)
NOTES = "notes.txt"  # one line per request that was not traced, or per hook error, and why
RAISED = "raised.txt"  # one line per traced request in flight when the engine step raised (its trace is incomplete)
LOADED = "loaded-{pid}"  # the plugin ran in this process
HOOKED = "hooked-{pid}"  # the hooks are installed in this process (it imported the model runner)
CLAIMS = "claims"  # claims/<k>: request slot k is taken (mkdir is atomic across engine processes)
TRACE_NAME = "request-{k}"  # request slot k's trace
FEATURES_READY = "features-ready.json"  # what the features hooks read back of the target when it loaded
FEATURES_DIR = "features"  # features/<request id>.<first position>.safetensors: one prefill forward's states
FEATURES_REQUEST_PREFIX = "eaglescope-features-"  # the ids of the requests whose features are written

PRODUCER_SUFFIX = "(eaglescope capture)"
# The versions whose internals each engine's hooks were written against (and tested on).
SUPPORTED = {"vllm": ("0.32.0",), "sglang": ("0.5.23",)}
SUPPORTED_VLLM = SUPPORTED["vllm"]
SUPPORTED_SGLANG = SUPPORTED["sglang"]
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def producer(engine: str, version: str) -> str:
    """The `producer` of a captured trace, e.g. "vllm-0.32.0 (eaglescope capture)"."""
    return f"{engine}-{version} {PRODUCER_SUFFIX}"


def unsupported_line(version: str, engine: str = "vllm") -> str | None:
    """The one line that refuses an engine version the hooks were not written for; None when supported."""
    if version in SUPPORTED[engine]:
        return None
    name = ENGINE_NAMES[engine]
    return (
        f"eaglescope capture supports {name} {', '.join(SUPPORTED[engine])} only; this is {name} {version}: nothing "
        "was captured (its internals differ between versions, and a trace from misread internals would mislead)"
    )


def _staging() -> Path | None:
    value = os.environ.get(ENV_DIR)
    return Path(value) if value else None


def note(line: str) -> None:
    """One line for `eaglescope capture` to report (and logged now, in the engine's process: plugin.py installs
    eaglescope's one-line stderr handler there, so it can be found in the engine's log)."""
    log.info("capture: %s", line)
    staging = _staging()
    if staging is not None:
        try:
            with open(staging / NOTES, "a", encoding="utf-8") as f:
                f.write(line.replace("\n", " ") + "\n")
        except OSError:
            pass
