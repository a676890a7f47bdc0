"""The round's state and the steps every backend shares: greedy acceptance, the hand-off to the next round, and the
order in which a round's stages reach a trace.

A round (decode/loop.py `speculative_round`) fills one `RoundState`: propose (the tree) → verify (the target's logits
and tap features over it) → accept (path, bonus, emitted tokens) → commit (the target KV of root + accepted nodes kept,
their features handed on). The draft side of proposing, catch-up and tree expansion, is `Eagle3Proposer` in
decode/speculative.py, and both backends call it. What a backend owns is how the steps run: the reference backend
(decode/loop.py) on any `Target`, eagerly, with exact-size tensors and sampled acceptance; the static-shape backend
(fast/engine.py) on slot caches, every shape fixed per tree budget, the whole round one CUDA graph on a GPU.

Written for both: every function here is device tensors in, device tensors out, with no host read and no shape that
depends on data, so the static backend can capture it; the reference backend passes exact-size tensors where the
static one passes tensors padded to the tree budget (the tensor "rows past the count are padding" below).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglescope import trace as T
from eaglescope.decode.tree import DraftTree
from eaglescope.decode.verify import VerifyResult, accept_greedy
from eaglescope.models.targets.llama import KVCache


@dataclass
class RoundState:
    """One round, as the steps fill it. N tree nodes (node 0 = the root, the last emitted token), V the target's
    vocabulary, nH the width of the target's concatenated taps, L = D + 1 on the static backend (root + up to D
    accepted nodes, padded) and exactly accepted + 1 on the reference one."""

    tree: DraftTree  # tokens [N] (target ids), parents [N], depths [N], the ancestor mask [N, N]
    logits: torch.Tensor | None = None  # [N, V] float: the target's prediction for the token after each node
    aux: torch.Tensor | None = None  # [N, nH]: the target's tap features of each node (None: it taps nothing)
    accepted: torch.Tensor | None = None  # [1] long: accepted draft tokens, the bonus excluded
    path: torch.Tensor | None = None  # [L] long: root + accepted nodes (rows past accepted + 1: padding)
    bonus: torch.Tensor | None = None  # [1] long: the target's token after the last accepted node
    emitted: torch.Tensor | None = None  # [L] long: the accepted tokens, then the bonus (padded with the bonus)

    def settle(self, result: VerifyResult) -> None:
        """Fill the acceptance from a host-side verdict (sampled or forced acceptance on the reference backend)."""
        dev = self.logits.device if self.logits is not None else self.tree.tokens.device
        self.path = torch.tensor(result.path, dtype=torch.long, device=dev)
        self.accepted = torch.tensor([len(result.accepted)], dtype=torch.long, device=dev)
        self.bonus = torch.tensor([result.bonus], dtype=torch.long, device=dev)
        self.emitted = torch.tensor(result.tokens, dtype=torch.long, device=dev)


# -- acceptance: verify.accept_greedy, and the tokens a round emits -----------------------------------------------
def emitted_tokens(tokens: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor):
    """tokens [N], path [L], accepted [1], bonus [1] → [L]: the accepted nodes' tokens, then the bonus (which also
    fills the padding rows): the tokens the round emits, and the token that follows each handed-on position."""
    j = torch.arange(path.shape[0], device=tokens.device)
    return torch.where(j < accepted, torch.cat([tokens[path[1:]], bonus]), bonus)


# -- the draft's slot cache ----------------------------------------------------------------------------------------
class SlotCache(KVCache):
    """Keys/values [L, B, n_kv, S, D] (values [.., Dv] where they differ, as in multi-head latent attention); `write`
    puts T new entries at `slots` [T] and returns the whole layer, so attention masks decide what is visible.

    Why slots: a round's keys go to positions that do not depend on how much was accepted (the static backend's
    shapes stay fixed), and a module given a slot tensor as its `start` runs unchanged on this cache."""

    @property
    def size(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer], self.v[layer]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src[j] → dst[j] for all layers; gathers first, so overlapping src/dst are safe."""
        for buf in (self.k, self.v):
            buf.index_copy_(3, dst, buf.index_select(3, src))


# -- the trace -----------------------------------------------------------------------------------------------------
def record_tree(rec, tree: DraftTree) -> None:
    """The tree sent to verify (after the draft stages, before the target's)."""
    rec.record(T.VERIFY_TOKENS, tree.tokens)
    rec.record(T.VERIFY_PARENTS, tree.parents)


def record_target(rec, aux: torch.Tensor, layers) -> None:
    """The target's features of the positions it processed: each tap (`layers`, in the contract's order), then their
    concatenation."""
    H = aux.shape[-1] // len(layers)
    for j, layer in enumerate(layers):
        rec.record(T.target_tap(layer), aux[:, j * H : (j + 1) * H])
    rec.record(T.TARGET_AUX, aux, segments=len(layers))


def record_verdict(rec, state: RoundState, handed_on: torch.Tensor | None) -> None:
    """What the round accepted, its bonus token, and the features handed to the next round (None: no proposer reads
    any)."""
    rec.record(T.VERIFY_ACCEPTED, state.path[1:])
    rec.record(T.VERIFY_BONUS, state.bonus)
    if handed_on is not None:
        rec.record(T.NEXT_HIDDEN_IN, handed_on)


def record_prefill(rec, record_target_fn, aux: torch.Tensor | None, first: torch.Tensor, layers=None) -> None:
    """Round 0: the target's features of the prompt, every layer's state when asked, the first token, and the
    features handed to round 1 (all of the prompt's)."""
    if aux is not None:
        record_target_fn(aux)
    if layers is not None:
        rec.record_layers(*layers)
    rec.record(T.VERIFY_BONUS, first)
    if aux is not None:
        rec.record(T.NEXT_HIDDEN_IN, aux)


class StageBuffers:
    """A round's stages kept on the device while it runs, for a trace written after the round is read (the static
    backend: a captured round cannot hand tensors to the host). `record` copies a stage into a buffer of its own
    (allocated on the first, uncaptured run, so a captured replay only copies); `flush` records them in the order they
    came, each cut to its real rows. `hold()` collects stages that are not buffered but prepended to the next flush's
    (the static backend's draft prefill, which the reference backend computes in round 1)."""

    def __init__(self, rec: T.TraceRecorder) -> None:
        self.rec = rec
        self._bufs: dict[tuple[str, str | None], tuple[torch.Tensor, dict]] = {}
        self._held: dict[tuple[str, str | None], torch.Tensor] | None = None
        self._prefix: dict[tuple[str, str | None], torch.Tensor] = {}

    def record(self, stage: str, tensor, **kw) -> None:
        parts = tensor.items() if isinstance(tensor, dict) else [(None, tensor)]
        for part, t in parts:
            key = (stage, part)
            if self._held is not None:
                self._held[key] = t.detach().clone()
                continue
            buf = self._bufs.get(key)
            if buf is None:
                buf = self._bufs[key] = (torch.empty_like(t), kw)
            buf[0].copy_(t)

    def hold(self, on: bool) -> None:
        if on:
            self._held = {}
        else:
            self._prefix, self._held = self._held or {}, None

    def flush(self, rows: dict[str, int]) -> None:
        """Record the buffered round: stage s cut to its first rows[s] rows where given, prefixed with held rows."""
        out: dict[str, dict] = {}
        kws: dict[str, dict] = {}
        for (stage, part), (buf, kw) in self._bufs.items():
            t = buf[: rows[stage]] if stage in rows else buf
            if (stage, part) in self._prefix:
                t = torch.cat([self._prefix[(stage, part)], t])
            out.setdefault(stage, {})[part] = t
            kws[stage] = kw
        self._prefix = {}
        for stage, parts in out.items():
            value = parts[None] if None in parts else parts
            self.rec.record(stage, value, **kws[stage])


__all__ = [
    "RoundState",
    "SlotCache",
    "StageBuffers",
    "accept_greedy",
    "emitted_tokens",
    "record_prefill",
    "record_target",
    "record_tree",
    "record_verdict",
]
