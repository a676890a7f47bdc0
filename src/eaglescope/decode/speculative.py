"""Proposers: what drafts a round's tree for the one speculative loop (decode/loop.py).

Each round the proposer builds a draft tree whose root is the last emitted token; after the target verified it,
the proposer is told what was accepted, with the target's tap features of exactly the positions whose KV survived
(root + accepted nodes). EAGLE-3, prompt lookup (n-gram), a small draft LM, and none (vanilla decoding).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch

from eaglescope import trace as T
from eaglescope.decode.generation import DecodeSettings, SamplingConfig
from eaglescope.decode.round import RoundState, SlotCache, StageBuffers
from eaglescope.decode.sampling import process_logits, sample
from eaglescope.decode.tree import (
    DraftTree,
    TreeBuilder,
    expand_level,
    finalize_tree,
    top_k_rows,
    tree_buffers,
    tree_capacity,
)
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import Eagle3Draft, check_draft_matches_target, load_draft
from eaglescope.models.targets import load_target
from eaglescope.models.targets.base import Target, TargetOutput


class Proposer(ABC):
    """Proposes a draft tree each round; learns what the target accepted."""

    name = "proposer"

    @property
    @abstractmethod
    def max_nodes(self) -> int:
        """Upper bound on tree size (root included), so the target cache can be sized."""

    def start(self, prompt_ids: list[int], prefill: TargetOutput, first_token: int) -> None:  # noqa: B027
        """After the target's prefill of the prompt and its first token."""

    @abstractmethod
    def propose(self, tokens: list[int], root_position: int) -> DraftTree:
        """A tree whose root is tokens[-1], which sits at `root_position` in the target's sequence."""

    def accepted(self, state: RoundState) -> None:  # noqa: B027
        """After verification: `state.path` are the tree nodes whose target KV was kept."""


class NoProposer(Proposer):
    """Vanilla decoding as the speculative loop: every round's tree is the root alone, so the target verifies one
    token and the bonus token is simply the next one."""

    name = "none"

    @property
    def max_nodes(self) -> int:
        return 1

    def propose(self, tokens, root_position) -> DraftTree:
        return DraftTree.chain([tokens[-1]])


class DraftPieces(NamedTuple):
    """The draft side's fixed-shape pieces, each a callable the proposer calls by its field, never by a string. The
    proposer's own functions (`Eagle3Proposer.own_pieces`) on the reference backend; on the static backend the table
    fast/draft_pieces.py builds from them: compiled one by one, and where the fused draft layer runs, its kernels
    standing in for some. `catch_up`, `tree_level` and `level_inputs` take and return what the methods of the same
    name do; `root_children` the root's features [1, H] → its draft log-probs [1, V], or its top-k children
    (log-probs, draft ids) [1, k] already picked (then `expand_level` takes them so)."""

    catch_up: Callable
    catch_up_inputs: Callable
    root_children: Callable
    tree_start: Callable
    tree_level: Callable
    level_inputs: Callable
    expand_level: Callable
    finalize: Callable
    logprobs: Callable
    logits: Callable
    rotary: Callable


@dataclasses.dataclass
class DraftState:
    """What one round hands the next on the draft side, as device tensors the proposer owns (`Eagle3Proposer.state`):
    exact-size on the reference backend (rows == count), padded on the static one (`padded`: `Pmax` rows, those past
    `count` padding; rewritten in place, so a captured round reads the same buffers every replay)."""

    aux: torch.Tensor  # [P, nH] target features of the positions not yet caught up
    tokens: torch.Tensor  # [P] the token that follows each of those positions
    count: torch.Tensor  # [1] long: how many of the P rows are real
    committed: torch.Tensor  # [1] long: draft positions caught up (their keys in the draft cache)
    root: torch.Tensor  # [1] long: the next tree's root token
    padded: bool = False


class Eagle3Proposer(Proposer):
    """EAGLE-3 draft: catch-up over newly accepted positions from the target's taps, then an EAGLE-2 tree.

    The draft side of the round for both backends: `catch_up` and `expand` are device tensors only (no host read, no
    data-dependent shape), so the static-shape backend (fast/engine.py) captures them in its round's graph, passing
    tensors padded to its budget where the reference backend (`propose`) passes exact ones. The hook methods below
    are one wiring decision each: doctor's fault hypotheses and the tests override exactly one, on this same code.

    Draft cache slots (a SlotCache): [0, max_len) hold step-0 keys of every context position (features from the
    target); tree level l writes its frontier's keys at tree_base + (l-1)*top_k + j, whatever the context length,
    and the next catch-up never reads them.
    """

    name = "eagle3"

    def __init__(
        self,
        draft: Eagle3Draft,
        depth: int,
        top_k: int,
        total_tokens: int,
        max_len: int,
        recorder: T.TraceRecorder | StageBuffers | None = None,
        tree_attention: str = T.TREE_ANCESTORS,
    ) -> None:
        """`max_len`: the context positions the draft cache holds; `recorder`: where the draft stages go (a trace, or
        the static backend's StageBuffers); `tree_attention`: which tree nodes a tree step's rows attend
        (trace.TREE_ATTENTIONS: EAGLE-2's ancestors, or an engine's per-column layout that a replay follows)."""
        if tree_attention not in T.TREE_ATTENTIONS:
            raise EagleScopeError(f"draft tree attention must be one of {', '.join(T.TREE_ATTENTIONS)}, "
                                  f"got {tree_attention!r}")  # fmt: skip
        self.tree_attention = tree_attention
        self.draft = draft
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.max_len = max_len
        self.rec = recorder
        p = draft.fc.weight
        self.device, self.dtype = p.device, p.dtype
        self.tree_base = max_len
        self.cache = draft_slot_cache(draft, max_len + max(depth - 1, 1) * top_k)
        self.slots = torch.arange(self.cache.size, device=self.device)
        self.state: DraftState | None = None  # what the last round handed on (set by `start`, or the static backend)
        self._levels = torch.arange(depth + 1, device=self.device)  # each tree level as a [1] slice (no host copy)
        # what a round calls: this class's own functions, or what the static backend hands in (fast/draft_pieces.py)
        self.pieces = self.own_pieces()

    @property
    def max_nodes(self) -> int:
        return self.total_tokens

    # -- hook points: one method per wiring decision, so a test can inject exactly one fault --------
    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """Step-0 input features: fc over the target's concatenated taps [P, nH] → [P, H]."""
        return self.draft.project(aux.to(self.dtype))

    def next_round_features(self, aux: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Target features [N, nH] of exactly the positions whose KV survived: root + accepted (`path`)."""
        return aux[path]

    def paired_tokens(self, following: torch.Tensor) -> torch.Tensor:
        """The token paired with each pending feature: the one *after* its position."""
        return following.to(self.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.draft.embed_tokens(token_ids)

    def child_hidden(self, parent_out: torch.Tensor) -> torch.Tensor:
        """Features a tree step reads: its parent's own pre-norm output (never the target's again)."""
        return parent_out

    def catch_up_positions(self, start, count: int) -> torch.Tensor:
        """RoPE positions of the pending features (`start`: int, or [1] on the static backend): their own sequence
        positions, continuing the cache."""
        return start + self.slots[:count]

    def tree_position(self, root_position, level: int):
        """RoPE position of a depth-`level` node's query: root + level - 1, as TTT step `level` uses."""
        return root_position + level - 1

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft.to_target_ids(draft_ids)

    # -- the draft side of a round (both backends) ------------------------------------------------------------
    def catch_up(self, aux: torch.Tensor, tokens: torch.Tensor, start) -> torch.Tensor:
        """Step 0 over positions start.. (aux [P, nH], each paired with the token after it, tokens [P]); their keys
        go to draft slots start..start+P-1 → the pre-norm outputs [P, H]. `start`: int, or [1] (static backend, whose
        rows past its pending count are padding: they land past the context, no real row sees them, and the next
        catch-up overwrites them)."""
        embeds, hidden, positions, slots, mask = self.catch_up_inputs(aux, tokens, start)
        out = self.draft.step(embeds[None], hidden[None], positions[None], self.cache, slots, mask[None, None])[0]
        self._record(T.draft_hidden_out(0), out)
        return out

    def catch_up_inputs(self, aux: torch.Tensor, tokens: torch.Tensor, start):
        """catch_up's draft step inputs → (embeddings, features [P, H], positions, slots [P], mask [P, S])."""
        P = aux.shape[0]
        slots = start + self.slots[:P]
        mask = self.slots[None, :] <= slots[:, None]  # the context before, and each row itself
        hidden = self.features(aux)  # [P, H]
        positions = self.catch_up_positions(start, P)
        self._record(T.DRAFT_FC_OUT, hidden)
        self._record(T.draft_tokens(0), tokens)
        self._record(T.draft_positions(0), positions)
        embeds = self.embed(tokens)
        self._record(T.draft_embed_in(0), embeds)
        self._record(T.draft_hidden_in(0), hidden)
        return embeds, hidden, positions, slots, mask

    def expand(self, h_root: torch.Tensor, root, root_position, context) -> DraftTree:
        """EAGLE-2 tree expansion from the root's features h_root [1, H] (the catch-up's output for the position
        before the root): `depth` levels of top_k, reranked to total_tokens nodes (target ids). `root`, `root_position`
        and `context` (the draft positions committed, the root's included): ints, or [1] on the static backend.

        Every level from the first on has the same shapes (top_k frontier rows, buffers sized for the whole tree,
        the level a [1] tensor), so `tree_level` and the builder's `expand_level` are one function each at every
        depth: compiled once (fast/draft_pieces.py), not once per level."""
        dev, K = self.device, self.top_k
        vocab = self.draft.config.draft_vocab_size
        capacity = tree_capacity(K, self.depth, vocab)
        buffers, ctx_mask, slot_of, prev_front, prev_out = self.pieces.tree_start(root, h_root, context, capacity)
        b = TreeBuilder(root, K, dev, levels=self.depth, vocab=vocab, expand_fn=self.pieces.expand_level,
                        buffers=buffers)  # fmt: skip
        lp = self.pieces.root_children(h_root)
        self._record_topk(1, lp)
        frontier = b.expand(self._levels[:1], lp)  # from the root, builder id 0
        for level in range(1, self.depth):
            bufs = (b.tokens, b.parents, b.lineage, slot_of)
            at = self._levels[level : level + 1]
            tok, positions, embeds, hidden_in, out, lp = self.pieces.tree_level(
                *bufs, ctx_mask, frontier, prev_front, prev_out, root_position, at
            )
            self._record(T.draft_tokens(level), tok)
            self._record(T.draft_positions(level), positions)
            self._record(T.draft_embed_in(level), embeds)
            self._record(T.draft_hidden_in(level), hidden_in)
            self._record(T.draft_hidden_out(level), out)
            self._record_topk(level + 1, lp)  # a replay may make lp the traced run's choice here, before expanding
            prev_front, prev_out = frontier, out
            frontier = b.expand(frontier, lp)
        bufs = (b.tokens, b.parents, b.depths, b.scores, b.lineage)
        tokens, parents, depths, scores, source, mask = self.pieces.finalize(*bufs, b.num_nodes, self.total_tokens)
        return DraftTree(tokens, parents, depths, scores, source=source, mask=mask)

    def tree_start(self, root, h_root: torch.Tensor, context, capacity: int):
        """What a tree's expansion starts from → (tree_buffers of the root alone, the committed context's draft-cache
        slots [S] (seen by every tree query), each builder node's draft-cache slot [capacity] (the cache's size: none
        yet), level 1's parents: the root's id and features [m], [m, H], as wide as a frontier (dense, as every later
        level's are: a compiled level is specialised to its inputs' strides))."""
        m = self.frontier_width
        buffers = tree_buffers(root, capacity, self.depth + 1, self.device)
        slot_of = torch.full((capacity,), self.cache.size, dtype=torch.long, device=self.device)
        return buffers, self.slots < context, slot_of, self._levels[:1].repeat(m), h_root.repeat(m, 1)

    def tree_level(self, tokens, parents, lineage, slot_of, ctx_mask, frontier, prev_front, prev_out, root_position,
                   level):  # fmt: skip
        """The draft step of tree level `level` ([1]) over the frontier's builder ids [m]: the parents' outputs (from
        the previous level's frontier prev_front [m] and outputs prev_out [m, H]), the frontier's keys at draft slots
        tree_base + (level-1)*top_k + j, attention to the committed context and each row's own ancestors (or, under
        the column layout, row j's slots of every level so far: `tree_attention`) → the step's
        (tokens, positions, embeddings, features in, pre-norm outputs, log-probs). Writes the frontier's slots into
        slot_of [capacity] (the cache's size where a node has none)."""
        tok, positions, embeds, hidden_in, slots, mask = self.level_inputs(
            tokens, parents, lineage, slot_of, ctx_mask, frontier, prev_front, prev_out, root_position, level
        )
        out = self.draft.step(embeds[None], hidden_in[None], positions[None], self.cache, slots, mask[None, None])[0]
        return tok, positions, embeds, hidden_in, out, self._logprobs(out)

    def level_inputs(self, tokens, parents, lineage, slot_of, ctx_mask, frontier, prev_front, prev_out,
                     root_position, level):  # fmt: skip
        """tree_level's draft step inputs → (tokens, positions, embeddings, features in, slots [m], mask [m, S])."""
        m, dev = frontier.shape[0], self.device
        par = parents[frontier]
        hidden_in = self.child_hidden(prev_out[(prev_front[None, :] == par[:, None]).float().argmax(1)])
        slots = self.tree_base + (level - 1) * self.top_k + self.slots[:m]
        if self.tree_attention == T.TREE_COLUMN:
            # SGLang's layout: row j attends the slots row j of levels 1..level wrote (its own new one included),
            # whoever its parent; levels below are last round's, not this tree's
            tree = self.slots[None, :] - self.tree_base  # [1, S]: the tree's slots from 0
            column = (tree >= 0) & (tree < level * self.top_k) & (tree % self.top_k == self.slots[:m, None])
            mask = ctx_mask[None, :] | column
        else:
            # each row's ancestors at their slots (the root's keys are in the context), and itself at its own new
            # slot: one comparison over [m, S, depth + 1], which compiles to one kernel where a scatter into zeros
            # took three
            lin = lineage[frontier]
            own = torch.where(lin == frontier[:, None], slots[:, None], slot_of[lin])
            mask = ctx_mask[None, :] | (self.slots[None, :, None] == own[:, None, :]).any(-1)
        slot_of.index_copy_(0, frontier, slots)  # for the levels below
        positions = _as_index(self.tree_position(root_position, level), dev).expand(m)
        tok = self.to_target_ids(tokens[frontier])  # the embedding is the target's
        return tok, positions, self.embed(tok), hidden_in, slots, mask

    @property
    def frontier_width(self) -> int:
        """Rows of every tree level's frontier: top_k, or the whole draft vocabulary where it is smaller."""
        return min(self.top_k, self.draft.config.draft_vocab_size)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft layer's RoPE cos, sin [T, D] at positions [T] (compiled: one kernel, eager: several)."""
        cos, sin = self.draft.midlayer.rotary(positions[None], self.dtype)
        return cos[0, 0], sin[0, 0]

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [m, Vd] of what a draft step returned (Eagle3Draft.logits)."""
        return self.draft.logits(hidden_out)

    def finalize(self, tokens, parents, depths, scores, lineage, num_nodes: int, total: int):
        """The builder's candidates reranked to `total` nodes (decode/tree.py finalize_tree), draft ids mapped to the
        target's (the root is a target id already)."""
        tokens, parents, depths, scores, source, mask = finalize_tree(tokens, parents, depths, scores, lineage,
                                                                      num_nodes, total)  # fmt: skip
        tokens = torch.cat([tokens[:1], self.to_target_ids(tokens[1:])])
        return tokens, parents, depths, scores, source, mask

    def own_pieces(self) -> DraftPieces:
        """The pieces as this class composes them (what the static backend compiles; a subclass's hooks run inside)."""
        return DraftPieces(catch_up=self.catch_up, catch_up_inputs=self.catch_up_inputs, root_children=self._logprobs,
                           tree_start=self.tree_start, tree_level=self.tree_level, level_inputs=self.level_inputs,
                           expand_level=expand_level, finalize=self.finalize, logprobs=self._logprobs,
                           logits=self.logits, rotary=self.rotary)  # fmt: skip

    def handed_on(self, aux: torch.Tensor, path: torch.Tensor, emitted: torch.Tensor):
        """What the next round's catch-up reads (RoundState's verify features, path and emitted tokens) → (features of
        root + accepted [L, nH], the token after each [L])."""
        return self.next_round_features(aux, path), self.paired_tokens(emitted)

    # -- a round's draft side on `state` (both backends) -------------------------------------------------------
    def draft_tree(self, root_position) -> DraftTree:
        """Catch-up over the state's pending positions, then the tree from its root (at `root_position`: an int, or
        [1] on the static backend); the caught-up positions become committed."""
        s = self.state
        # the hooks' contract: positions as ints on the reference backend, [1] tensors on the static one
        at = (lambda x: x) if s.padded else int
        out = self.pieces.catch_up(s.aux, s.tokens, at(s.committed))
        h_root = out.index_select(0, s.count - 1)  # [1, H]: the features of the position before the root
        s.committed.add_(s.count)  # == the root's position
        return self.expand(h_root, s.root, root_position, at(s.committed))

    def hand_on(self, aux: torch.Tensor, path: torch.Tensor, emitted: torch.Tensor, accepted, bonus) -> None:
        """After verification (RoundState's aux, path, emitted, accepted [1], bonus [1]): root + accepted positions
        become the pending ones, the bonus the next root."""
        s = self.state
        features, following = self.handed_on(aux, path, emitted)
        if s.padded:  # the static backend's buffers, rewritten in place
            s.aux.copy_(features)
            s.tokens.copy_(following)
        else:
            s.aux, s.tokens = features, following
        s.count.copy_(accepted + 1)
        s.root.copy_(bonus)

    # -- protocol (the reference backend) --------------------------------------------------------------------
    def start(self, prompt_ids, prefill, first_token) -> None:
        if prefill.aux is None:
            raise EagleScopeError("the target returned no tap features: set its taps to the draft's contract")
        one = lambda v: torch.tensor([v], dtype=torch.long, device=self.device)  # noqa: E731
        tokens = self.paired_tokens(torch.tensor(prompt_ids[1:] + [first_token], device=self.device))
        self.state = DraftState(prefill.aux, tokens, one(prefill.aux.shape[0]), one(0), one(first_token))

    def accepted(self, state) -> None:
        self.hand_on(state.aux, state.path, state.emitted, state.accepted, state.bonus)

    def _record(self, stage: str, tensor: torch.Tensor, **kw) -> None:
        if self.rec is not None:
            self.rec.record(stage, tensor, **kw)

    def _logprobs(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary log-probs [m, Vd] in float32."""
        return torch.log_softmax(self.draft.logits(hidden_out).float(), dim=-1)

    @torch.inference_mode()
    def propose(self, tokens, root_position) -> DraftTree:
        P, start = self.state.aux.shape[0], int(self.state.committed)
        if root_position != start + P:
            raise RuntimeError(
                f"draft/target out of step: root at {root_position}, draft has {start} committed + {P} pending"
            )
        if start + P > self.tree_base:
            raise EagleScopeError("draft cache overflow: sequence longer than the decoder was sized for")
        return self.draft_tree(root_position)

    def _record_topk(self, step: int, lp: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> None:
        """`lp`: a step's log-probs [m, V], or its top-k children (log-probs, draft ids) already picked."""
        if self.rec is not None:
            v, i = lp if isinstance(lp, tuple) else top_k_rows(lp, min(self.top_k, lp.shape[-1]))
            self.rec.record(T.draft_topk(step - 1), {T.TOPK_IDS: self.to_target_ids(i), T.TOPK_LOGPROBS: v})


def _as_index(x, device) -> torch.Tensor:
    """An int (reference backend) or a [1] device tensor (static backend) as a [1] long tensor."""
    return x.reshape(1) if isinstance(x, torch.Tensor) else torch.tensor([int(x)], device=device)


def draft_slot_cache(draft: Eagle3Draft, size: int) -> SlotCache:
    """A SlotCache of `size` slots shaped like the draft's own cache (MLA's values are narrower than its keys)."""
    probe = draft.new_cache(1, 1)
    k, v = probe.k, probe.v
    return SlotCache(k.shape[0], 1, k.shape[2], size, k.shape[4], k.dtype, k.device, v_dim=v.shape[4])


class NgramProposer(Proposer):
    """Prompt-lookup decoding: continue the latest earlier occurrence of the trailing n-gram."""

    name = "ngram"

    def __init__(self, k: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram

    @property
    def max_nodes(self) -> int:
        return self.k + 1

    def propose(self, tokens, root_position) -> DraftTree:
        seq = tokens
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for s in range(len(seq) - n - 1, -1, -1):
                if seq[s : s + n] == tail:
                    cont = seq[s + n : s + n + self.k]
                    if cont:
                        return DraftTree.chain([seq[-1], *cont])
        return DraftTree.chain([seq[-1]])


class DraftLMProposer(Proposer):
    """Classic speculative decoding with a small causal LM sharing the target's tokenizer."""

    name = "draft-lm"

    def __init__(self, draft_lm: Target, k: int, sampling: SamplingConfig, max_len: int) -> None:
        self.lm, self.k, self.sampling = draft_lm, k, sampling
        self.max_len = max_len
        self.lm.reset(max_len + k + 2)
        # The drafts must be independent of verification's uniforms: seeded like the verifier, this generator
        # would replay its stream, correlating each proposal with its own accept test (output no longer p).
        seed = None if sampling.seed is None else (sampling.seed * 6364136223846793005 + 1442695040888963407) % 2**63
        self.gen = dataclasses.replace(sampling, seed=seed).generator(draft_lm.device)

    @property
    def max_nodes(self) -> int:
        return self.k + 1

    def start(self, prompt_ids, prefill, first_token) -> None:
        self.lm.reset(self.max_len + self.k + 2)  # a new sequence: nothing of the previous one may be reused

    @torch.inference_mode()
    def propose(self, tokens, root_position) -> DraftTree:
        out = self.lm.forward(torch.tensor(tokens[self.lm.cache_len :], device=self.lm.device))
        self.lm.commit()
        draft, probs = [], []
        logits = out.logits[-1]
        for i in range(self.k):
            if self.sampling.greedy:
                tok = int(logits.argmax())
            else:
                q = process_logits(logits, self.sampling.temperature, self.sampling.top_k, self.sampling.top_p)
                tok = int(sample(q, self.gen))
                probs.append(q)
            draft.append(tok)
            if i + 1 < self.k:
                logits = self.lm.forward(torch.tensor([tok], device=self.lm.device)).logits[-1]
                self.lm.commit()
        self._context = len(tokens)
        q = None
        if probs:
            q = torch.stack(probs + [torch.zeros_like(probs[0])]).to("cpu")  # row i: q the child of node i came from
        return DraftTree.chain([tokens[-1], *draft], draft_probs=q)

    def accepted(self, state) -> None:
        # The LM consumed tokens[:-1]... plus drafts 1..k-1; keep what is still on the true path.
        keep = self._context + min(int(state.accepted), self.k - 1)
        self.lm.truncate(keep)


def build_proposer(
    settings: DecodeSettings, target: Target, max_len: int, recorder=None, draft: Eagle3Draft | None = None
) -> Proposer:
    """The proposer `settings` ask for (`draft`: an EAGLE-3 draft already loaded by `load_eagle3`)."""
    depth, top_k, total = settings.shape
    if settings.proposer == "ngram":
        return NgramProposer(depth)
    if settings.draft is None and draft is None:
        raise EagleScopeError(f"--proposer {settings.proposer} needs --draft DIR")
    if settings.proposer == "draft-lm":
        lm = load_target(settings.draft, device=target.device, dtype=target.dtype, backend=settings.backend)
        if lm.vocab_size != target.vocab_size:
            raise EagleScopeError(
                f"draft LM vocabulary ({lm.vocab_size}) differs from the target's ({target.vocab_size})"
            )
        return DraftLMProposer(lm, depth if settings.chain is not None else 4, settings.sampling, max_len)
    draft = draft if draft is not None else load_eagle3(settings.draft, target)
    check_top_k(draft, top_k)
    return Eagle3Proposer(draft, depth, top_k, total, max_len, recorder)


def check_top_k(draft: Eagle3Draft, top_k: int) -> None:
    n_draft = draft.config.draft_vocab_size
    if top_k > n_draft:
        raise EagleScopeError(f"--tree top-k {top_k} exceeds the draft's vocabulary of {n_draft} tokens")


def load_eagle3(path: str, target: Target) -> Eagle3Draft:
    """An EAGLE-3 draft for `target`: loaded, checked against the target, given the target's embedding where it
    ships none; the target's taps set to the draft's contract."""
    loaded = load_draft(path, target.num_layers, device=target.device, dtype=target.dtype)
    check_draft_matches_target(loaded.contract, target.fingerprint)
    if not loaded.has_embedding:
        loaded.model.load_target_embedding(target_embedding(target))
    target.set_taps(loaded.contract.taps)
    return loaded.model


def target_embedding(target: Target) -> torch.Tensor:
    if isinstance(emb := getattr(target, "embedding", None), torch.Tensor):  # a target held as its embedding alone
        return emb
    if hasattr(target, "model") and hasattr(target.model, "get_input_embeddings"):
        return target.model.get_input_embeddings().weight
    return target.model.model.embed_tokens.weight
