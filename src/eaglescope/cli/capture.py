"""`eaglescope capture` (the capture: eaglescope.capture.command); its account goes to stderr, as the user's command
owns stdout."""

from __future__ import annotations

import sys

from eaglescope.capture import ENGINE_NAMES
from eaglescope.capture.command import capture


def _say(line: str) -> None:
    print(f"eaglescope capture: {line}", file=sys.stderr)


def cmd_capture(args) -> int:
    done = capture(args.command, args.out, args.requests, args.mode, args.layers, getattr(args, "engine", "vllm"))
    for line in done.notes:
        _say(f"note: {line}")
    short = f" of the {done.requested} asked for" if done.traces < done.requested else ""
    _say(f"{done.traces} trace(s){short} written to {done.out}; diagnose with: eaglescope doctor --target TARGET "
         f"--draft DRAFT --trace {done.first}")  # fmt: skip
    if done.exit_status:
        _say(f"warning: the command exited with status {done.exit_status}")
    if done.raised:
        # The command may have caught the error and gone on; the traces of those requests still stop early.
        engine = ENGINE_NAMES[done.engine]
        _say(f"warning: {engine}'s engine step raised while {len(done.raised)} traced request(s) were in flight; "
             "their traces stop there (marked incomplete: doctor reports TRACE_INCOMPLETE)")  # fmt: skip
        return done.exit_status or 1
    return done.exit_status
