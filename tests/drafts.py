"""Random EAGLE-3 drafts for tiny targets, built through the real config and vocab-map code."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eaglescope.data.vocab import build_draft_vocab
from eaglescope.draft import DraftConfig, DraftContract, Eagle3Draft
from eaglescope.taps import TapContract


def make_draft(
    target_dir: Path,
    taps: TapContract | None = None,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    scale: float = 1.0,
) -> tuple[Eagle3Draft, DraftContract]:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    taps = taps or TapContract.default(L)
    V = cfg["vocab_size"]
    n = draft_vocab_size or V
    config = DraftConfig.for_target(cfg, taps, n)
    g = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 2 and name != "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
    counts = torch.randint(0, 1000, (V,), generator=g)
    d2t, t2d = build_draft_vocab(counts, n)
    draft.set_vocab_map(d2t, t2d)
    return draft.eval(), DraftContract(taps=taps, ttt_length=7)
