"""Did a change to the decoding code change what the decoder accepts? `eaglescope bench` run by two (or more)
versions of the package on one target, draft and prompt set.

Greedy speculative decoding is deterministic: for the same models and prompts, a version that runs the same round
gives the same rounds, the same tokens accepted at each depth and the same outputs, to the last digit; the speed may
differ, nothing else may. That separates a change of the round from the run-to-run spread of a protocol that trains
its draft under a time budget (bench/README.md, "The protocol").

    python bench/compare_commits.py --version before=1ec097a --version after=HEAD \
        --target T --draft D --prompts P.jsonl [--method tree=6,1,7 ...] [--device cuda] [--out DIR]

A version is NAME=REV (a git revision of this repository: its src/ is extracted with `git archive`) or NAME=DIR (a
directory holding the package, e.g. an extracted src/). Each version runs in its own process with PYTHONPATH at its
source, in this Python environment. Prints one JSON object and writes it under --out; exit 0 when every version's
acceptance equals the first's, 1 when one differs, 2 on bad input.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what a version may not change: per method, the decisions (rounds, acceptance per depth) and the outputs' equality
DECISIONS = ("new_tokens", "rounds", "accept_length", "alpha", "accepted_per_position", "identical_to_vanilla")
DEFAULT_METHODS = ["vanilla", "tree=6,1,7", "tree=7,10,60", "tree=6,4,24", "chain=4"]


def fail(message: str) -> None:
    print(f"compare_commits: {message}", file=sys.stderr)
    raise SystemExit(2)


def source_of(spec: str, scratch: Path) -> tuple[str, Path, str]:
    """NAME=REV or NAME=DIR → (name, directory holding the `eaglescope` package, where it came from)."""
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        fail(f"--version wants NAME=REV or NAME=DIR, not {spec!r}")
    if (Path(where) / "eaglescope").is_dir():
        return name, Path(where), f"directory {where}"
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{where}^{{commit}}"],
                         capture_output=True, text=True)  # fmt: skip
    if rev.returncode != 0:
        fail(f"{where!r} is neither a directory holding eaglescope nor a git revision")
    commit = rev.stdout.strip()
    archive = scratch / f"{name}.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), commit, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(scratch / name, filter="data")
    return name, scratch / name / "src", f"commit {commit}"


def run_bench(src: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-c", "from eaglescope.cli import main; main()", "bench", "--json"]
    cmd += ["--target", args.target, "--draft", args.draft, "--prompts", args.prompts]
    cmd += ["--max-new-tokens", str(args.max_new_tokens)]
    for m in args.method or DEFAULT_METHODS:
        cmd += ["--method", m]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    if args.device:
        cmd += ["--device", args.device]
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode not in (0, 1):  # 1: a method's output differed from vanilla, which the rows report
        tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        fail(f"eaglescope bench from {src} exited {done.returncode}: {tail[0]}")
    return json.loads(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="append", required=True, help="NAME=REV or NAME=DIR (two or more)")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--method", action="append", help=f"as eaglescope bench (default: {' '.join(DEFAULT_METHODS)})")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if len(args.version) < 2:
        fail("give at least two --version")
    names = [v.partition("=")[0] for v in args.version]
    if len(set(names)) != len(names):
        fail(f"--version names must differ: {names}")
    with tempfile.TemporaryDirectory(prefix="eaglescope-compare-") as tmp:
        sources = [source_of(v, Path(tmp)) for v in args.version]
        results = {}
        for name, src, origin in sources:
            print(f"compare_commits: {name} ({origin})", file=sys.stderr, flush=True)
            results[name] = run_bench(src, args)
    first = sources[0][0]
    differences = []
    for name, _, _ in sources[1:]:
        for a, b in zip(results[first]["rows"], results[name]["rows"], strict=True):
            for key in DECISIONS:
                if a.get(key) != b.get(key):
                    differences.append({"method": a["method"], "field": key, first: a.get(key), name: b.get(key)})
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {name: origin for name, _, origin in sources},
        "device": results[first].get("device"),
        "dtype": results[first].get("dtype"),
        "identical_decisions": not differences,
        "differences": differences,
        "rows": {
            name: [{k: r.get(k) for k in ("method", "backend", "tokens_per_second", *DECISIONS)} for r in res["rows"]]
            for name, res in results.items()
        },
    }
    text = json.dumps(report, indent=1)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    (out / f"compare-commits-{stamp}.json").write_text(text + "\n")
    return 0 if not differences else 1


if __name__ == "__main__":
    sys.exit(main())
