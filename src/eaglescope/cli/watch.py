"""`eaglescope watch` (the loop and the rules: eaglescope.detective.watch): a live table, or one JSON line per poll."""

from __future__ import annotations

import json
import logging
import shlex
import sys
import textwrap

from eaglescope.detective.serving_metrics import scrape
from eaglescope.detective.watch import WatchSettings, expectation_for, run_watch, static_findings_for
from eaglescope.errors import EagleScopeError

log = logging.getLogger("eaglescope.watch")
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: the table is redrawn in place on a terminal
WIDTH = 110  # the alert's sentence is wrapped to this


def doctor_command(args, code: str) -> str:
    """The doctor run that names the cause: the server's own counts against a prediction on the served traffic."""
    argv = ["eaglescope", "doctor", "--target", args.target or "TARGET_DIR", "--draft", args.draft,
            "--metrics-url", args.url, "--data", args.data or "SERVED_TRAFFIC.jsonl"]  # fmt: skip
    return " ".join(a if a in ("TARGET_DIR", "SERVED_TRAFFIC.jsonl") else shlex.quote(a) for a in argv)


def cmd_watch(args) -> int:
    if args.interval <= 0 or args.sustain < 1 or args.min_rounds < 1:
        raise EagleScopeError("--interval must be > 0, --sustain and --min-rounds >= 1")
    if (args.max_polls is not None and args.max_polls < 1) or (args.duration is not None and args.duration <= 0):
        raise EagleScopeError("--max-polls must be >= 1 and --duration > 0")
    expected_for = expectation_for(args.draft, args.expect, args.target, args.data, args.eval_samples, args.device,
                                   args.dtype)  # fmt: skip
    settings = WatchSettings(args.url, args.interval, args.window, args.sustain, args.min_rounds, args.max_polls,
                             args.duration, args.keep_watching, args.give_up_after, args.depth)  # fmt: skip
    tty = sys.stdout.isatty() and not args.json
    alerts = judged = 0
    static: list[dict] = []  # what the served files show, kept on the table while it is redrawn
    for record in run_watch(settings, expected_for, lambda: scrape(args.url), lambda c: doctor_command(args, c),
                            static_for=static_findings_for(args.draft, args.target)):  # fmt: skip
        judged += record.get("status") in ("ok", "low")
        static = record.get("static") or static
        if record.get("alert"):
            alerts += 1
            if record["alert"]["raised"]:  # once per episode; the table and the JSON lines show it while it lasts
                log.warning("%s; next: %s", record["alert"]["line"], record["alert"]["next"])
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print((CLEAR if tty else "") + format_table(record, static), flush=True)
    if not judged:
        log.info("watch: no window had %d verify rounds to judge (send traffic, or lower --min-rounds)",
                 args.min_rounds)  # fmt: skip
    return 1 if alerts or static else 0


def _num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _interval(i) -> str:
    return "" if not i else f"[{_num(i[0])}, {_num(i[1])}]"


def format_table(r: dict, static: list[dict] | None = None) -> str:
    """One poll as the terminal view (docs/watch-terminal.png); `static`: what the served files show (doctor's codes),
    above the window while the run lasts."""
    head = (f"eaglescope watch  {r['url']}  {r.get('engine') or '?'} {r.get('version') or ''}".rstrip()
            + f"  poll {r['poll']}  {r['time']}")  # fmt: skip
    lines = [head]
    for f in static or []:
        lines += textwrap.wrap(f"FINDING {f['code']} (the served files, before any window): {f['verdict']}", WIDTH,
                               initial_indent="  ", subsequent_indent="    ")  # fmt: skip
        lines.append(f"    fix: {f['fix']}")
    status = r.get("status")
    if status == "unreachable":
        return "\n".join(lines + [f"  server does not answer: {r.get('error')} (retrying with back-off)", ""])
    if status == "waiting":
        return "\n".join(lines + ["  waiting for a first window of counts", ""])
    w, e = r["window"], r["expected"]
    lines.append(f"  window: last {w['polls']} polls, {w['rounds']:.0f} verify rounds"
                 + ("   (counters reset: the server restarted)" if r.get("reset") else ""))  # fmt: skip
    lines.append(f"  expected: {e['what']} ({e['source']}); low below τ {_num(e['floor'])} = {e['ratio']} × "
                 f"{_num(e['tau'])} with the intervals apart")  # fmt: skip
    lines.append("")
    lines.append(f"  {'':6}{'served (window)':<26}{'n':>7}   {'expected':<26}")
    lines.append(f"  {'τ':6}{_num(w['tau']) + ' ' + _interval(w['tau_interval']):<26}{w['rounds']:>7.0f}   "
                 f"{_num(e['tau']) + ' ' + _interval(e['tau_interval']):<26}")  # fmt: skip
    served_pos = w.get("positions") or []
    exp_pos = e.get("positions") or []
    for k in range(max(len(served_pos), len(exp_pos), len(e.get("alpha") or []))):
        s = served_pos[k] if k < len(served_pos) else None
        x = exp_pos[k] if k < len(exp_pos) else None
        ealpha = (e.get("alpha") or [None] * (k + 1))[k] if k < len(e.get("alpha") or []) else None
        left = "-" if s is None else f"{_num(s['alpha'])} {_interval((s['lo'], s['hi']))}"
        right = f"{_num(x['alpha'])} {_interval((x['lo'], x['hi']))}" if x else _num(ealpha)
        mark = "  below" if (k + 1) in r.get("low_positions", []) else ""
        n = "" if s is None else f"{s['n']:.0f}"
        lines.append(f"  {'α_' + str(k + 1):6}{left:<26}{n:>7}   {right:<26}{mark}")
    if r.get("gauges"):
        g = r["gauges"]
        lines.append(f"  engine gauges (its last log interval): accept length {_num(g.get('accept_length'))}, "
                     f"accept rate {_num(g.get('accept_rate'))}")  # fmt: skip
    lines.append("")
    verdict = {"ok": "ok: in band", "low": "LOW: below the expected band", "thin": "too few rounds to judge"}[status]
    lines.append(f"  {verdict}  (low windows in a row: {r['low_streak']}/{r['sustain']})")
    if r.get("alert"):
        lines += textwrap.wrap(r["alert"]["line"], WIDTH, initial_indent="  ", subsequent_indent="    ")
        lines.append(f"  next: {r['alert']['next']}")
    return "\n".join(lines + [""])
