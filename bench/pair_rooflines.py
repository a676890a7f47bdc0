"""The 8B section of two protocol runs side by side, made on one GPU in one call: this version's (AFTER, from
`run_bench.py --part all`) and an earlier version's (BEFORE, `--part roofline --replay-from AFTER`), so both replayed
the same acceptance round for round and their η pair (bench/README.md, "Paired before and after").

    python3 bench/pair_rooflines.py AFTER.json BEFORE.json [--out paired.md]

Prints the table (markdown) on stdout, and writes it with --out. Exit 0 when the two runs pair, 1 when they do not
(another tree shape, another forced acceptance, another card, or a roofline that broke), 2 on unreadable input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (label, how to read it from a roofline, digits): what the README protocol's bar is stated in
FIGURES = (
    ("8B decode, fraction of copy", lambda r: r["decode_fraction_of_copy"], 4),
    ("8B decode step, ms", lambda r: r["decode_step_ms"], 3),
    ("verify 64 rows / one-token step", lambda r: r["verify_cost_ratio"]["64"], 3),
    ("replayed round, ms", lambda r: r["replay_round_ms"], 3),
    ("replayed τ", lambda r: r["replay_tau"], 2),
    ("replayed speedup", lambda r: r["replay_speedup"], 3),
    ("η", lambda r: r["replay_eta"], 3),
    ("η after the start", lambda r: r["replay_eta_after_start"], 3),
)


def read(path: str) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        print(f"pair_rooflines: cannot read {path}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return result


def why_unpaired(after: dict, before: dict) -> str | None:
    ra, rb = after.get("roofline") or {}, before.get("roofline") or {}
    for name, r in (("after", ra), ("before", rb)):
        if "error" in r or "replay_eta" not in r:
            return f"the {name} run's roofline has no replay ({r.get('error', 'no replay_eta')[:200]})"
    if ra["replay_shape"] != rb["replay_shape"]:
        return f"tree shapes differ: {ra['replay_shape']} after, {rb['replay_shape']} before"
    if ra["replay_accepted"] != rb["replay_accepted"]:
        return "the forced acceptance differs round for round: BEFORE did not replay AFTER's JSON"
    card_a, card_b = after.get("device"), before.get("device")
    if card_a != card_b:
        return f"different cards: {card_a} after, {card_b} before"
    return None


def table(after: dict, before: dict) -> str:
    ra, rb = after["roofline"], before["roofline"]
    lines = ["| figure | before | after | after / before |", "|---|---|---|---|"]
    for label, get, digits in FIGURES:
        try:
            a, b = get(ra), get(rb)
        except (KeyError, TypeError):  # an older version's roofline that did not measure it
            lines.append(f"| {label} | - | - | - |")
            continue
        lines.append(f"| {label} | {b:.{digits}f} | {a:.{digits}f} | {a / b:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("after")
    ap.add_argument("before")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    after, before = read(args.after), read(args.before)
    why = why_unpaired(after, before)
    if why:
        print(f"pair_rooflines: not a pair: {why}", file=sys.stderr)
        return 1
    text = table(after, before)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
