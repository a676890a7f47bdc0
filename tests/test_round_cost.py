"""bench/round_cost.py --smoke: the GPU benchmark of a round's pieces, on the CPU through the same code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import round_cost  # noqa: E402


def test_round_cost_smoke_accounts_for_every_round(tmp_path, capsys):
    """Each tree's row: the rounds of its 24 new tokens (τ × rounds covers the tokens after the prefill's first), each
    piece timed, and nothing compiled without --modes round; the table printed last names every row."""
    assert round_cost.main(["--smoke", "--out", str(tmp_path), "--modes", "none", "--trees", "3,2,6", "2,1,3"]) == 0
    (path,) = tmp_path.glob("round-cost-*.json")
    res = json.loads(path.read_text())
    assert res["runner"]["fast"] is True and res["vanilla_step_ms"] > 0
    assert [(r["mode"], r["tree"]) for r in res["rows"]] == [("none", [3, 2, 6]), ("none", [2, 1, 3])]
    for r in res["rows"]:
        assert r["compiled"] is False
        # every round emits its accepted tokens and a bonus; together they cover the tokens after the prefill's first
        assert 1 <= r["rounds"] <= res["new_tokens"] - 1 <= round(r["tau"] * r["rounds"], 6)
        assert all(p["ms"] > 0 for p in r["pieces"].values())
    table = capsys.readouterr().out
    assert "| none | (3, 2, 6) |" in table and "| none | (2, 1, 3) |" in table
