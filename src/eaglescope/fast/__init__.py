"""GPU fast path: static slot caches, graph-captured decode and EAGLE-3 rounds, one host read per round.

The package's face imports its engine only when one of these names is asked for, so that importing one module of
the package (its layers, its kernels' availability) does not load every kernel module.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["FastEagle", "FastTarget", "FastVanilla", "SlotCache", "accept_greedy"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("eaglescope.fast.engine"), name)
    raise AttributeError(f"module 'eaglescope.fast' has no attribute {name!r}")
