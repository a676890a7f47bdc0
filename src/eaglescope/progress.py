"""Progress of long steps, on stderr: a tqdm bar on a terminal; elsewhere (a log file, CI, a pipe) one plain line
every EAGLESCOPE_PROGRESS_EVERY seconds (default 30), so a 40-minute step never leaves an empty log. stdout is
never touched: `--json` output stays parseable."""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger(__name__)


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("EAGLESCOPE_PROGRESS_EVERY", "30")))
    except ValueError:
        return 30.0


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """`update(n)`, `set_postfix(**kw)`, `close()`; `enabled=False` shows nothing."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", initial: int = 0, enabled: bool = True):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.enabled = enabled
        self._bar = None
        self._postfix: dict = {}
        self._t0 = self._last = time.monotonic()
        self._start_n = initial
        self._every = _interval()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, leave=False)

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            now = time.monotonic()
            if now - self._last >= self._every:
                self._last = now
                self._line(now)

    def set_postfix(self, **kw) -> None:
        self._postfix = kw
        if self._bar is not None:
            self._bar.set_postfix(**kw)

    def _line(self, now: float) -> None:
        elapsed = now - self._t0
        parts = [f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{_clock(elapsed)} elapsed")
        done = self.n - self._start_n
        if self.total and done > 0 and self.n < self.total:
            parts.append(f"about {_clock(elapsed / done * (self.total - self.n))} left")
        parts += [f"{k}={v}" for k, v in self._postfix.items()]
        log.info("%s: %s", self.desc, ", ".join(parts))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


__all__ = ["Progress"]
