"""`eaglescope replay`: the golden trace for a recorded one (the replay: eaglescope.detective.replay)."""

from __future__ import annotations

import torch

from eaglescope.detective.replay import replay
from eaglescope.models.draft import load_draft
from eaglescope.models.targets import load_target, parse_device, parse_dtype


def cmd_replay(args) -> int:
    device = parse_device(args.device)
    # The golden reference defaults to float32: it is the yardstick, precision is not where to save.
    dtype = parse_dtype(args.dtype, device) if args.dtype != "auto" else torch.float32
    target = load_target(args.target, device=device, dtype=dtype, backend=args.backend)
    loaded = load_draft(args.draft, target.num_layers, device=device, dtype=dtype)
    out = replay(target, loaded, args.trace, args.out, mode=args.trace_mode)
    print(f"golden trace written to {out}")
    return 0
