"""`eaglescope bench` (the measurement: eaglescope.bench)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from eaglescope.bench import (
    BENCH_REPORT,
    DEFAULT_METHODS,
    format_table,
    parse_method,
    read_prompts,
    run_bench,
    write_report,
)
from eaglescope.errors import EagleScopeError
from eaglescope.models.targets import load_target, parse_device, parse_dtype
from eaglescope.outputs import check_destination


def cmd_bench(args) -> int:
    if args.html:
        check_destination(args.html, BENCH_REPORT, flag="--html")  # refused before minutes of decoding
    methods = [parse_method(m) for m in (args.method or DEFAULT_METHODS)]
    if args.draft is None:
        if any(m.kind == "eagle3" for m in methods) and args.method:
            raise EagleScopeError("EAGLE-3 methods (chain=K, tree=...) need --draft DIR")
        methods = [m for m in methods if m.kind != "eagle3"]
    if args.max_new_tokens < 1:
        raise EagleScopeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    device = parse_device(args.device)
    target = load_target(args.target, device=device, dtype=parse_dtype(args.dtype, device), backend=args.backend)
    prompts = read_prompts(Path(args.prompts), target.tokenizer, args.chat)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    res = run_bench(target, args.draft, prompts, methods, args.max_new_tokens, not args.reference,
                    not args.no_batch_invariant, compile=args.compile)  # fmt: skip
    print(json.dumps(_finite(res), indent=2, allow_nan=False) if args.json else format_table(res))
    if args.html:
        write_report(res, args.html)
        if not args.json:
            print(f"report: {args.html}")
    return 0 if res["all_identical"] else 1


def _finite(x):
    """NaN (an α_k no round reached) as null: --json output is strict JSON."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x
