"""The engine side of the spool protocol every `prepare --engine` worker speaks (features/vllm_worker.py,
features/sglang_worker.py); the standard library only, so that it runs in any engine's environment. eaglescope's side
is features/engine.py.

SPOOL/config.json      {"target", "layer_ids", "dtype", "max_model_len", "engine_args"}: written by eaglescope first
SPOOL/ready.json       {"version", "captured_layers", ...}: the engine started; what it reports of itself
SPOOL/failed.json      {"error": one line}: the engine could not start or a batch raised
SPOOL/batch-K.json     {"requests": [{"messages": [...]} | {"prompt_ids": [...]}]} from eaglescope, processed in K order
SPOOL/batch-K.out.json {"results": [{"file", "prompt_ids", "sampled", optional "mismatches"}], "seconds"}: written
                       when every file is complete; each file holds hidden_states [T, n_taps + 1, H] and token_ids [T]
SPOOL/stop             eaglescope is done: the worker exits
The engine's own log goes to the worker's stdout and stderr (eaglescope sends them to SPOOL/engine.log).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

POLL_S = 0.05


def write(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def line(e: BaseException) -> str:
    lines = [ln.strip() for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def serve(argv: list[str], worker: str, start: Callable[[str, dict], tuple[object, dict]],
          run_batch: Callable[[object, list[dict]], list[dict]],
          shutdown: Callable[[object], None] | None = None) -> int:  # fmt: skip
    """`start(spool, config)` → (engine, ready); then every batch through `run_batch(engine, requests)` → results,
    until eaglescope writes `stop`; then `shutdown(engine)` (an engine with processes of its own ends them)."""
    if len(argv) != 2:
        print(f"usage: python -m eaglescope.features.{worker} SPOOL", file=sys.stderr)
        return 2
    spool = argv[1]
    try:
        with open(os.path.join(spool, "config.json")) as f:
            cfg = json.load(f)
        engine, ready = start(spool, cfg)
    except Exception as e:  # noqa: BLE001 - one line for eaglescope to report
        write(os.path.join(spool, "failed.json"), {"error": line(e)})
        return 1
    write(os.path.join(spool, "ready.json"), ready)
    try:
        return _loop(spool, engine, run_batch)
    finally:
        if shutdown is not None:
            shutdown(engine)


def _loop(spool: str, engine, run_batch: Callable[[object, list[dict]], list[dict]]) -> int:
    k = 0
    while not os.path.exists(os.path.join(spool, "stop")):
        batch = os.path.join(spool, f"batch-{k:05d}.json")
        if not os.path.exists(batch):
            time.sleep(POLL_S)
            continue
        with open(batch) as f:
            requests = json.load(f)["requests"]
        t = time.perf_counter()
        try:
            results = run_batch(engine, requests)
        except Exception as e:  # noqa: BLE001
            write(os.path.join(spool, "failed.json"), {"error": line(e), "batch": k})
            return 1
        write(os.path.join(spool, f"batch-{k:05d}.out.json"), {"results": results, "seconds": time.perf_counter() - t})
        k += 1
    return 0
