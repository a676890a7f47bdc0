"""The `eaglescope` command line: the only code that reads argparse or writes to stdout.

Each subcommand is a `cmd_*` function in a module of this package (named in parsers.py, imported when it runs); the
library below reports through `logging`, whose one stderr handler `main` installs (eaglescope.log). Errors become
one stderr line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import warnings

from eaglescope.cli.parsers import add_parsers
from eaglescope.errors import EagleScopeError
from eaglescope.log import configure as configure_logging


class _Parser(argparse.ArgumentParser):
    """argparse with the product's error form: one `eaglescope: error:` line and exit 2 (not usage + error)."""

    def error(self, message: str):
        self.exit(
            2, f"eaglescope: error: {self.prog.removeprefix('eaglescope ')}: {message} (see {self.prog} --help)\n"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="eaglescope", description="Train, serve and debug EAGLE-3 draft models.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    return parser


def _command(func):
    """A subcommand's function, named "module:function" and imported now (see parsers.py)."""
    module, name = func.split(":")
    return getattr(importlib.import_module(module), name)


def _quiet_transformers() -> None:
    # Loading reports and progress bars from transformers would bury our one-line errors.
    try:
        from transformers.utils import logging as hf_logging  # after parsing: --help and flag errors stay instant

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


class _Interrupts:
    """Ctrl-C as KeyboardInterrupt, remembered: a KeyboardInterrupt raised while C code is running (torch's tensor
    construction, for one) can come out as another exception, and the user who pressed Ctrl-C is still owed
    "interrupted" and exit 130, not an internal error."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self):
        # Only where Python's own default handler stands (not where a parent asked for SIGINT to be ignored, nor
        # off the main thread, where signal handlers cannot be set), and only while the command runs.
        own = threading.current_thread() is threading.main_thread()
        own = own and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if own:
            signal.signal(signal.SIGINT, self)
        try:
            yield self
        finally:
            if own:
                signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = os.environ.get("EAGLESCOPE_DEBUG") == "1"
    configure_logging(debug)
    if not debug:
        warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
        _quiet_transformers()
    # Warnings are held back while the command runs: after a success each becomes one `eaglescope: warning:`
    # line; after a failure they are dropped, so the error stays the single line on stderr.
    with _Interrupts().installed() as interrupts, warnings.catch_warnings(record=True) as caught:
        if not debug:
            warnings.simplefilter("always")
        try:
            rc = int(_command(args.func)(args) or 0)
        except EagleScopeError as e:
            print(f"eaglescope: error: {_one_line(e)}", file=sys.stderr)
            return _exit_with(2)
        except KeyboardInterrupt:
            print("eaglescope: interrupted", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 - a bug, but the user still gets one line and a way to see more
            if interrupts.seen and not debug:
                print("eaglescope: interrupted", file=sys.stderr)
                return 130
            if debug:
                raise
            print(
                f"eaglescope: internal error: {type(e).__name__}: {_one_line(e)} (set EAGLESCOPE_DEBUG=1 for a "
                "traceback)",
                file=sys.stderr,
            )
            return _exit_with(3)  # distinct from doctor's 1 (findings) and bad input's 2
    seen = set()
    for w in caught:
        text = _one_line(w.message)
        if text not in seen and _ours(w):
            seen.add(text)
            print(f"eaglescope: warning: {text}", file=sys.stderr)
    return _exit_with(rc)


def _exit_with(rc: int) -> int:
    """`rc`, or, in a process whose gloo threads may still run, the process's end with `rc` without the
    interpreter's teardown. Those threads abort a finalizing interpreter ("terminate called without an active
    exception", SIGABRT or SIGSEGV, though the command finished): after an error ~1 run in 20 of a two-rank CPU job,
    after a success ~1 in 100 under load (torch 2.13). Which processes: one whose group is still up (a rank that
    stopped on an error), and any rank of a multi-process torchrun job, since ending the group does not end its
    threads where DDP wrapped a model (DDP's C++ reducer keeps the group alive; docs/distributed.md). Every
    `finally` and the command's own cleanup have run by now; only stdio is left to flush."""
    dist = sys.modules.get("torch.distributed")  # never imported: no group
    if dist is None or not dist.is_available():
        return rc
    if not (dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return rc
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _one_line(e: object) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _ours(w: warnings.WarningMessage) -> bool:
    """Warnings eaglescope raised for the user (libraries' deprecation chatter is not the user's business)."""
    return "eaglescope" in (w.filename or "") and not issubclass(w.category, DeprecationWarning)


__all__ = ["main", "build_parser"]
