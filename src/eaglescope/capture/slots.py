"""What the engine-side hooks of every engine share (vllm_hooks.py, sglang_hooks.py): one request's trace and how it
is closed, the process-wide capture state's bookkeeping (EngineCapture) and the guard every hook runs under, request
slots claimed across the engine's processes, the line that marks a trace cut short by the engine, the target's
fingerprint, and copying rows out of buffers the engine reuses."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import torch

from eaglescope.capture import CLAIMS, RAISED, TRACE_NAME, note, producer
from eaglescope.trace import TraceRecorder

# How a request ended when its trace holds all it should: its own stop or length, or the engine saying it finished.
COMPLETE_ENDS = ("stop", "length", "finished (reported by the scheduler)")


class TracedRequest:
    """One request's trace, in slot `slot` of the staging directory: rounds are recorded when verified; what the
    drafter made for the next round waits in `staged` until a target verifies it (a request that ends first drops it:
    drafts no target verified belong to no round)."""

    def __init__(self, staging: Path, slot: int, req_id: str, mode: str, producer: str) -> None:
        self.req_id, self.slot = req_id, slot
        self.round = -1  # the last round recorded (verified); -1 while the prefill runs
        self.emitted: list[int] = []
        self.staged: list[tuple[int, str, Any, dict]] = []
        self.closing: str | None = None  # how it ended, where the engine decides that before its step is done
        self.rec = TraceRecorder(staging / TRACE_NAME.format(k=slot), mode=mode, producer=producer, flag="capture")

    def record(self, rnd: int, stage: str, value, **kw) -> None:
        self.rec.record(stage, value, round=rnd, **kw)

    def commit_staged(self) -> None:
        for rnd, stage, value, kw in self.staged:
            self.record(rnd, stage, value, **kw)
        self.staged = []

    def close(self, reason: str, incomplete: str | None = None) -> None:
        """Write the trace. `incomplete`: why it stops before its request ended (the engine raised, the process
        exited), kept in meta for doctor (TRACE_INCOMPLETE) with `complete: false`."""
        self.staged = []  # drafts no target verified: not part of any round
        if incomplete is None and reason not in COMPLETE_ENDS:
            incomplete = f"the request had not finished when its trace was closed ({reason})"
        if incomplete is not None:
            incomplete += f"; the trace stops after round {self.round}"
        self.rec.set_meta(finished=reason, rounds=self.round + 1, emitted_tokens=len(self.emitted),
                          complete=incomplete is None, incomplete=incomplete)  # fmt: skip
        if self.round < 0:
            self.rec.abort()  # nothing verified yet: no trace is better than an empty one
            note(f"request {self.req_id} ended ({reason}) before its prefill finished; not traced")
            return
        self.rec.close()


class EngineCapture:
    """The process-wide capture state every engine's hooks keep (vllm_hooks.Capture and sglang_hooks.Capture add
    what their engine's step holds): the requests traced, by the engine's request id; the ids already seen; whether
    the slots are all taken; one lock, since an engine may call hooks from more than one thread; notes said once."""

    def __init__(self, staging: Path, limit: int, mode: str, engine: str, version: str) -> None:
        self.staging, self.limit, self.mode, self.version = staging, limit, mode, version
        self.producer = producer(engine, version)
        self.traces: dict[str, TracedRequest] = {}
        self.seen: set[str] = set()
        self.exhausted = False  # every slot is taken (here or by another engine process), or nothing can be traced
        self.lock = threading.RLock()
        self.noted: set[str] = set()

    @property
    def idle(self) -> bool:
        """Nothing is left to do: the hooks then cost one check."""
        return self.exhausted and not self.traces

    def note_once(self, key: str, line: str) -> None:
        if key not in self.noted:
            self.noted.add(key)
            note(line)

    def drop(self, req_id: str, why: str) -> None:
        tr = self.traces.pop(req_id, None)
        if tr is not None:
            tr.rec.abort()
            note(f"request {req_id} (slot {tr.slot}) is not traced: {why}")

    def close(self, req_id: str, reason: str, incomplete: str | None = None) -> None:
        tr = self.traces.pop(req_id, None)
        if tr is None:
            return
        try:
            tr.close(tr.closing or reason, incomplete)
        except Exception as e:  # noqa: BLE001 - a trace that cannot be written is reported, serving goes on
            tr.rec.abort()
            note(f"request {req_id}: its trace could not be written: {type(e).__name__}: {e}")

    def close_all(self, reason: str) -> None:
        with self.lock:
            for req_id in list(self.traces):
                self.close(req_id, reason)

    def abandon_step(self) -> None:
        """Forget what the engine step in progress holds (after a hook failed); each engine's state says what."""


def guarded(fn):
    """A hook's recording step, run under the capture's lock. Any error drops the traces in flight and the step's
    state (EngineCapture.abandon_step) and never reaches the engine."""

    @functools.wraps(fn)
    def run(cap: EngineCapture, *a, **kw):
        try:
            with cap.lock:
                return fn(cap, *a, **kw)
        except Exception as e:  # noqa: BLE001 - the user's serving must not fail because a trace could not be made
            note(f"a capture hook failed ({fn.__name__}: {type(e).__name__}: {e}); the requests in flight are dropped")
            for req_id in list(cap.traces):
                cap.drop(req_id, "a hook failed")
            cap.abandon_step()
            return None

    return run


def claim_slot(staging: Path, limit: int) -> int | None:
    """The first free request slot below `limit` (claimed across every engine process by an atomic mkdir), or None
    when every slot is taken."""
    claims = staging / CLAIMS
    claims.mkdir(exist_ok=True)
    for k in range(limit):
        try:
            (claims / str(k)).mkdir()
            return k
        except FileExistsError:
            continue
    return None


def report_raised(staging: Path, line: str) -> None:
    """One traced request cut short because the engine's step raised: a note, and a line in raised.txt for
    `eaglescope capture`'s exit status."""
    note(line)
    try:
        with open(staging / RAISED, "a", encoding="utf-8") as f:
            f.write(line.replace("\n", " ") + "\n")
    except OSError:
        pass


@functools.lru_cache(maxsize=8)
def target_fingerprint(path: str) -> dict | None:
    """eaglescope's fingerprint of the served target directory (what doctor checks a trace's target against); None
    for a hub id or a directory eaglescope cannot read."""
    try:
        from eaglescope.models.targets.loading import fingerprint_of, read_config

        return fingerprint_of(Path(path), read_config(Path(path))).to_dict()
    except Exception:  # noqa: BLE001 - no fingerprint is said by its absence
        return None


def wrap(cls, name: str, make) -> None:
    """Replace method `name` of `cls` by `make(original)` (class level, once per process): the hooks' wrappers read
    what the engine computed around the method and never change its result."""
    orig = getattr(cls, name)
    setattr(cls, name, functools.wraps(orig)(make(orig)))


def rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) copied to the CPU now: engines reuse their buffers (and CUDA graphs their outputs) before a round
    is committed."""
    return t[a:b].detach().to("cpu", copy=True)
