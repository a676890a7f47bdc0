"""The library reports through `logging` (one logger per module, under "eaglescope"); this is the one handler.

`configure()` (the CLI calls it) writes each record as one line on stderr in the product's form,
`eaglescope: <message>` and `eaglescope: warning: <message>`, so that stdout carries only the command's result
(`--json` stays parseable) and an error stays a single line. The handler looks up `sys.stderr` when it writes,
not when it is made, so output follows a redirected stderr (pytest's capture, a caller's own).
"""

from __future__ import annotations

import logging
import sys

ROOT = "eaglescope"


class _StderrNow(logging.StreamHandler):
    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns one; the property ignores it
        pass


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = " ".join(record.getMessage().split())
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"{ROOT}: {level}{text}"


def configure(debug: bool = False) -> None:
    """One stderr handler on the "eaglescope" logger (idempotent): INFO and above, DEBUG with `debug`."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    logger.propagate = False  # an application's own root handlers would print each line twice
    if not any(isinstance(h, _StderrNow) for h in logger.handlers):
        handler = _StderrNow()
        handler.setFormatter(_OneLine())
        logger.addHandler(handler)


__all__ = ["configure"]
