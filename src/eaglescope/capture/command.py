"""`eaglescope capture --engine vllm|sglang --out TRACE [--mode full|fingerprint] [--requests N] [--layers] -- COMMAND`

Runs the user's own command (`python serve.py`, `vllm serve ...`, `python -m sglang.launch_server ...`, a benchmark
script) unchanged, with a switch in its environment that eaglescope's plugin for that engine (plugin.py, registered
under `vllm.general_plugins` and `sglang.srt.plugins`) reads in every engine process. The process that runs the model
then writes one trace per request, for the first N requests it starts, into a hidden staging directory beside TRACE;
each trace is complete the moment it is written. When the
command ends the traces are moved into place: with N = 1, TRACE is that request's trace; with N > 1, TRACE is a
directory of `request-<k>/` traces and a `capture.json` index. Standard library only (no torch here).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from eaglescope import outputs
from eaglescope.capture import (
    ENGINE_NAMES,
    ENV_DIR,
    ENV_ENGINE,
    ENV_LAYERS,
    ENV_MODE,
    ENV_REQUESTS,
    HOOKED,
    LOADED,
    NOTES,
    PRODUCER_SUFFIX,
    RAISED,
    REFUSED,
    SUPPORTED,
    TRACE_NAME,
)
from eaglescope.errors import EagleScopeError

INDEX = "capture.json"
WRITTEN_BY = "eaglescope capture"
PLUGIN_NAME = "eaglescope_capture"  # the entry point's name (VLLM_PLUGINS and SGLANG_PLUGINS allow-list by it)
# engine → (its plugin allow-list variable, the script that installs eaglescope beside it, how EAGLE-3 is asked for)
ENGINES = {
    "vllm": ("VLLM_PLUGINS", "scripts/vllm_env.sh", "speculative_config method 'eagle3'"),
    "sglang": ("SGLANG_PLUGINS", "scripts/sglang_env.sh", "speculative_algorithm EAGLE3"),
}
POLL_S = 0.2
TERMINATE_GRACE_S = 15.0


def _captured(path: Path) -> bool:
    """A trace this command wrote (any engine version), or a directory of them with our index."""
    manifest = outputs.read_json(path / "manifest.json")
    if manifest is not None:
        return str(manifest.get("producer", "")).endswith(PRODUCER_SUFFIX)
    index = outputs.read_json(path / INDEX)
    return index is not None and index.get("written_by") == WRITTEN_BY


CAPTURE_KIND = outputs.dir_kind(
    "capture written by eaglescope capture",
    markers=["manifest.json", INDEX],
    entries=["manifest.json", "trace-*.safetensors", INDEX, "request-*"],
    check=_captured,
)


def _child_env(staging: Path, requests: int, mode: str, layers: bool = False, engine: str = "vllm") -> dict[str, str]:
    env = dict(os.environ)
    env.update({ENV_DIR: str(staging), ENV_REQUESTS: str(requests), ENV_MODE: mode, ENV_ENGINE: engine})
    env[ENV_LAYERS] = "1" if layers else "0"
    allow_list = ENGINES[engine][0]
    allowed = env.get(allow_list)
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        # An allow-list would keep the plugin out: add it (capture was asked for explicitly).
        env[allow_list] = ",".join(p for p in (*allowed.split(","), PLUGIN_NAME) if p)
    return env


def _run(command: list[str], env: dict[str, str], staging: Path) -> tuple[int, str | None]:
    """Run the command to its end (or until the plugin refuses this engine version) → (exit status, refusal line)."""
    try:
        proc = subprocess.Popen(command, env=env)
    except OSError as e:
        raise EagleScopeError(f"cannot run {command[0]!r}: {e.strerror or e}") from None
    # Ctrl-C reaches the command through the terminal's process group; this process outlives it to put the
    # finished traces in place. A TERM sent to this process alone is passed on.
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    refused = None
    try:
        while proc.poll() is None:
            if refused is None and (staging / REFUSED).is_file():
                refused = (staging / REFUSED).read_text(encoding="utf-8").strip()
                proc.terminate()  # nothing can be captured: do not leave the user's server running for nothing
                deadline = time.monotonic() + TERMINATE_GRACE_S
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                if proc.poll() is None:
                    proc.kill()
            time.sleep(POLL_S)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    if refused is None and (staging / REFUSED).is_file():
        refused = (staging / REFUSED).read_text(encoding="utf-8").strip()
    return proc.returncode, refused


def _nothing_captured(staging: Path, rc: int, notes: list[str], engine: str = "vllm") -> EagleScopeError:
    status = f" (the command exited with status {rc})" if rc else ""
    name, (_, script, eagle3) = ENGINE_NAMES[engine], ENGINES[engine]
    if not any(staging.glob(LOADED.format(pid="*"))):
        why = (
            f"the eaglescope {name} plugin never loaded: install eaglescope into the Python environment that runs "
            f"{name} (`pip install --no-deps -e /path/to/eaglescope` there; {script} does it), and run "
            f"{name} from that environment"
        )
    elif not any(staging.glob(HOOKED.format(pid="*"))):
        why = f"the eaglescope plugin loaded but no process ran {name}'s model (did the command start an engine?)"
    else:
        why = f"{name} ran, but no request was traced"
        if notes:
            why += f": {notes[-1]}"
        else:
            why += f" (was it serving with {eagle3}?)"
    return EagleScopeError(f"nothing was captured{status}: {why}")


@dataclass
class Captured:
    """What a capture wrote, for the command to report."""

    out: Path  # the trace (one request) or the directory of request-<k>/ traces
    first: Path  # the first trace written
    traces: int
    requested: int
    exit_status: int  # the user's command's
    notes: list[str]  # the plugin's notes, one line each
    raised: list[str]  # the engine's step errors while traced requests were in flight
    engine: str = "vllm"  # "vllm" | "sglang"


def capture(
    command: list[str], out: str | Path, requests: int = 1, mode: str = "full", layers: bool = False,
    engine: str = "vllm",
) -> Captured:  # fmt: skip
    """Run `command` with the capture switched on; the traces of its first `requests` requests end up at `out`."""
    command = list(command or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise EagleScopeError("give the command to run after --, e.g. eaglescope capture ... -- python serve.py")
    if requests < 1:
        raise EagleScopeError(f"--requests must be >= 1, got {requests}")
    if engine not in ENGINES:
        raise EagleScopeError(f"--engine must be one of {', '.join(ENGINES)}, not {engine}")
    if layers and engine != "vllm":
        raise EagleScopeError(f"--layers is supported with --engine vllm only, not {engine}")
    out = outputs.check_destination(out, CAPTURE_KIND, flag="--out")
    outputs.clean_stale(out)
    staging = out.with_name(f".{out.name}{outputs.TMP_TAG}{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    except OSError as e:
        raise EagleScopeError(f"cannot write beside {out}: {e.strerror or e}") from None
    try:
        env = _child_env(staging, requests, mode, bool(layers), engine)
        rc, refused = _run(command, env, staging)
        if refused:
            raise EagleScopeError(refused)
        notes = [ln for ln in _read_lines(staging / NOTES) if ln]
        raised = [ln for ln in _read_lines(staging / RAISED) if ln]
        slots = sorted(
            (int(p.name.rsplit("-", 1)[1]), p)
            for p in staging.glob(TRACE_NAME.format(k="*"))
            if p.is_dir() and p.name.rsplit("-", 1)[1].isdigit() and (p / "manifest.json").is_file()
        )
        if not slots:
            raise _nothing_captured(staging, rc, notes, engine)
        if requests == 1:
            outputs.swap_in(slots[0][1], out)
        else:
            index = {
                "written_by": WRITTEN_BY,
                "engine": engine,
                "supported_versions": list(SUPPORTED[engine]),
                "mode": mode,
                "requested": requests,
                "command": command,
                "exit_status": rc,
                "traces": [_summary(path, engine) for _, path in slots],
                "notes": notes,
                "raised": raised,
            }
            for p in staging.iterdir():  # the engine side's bookkeeping stays behind
                if not (p.name.startswith("request-") and p.is_dir()):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            (staging / INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
            outputs.swap_in(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    first = out if requests == 1 else out / slots[0][1].name
    return Captured(out, first, len(slots), requests, rc, notes, raised, engine)


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []


def _summary(path: Path, engine: str) -> dict:
    meta = (outputs.read_json(path / "manifest.json") or {}).get("meta") or {}
    return {
        "trace": path.name,
        "request_id": (meta.get(engine) or {}).get("request_id"),
        "prompt_tokens": len(meta.get("prompt_ids") or []),
        "rounds": meta.get("rounds"),
        "finished": meta.get("finished"),
        "complete": meta.get("complete"),
    }


__all__ = ["capture", "Captured", "CAPTURE_KIND"]
