"""Fault injection for the formula tests of the trace diagnosis (tests/test_doctor_faults.py): each helper plants
exactly one wiring mistake into eaglescope's own decoding.

Three ways in:
- a target wrapper (`TapFault`) whose taps are mis-wired the way an engine's capture code can be:
  the wrong layer, the RMS-normed state, segments in the wrong order; per-tap stages keep the
  contract's labels, as an engine that believes it taps the right layers records them;
- a proposer subclass overriding one hook of `Eagle3Proposer` (`fault(...)`), optionally only from
  a given round on;
- a trace editor (`edit_trace`) that rewrites one recorded tensor, for mistakes a proposer cannot
  make without breaking the decoding loop itself (e.g. every tree row handed to the next round).

Some plants use the formula a hypothesis tests (`tile_project` is diagnose's tiled fc, the normed tap its `normed`
candidate): they test that formula, nothing more. Whether doctor names a fault made in an engine it did not write is
tests/test_independent_engine.py's claim, on tests/engines/plain_eagle3.py.

`oracle(cls, sequence)` makes any proposer send a tree that contains the target's own greedy
continuation next to distractor siblings, so that rounds accept several tokens at tree positions
other than the first rows: what the position bookkeeping needs to be visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.decode.loop import generate_speculative
from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.decode.tree import DraftTree
from eaglescope.decode.vanilla import generate_vanilla
from eaglescope.models.draft import LoadedDraft, load_draft
from eaglescope.models.targets.base import Target, TargetOutput
from eaglescope.taps import TapContract


# -- models --------------------------------------------------------------------------------------------
@dataclass
class Setup:
    """A target and the directory of a draft checkpoint made for it."""

    target: Target
    draft_dir: Path
    root: Path
    prompt: list[int]
    target_dir: Path | None = None  # the checkpoint the target was loaded from (for run_doctor)

    def draft(self, dtype: torch.dtype = torch.float32, target: Target | None = None) -> LoadedDraft:
        """A freshly loaded draft with the target's embedding (what decoding and doctor both start from)."""
        t = target or self.target
        loaded = load_draft(self.draft_dir, t.num_layers, device=t.device, dtype=dtype)
        if not loaded.has_embedding:
            loaded.model.load_target_embedding(target_embedding(t).to(dtype))
        return loaded


def input_norm(target: Target, i: int) -> torch.nn.Module:
    """Layer i's input RMSNorm (the same attribute path on the native and the transformers Llama)."""
    return target.model.model.layers[i].input_layernorm


# -- tap faults: a target whose capture is mis-wired ---------------------------------------------------
class TapFault:
    """Wraps a target; segment j of aux becomes `swap[j]` = ("hs", i) hidden state i or ("normed", i) layer i's
    input_layernorm(hs[i]), from the `from_round`-th forward on (0 = prefill). Everything else is delegated."""

    def __init__(self, inner: Target, swap: dict[int, tuple[str, int]], from_round: int = 0) -> None:
        self.inner, self.swap, self.from_round = inner, swap, from_round
        self.calls = 0
        self.taps: TapContract | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def set_taps(self, taps: TapContract | None) -> None:
        self.taps = taps
        L = self.inner.num_layers
        self.inner.set_taps(TapContract(tuple(range(L)), L))  # capture everything; pick per segment

    @torch.inference_mode()
    def forward(self, tokens, positions=None, tree_mask=None) -> TargetOutput:
        out = self.inner.forward(tokens, positions, tree_mask)
        H = self.inner.hidden_size
        active = self.calls >= self.from_round
        self.calls += 1
        segs = []
        for j, layer in enumerate(self.taps.layers):
            kind, i = self.swap[j] if active and j in self.swap else ("hs", layer)
            x = out.aux[:, i * H : (i + 1) * H]
            if kind == "normed":
                x = input_norm(self.inner, i)(x)
            segs.append(x)
        return TargetOutput(out.logits, torch.cat(segs, dim=-1))


# -- proposer faults -----------------------------------------------------------------------------------
def fault(hook: str, impl, from_round: int = 1, name: str | None = None) -> type[Eagle3Proposer]:
    """An Eagle3Proposer whose `hook` is `impl(self, *args)` from draft round `from_round` on (1 = first)."""

    def method(self, *args):
        if self.round >= from_round:
            return impl(self, *args)
        return getattr(Eagle3Proposer, hook)(self, *args)

    return type(name or f"Fault_{hook}", (RoundCounting,), {hook: method})


class RoundCounting(Eagle3Proposer):
    """Counts rounds as the trace does (0 = prefill, r = the r-th propose and its verify) so that a fault
    can start late; hooks called from accepted() (next_round_features, paired_tokens) see the verify's round."""

    round = 0

    def propose(self, tokens, root_position):
        self.round += 1
        return super().propose(tokens, root_position)


def tile_project(p: Eagle3Proposer, x: torch.Tensor) -> torch.Tensor:
    """fc over H-wide features tiled to the fc's width: a second projection of already-projected features."""
    n = p.draft.fc.weight.shape[1] // x.shape[-1]
    return p.draft.project(torch.cat([x] * n, dim=-1))


def scaled_embedding(p: Eagle3Proposer) -> torch.Tensor:
    """The target's token table times sqrt(H): an embedding scaled as Gemma-style models scale theirs, applied where
    the draft was trained without it."""
    w = p.draft.embed_tokens.weight
    return w * w.shape[1] ** 0.5


class OwnPositionTokens(RoundCounting):
    """Pairs each feature with the token at its own position (the previous one) instead of the next."""

    shift_from_round = 1

    def start(self, prompt_ids, prefill, first_token) -> None:
        self._prev = prompt_ids[0]
        super().start(prompt_ids, prefill, first_token)

    def paired_tokens(self, following):
        following = following.to(self.device)
        own = torch.cat([torch.tensor([self._prev], device=self.device), following[:-1]])
        self._prev = int(following[-1])
        # these tokens are consumed by the next round's step 0
        return own if self.round + 1 >= self.shift_from_round else following


def oracle(cls: type[Eagle3Proposer], sequence: list[int]) -> type[Eagle3Proposer]:
    """`cls` that sends a tree holding the target's greedy continuation (`sequence` = prompt + continuation)
    with a wrong sibling before each right node, so the accepted path is not the first rows in tree order.
    The draft still runs (and records) its own steps; only the tree sent to the target changes."""

    def propose(self, tokens, root_position):
        own = super(cls_o, self).propose(tokens, root_position)
        assert sequence[: len(tokens)] == list(tokens), "the run left the greedy continuation"
        nxt = sequence[len(tokens) : len(tokens) + self.depth]
        V = self.draft.config.vocab_size
        toks, parents, last = [tokens[-1]], [-1], 0
        for t in nxt:
            if len(toks) + 2 > self.total_tokens:
                break
            toks += [(t + 1) % V, t]
            parents += [last, last]
            last = len(toks) - 1
        if len(toks) == 1:
            return own
        return DraftTree.from_parents(torch.tensor(toks, device=self.device), torch.tensor(parents))

    cls_o = type(f"Oracle{cls.__name__}", (cls,), {"propose": propose})
    return cls_o


def greedy_sequence(target: Target, prompt: list[int], n: int) -> list[int]:
    t = target.inner if isinstance(target, TapFault) else target
    taps = t.taps
    out = generate_vanilla(t, prompt, n, stop_ids=[])
    t.set_taps(taps)
    return list(prompt) + list(out.token_ids)


# -- recording -----------------------------------------------------------------------------------------
def record(
    setup: Setup,
    out: Path,
    proposer_cls: type[Eagle3Proposer] = Eagle3Proposer,
    shape: tuple[int, int, int] = (3, 3, 8),
    max_new_tokens: int = 14,
    mode: str = "full",
    target=None,
    dtype: torch.dtype = torch.float32,
    accept: bool = False,
):
    """Decode the setup's prompt with `proposer_cls` (and optionally a wrapped target) and record a trace.
    `accept=True` sends oracle trees so that rounds accept. Returns (trace path, GenerationResult)."""
    target = target or setup.target
    inner = target.inner if isinstance(target, TapFault) else target
    loaded = setup.draft(dtype=dtype, target=inner)
    target.set_taps(loaded.contract.taps)
    if accept:
        proposer_cls = oracle(proposer_cls, greedy_sequence(target, setup.prompt, max_new_tokens + 8))
        target.set_taps(loaded.contract.taps)
    depth, top_k, total = shape
    rec = T.TraceRecorder(out, mode=mode, producer="faults")
    rec.set_meta(prompt_ids=setup.prompt, settings={"tree": f"{depth},{top_k},{total}"})
    p = proposer_cls(loaded.model, depth, top_k, total, max_len=len(setup.prompt) + max_new_tokens + 4, recorder=rec)
    try:
        res = generate_speculative(target, p, setup.prompt, max_new_tokens, stop_ids=[], recorder=rec)
    except BaseException:
        rec.abort()
        raise
    return rec.close(), res


def edit_trace(src: Path, dst: Path, edits: dict) -> Path:
    """Copy a full-mode trace, replacing tensors: `edits[(stage, round)] = fn(tensor, trace) -> tensor`."""
    tr = T.load_trace(src)
    rec = T.TraceRecorder(dst, mode=tr.mode, producer=tr.producer + "+edited")
    rec.set_meta(**tr.meta)
    for ev in tr:
        x = tr.load(ev)
        fn = edits.get((ev.stage, ev.round))
        if fn is not None:
            x = fn(x, tr)
        rec.record(ev.stage, x if ev.part is None else {ev.part: x}, round=ev.round, segments=ev.segments)
    return rec.close()


def permute_segments(order: list[int]):
    """Trace edit: segments of a [T, nH] tensor in `order`."""

    def fn(x: torch.Tensor, tr) -> torch.Tensor:
        segs = x.chunk(len(order), dim=-1)
        return torch.cat([segs[j] for j in order], dim=-1)

    return fn


def aux_of_round(r: int) -> dict:
    """Trace edits: round r's next.hidden_in := every row of round r's target.aux (no filtering at all)."""
    return {(T.NEXT_HIDDEN_IN, r): lambda x, tr: tr.get(T.TARGET_AUX, round=r)}
