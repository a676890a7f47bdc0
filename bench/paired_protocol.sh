#!/usr/bin/env bash
# The README protocol at this checkout ("after"), then an earlier version's 8B section ("before") replaying the same
# acceptance round for round, on one GPU in one call, and the two side by side (bench/pair_rooflines.py). A change
# that claims "no behaviour changed" is judged by this pair, not by two runs on two machines.
#
#   git archive REV src bench | tar -x -C BEFORE_DIR        # here, once: the earlier version's code
#   EAGLESCOPE_COMMIT=<this commit> bash bench/paired_protocol.sh BEFORE_DIR OUT_DIR [AFTER_LIMIT_S]
#
# AFTER_LIMIT_S (default 430) is the protocol's --time-limit (stopped at +20 s); the before run at most 120 s more, so
# the call stays under 10 minutes. OUT_DIR gets six files: card.txt, after.log, after/bench-all-*.json, before.log,
# before/bench-roofline-*.json, paired.md. Exits with pair_rooflines.py's code (1: the runs do not pair).
set -uo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bash bench/paired_protocol.sh BEFORE_DIR OUT_DIR [AFTER_LIMIT_S]" >&2
    exit 2
fi
before_dir=$(cd "$1" && pwd) || exit 2
mkdir -p "$2" && out=$(cd "$2" && pwd) || exit 2
limit=${3:-430}
[ -f "$before_dir/bench/run_bench.py" ] || { echo "paired_protocol: $before_dir has no bench/run_bench.py" >&2; exit 2; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/card.txt" 2>&1
PYTHONPATH=src timeout $((limit + 20)) python3 bench/run_bench.py --part all --compile --variants fused_verify \
    --scale 0.35 --hf-workers 16 --no-vendor-rows --time-limit "$limit" --work /tmp/eaglescope-paired-after \
    --out "$out/after" 2>&1 | tee "$out/after.log" | tail -n 25
after=$(ls "$out"/after/bench-all-*.json 2>/dev/null | head -n 1)
[ -n "$after" ] || { echo "paired_protocol: the after run wrote no results (see $out/after.log)" >&2; exit 1; }
(cd "$before_dir" && EAGLESCOPE_COMMIT="${EAGLESCOPE_BEFORE_COMMIT:-unknown}" PYTHONPATH=src timeout 120 \
    python3 bench/run_bench.py --part roofline --compile --variants fused_verify --replay-from "$after" \
    --time-limit 110 --work /tmp/eaglescope-paired-before --out "$out/before") 2>&1 | tee "$out/before.log" | tail -n 10
before=$(ls "$out"/before/bench-roofline-*.json 2>/dev/null | head -n 1)
[ -n "$before" ] || { echo "paired_protocol: the before run wrote no results (see $out/before.log)" >&2; exit 1; }
python3 bench/pair_rooflines.py "$after" "$before" --out "$out/paired.md"
