"""Static-shape decoding on eaglescope's own modules (LlamaModel, Eagle3Draft): no second model definition.

Why static: a batch-1 decode step of a small target is a few hundred tiny kernels, so launch overhead and
host syncs decide the speed. Every buffer here has a fixed shape per tree budget, every index that varies
(cache length, slots, positions) lives in a device tensor, and a whole EAGLE-3 round — draft catch-up,
tree expansion, target verify, greedy acceptance, KV compaction, next round's features — is one function
that can be captured as one CUDA graph. The host reads one small tensor per round: how many tokens came out
and which.

The round's steps are not written here: the draft side (catch-up, tree expansion, hand-off) is
decode/speculative.py's Eagle3Proposer, acceptance decode/verify.py's accept_greedy, the trace's stages
decode/round.py's (docs/architecture.md). This backend owns how they run: slot caches (decode/round.py SlotCache:
LlamaModel / Eagle3Draft pass their `start` argument straight to `cache.write`, so a slot tensor as `start` runs the
unchanged modules on them), the target verify over them, the KV keep by moving the kept slots, tensors padded to the
tree budget, and the capture.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

import eaglescope.fast.invariant as inv
from eaglescope import trace as T
from eaglescope.decode.loop import RoundReport, Runner, decode, speculative_round
from eaglescope.decode.round import (
    RoundState,
    SlotCache,
    StageBuffers,
    emitted_tokens,
    record_prefill,
    record_target,
    record_tree,
    record_verdict,
)
from eaglescope.decode.speculative import DraftState, Eagle3Proposer
from eaglescope.decode.tree import DraftTree
from eaglescope.decode.verify import accept_greedy
from eaglescope.fast.draft_pieces import FusedPieces, compiled_pieces
from eaglescope.fast.fused_decode import FusedDecode, attend_fused
from eaglescope.fast.fused_draft import FusedDraftStep, fused_draft_supported
from eaglescope.fast.fused_verify import MAX_ROWS, FusedVerify
from eaglescope.fast.layers import Float32Logits, GemvLinear, allow_recompiles, argmax_rows, compile_layers
from eaglescope.fast.tuning import BUILT_IN, tuning_for
from eaglescope.models.draft import Eagle3Draft
from eaglescope.models.targets.llama import LlamaModel, QKVProjection, RMSNorm, fuse_projections

log = logging.getLogger(__name__)

ATTENTION = {"invariant": inv.invariant_attention, "fused": attend_fused}  # the fast path's kernels


def set_attention(model: nn.Module, impl: str) -> nn.Module:
    """Every attention of `model` through target.llama.attend: "sdpa" or "matmul" (its own forms), "invariant"
    (fast/invariant.py) or "fused" (fast/fused_decode.py); returns `model`."""
    fn = ATTENTION.get(impl, impl)
    for m in model.modules():
        if isinstance(m, QKVProjection):
            m.attention_impl = fn
    return model


def use_matmul_attention(model: nn.Module, enable: bool = True) -> nn.Module:
    """Masked attention as two products + softmax in every layer of `model` (see attend), or back to SDPA with
    enable=False; returns `model`."""
    return set_attention(model, "matmul" if enable else "sdpa")


def use_batch_invariant(model: LlamaModel, enable: bool = True, sliced: bool = True) -> LlamaModel:
    """Run every product, norm and attention of `model` through the batch-invariant kernels (fast/invariant.py),
    or back with enable=False (in place); returns `model`. Float32Logits keeps float32 logits. `sliced`: large
    products with K-sliced reductions (invariant.k_slices)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not enable:
                if isinstance(child, inv._Swapped):
                    setattr(parent, name, child.original)
            elif type(child) in (nn.Linear, GemvLinear):
                setattr(parent, name, inv.InvariantLinear(child, sliced=sliced))
            elif isinstance(child, Float32Logits):
                setattr(parent, name, inv.InvariantLinear(child, out_dtype=torch.float32, sliced=sliced))
            elif isinstance(child, RMSNorm):
                setattr(parent, name, inv.InvariantRMSNorm(child))
    return set_attention(model, "invariant" if enable else "sdpa")


class FastTarget:
    """A LlamaModel run on a SlotCache: prefill, and a static-shape step for T tokens at given slots."""

    def __init__(
        self,
        model: LlamaModel,
        size: int,
        taps: tuple[int, ...] = (),
        compile: bool = False,
        fuse: bool = False,
        float32_logits: bool = False,
        batch_invariant: bool = False,
        fused_decode: bool = False,
        fused_verify: bool = False,
        graph_prefill: bool | None = None,
    ) -> None:
        """`fuse` merges q/k/v and gate/up weights in place (the model is then for inference only); `compile`
        compiles each decoder layer (see compile_layers); `float32_logits` swaps in a Float32Logits lm_head;
        `batch_invariant` runs the model on the batch-invariant kernels (use_batch_invariant), so a token's
        logits are bit-identical whether it is decoded alone or verified in a tree; `fused_decode` runs one-token
        steps through fast/fused_decode.py (five kernels per layer; needs `fuse`), longer ones on the modules;
        `fused_verify` runs 2..64-token steps in the same layout on tensor cores (fast/fused_verify.py; untimed);
        `graph_prefill` (default: with `fused_verify` on a GPU) prefills prompts through it in PREFILL_ROWS-row
        chunks, one captured graph replayed per chunk on a GPU (prefill)."""
        if batch_invariant and compile:
            raise ValueError("batch_invariant runs the target uncompiled (inductor would re-fuse its kernels)")
        if batch_invariant and (fused_decode or fused_verify):
            raise ValueError("fused_decode has its own reduction order: a verify would not reproduce its steps bitwise")
        self.model = model.eval()
        if float32_logits and not isinstance(model.lm_head, Float32Logits):
            model.lm_head = Float32Logits(model.lm_head)
        if fuse:
            fuse_projections(model)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            use_batch_invariant(model)
        a = model.args
        p = model.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        self.taps = tuple(taps)
        self.cache = SlotCache(a.num_layers, 1, a.num_kv_heads, size, a.head_dim, p.dtype, p.device)
        self.size = size
        self._run = self._run_eager
        if compile:
            compile_layers(model.model.layers)
        self.fused = None
        if fused_decode:
            self.fused = FusedDecode(model, self.cache, self.taps)
        self.fused_rows = None
        self.tuning = tuning_for(self.device) if fused_verify else BUILT_IN
        if fused_verify:  # with this GPU's tuned settings by row count, where a tuning file has them
            self.fused_rows = FusedVerify(model, self.cache, self.taps, by_rows=self.tuning.verify)
        if graph_prefill is None:
            graph_prefill = self.fused_rows is not None and self.device.type == "cuda"
        if graph_prefill and self.fused_rows is None:
            raise ValueError("graph_prefill runs the prompt through the fused verify: it needs fused_verify")
        self.graph_prefill = graph_prefill
        self._chunk: _PrefillChunk | None = None  # the captured chunk, at the first graphed prefill

    def _forward(self, tokens, positions, mask, slots, taps):
        if self.batch_invariant:
            mask = inv.KeyIndex.from_mask(mask)
        else:
            mask = mask[None, None]
        logits, aux, final = self.model(tokens[None], positions[None], mask, self.cache, slots, taps)
        return logits[0], None if aux is None else aux[0], final[0]

    def _run_eager(self, tokens, positions, mask, slots):
        return self._forward(tokens, positions, mask, slots, self.taps)[:2]

    def run(
        self, tokens, positions, mask, slots, limit: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens/positions/slots [T], mask [T, size] bool → logits [T, V], aux [T, nH] | None. `limit` [1] int32,
        where the caller knows it: one past the highest slot `mask` allows (FusedVerify's flash attention)."""
        if self.fused is not None and tokens.shape[0] == 1:
            return self.fused(tokens, positions, mask[0], slots)
        if self.fused_rows is not None and self.fused_rows.supports_rows(tokens.shape[0]):
            return self.fused_rows(tokens, positions, mask, slots, limit)
        return self._run(tokens, positions, mask, slots)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor):
        """The prompt's logits [P, V] and tap features [P, nH] | None, its K/V in slots 0..P-1. With graph_prefill,
        in chunks of PREFILL_ROWS rows, each one replay of a captured fused verify (_PrefillChunk); else one eager
        forward of the modules (compiled where the layers are), as a prompt too long for the chunks' padding is."""
        n = prompt.shape[0]
        if self.graph_prefill and -(-n // PREFILL_ROWS) * PREFILL_ROWS <= self.size:
            try:
                if self._chunk is None:
                    self._chunk = _PrefillChunk(self)
                return self._chunk.prefill(prompt)
            except Exception as e:  # a failed capture must not take the decoder down: the modules do the same
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                log.warning("the graphed prefill failed (%s); prompts prefill on the modules", e)
                self.graph_prefill, self._chunk = False, None
        slots = torch.arange(n, device=self.device)
        mask = torch.arange(self.size, device=self.device)[None, :] <= slots[:, None]
        return self._run_eager(prompt, slots, mask, slots)

    @torch.inference_mode()
    def prefill_layers(self, prompt: torch.Tensor):
        """The prefill with every layer tapped → (logits, aux of the taps, the states entering each layer, the
        final normed state, each layer's input RMSNorm of its state): what a trace's target.layer.* records."""
        slots = torch.arange(prompt.shape[0], device=self.device)
        mask = torch.arange(self.size, device=self.device)[None, :] <= slots[:, None]
        layers = self.model.model.layers
        H = self.model.args.hidden_size
        logits, every, final = self._forward(prompt, slots, mask, slots, tuple(range(len(layers))))
        states = list(every.split(H, dim=-1))
        aux = torch.cat([states[i] for i in self.taps], dim=-1)
        return logits, aux, states, final, [layer.input_layernorm(h) for layer, h in zip(layers, states, strict=True)]


# the graphed prefill's chunk: the fused verify's most rows, so a 64-token prompt is one replay
PREFILL_ROWS = MAX_ROWS


class _PrefillChunk:
    """One fused verify of PREFILL_ROWS prompt rows at slots start..start+PREFILL_ROWS-1 (their positions), captured
    as a CUDA graph whose inputs are a token buffer and the chunk's start. Why: eagerly the fused verify is ~300
    Python-side kernel launches, so a 64-token prefill took 10.5 ms of host time on an H100 where its kernels take
    6.4 (bench-roofline-20261205T185259.json); the modules' compiled prefill 10.9. A chunk shorter than
    PREFILL_ROWS is padded: the pad rows' K/V land in the slots after the prompt, which no step reads before it
    writes them itself (a verify's mask allows only the context and its own rows), and their outputs are dropped."""

    def __init__(self, target: FastTarget) -> None:
        dev = target.device
        self.tokens = torch.zeros(PREFILL_ROWS, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self._rows = torch.arange(PREFILL_ROWS, device=dev)
        self._slot_ids = torch.arange(target.size, device=dev)
        self.verify = target.fused_rows
        self.out: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # on a CPU (the tests, under Triton's interpreter) the same chunks run uncaptured
        self.graph = _graph(self._chunk) if dev.type == "cuda" else None

    def _chunk(self) -> None:
        slots = self.start + self._rows
        mask = self._slot_ids[None, :] <= slots[:, None]
        self.out = self.verify(self.tokens, slots, mask, slots)

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, aux = [], []
        for c in range(0, prompt.shape[0], PREFILL_ROWS):
            rows = min(PREFILL_ROWS, prompt.shape[0] - c)
            self.tokens[:rows].copy_(prompt[c : c + rows])
            self.tokens[rows:].zero_()
            self.start.fill_(c)
            if self.graph is not None:
                self.graph.replay()
            else:
                self._chunk()
            logits.append(self.out[0][:rows].clone())  # the graph's outputs are rewritten by the next replay
            if self.out[1] is not None:
                aux.append(self.out[1][:rows].clone())
        return torch.cat(logits), torch.cat(aux) if aux else None


def _graph(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Capture `fn` (after warm-up on a side stream, as CUDA graphs require) into a graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@dataclass
class Decoded:
    tokens: list[int]
    seconds: float
    accepted: list[int] = field(default_factory=list)  # per round, bonus excluded (speculative only)


class FastVanilla(Runner):
    """Greedy decoding as the speculative loop with no proposer: a round is one target step on the slot cache
    (graph-captured), and a launch queues `chunk` of them, so the host reads the tokens only every chunk."""

    def __init__(self, target: FastTarget, max_new: int, use_graph: bool | None = None) -> None:
        self.t = target
        dev = target.device
        self.max_new = max_new
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.i = torch.zeros(1, dtype=torch.long, device=dev)
        self.out = torch.zeros(max_new + 1, dtype=torch.long, device=dev)
        self.slots_all = torch.arange(target.size, device=dev)
        self.tree = DraftTree(
            self.tok, torch.full_like(self.tok, -1), torch.zeros_like(self.tok), torch.zeros(1, device=dev)
        )
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        self.graph = None
        self.chunk = max_new
        self._done = self._remaining = 0
        self._pending: list[tuple[int, int]] = []

    # -- the round: the root alone ---------------------------------------------------------------------------------
    def propose(self) -> RoundState:
        return RoundState(self.tree)

    def verify(self, state: RoundState) -> None:
        mask = (self.slots_all <= self.pos)[None, :]
        state.logits = self.t.run(state.tree.tokens, self.pos, mask, self.pos)[0]

    def accept(self, state: RoundState) -> None:
        # greedy acceptance of a tree of the root alone: nothing to accept, the bonus is the argmax
        state.bonus = state.emitted = argmax_rows(state.logits[-1:])

    def commit(self, state: RoundState) -> None:
        self.out.index_copy_(0, self.i, state.bonus)
        self.tok.copy_(state.bonus)
        self.pos.add_(1)
        self.i.add_(1)

    @torch.inference_mode()
    def _step(self) -> None:
        speculative_round(self)

    # -- running rounds ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self, prompt: list[int]) -> None:
        logits, _ = self.t.prefill(torch.tensor(prompt, device=self.t.device))
        self.tok.copy_(logits[-1:].argmax(-1))
        self.out[:1].copy_(self.tok)
        self.pos.fill_(len(prompt))
        self.i.fill_(1)

    def prepare(self, prompt_ids: list[int], budget: int) -> None:
        if budget > self.max_new:
            raise ValueError(f"{budget} new tokens exceed this decoder's buffer of {self.max_new}")
        if len(prompt_ids) + budget + 1 > self.t.size:
            raise ValueError(f"prompt {len(prompt_ids)} + {budget} new tokens exceed the cache of {self.t.size}")
        if self.use_graph and self.graph is None:
            self._prefill(prompt_ids)
            self.graph = _graph(self._step)

    def start(self, prompt_ids, budget) -> int:
        self._prefill(prompt_ids)
        self._done, self._remaining, self._pending = 1, budget - 1, []
        return int(self.out[0])

    def launch(self) -> None:
        k = max(1, min(self.chunk, self._remaining))
        for _ in range(k):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
        self._pending.append((self._done, self._done + k))
        self._done += k
        self._remaining -= k

    def read(self) -> RoundReport:
        a, b = self._pending.pop(0)
        return RoundReport(self.out[a:b].tolist(), 0, 0, 0)

    @torch.inference_mode()
    def generate(
        self, prompt: list[int], max_new: int | None = None, stop: set[int] | None = None, check_every: int = 16
    ) -> Decoded:
        """Greedy tokens; with `stop`, ends after the first stop token (read every `check_every` steps, so
        the loop stays free of per-token host syncs)."""
        n = max_new or self.max_new
        self.chunk = check_every if stop else n
        res = decode(self, prompt, n, n, set(stop or ()), self.t.device)
        return Decoded(res.token_ids, res.seconds)


class FastEagle(Runner):
    """EAGLE-3 greedy speculative decoding on the static-shape backend: `speculative_round` over device tensors
    only, captured as one CUDA graph; one host read per round, the next round queued before that read.

    The round's steps are the shared ones: the draft side is `Eagle3Proposer.catch_up` / `expand` (decode/
    speculative.py, through `draft_tree`) on tensors padded to the tree budget, acceptance `accept_greedy`, the
    hand-off `Eagle3Proposer.hand_on` into the proposer's padded `DraftState`; this backend owns the slot caches, the
    target verify and the KV keep. `replay` (a list of accepted lengths) forces the acceptance instead of checking
    tokens: every network still runs, so a replayed run pays every cost of a real one (used at 8B scale)."""

    run_ahead = True

    def __init__(
        self,
        target: FastTarget,
        draft: Eagle3Draft,
        depth: int,
        top_k: int,
        total_tokens: int,
        max_len: int,
        use_graph: bool | None = None,
        replay: bool = False,
        compile: bool = False,
        recorder: T.TraceRecorder | None = None,
        trace_layers: bool = False,
        proposer_cls: type[Eagle3Proposer] = Eagle3Proposer,
        fused_draft: bool | None = None,
    ) -> None:
        """`compile` torch.compiles the draft side of a round and the acceptance (not the target: compile its layers
        through FastTarget). `fused_draft` runs the draft layer on fast/fused_draft.py's kernels (the catch-up and
        every tree level; with `compile`, the pieces around it compile); None: wherever the target's verifies run
        the fused kernels and the draft is one they run (on an H200 at 8B a round 7.05 → 6.76 ms: fewer launches
        and gaps for the same weight reads). `recorder` records every round as a trace: each stage tensor is copied,
        inside the (captured) round, into a buffer of its own, and the host records the buffers after reading the
        round; rounds then run one at a time, uncompiled. `trace_layers`: the trace also records every layer's
        state of the prefill (TraceRecorder.record_layers). `proposer_cls`: the draft side's class (a subclass
        overriding one hook runs that wiring on this backend)."""
        self.t, self.draft = target, draft
        self.rec, self.trace_layers = recorder, trace_layers
        self.stages = StageBuffers(recorder) if recorder is not None else None
        self.D, self.K, self.N = depth, top_k, total_tokens
        self.Pmax = depth + 1  # root + at most `depth` accepted positions feed the next catch-up
        dev = self.device = target.device
        if target.size < max_len + total_tokens + self.Pmax:
            raise ValueError(f"target cache {target.size} < {max_len + total_tokens + self.Pmax} needed")
        # the catch-up's pad rows land past the context: the draft's context region is Pmax longer than max_len
        self.proposer = proposer_cls(draft, depth, top_k, total_tokens, max_len + self.Pmax, recorder=self.stages)
        if fused_draft is None:
            fused_draft = target.fused_rows is not None and fused_draft_supported(draft) is None
        # the draft layer's own kernels (fast/fused_draft.py), or None: the modules
        self.fused_layer: FusedDraftStep | None = None
        if fused_draft:
            tuned = tuning_for(dev)
            self.fused_layer = FusedDraftStep(draft, self.proposer.cache, max(self.Pmax, top_k),
                                              k_splits=tuned.draft_k_splits, stream=tuned.draft_stream)  # fmt: skip
        self.composed = self.proposer.own_pieces()  # compiled by compile_draft
        self.fused: FusedPieces | None = None  # the pieces on the fused layer (hand_pieces)
        self.hand_pieces()
        c = draft.config
        nH = c.num_aux * c.target_hidden_size
        z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
        self.t_len = z(1)
        self.force = z(1)
        # what a round hands the next, padded to the most positions one round keeps (root + depth accepted)
        self.proposer.state = DraftState(z(self.Pmax, nH, dt=target.dtype), z(self.Pmax), z(1), z(1), z(1), padded=True)
        self.round_n = z(
            1
        )  # with a recorder: this round's pending count, for the trace (the state's is the next one's)
        self.report = z(self.Pmax + 1)  # [n_emitted, emitted tokens (padded)]
        self._reports = torch.zeros(2, self.Pmax + 1, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if dev.type == "cuda" else []
        self.max_len = max_len
        self.t_slots = torch.arange(target.size, device=dev)
        self.replay = replay
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        self.graph = None
        self._accept_fn, self._commit_fn = self._accept, self._commit
        self._verify_inputs_fn = self._verify_inputs
        self.compiled = False  # whether the draft side and acceptance run compiled (False after a fallback)
        if recorder is not None:
            self.run_ahead, compile = False, False  # a recorded round is read before the next one runs
        if compile:
            # a round's draft side is several hundred small kernels (the draft layer's norms, RoPE and SwiGLU at
            # every level, the tree's topk, scatters and sorts): compiled they are about a third as many. The pieces
            # compile one by one, so a tree level compiles once and runs at every depth (compiled_pieces); the
            # round around them stays plain Python, which the CUDA graph removes anyway.
            allow_recompiles()
            self.compile_draft()
            self._accept_fn = torch.compile(self._accept, dynamic=False)
            self._commit_fn = torch.compile(self._commit, dynamic=False)
            # eagerly the verify's mask over the whole target cache is ~10 small kernels, compiled one
            self._verify_inputs_fn = torch.compile(self._verify_inputs, dynamic=False)
            self.compiled = True
        self._prompt_len = 0
        self._launched = self._read = 0
        self._forced: list[int] | None = None

    def hand_pieces(self) -> None:
        """Hand the proposer the pieces it calls: `composed`, around the fused layer where there is one (FusedPieces,
        which reads the layer's `one_launch` here: call again after switching it)."""
        self.fused = None if self.fused_layer is None else FusedPieces(self.proposer, self.fused_layer, self.composed)
        self.proposer.pieces = self.composed if self.fused is None else self.fused.pieces

    def compile_draft(self, backend: str = "inductor") -> None:
        """torch.compile the draft side's pieces that run every round at fixed shapes (compiled_pieces)."""
        self.composed = compiled_pieces(self.proposer.own_pieces(), backend)
        self.hand_pieces()

    def set_one_launch(self, enable: bool) -> None:
        """The fused layer's one-launch level inputs, tree start and finalize on (where they apply) or off."""
        self.fused_layer.one_launch = enable
        self.hand_pieces()

    # -- the round's operations (device tensors only: the whole round is one graph) --------------------------------
    def _draft_tree(self):
        """The shared draft side over the pending positions (padded to Pmax) → the tree's tensors."""
        p = self.proposer
        if self.stages is not None:
            self.round_n.copy_(p.state.count)
        tree = p.draft_tree(self.t_len)
        if self.stages is not None:
            record_tree(self.stages, tree)
        return tree.tokens, tree.parents, tree.depths, tree.scores, tree.mask

    def _accept(self, tokens, parents, depths, tmask, logits):
        """Greedy acceptance without host syncs → (accepted count [1], path [D+1], bonus [1], emitted [D+1])."""
        force = self.force if self.replay else None
        a, path, bonus = accept_greedy(tokens, parents, depths, tmask, argmax_rows(logits), self.D, force)
        return a, path, bonus, emitted_tokens(tokens, path, a, bonus)

    def _commit(self, a, path, bonus, emitted, aux) -> None:
        """Keep root + accepted KV (contiguous after the context), hand their features and tokens on."""
        j = torch.arange(self.Pmax, device=self.device)
        self.t.cache.move(self.t_len + path, self.t_len + j)
        self.proposer.hand_on(aux, path, emitted, a, bonus)
        self.t_len.add_(a + 1)
        self.report[:1].copy_(a + 1)
        self.report[1:].copy_(emitted)

    def propose(self) -> RoundState:
        tokens, parents, depths, scores, mask = self._draft_tree()
        return RoundState(DraftTree(tokens, parents, depths, scores, mask=mask))

    def verify(self, state: RoundState) -> None:
        """Target verify over the tree at slots t_len..t_len+N-1 → logits, aux."""
        tree = state.tree
        mask, positions, slots, limit = self._verify_inputs_fn(tree.mask, tree.depths)
        state.logits, state.aux = self.t.run(tree.tokens, positions, mask, slots, limit)
        if self.stages is not None:
            record_target(self.stages, state.aux, self.t.taps)

    def _verify_inputs(self, tree_mask: torch.Tensor, depths: torch.Tensor):
        """The verify's attention mask over the target cache [N, size] (the context, then the tree's own ancestor
        mask at slots t_len..t_len+N-1), its RoPE positions, its slots [N] and one past the highest slot the mask
        allows [1] int32. That is t_len + N because an ancestor mask includes each node itself; known here, the
        fused verify need not find it from the mask (that saves a memset and a kernel a round)."""
        N = tree_mask.shape[0]
        rel = self.t_slots - self.t_len
        inwin = (rel >= 0) & (rel < N)
        mask = (tree_mask[:, rel.clamp(0, N - 1)] & inwin[None, :]) | (rel < 0)[None, :]
        limit = (self.t_len + N).to(torch.int32).reshape(1)
        return mask, self.t_len + depths, self.t_len + torch.arange(N, device=self.device), limit

    def accept(self, state: RoundState) -> None:
        t = state.tree
        state.accepted, state.path, state.bonus, state.emitted = self._accept_fn(
            t.tokens, t.parents, t.depths, t.mask, state.logits
        )

    def commit(self, state: RoundState) -> None:
        self._commit_fn(state.accepted, state.path, state.bonus, state.emitted, state.aux)
        if self.stages is not None:
            record_verdict(self.stages, state, self.proposer.state.aux)

    @torch.inference_mode()
    def _round(self) -> None:
        speculative_round(self)

    # -- running rounds ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _start(self, prompt: list[int], record: bool = True) -> int:
        ids = torch.tensor(prompt, device=self.device)
        n = ids.shape[0]
        record = record and self.rec is not None
        layers = None
        if record and self.trace_layers:
            logits, aux, *layers = self.t.prefill_layers(ids)
        else:
            logits, aux = self.t.prefill(ids)
        first = logits[-1:].argmax(-1)
        if record:
            record_prefill(self.rec, lambda a: record_target(self.rec, a, self.t.taps), aux, first, layers)
        # draft prefill: the shared catch-up over positions 0..n-2 (paired with tokens 1..n-1); the last position
        # stays pending. The reference backend catches up over the whole prompt in round 1, so the trace shows these
        # rows in round 1, before the round's own.
        p, rec = self.proposer, self.proposer.rec
        p.rec = self.stages if record else None
        if record:
            self.stages.hold(True)
        p.catch_up(aux[: n - 1], ids[1:], 0)
        if record:
            self.stages.hold(False)
        p.rec = rec
        self.t_len.fill_(n)
        s = p.state
        s.committed.fill_(n - 1)
        s.count.fill_(1)
        s.aux[:1].copy_(aux[n - 1 :])
        s.tokens[:1].copy_(first)
        s.root.copy_(first)
        return int(first)

    def _uncompiled(self, e: Exception) -> None:
        log.warning("the compiled EAGLE-3 round failed (%s: %s); running it uncompiled", type(e).__name__, e)
        self.composed = self.proposer.own_pieces()
        self.hand_pieces()
        self._accept_fn, self._commit_fn = self._accept, self._commit
        self._verify_inputs_fn = self._verify_inputs
        self.compiled = False

    def prepare(self, prompt_ids: list[int], budget: int) -> None:
        """One-time costs before the timed run: graph capture (or a first compiled round), with fallbacks."""
        if len(prompt_ids) < 2:
            raise ValueError("the prompt needs at least 2 tokens")
        if len(prompt_ids) + budget > self.max_len:
            raise ValueError(f"prompt {len(prompt_ids)} + {budget} new tokens exceed max_len {self.max_len}")
        if self.graph is not None or not (self.use_graph or self.compiled):
            return
        self._start(prompt_ids, record=False)
        try:
            if self.use_graph:
                self.graph = _graph(self._round)
            else:
                self._round()
        except Exception as e:  # keep the run going without the failing piece, and say so
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            if self.compiled:
                self._uncompiled(e)
                return self.prepare(prompt_ids, budget)
            log.warning("CUDA graph capture of the EAGLE-3 round failed (%s); running rounds eagerly", e)
            self.use_graph = False

    def start(self, prompt_ids, budget) -> int:
        self._prompt_len = len(prompt_ids)
        self._launched = self._read = 0
        return self._start(prompt_ids)

    def launch(self) -> None:
        if self.replay:
            self.force.fill_(self._forced[self._launched % len(self._forced)])
        if self.graph is not None:
            self.graph.replay()
        else:
            self._round()
        # the report goes to its own host slot: the next round, launched before this one is read, rewrites it
        self._reports[self._launched % 2].copy_(self.report, non_blocking=True)
        if self._events:
            self._events[self._launched % 2].record()
        self._launched += 1

    def read(self) -> RoundReport:
        if self._events:
            self._events[self._read % 2].synchronize()
        rep = self._reports[self._read % 2].tolist()  # the one host read of the round
        self._read += 1
        n = rep[0]
        if self.rec is not None:
            self._record_round(n - 1)
        return RoundReport(rep[1 : 1 + n], n - 1, self.D, self.N - 1)

    def _record_round(self, accepted: int) -> None:
        """The round just read, in the stages and order the shared steps recorded them, padding rows cut."""
        self.rec.next_round()
        caught_up = int(self.round_n)
        rows = {s: caught_up for s in (T.DRAFT_FC_OUT, T.draft_tokens(0), T.draft_positions(0), T.draft_embed_in(0),
                                       T.draft_hidden_in(0), T.draft_hidden_out(0))}  # fmt: skip
        rows |= {T.VERIFY_ACCEPTED: accepted, T.NEXT_HIDDEN_IN: accepted + 1}
        self.stages.flush(rows)

    def room_for_another(self, emitted: int) -> bool:
        # the queued round must fit whatever the unread one accepts (<= Pmax positions each)
        return self._prompt_len + emitted + 2 * self.Pmax <= self.max_len

    @torch.inference_mode()
    def generate(
        self, prompt: list[int], max_new: int, replay: list[int] | None = None, stop: set[int] | None = None
    ) -> Decoded:
        """Greedy speculative tokens; with `stop`, ends after the first stop token (checked at each round's read)."""
        self._forced = replay
        res = decode(self, prompt, max_new, max_new, set(stop or ()), self.device)
        return Decoded(res.token_ids, res.seconds, list(res.stats.accepted))
