"""The draft side's pieces as the static backend runs them (decode/speculative.py DraftPieces): the proposer's own
functions compiled one by one, and the fused draft layer's kernels (fast/fused_draft.py FusedDraftStep) standing in
where they compute the same thing. Built here and handed to the proposer, so decode/ calls what it is given by field
and knows no kernel by name."""

from __future__ import annotations

import torch

from eaglescope import trace as T
from eaglescope.decode.speculative import DraftPieces, Eagle3Proposer
from eaglescope.decode.tree import tree_capacity
from eaglescope.fast.fused_draft import FusedDraftStep


def compiled_pieces(own: DraftPieces, backend: str = "inductor") -> DraftPieces:
    """The proposer's own pieces (`Eagle3Proposer.own_pieces`) each torch.compiled: one compilation each per tree
    budget, whatever the depth. The hooks run inside them, so a subclass's wiring is what gets compiled. Each tree
    budget and each proposer is another graph of the same code: the static backend raises dynamo's recompile limit
    (fast/layers.py allow_recompiles). The root's children are the compiled log-probs (one function, one graph)."""
    done = DraftPieces(*(torch.compile(fn, dynamic=False, backend=backend) for fn in own))
    return done._replace(root_children=done.logprobs)


class FusedPieces:
    """The pieces whose draft step runs on the fused draft layer `layer`, around `composed` (the proposer's own
    pieces, compiled or not): the catch-up's and every tree level's draft step, the root's and each level's top-k
    children picked from the logits, each level's expansion in one launch; and, where its kernels take them and the
    proposer's wiring is Eagle3Proposer's own (the kernels hard-code it: a subclass overriding one of those hooks, as
    doctor's hypotheses and the tests' faults do, runs its own), a level's inputs, the tree's start and its finalize
    in one launch each. `pieces`: the table the proposer is handed."""

    def __init__(self, proposer: Eagle3Proposer, layer: FusedDraftStep, composed: DraftPieces) -> None:
        self.proposer, self.layer = proposer, layer
        cls, own = type(proposer), Eagle3Proposer
        maps_ids = cls.to_target_ids is own.to_target_ids
        # the one-launch level_inputs builds the ancestors' mask only
        levels_own = maps_ids and all(
            (cls.level_inputs is own.level_inputs, cls.child_hidden is own.child_hidden, cls.embed is own.embed,
             cls.tree_position is own.tree_position, proposer.tree_attention == T.TREE_ANCESTORS)
        )  # fmt: skip
        vocab = proposer.draft.config.draft_vocab_size
        finalize_own = maps_ids and cls.finalize is own.finalize
        takes_tree = layer.takes_finalize(tree_capacity(proposer.top_k, proposer.depth, vocab))
        one = layer.one_launch
        self.pieces = composed._replace(
            catch_up=self.catch_up,
            root_children=self.root_children,
            tree_level=self.tree_level,
            expand_level=layer.expand_level,  # the children come picked: the level's writes in one launch
            level_inputs=self.level_inputs if one and levels_own else composed.level_inputs,
            tree_start=self.tree_start if one and cls.tree_start is own.tree_start else composed.tree_start,
            finalize=self.finalize if one and finalize_own and takes_tree else composed.finalize,
        )

    def catch_up(self, aux: torch.Tensor, tokens: torch.Tensor, start) -> torch.Tensor:
        """Eagle3Proposer.catch_up with the draft step on the fused layer."""
        embeds, hidden, positions, slots, mask = self.pieces.catch_up_inputs(aux, tokens, start)
        out = self.layer(embeds, hidden, *self.pieces.rotary(positions), slots, mask)[0]
        self.proposer._record(T.draft_hidden_out(0), out)
        return out

    def root_children(self, h_root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The root's top-k children (log-probs, draft ids) [1, k] straight from the logits, as every level's."""
        return self.layer.children(self.pieces.logits(h_root), self.proposer.top_k)

    def tree_level(self, *args):
        """Eagle3Proposer.tree_level with the draft step on the fused layer. Its `out` is a view the next level's
        layer overwrites: the next level_inputs gathers from it first, and nothing else holds it."""
        tok, positions, embeds, hidden_in, slots, mask = self.pieces.level_inputs(*args)
        out, normed = self.layer(embeds, hidden_in, *self.pieces.rotary(positions), slots, mask)
        children = self.layer.children(self.layer.head(normed), self.proposer.top_k)
        return tok, positions, embeds, hidden_in, out, children

    def level_inputs(self, *args):
        """Eagle3Proposer.level_inputs in one launch (FusedDraftStep.level_inputs)."""
        return self.layer.level_inputs(*args, tree_base=self.proposer.tree_base, top_k=self.proposer.top_k)

    def tree_start(self, root, h_root: torch.Tensor, context, capacity: int):
        """Eagle3Proposer.tree_start in one launch (FusedDraftStep.tree_start)."""
        p = self.proposer
        return self.layer.tree_start(root, h_root, context, capacity, p.depth + 1, p.frontier_width)

    def finalize(self, *args):
        """Eagle3Proposer.finalize in one launch (FusedDraftStep.finalize)."""
        return self.layer.finalize(*args)
