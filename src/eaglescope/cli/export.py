"""`eaglescope inspect` and `eaglescope export` (the work: eaglescope.export)."""

from __future__ import annotations

import json
import logging

from eaglescope.export import export_checkpoint, format_description, format_export_report, inspect_checkpoint

log = logging.getLogger(__name__)


def cmd_inspect(args) -> int:
    d = inspect_checkpoint(args.draft_dir, args.target)
    print(json.dumps(d, indent=2) if args.json else format_description(d))
    return 0


def cmd_export(args) -> int:
    report = export_checkpoint(args.draft, args.to, args.out, args.target, args.with_embedding, args.dtype)
    if args.json:
        print(json.dumps(report, indent=2))
        for w in report["warnings"]:  # JSON on stdout stays machine-readable; people still see warnings
            log.warning("%s", w)
    else:
        print(format_export_report(report))
    return 0
