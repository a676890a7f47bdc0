"""Verification: which drafted tokens the target accepts, and the bonus token after them.

``target_logits[i]`` is the target's prediction for the token *after* tree node i (one target
forward over the tree with ``tree.ancestor_mask()``). Both verifiers walk from the root down
one path; the result is the same whatever proposer built the tree (chain, EAGLE-2 tree,
prompt lookup, a small LM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglescope.decode.sampling import process_logits, sample
from eaglescope.decode.tree import DraftTree
from eaglescope.errors import EagleScopeError


@dataclass
class VerifyResult:
    accepted: list[int]  # node indices of the accepted path, root excluded, in order
    bonus: int  # token emitted after the last accepted node
    tokens: list[int]  # what this round emits: accepted draft tokens, then the bonus

    @property
    def last_node(self) -> int:
        """The node whose target state the bonus was drawn from (0 = root when nothing accepted)."""
        return self.accepted[-1] if self.accepted else 0

    @property
    def path(self) -> list[int]:
        """Root plus accepted nodes: the positions whose target KV / features survive the round."""
        return [0, *self.accepted]


def _check(tree: DraftTree, target_logits: torch.Tensor) -> None:
    if target_logits.dim() != 2 or target_logits.shape[0] != tree.num_nodes:
        raise EagleScopeError(
            f"target logits must be [{tree.num_nodes}, V] for a {tree.num_nodes}-node tree,"
            f" got {list(target_logits.shape)}"
        )


def _children_by_score(tree: DraftTree) -> list[list[int]]:
    scores = tree.scores.tolist()
    return [sorted(kids, key=lambda c: -scores[c]) for kids in tree.children_lists()]


def accept_greedy(
    tokens: torch.Tensor,  # [N] tree tokens (target ids), node 0 = root
    parents: torch.Tensor,  # [N], parents[0] = -1
    depths: torch.Tensor,  # [N]
    anc: torch.Tensor,  # [N, N] bool ancestor mask (self included)
    best: torch.Tensor,  # [N] target argmax after each node
    max_depth: int,
    force: torch.Tensor | None = None,  # [1] long: accept this depth instead (replay), for cost studies
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification without host syncs → (accepted count [1], path [max_depth+1], bonus [1]).

    The deepest node whose whole root path matches the target argmax, first in node order among equals (lossless:
    every emitted token is the target's argmax given exactly the emitted prefix). path[d] = its ancestor at depth d
    (0 past its depth)."""
    # the root always "matches"; no item assignment: a Python scalar written into a CUDA tensor is a host
    # copy, which CUDA graph capture refuses
    match = (tokens == best[parents.clamp(min=0)]) | (parents < 0)
    ok = ~(anc & ~match[None, :]).any(1)
    key = torch.where(ok, depths, -1) if force is None else torch.where(depths <= force, depths, -1)
    # [1]-shaped indices throughout: indexing with a 0-dim tensor would read it on the host (a sync)
    last = key.float().argmax().view(1)  # float: argmax over integer tensors is not implemented everywhere
    a = depths.index_select(0, last)
    levels = torch.arange(max_depth + 1, device=tokens.device)
    sel = anc.index_select(0, last) & (depths[None, :] == levels[:, None])  # [D+1, N]
    path = sel.float().argmax(1)
    return a, path, best.index_select(0, last)


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    """Longest root path whose every token equals the target argmax at its parent (`accept_greedy`, read back to the
    host). With duplicate siblings the deepest matching path wins (ties: first in node order)."""
    _check(tree, target_logits)
    best = target_logits.argmax(-1)
    tokens = tree.tokens.to(best.device)
    mask = tree.ancestor_mask().to(best.device)
    a, path, bonus = accept_greedy(tokens, tree.parents.to(best.device), tree.depths.to(best.device), mask, best,
                                   tree.max_depth)  # fmt: skip
    n = int(a)
    accepted = path[1 : n + 1].tolist()
    return VerifyResult(accepted, int(bonus), tokens[path[1 : n + 1]].tolist() + [int(bonus)])


def verify_sampling(
    tree: DraftTree,
    target_logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Recursive rejection sampling down the tree; emits tokens distributed exactly as the target's.

    ``generator`` must live on the logits' device. ``temperature == 0`` is greedy verification."""
    if temperature == 0:
        return verify_greedy(tree, target_logits)
    _check(tree, target_logits)
    p = process_logits(target_logits, temperature, top_k, top_p)  # [N, V]
    q = tree.draft_probs
    if q is not None:
        q = q.to(p.device, p.dtype)
    tokens = tree.tokens.tolist()
    kids = _children_by_score(tree)
    walk = _walk_topk if q is None else _walk_sampled
    accepted, residual = walk(p, q, tokens, kids, generator)
    bonus = int(sample(residual, generator))
    return VerifyResult(accepted, bonus, [tokens[c] for c in accepted] + [bonus])


def _uniforms(n: int, p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    device = generator.device if generator is not None else p.device
    return torch.rand(n, generator=generator, device=device, dtype=torch.float64).to(p.device)


def _walk_topk(p, q, tokens, kids, generator) -> tuple[list[int], torch.Tensor]:
    """Deterministic draft (q = 1 on each proposed child): recursive rejection over siblings.

    At node ``cur`` with residual r (initially p[cur]): accept child c w.p. r(c); on rejection zero
    r(c) and renormalise. The token leaving the node is then exactly r: P(y) = r(c)[y=c] +
    (1 - r(c)) * r(y)[y!=c] / (1 - r(c)) = r(y), and by induction over the siblings it is p[cur].
    A duplicate sibling finds r(c) = 0 and is rejected without changing r. Since r(c) = p(c) /
    (1 - rejected mass), a level needs one host sync: p at the children and the uniforms together."""
    cur, accepted = 0, []
    while True:
        children = kids[cur]
        if not children:
            return accepted, p[cur]
        child_tok = torch.tensor([tokens[c] for c in children], device=p.device)
        pc, u = torch.stack([p[cur, child_tok].double(), _uniforms(len(children), p, generator)]).tolist()
        rejected: dict[int, float] = {}
        child = None
        for j, c in enumerate(children):
            if tokens[c] in rejected:
                continue
            left = 1.0 - sum(rejected.values())
            if left <= 0.0:  # float round-off only: everything already rejected
                break
            if u[j] * left < pc[j]:  # u < p(c) / left
                child = c
                break
            rejected[tokens[c]] = pc[j]
        if child is None:
            residual = p[cur].clone()
            residual[list(rejected)] = 0.0
            total = residual.sum()
            return accepted, residual / total if bool(total > 0) else p[cur]
        accepted.append(child)
        cur = child


def _walk_sampled(p, q, tokens, kids, generator) -> tuple[list[int], torch.Tensor]:
    """Sampled draft: child c ~ q[cur] (a chain, or SpecInfer-style i.i.d. siblings).

    Accept c w.p. min(1, r(c)/q(c)), else continue with r = norm(max(r - q, 0)): the standard
    speculative-sampling step (Leviathan et al.) whose output is exactly r. The next sibling is a
    fresh draw from q, so the same step repeats with the residual as target, and the token leaving
    the node is distributed as p[cur] (SpecInfer)."""
    cur, accepted = 0, []
    residual = p[0]
    while True:
        child = None
        for c in kids[cur]:
            tok = tokens[c]
            u = _uniforms(1, p, generator)[0]
            if bool(u * q[cur, tok] < residual[tok]):  # u < r/q without dividing by q = 0
                child = c
                break
            residual = (residual - q[cur]).clamp(min=0.0)
            total = residual.sum()
            if not bool(total > 0):  # cannot happen in exact arithmetic: rejection had prob 0
                residual = p[cur]
                break
            residual = residual / total
        if child is None:
            return accepted, residual
        accepted.append(child)
        cur = child
        residual = p[cur]  # fresh target distribution after the accepted prefix
