"""`eaglescope replay`: the golden trace for a recorded one."""

from __future__ import annotations

import warnings

from eaglescope.errors import EagleScopeError


def cmd_replay(args) -> int:
    import torch

    from eaglescope.detective.replay import replay
    from eaglescope.draft import load_draft
    from eaglescope.target import default_device, load_target, parse_dtype

    device = torch.device(args.device) if args.device else default_device()
    # The golden reference defaults to float32: it is the yardstick, precision is not where to save.
    dtype = parse_dtype(args.dtype, device) if args.dtype != "auto" else torch.float32
    target = load_target(args.target, device=device, dtype=dtype, backend=args.backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_draft(args.draft, target.num_layers, device=device, dtype=dtype)
    for w in caught:
        print(f"eaglescope: warning: {w.message}")
    out = replay(target, loaded, args.trace, args.out, mode=args.trace_mode)
    print(f"golden trace written to {out}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("replay", help="recompute the golden trace for a recorded trace's prompt and decisions")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--trace", required=True, help="the recorded trace directory")
    p.add_argument("--out", required=True, help="where to write the golden trace")
    p.add_argument("--trace-mode", default="full", choices=["full", "fingerprint"])
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", help="default float32")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "hf"])
    p.set_defaults(func=cmd_replay)


__all__ = ["add_parsers", "cmd_replay", "EagleScopeError"]
