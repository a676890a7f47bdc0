"""Proposers: what drafts a round's tree for the one speculative loop (decode/loop.py).

Each round the proposer builds a draft tree whose root is the last emitted token; after the target verified it,
the proposer is told what was accepted, with the target's tap features of exactly the positions whose KV survived
(root + accepted nodes). EAGLE-3, prompt lookup (n-gram), a small draft LM, and none (vanilla decoding).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import torch

from eaglescope import trace as T
from eaglescope.decode.generation import SamplingConfig
from eaglescope.decode.sampling import process_logits, sample
from eaglescope.decode.tree import EAGLE_DEFAULT_TREE, DraftTree, TreeBuilder
from eaglescope.decode.verify import VerifyResult
from eaglescope.draft import Eagle3Draft, check_draft_matches_target, load_draft
from eaglescope.errors import EagleScopeError
from eaglescope.target import load_target
from eaglescope.target.base import Target, TargetOutput


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

    def accepted(self, tree: DraftTree, result: VerifyResult, verify_out: TargetOutput) -> None:  # noqa: B027
        """After verification: `result.path` are the tree nodes whose target KV was kept."""


class NoProposer(Proposer):
    """Vanilla decoding as the speculative loop: every round's tree is the root alone, so the target verifies one
    token and the bonus token is simply the next one."""

    name = "none"

    @property
    def max_nodes(self) -> int:
        return 1

    def propose(self, tokens, root_position) -> DraftTree:
        return DraftTree.chain([tokens[-1]])


def parse_tree_shape(chain: int | None, tree: str | None) -> tuple[int, int, int]:
    """(depth, top_k, total_tokens). A chain of K is a tree of depth K, top_k 1, K+1 nodes."""
    if chain is not None:
        if chain < 1:
            raise EagleScopeError(f"--chain must be >= 1, got {chain}")
        return chain, 1, chain + 1
    if tree is None:
        return EAGLE_DEFAULT_TREE
    try:
        depth, top_k, total = (int(x) for x in tree.split(","))
    except ValueError:
        raise EagleScopeError(f"--tree must be DEPTH,TOPK,TOTAL (e.g. 7,10,60), got {tree!r}") from None
    if depth < 1 or top_k < 1 or total < 2:
        raise EagleScopeError(f"--tree needs depth >= 1, top_k >= 1 and total >= 2, got {tree!r}")
    return depth, top_k, total


class Eagle3Proposer(Proposer):
    """EAGLE-3 draft: catch-up over newly accepted positions from the target's taps, then an EAGLE-2 tree.

    Draft cache slots: [0, committed) hold step-0 keys of every context position (features from
    the target); tree nodes of the current round are appended after them and dropped when the
    round ends (the next catch-up overwrites those slots).
    """

    name = "eagle3"

    def __init__(
        self,
        draft: Eagle3Draft,
        depth: int,
        top_k: int,
        total_tokens: int,
        max_len: int,
        recorder: T.TraceRecorder | None = None,
    ) -> None:
        self.draft = draft
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.max_len = max_len
        self.rec = recorder
        p = draft.fc.weight
        self.device, self.dtype = p.device, p.dtype
        # Every expansion adds at most top_k nodes (the frontier), so a round appends at most this many keys.
        self.cache = draft.new_cache(1, max_len + depth * top_k + 1)
        self.committed = 0
        self.pending_aux: torch.Tensor | None = None  # [P, nH] target features of positions not yet caught up
        self.pending_tokens: torch.Tensor | None = None  # [P] the token that follows each of those positions

    @property
    def max_nodes(self) -> int:
        return self.total_tokens

    # -- hook points: one method per wiring decision, so a test can inject exactly one fault --------
    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """Step-0 input features: fc over the target's concatenated taps [P, nH] → [P, H]."""
        return self.draft.project(aux.to(self.dtype))

    def next_round_features(self, verify_out: TargetOutput, result: VerifyResult) -> torch.Tensor:
        """Target features of exactly the positions whose KV survived: root + accepted."""
        return verify_out.aux[torch.tensor(result.path, device=verify_out.aux.device)]

    def paired_tokens(self, following: list[int]) -> torch.Tensor:
        """The token paired with each pending feature: the one *after* its position."""
        return torch.tensor(following, device=self.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.draft.embed_tokens(token_ids)

    def child_hidden(self, parent_out: torch.Tensor) -> torch.Tensor:
        """Features a tree step reads: its parent's own pre-norm output (never the target's again)."""
        return parent_out

    def catch_up_positions(self, start: int, count: int) -> torch.Tensor:
        """RoPE positions of the pending features: their own sequence positions, continuing the cache."""
        return torch.arange(start, start + count, device=self.device)

    def tree_position(self, root_position: int, level: int) -> int:
        """RoPE position of a depth-`level` node's query: root + level - 1, as TTT step `level` uses."""
        return root_position + level - 1

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft.to_target_ids(draft_ids)

    # -- protocol ------------------------------------------------------------------------
    def start(self, prompt_ids, prefill, first_token) -> None:
        if prefill.aux is None:
            raise EagleScopeError("the target returned no tap features: set its taps to the draft's contract")
        self.committed = 0
        self.pending_aux = prefill.aux
        self.pending_tokens = self.paired_tokens(prompt_ids[1:] + [first_token])

    def accepted(self, tree, result, verify_out) -> None:
        self.pending_aux = self.next_round_features(verify_out, result)
        self.pending_tokens = self.paired_tokens([int(tree.tokens[i]) for i in result.accepted] + [result.bonus])

    def _record(self, stage: str, tensor: torch.Tensor, **kw) -> None:
        if self.rec is not None:
            self.rec.record(stage, tensor, **kw)

    @torch.inference_mode()
    def catch_up(self) -> torch.Tensor:
        """Step 0 over the pending positions; commits their keys. Returns the last pre-norm output [H]."""
        P = self.pending_aux.shape[0]
        start = self.committed
        if start + P + self.depth * self.top_k + 1 > self.cache.max_len:
            raise EagleScopeError("draft cache overflow: sequence longer than the decoder was sized for")
        hidden = self.features(self.pending_aux)  # [P, H]
        positions = self.catch_up_positions(start, P)
        mask = torch.ones(P, start + P, dtype=torch.bool, device=self.device)
        mask[:, start:] = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()
        self._record(T.DRAFT_FC_OUT, hidden)
        self._record(T.draft_tokens(0), self.pending_tokens)
        self._record(T.draft_positions(0), positions)
        embeds = self.embed(self.pending_tokens)
        self._record(T.draft_embed_in(0), embeds)
        self._record(T.draft_hidden_in(0), hidden)
        out = self.draft.step(embeds[None], hidden[None], positions[None], self.cache, start, mask[None, None])[0]
        self._record(T.draft_hidden_out(0), out)
        self.committed = start + P
        return out[-1]

    def _logprobs(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary log-probs [m, Vd] in float32."""
        return torch.log_softmax(self.draft.logits(hidden_out).float(), dim=-1)

    @torch.inference_mode()
    def propose(self, tokens, root_position) -> DraftTree:
        if root_position != self.committed + self.pending_aux.shape[0]:
            raise RuntimeError(
                f"draft/target out of step: root at {root_position}, draft has {self.committed} committed + "
                f"{self.pending_aux.shape[0]} pending"
            )
        h_root = self.catch_up()  # features of the position before the root, paired with the root token
        builder = TreeBuilder(tokens[-1], self.top_k, self.device)
        lp = self._logprobs(h_root[None])
        self._record_topk(1, lp)
        frontier = builder.expand(torch.zeros(1, dtype=torch.long, device=self.device), lp)
        hidden_of = {0: h_root}  # builder id → pre-norm output of the step that consumed that node
        processed: list[int] = []  # builder ids whose keys sit in the tree slots, in slot order
        for level in range(1, self.depth):
            ids = frontier.tolist()
            m = len(ids)
            parents = builder.parents[frontier].tolist()
            tgt_tok = self.to_target_ids(builder.tokens[frontier])  # the embedding is the target's
            hidden_in = self.child_hidden(torch.stack([hidden_of[p] for p in parents]))
            start = self.committed + len(processed)
            anc = builder.ancestor_mask(frontier)  # [m, num_nodes]
            cols = torch.tensor(processed + ids, dtype=torch.long, device=self.device)
            mask = torch.cat([torch.ones(m, self.committed, dtype=torch.bool, device=self.device), anc[:, cols]], 1)
            positions = torch.full((m,), self.tree_position(root_position, level), device=self.device)
            self._record(T.draft_tokens(level), tgt_tok)
            self._record(T.draft_positions(level), positions)
            embeds = self.embed(tgt_tok)
            self._record(T.draft_embed_in(level), embeds)
            self._record(T.draft_hidden_in(level), hidden_in)
            step_mask = mask[None, None]
            out = self.draft.step(embeds[None], hidden_in[None], positions[None], self.cache, start, step_mask)[0]
            self._record(T.draft_hidden_out(level), out)
            for j, i in enumerate(ids):
                hidden_of[i] = out[j]
            processed += ids
            lp = self._logprobs(out)
            self._record_topk(level + 1, lp)
            frontier = builder.expand(frontier, lp)
        tree = builder.finalize(self.total_tokens)
        toks = tree.tokens.clone()
        toks[1:] = self.to_target_ids(toks[1:])
        tree.tokens = toks
        return tree

    def _record_topk(self, step: int, lp: torch.Tensor) -> None:
        if self.rec is not None:
            v, i = lp.topk(min(self.top_k, lp.shape[-1]), dim=-1)
            self.rec.record(T.draft_topk(step - 1), {T.TOPK_IDS: self.to_target_ids(i), T.TOPK_LOGPROBS: v})


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

    def accepted(self, tree, result, verify_out) -> None:
        # The LM consumed tokens[:-1]... plus drafts 1..k-1; keep what is still on the true path.
        keep = self._context + min(len(result.accepted), self.k - 1)
        self.lm.truncate(keep)


def build_proposer(args, target: Target, sampling: SamplingConfig, max_len: int, recorder=None) -> Proposer:
    """The proposer the CLI flags ask for."""
    depth, top_k, total = parse_tree_shape(args.chain, args.tree)
    if args.proposer == "ngram":
        return NgramProposer(depth)
    if args.draft is None:
        raise EagleScopeError(f"--proposer {args.proposer} needs --draft DIR")
    if args.proposer == "draft-lm":
        lm = load_target(args.draft, device=target.device, dtype=target.dtype, backend=args.backend)
        if lm.vocab_size != target.vocab_size:
            raise EagleScopeError(
                f"draft LM vocabulary ({lm.vocab_size}) differs from the target's ({target.vocab_size})"
            )
        return DraftLMProposer(lm, depth if args.chain is not None else 4, sampling, max_len)
    loaded = load_draft(args.draft, target.num_layers, device=target.device, dtype=target.dtype)
    check_draft_matches_target(loaded.contract, target.fingerprint)
    n_draft = loaded.model.config.draft_vocab_size
    if top_k > n_draft:
        raise EagleScopeError(f"--tree top-k {top_k} exceeds the draft's vocabulary of {n_draft} tokens")
    if not loaded.has_embedding:
        loaded.model.load_target_embedding(target_embedding(target))
    target.set_taps(loaded.contract.taps)
    return Eagle3Proposer(loaded.model, depth, top_k, total, max_len, recorder)


def target_embedding(target: Target) -> torch.Tensor:
    if isinstance(emb := getattr(target, "embedding", None), torch.Tensor):  # a target held as its embedding alone
        return emb
    if hasattr(target, "model") and hasattr(target.model, "get_input_embeddings"):
        return target.model.get_input_embeddings().weight
    return target.model.model.embed_tokens.weight
