"""GPU fast path: static slot caches, graph-captured decode and EAGLE-3 rounds, one host read per round."""

from eaglescope.fast.engine import FastEagle, FastTarget, FastVanilla, SlotCache, accept_greedy

__all__ = ["FastEagle", "FastTarget", "FastVanilla", "SlotCache", "accept_greedy"]
