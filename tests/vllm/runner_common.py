"""What both vLLM-side runners (vllm_runner.py, capture_runner.py) need, with no side effects on import: each sets
its own vLLM environment before vLLM loads. Runs in the vLLM environment: the standard library only."""

from __future__ import annotations

import json
import os
import sys
import time

SPEC_WAIT_S = 600


def write(path: str, obj) -> None:
    """`obj` as JSON at `path`, atomically: the caller polls for the file and must never read half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def wait_for_spec(path: str, who: str) -> dict | None:
    """The run spec, once the caller has written it (atomically, after building what it names); None after
    SPEC_WAIT_S, said on stderr."""
    deadline = time.monotonic() + SPEC_WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"{who}: no {path} after {SPEC_WAIT_S} s", file=sys.stderr)
            return None
        time.sleep(0.1)
    return json.loads(open(path).read())
