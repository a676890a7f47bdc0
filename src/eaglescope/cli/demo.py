"""`eaglescope demo` (the pipeline: eaglescope.demo). Its account of each step is the command's output, on stdout."""

from __future__ import annotations

import logging
import math
import sys

from eaglescope.demo import STEPS, DemoConfig, default_workdir, run_demo
from eaglescope.errors import EagleScopeError


class _StepsToStdout(logging.Handler):
    """Each step line as the demo wrote it (no prefix, indentation kept), on the stdout of the moment it is written."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stdout.write(record.getMessage() + "\n")
        sys.stdout.flush()


def _show_steps() -> None:
    STEPS.setLevel(logging.INFO)
    STEPS.propagate = False  # once on stdout, not again as a log line on stderr
    if not any(isinstance(h, _StepsToStdout) for h in STEPS.handlers):
        STEPS.addHandler(_StepsToStdout())


def cmd_demo(args) -> int:
    workdir = args.workdir or str(default_workdir())
    cfg = DemoConfig(workdir=workdir, fast=args.fast, seed=args.seed, scenario=args.scenario)
    if args.pretrain_steps is not None:
        if args.pretrain_steps < 10:
            raise EagleScopeError(f"--pretrain-steps must be >= 10, got {args.pretrain_steps}")
        cfg.pretrain_steps = args.pretrain_steps
    if args.time_budget is not None:
        if not (args.time_budget >= 0 and math.isfinite(args.time_budget)):
            raise EagleScopeError(f"--time-budget must be a number of seconds >= 0, got {args.time_budget}")
        cfg.pretrain_budget_s = args.time_budget or None
    _show_steps()
    res = run_demo(cfg)
    return 0 if res["identical"] else 1
