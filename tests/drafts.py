"""Random EAGLE-3 drafts for tiny targets, built through the real config and vocab-map code."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eaglescope.models.draft import DraftConfig, DraftContract, Eagle3Draft, save_draft
from eaglescope.models.vocab import build_draft_vocab
from eaglescope.taps import TapContract


def make_draft(
    target_dir: Path,
    taps: TapContract | None = None,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    scale: float = 1.0,
    arch: str = "llama",
    random_norms: bool = False,
    **options,
) -> tuple[Eagle3Draft, DraftContract]:
    """`arch` and `options` (EAGLE 3.1 flags) as DraftConfig.for_target takes them; `random_norms` draws every norm
    weight around 1 instead of exactly 1, so a norm applied or skipped changes the output (EAGLE 3.1 tests)."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    taps = taps or TapContract.default(L)
    V = cfg["vocab_size"]
    n = draft_vocab_size or V
    config = DraftConfig.for_target(cfg, taps, n, arch=arch, **options)
    g = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 2 and name != "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
            elif p.dim() == 1 and random_norms:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
    counts = torch.randint(0, 1000, (V,), generator=g)
    d2t, t2d = build_draft_vocab(counts, n)
    draft.set_vocab_map(d2t, t2d)
    return draft.eval(), DraftContract(taps=taps, ttt_length=7)


def save_random_draft(target_dir: Path, out: Path, draft_vocab_size: int | None = None, dtype=torch.bfloat16) -> Path:
    """`make_draft` (unit scale) for the target at `target_dir`, saved in `dtype` at `out`; an `out` that holds a
    draft already is reused (the GPU tests and the benchmarks share their 8B-shaped pair)."""
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    draft, contract = make_draft(target_dir, draft_vocab_size=draft_vocab_size)
    partial = out.with_name(out.name + ".partial")
    save_draft(draft.to(dtype), contract, partial)
    partial.rename(out)
    return out


LEVEL_INPUTS = ("tokens", "positions", "embeddings", "features", "slots", "mask")


def check_level_inputs(monkeypatch) -> list[int]:
    """Make every one-launch tree level (FusedDraftStep.level_inputs, via fast/draft_pieces.py FusedPieces) also run
    the composed Eagle3Proposer.level_inputs on the same state and assert the two equal: the six tensors, exactly,
    and the writes to slot_of. → the levels checked, appended as they run (rounds must run uncaptured: it syncs)."""
    from eaglescope.decode.speculative import Eagle3Proposer
    from eaglescope.fast.draft_pieces import FusedPieces

    one_launch, checked = FusedPieces.level_inputs, []

    def both(self, *args):
        slot_of = args[3]
        before = slot_of.clone()
        got = [x.clone() for x in one_launch(self, *args)]
        written, _ = slot_of.clone(), slot_of.copy_(before)
        want = Eagle3Proposer.level_inputs(self.proposer, *args)
        for name, a, b in zip(LEVEL_INPUTS, got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert torch.equal(written, slot_of) and not torch.equal(written, before)
        checked.append(int(args[-1]))
        return got

    monkeypatch.setattr(FusedPieces, "level_inputs", both)
    return checked


def check_tree_start(fe, capacity: int, seed: int = 0) -> None:
    """FusedDraftStep.tree_start (via the FastEagle `fe`'s FusedPieces) against the composed Eagle3Proposer.tree_start
    on two starts: every tensor equal, exactly; the second over buffers filled with other values, as a round leaves
    them (every entry is rewritten)."""
    from eaglescope.decode.speculative import Eagle3Proposer

    proposer = fe.proposer
    dev = proposer.device
    g = torch.Generator(dev).manual_seed(seed)
    for root, context in ((17, 9), (3, 21)):
        h_root = torch.randn(1, proposer.draft.config.hidden_size, generator=g, device=dev).to(proposer.dtype)
        args = (torch.tensor([root], device=dev), h_root, torch.tensor([context], device=dev), capacity)
        got, want = fe.fused.tree_start(*args), Eagle3Proposer.tree_start(proposer, *args)
        got, want = [*got[0], *got[1:]], [*want[0], *want[1:]]
        assert len(got) == len(want) == 10
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), i
        for t in got:  # what a round leaves behind
            t.copy_(torch.randint(-5, 90, t.shape, generator=g, device=dev).to(t.dtype))


def check_finalize(fe, top_k: int, levels: int, vocab: int, seed: int, scores: str, total: int) -> bool:
    """FusedDraftStep.finalize (the FastEagle `fe`'s fused layer) against the composed Eagle3Proposer.finalize over a
    builder grown by decode/tree.py (`scores`: "distinct" log-probs, coarse ones where many candidates "ties", or one
    draft row all "nan" half way down): every tensor equal, exactly (both rank NaN as -inf); the tree connected.
    → False where the tree is wider than the kernel takes (nothing checked)."""
    from eaglescope.decode.speculative import Eagle3Proposer
    from eaglescope.decode.tree import DraftTree, TreeBuilder
    from eaglescope.fast.fused_draft import FusedDraftStep

    proposer = fe.proposer
    dev = proposer.device
    g = torch.Generator(dev).manual_seed(seed)
    b = TreeBuilder(7, top_k, dev, levels=levels, vocab=vocab)
    frontier = torch.tensor([0], device=dev)
    for level in range(levels):
        lp = torch.log_softmax(torch.randn(frontier.shape[0], vocab, generator=g, device=dev) * 3, -1)
        if scores == "ties":
            lp = (lp * 2).round() / 2
        if scores == "nan" and level == levels // 2:
            lp[-1] = float("nan")
        frontier = b.expand(frontier, lp)
    if not FusedDraftStep.takes_finalize(b.num_nodes):
        return False
    args = (b.tokens, b.parents, b.depths, b.scores, b.lineage, b.num_nodes, total)
    got = [t.clone() for t in fe.fused_layer.finalize(*args)]
    want = Eagle3Proposer.finalize(proposer, *args)
    if scores == "nan":
        assert b.scores[: b.num_nodes].isnan().any()
    for name, x, y in zip(("tokens", "parents", "depths", "scores", "source", "mask"), got, want, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) if x.dtype.is_floating_point else torch.equal(x, y)
    DraftTree(*got[:4], source=got[4], mask=got[5]).validate()  # connected, whatever the scores
    return True
