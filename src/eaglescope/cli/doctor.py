"""`eaglescope doctor` (the checks: eaglescope.detective.doctor)."""

from __future__ import annotations

from eaglescope.detective.doctor import format_report, report_json, run_doctor
from eaglescope.detective.report import REPORT, write_html
from eaglescope.errors import EagleScopeError
from eaglescope.outputs import check_destination


def cmd_training_data(args) -> int:
    """doctor --training-data: the draft's training data against the target's states for the same tokens."""
    from eaglescope.detective.training_data import check_training_data, format_training_data, read_training_data
    from eaglescope.models.targets import load_target, parse_device, parse_dtype

    data = read_training_data(args.training_data, limit=args.training_samples)  # bad input refused before the load
    device = parse_device(args.device or "cpu")
    dtype = parse_dtype(args.dtype if args.dtype != "auto" else "float32", device)
    target = load_target(args.target, device=device, dtype=dtype, backend=args.backend)
    engine = args.engine[0] if args.engine else "vllm"
    report = check_training_data(target, data, draft=args.draft, engine=engine)
    print(report_json(report) if args.json else format_training_data(report))
    return 0 if report.healthy else 1


def cmd_doctor(args) -> int:
    if args.training_data:
        return cmd_training_data(args)
    if args.draft is None:
        raise EagleScopeError("doctor needs --draft (or --training-data to check a draft's training data)")
    if args.html:  # refused before the minutes of checks, not after
        check_destination(args.html, REPORT, flag="--html")
    report = run_doctor(
        args.target,
        args.draft,
        data=args.data,
        trace=args.trace,
        engine_log=args.engine_log,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        depth=args.depth,
        eval_samples=args.eval_samples,
        engines=tuple(args.engine) if args.engine else None,
        replay=args.replay,
        metrics_url=args.metrics_url,
        measure_wiring=args.measure_wiring,
        layer_states=args.layer_states,
        wiring_tokens=args.wiring_tokens,
        progress=True,  # on stderr: --json on stdout stays parseable
    )
    if args.html:
        write_html(report, args.html)
    print(report_json(report) if args.json else format_report(report))
    if args.html and not args.json:
        print(f"report: {args.html}")
    return 0 if report.healthy else 1
