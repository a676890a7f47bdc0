"""Draft trees: the data structure every proposer hands to verification, and EAGLE-2 tree building.

A tree of N nodes is a few parallel tensors. Node 0 is the root: the last committed token
(or last round's bonus token), already known to be right, not a draft. Parents precede
children (``parents[i] < i``), so one pass in node order visits every parent first, and the
flattened tree can be fed to the target in node order with ``ancestor_mask`` as attention
mask and ``positions`` as RoPE positions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from eaglescope.errors import EagleScopeError

# Official EAGLE-2/3 dynamic-tree defaults (docs/field.md §4): (depth, top_k, total_tokens).
EAGLE_DEFAULT_TREE = (7, 10, 60)


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long; tokens[0] = root (already committed)
    parents: torch.Tensor  # [N] long; parents[0] = -1, parents[i] < i
    depths: torch.Tensor  # [N] long; root 0
    scores: torch.Tensor  # [N] float; cumulative draft log-prob, root 0
    # [N, V] or None. Row i = the draft distribution q the children of node i were sampled from
    # (sampled chains / SpecInfer-style i.i.d. siblings). None = deterministic top-k tree (q = 1).
    draft_probs: torch.Tensor | None = None
    # [N] long or None: TreeBuilder ids of the nodes (root = builder id 0), so the caller can map
    # a tree node back to the draft step output (hidden state) that produced it.
    source: torch.Tensor | None = None
    # [N, N] bool or None: a precomputed ancestor_mask() (TreeBuilder fills it without host syncs)
    mask: torch.Tensor | None = None

    @classmethod
    def from_parents(
        cls,
        tokens: torch.Tensor | list[int],
        parents: torch.Tensor | list[int],
        scores: torch.Tensor | list[float] | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> DraftTree:
        """Tree from tokens and parents (parents precede children); depths are computed."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
        par = parents.tolist()
        depth = [0] * len(par)
        for i in range(1, len(par)):
            if not 0 <= par[i] < i:
                raise EagleScopeError(f"tree node {i} has parent {par[i]}; parents must precede children")
            depth[i] = depth[par[i]] + 1
        if scores is None:
            scores = torch.zeros(len(par), device=tokens.device)
        scores = torch.as_tensor(scores, device=tokens.device)
        tree = cls(tokens, parents, torch.tensor(depth, device=tokens.device), scores, draft_probs)
        tree.validate()
        return tree

    @classmethod
    def chain(cls, tokens: torch.Tensor | list[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
        """A chain ``tokens[0] (root) -> tokens[1] -> ...``.

        ``draft_probs`` ``[N, V]`` or ``[N-1, V]``: row i = the q token i+1 was sampled from (the leaf
        row, never used, is zero-filled when omitted). Scores are cumulative log q when given, else 0."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        n = tokens.shape[0]
        dev = tokens.device
        parents = torch.arange(-1, n - 1, device=dev)
        depths = torch.arange(n, device=dev)
        scores = torch.zeros(n, device=dev)
        if draft_probs is not None:
            if draft_probs.dim() != 2 or draft_probs.shape[0] not in (n, n - 1):
                raise EagleScopeError(f"chain draft_probs must be [{n} or {n - 1}, V], got {list(draft_probs.shape)}")
            if draft_probs.shape[0] == n - 1:
                draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(1, draft_probs.shape[1])])
            step = draft_probs[:-1].gather(1, tokens[1:, None]).squeeze(1).float().log()
            scores = torch.cat([scores[:1], step.cumsum(0)])
        tree = cls(tokens, parents, depths, scores, draft_probs)
        tree.validate()
        return tree

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def positions(self, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """RoPE positions of the nodes when the root sits at ``offset``."""
        return offset + self.depths

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool: node i attends node j iff j is i or an ancestor of i."""
        if self.mask is not None:
            return self.mask
        n = self.num_nodes
        rows = torch.arange(n, device=self.parents.device)
        up = self.parents.clamp(min=0)  # root points to itself: walking past it stays at the root
        mask = torch.zeros(n, n, dtype=torch.bool, device=self.parents.device)
        cur = rows
        for _ in range(self.max_depth + 1):  # one step up per level; small loop, no loop over N
            mask[rows, cur] = True
            cur = up[cur]
        return mask

    def children(self, i: int) -> list[int]:
        """Children of node i in node order."""
        return (self.parents == i).nonzero().flatten().tolist()

    def children_lists(self) -> list[list[int]]:
        """``out[i]`` = children of node i in node order (one host sync for the whole tree)."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            out[p].append(i)
        return out

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node-index paths, leaves in node order."""
        par = self.parents.tolist()
        kids = self.children_lists()
        out = []
        for leaf in range(self.num_nodes):
            if kids[leaf]:
                continue
            path = [leaf]
            while par[path[-1]] >= 0:
                path.append(par[path[-1]])
            out.append(path[::-1])
        return out

    def validate(self) -> None:
        n = self.tokens.shape[0]
        if n < 1 or self.tokens.dim() != 1:
            shape = list(self.tokens.shape)
            raise EagleScopeError(f"a draft tree needs a 1-D token tensor with a root, got shape {shape}")
        for name, t in (("parents", self.parents), ("depths", self.depths), ("scores", self.scores)):
            if t.shape != (n,):
                raise EagleScopeError(f"draft tree {name} has shape {list(t.shape)}, expected [{n}]")
        par = self.parents.tolist()
        if par[0] != -1:
            raise EagleScopeError(f"draft tree root must have parent -1, got {par[0]}")
        idx = torch.arange(n, device=self.parents.device)
        if n > 1 and not bool(((self.parents[1:] >= 0) & (self.parents[1:] < idx[1:])).all()):
            raise EagleScopeError("draft tree parents must precede children (0 <= parents[i] < i for i > 0)")
        if int(self.depths[0]) != 0 or (
            n > 1 and not bool((self.depths[1:] == self.depths[self.parents[1:]] + 1).all())
        ):
            raise EagleScopeError("draft tree depths must be 0 at the root and parent depth + 1 elsewhere")
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n):
            raise EagleScopeError(f"draft tree draft_probs must be [{n}, V], got {list(self.draft_probs.shape)}")
        if self.source is not None and self.source.shape != (n,):
            raise EagleScopeError(f"draft tree source has shape {list(self.source.shape)}, expected [{n}]")
        if self.mask is not None and not torch.equal(self.mask, replace(self, mask=None).ancestor_mask()):
            raise EagleScopeError("draft tree mask does not match its parents")


def tree_capacity(top_k: int, levels: int, vocab: int) -> int:
    """Nodes a TreeBuilder holds after `levels` expansions from the root (draft vocabulary `vocab`): the root, then each
    level's frontier times its top-k children."""
    n = m = 1
    k = min(top_k, vocab)
    for _ in range(levels):
        n += m * k
        m = min(top_k, m * k)
    return n


class TreeBuilder:
    """EAGLE-2 dynamic tree construction, on-device, in buffers sized once for the whole tree.

    Builder ids: 0 is the root; every candidate ever expanded gets the next id. A round goes::

        b = TreeBuilder(root_token, top_k, device, levels=depth, vocab=V)
        frontier = b.expand(torch.tensor([0]), draft_logprobs_at_root)        # [1, V]
        for _ in range(depth - 1):
            # run the draft on b.tokens[frontier] (mask: b.ancestor_mask(frontier)) ...
            frontier = b.expand(frontier, draft_logprobs)                        # [m, V]
        tree = b.finalize(total_tokens)          # tree.source maps nodes back to builder ids

    Every expansion adds all m*top_k children as candidates; only the global top_k (by cumulative
    log-prob) are expanded further. ``finalize`` reranks all candidates globally.

    Why fixed buffers: every level from the second on then has the same shapes (K parents, K*K candidates written at an
    offset held in a device tensor), so the static backend compiles one level and runs it at every depth, and a level
    is a few in-place writes instead of growing five tensors by concatenation. `expand_fn` is `expand_level` or a
    compiled copy of it.
    """

    def __init__(
        self,
        root_token: int | torch.Tensor,
        top_k: int,
        device: torch.device | str | None = None,
        *,
        levels: int,
        vocab: int,
        expand_fn=None,
        buffers: tuple[torch.Tensor, ...] | None = None,
    ):
        """`buffers`: tree_buffers(root_token, capacity, levels + 1, device)'s tensors, made by the caller (the static
        backend compiles their initialisation into a piece of its round)."""
        if top_k < 1:
            raise EagleScopeError(f"tree top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.capacity = tree_capacity(top_k, levels, vocab)
        if buffers is None:
            buffers = tree_buffers(root_token, self.capacity, levels + 1, self.device)
        self.tokens, self.parents, self.depths, self.scores, self.lineage, self.next_id = buffers
        self.num_nodes = 1  # the same count on the host (shapes only: no value is read back)
        self.expand_fn = expand_fn or expand_level

    def expand(
        self, parent_nodes: torch.Tensor, logprobs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Add the top_k children of each ``parent_nodes[j]`` (draft log-probs ``logprobs[j]``, or the children
        already picked: their log-probs and token ids ``[m, min(top_k, V)]`` each, best first).

        Returns the builder ids of the next frontier: the global top_k new candidates by cumulative
        log-prob, best first."""
        parent_nodes = parent_nodes.to(self.device, torch.long).flatten()
        m = parent_nodes.shape[0]
        picked = isinstance(logprobs, tuple)
        first = logprobs[0] if picked else logprobs
        if first.dim() != 2 or first.shape[0] != m or (picked and first.shape[1] > self.top_k):
            want = f"[{m}, <= {self.top_k}] children" if picked else f"logprobs [{m}, V]"
            raise EagleScopeError(f"expand needs {want} for {m} parents, got {list(first.shape)}")
        k = first.shape[1] if picked else min(self.top_k, first.shape[1])
        if self.num_nodes + m * k > self.capacity:
            raise EagleScopeError(f"tree builder full: {self.num_nodes} + {m * k} nodes exceed its {self.capacity}")
        self.num_nodes += m * k
        bufs = (self.tokens, self.parents, self.depths, self.scores, self.lineage, self.next_id)
        return self.expand_fn(*bufs, parent_nodes, logprobs, k, self.top_k)

    def ancestor_mask(self, nodes: torch.Tensor) -> torch.Tensor:
        """``[m, capacity]`` bool: which builder nodes each of ``nodes`` attends (itself + ancestors)."""
        nodes = nodes.to(self.device, torch.long).flatten()
        mask = torch.zeros(nodes.shape[0], self.capacity, dtype=torch.bool, device=self.device)
        return mask.scatter_(1, self.lineage[nodes], True)

    def finalize(self, total_tokens: int, check: bool = False) -> DraftTree:
        """Keep the root and the best ``total_tokens - 1`` candidates; nodes ordered by (depth, -score)
        (`finalize_tree`)."""
        if total_tokens < 1:
            raise EagleScopeError(f"total_tokens must be >= 1, got {total_tokens}")
        bufs = (self.tokens, self.parents, self.depths, self.scores, self.lineage)
        tokens, parents, depths, scores, src, mask = finalize_tree(*bufs, self.num_nodes, total_tokens)
        tree = DraftTree(tokens=tokens, parents=parents, depths=depths, scores=scores, source=src, mask=mask)
        if check:  # host syncs; connectivity holds by construction, tests check it
            tree.validate()  # a missing ancestor would show up as parent -1 here
        return tree


def tree_buffers(root_token: int | torch.Tensor, capacity: int, columns: int, device: torch.device):
    """A TreeBuilder's buffers holding the root alone → (tokens, parents, depths, scores, lineage, next_id)."""
    z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
    tokens = z(capacity)
    if isinstance(root_token, torch.Tensor):  # the static backend's [1] device tensor: no host copy
        tokens[:1].copy_(root_token.reshape(1))
    else:
        tokens[:1].fill_(int(root_token))
    scores = torch.zeros(capacity, device=device)  # float32 cumulative draft log-probs
    # [capacity, columns]: column d = the node's ancestor at depth d, the node itself past its own depth; makes an
    # ancestor mask one comparison instead of a walk up the tree
    lineage = z(capacity, columns)
    return tokens, z(capacity).fill_(-1), z(capacity), scores, lineage, z(1) + 1  # next_id: the first free id


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, dim=-1) of a wide [..., V] (a draft vocabulary's log-probs), best first: the top k of every 256 (or
    128) columns, then the top k of those. On CUDA, torch takes a few wide rows through its multi-block radix select,
    ~14 kernels (~33 µs for [4, 32000] on an H200, bench-roofline-20261204T192019.json's draft profile); 500 narrow
    slices and one short row take its single-block kernel twice. The same values; among equal values the indices
    may differ, as they may between any two topk kernels."""
    V = x.shape[-1]
    chunk = next((c for c in (256, 128) if V % c == 0), 0)
    if not chunk or V < 8 * chunk or k > chunk:
        return x.topk(k, dim=-1)
    lead = x.shape[:-1]
    local_vals, local_ids = x.reshape(-1, V // chunk, chunk).topk(k, dim=-1, sorted=False)  # [m, V/chunk, k]
    offsets = torch.arange(0, V, chunk, device=x.device)[None, :, None]
    vals, pick = local_vals.flatten(1).topk(k, dim=-1)
    ids = (local_ids + offsets).flatten(1).gather(1, pick)
    return vals.reshape(*lead, k), ids.reshape(*lead, k)


def expand_level(tokens, parents, depths, scores, lineage, next_id, parent_nodes, logprobs, k: int, top_k: int):
    """One level of TreeBuilder.expand, in place: the top-k children of each of parent_nodes [m] (log-probs [m, V]) get
    builder ids next_id .. next_id + m*k - 1, next_id moves past them → the next frontier (the global top_k of the new
    candidates by cumulative log-prob, best first). `logprobs` may be the children already picked (log-probs, ids)
    [m, k]. Tensors in, tensors out, no host read: capturable and compilable."""
    child_lp, child_tok = logprobs if isinstance(logprobs, tuple) else top_k_rows(logprobs, k)  # [m, k]
    cum = (scores[parent_nodes][:, None] + child_lp.to(scores.dtype)).flatten()  # [m*k]
    ids = next_id + torch.arange(cum.shape[0], device=tokens.device)
    of = parent_nodes.repeat_interleave(k)  # each candidate's parent
    depth = depths[of] + 1
    tokens.index_copy_(0, ids, child_tok.flatten())
    parents.index_copy_(0, ids, of)
    depths.index_copy_(0, ids, depth)
    scores.index_copy_(0, ids, cum)
    cols = torch.arange(lineage.shape[1], device=tokens.device)
    lineage.index_copy_(0, ids, torch.where(cols[None, :] >= depth[:, None], ids[:, None], lineage[of]))
    next_id.add_(cum.shape[0])
    return ids[cum.topk(min(top_k, cum.shape[0])).indices]


def finalize_tree(tokens, parents, depths, scores, lineage, num_nodes: int, total_tokens: int):
    """The root and the best ``total_tokens - 1`` of a builder's first `num_nodes` nodes → (tokens, parents, depths,
    scores, source ids, ancestor mask) of the tree, nodes ordered by (depth, -score).

    A child's cumulative log-prob never exceeds its parent's, and ties are broken towards the
    shallower node, so every kept node's parent ranks before it: the kept set is connected."""
    dev = tokens.device
    n_keep = min(total_tokens - 1, num_nodes - 1)
    cand = torch.arange(1, num_nodes, device=dev)
    # rank by score desc, ties to the shallower node: stable sort by depth, then stable by score. NaN ranks as -inf:
    # a draft row of NaN log-probs gives its children NaN under a parent with a number, and sort's NaN-first order
    # would keep them without it
    by_depth = cand[torch.sort(depths[cand], stable=True).indices]
    rank_by = torch.where(scores.isnan(), float("-inf"), scores)
    ranked = by_depth[torch.sort(rank_by[by_depth], descending=True, stable=True).indices]
    # final order: by depth, then score desc (parents precede children; siblings best first): `ranked` is by score
    # desc already, so one stable sort by depth
    kept = ranked[:n_keep]
    kept = kept[torch.sort(depths[kept], stable=True).indices]
    src = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), kept])
    remap = torch.full((num_nodes,), -1, dtype=torch.long, device=dev)
    remap[src] = torch.arange(src.shape[0], device=dev)
    tree_parents = torch.cat([remap.new_full((1,), -1), remap[parents[kept]]])
    n = src.shape[0]
    # kept set is ancestor-closed, so every lineage entry maps to a kept node
    mask = torch.zeros(n, n, dtype=torch.bool, device=dev).scatter_(1, remap[lineage[src]], True)
    return tokens[src], tree_parents, depths[src], scores[src], src, mask


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
