"""The doctor's HTML report: self-contained, every part optional, and it renders in headless Chromium."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from eaglescope.detective.doctor import format_report, report_json
from eaglescope.detective.findings import CODES, DoctorReport, Finding, rank
from eaglescope.detective.report import html_of, write_html

ROOT = Path(__file__).resolve().parents[1]


def full_report() -> DoctorReport:
    findings = [
        Finding("NO_TTT", "behaviour", "acc_1 0.6 but later 0.1 <script>", {"acc": [0.6, 0.1]}, "retrain", 0.9),
        Finding("TAP_OFF_BY_ONE", "target.aux", "segment 2 is tap 7", {"rel_err": 1e-7}, "fix ids", 0.95, round=0),
    ]
    stages = ["target.tap.0", "target.aux", "draft.fc.out", "draft.step0.hidden_out"]
    return DoctorReport(
        False,
        rank(findings),
        {
            "acceptance": {
                "served": {"source": "vllm log", "alpha": [0.6, 0.1, float("nan")], "accept_length": 1.13},
                "predicted": {"source": "teacher-forced on data", "alpha": [0.62, 0.2, 0.1], "acc": [0.62, 0.2, 0.1]},
            },
            "segment_norms": {
                "trace": [[1.0, 2.0, 3.5]],
                "replay": [[1.0, 2.0, 3.0]],
                "labels": ["tap 0", "tap 3", "tap 6"],
            },
            "stage_table": [
                {"round": r, "stage": s, "rel_err": 1e-7 if s == "target.tap.0" else 0.3, "match": s == "target.tap.0"}
                for r in range(3)
                for s in stages
            ],
            "first_divergence": {"round": 0, "stage": "target.aux", "part": None},
            "notes": ["a note"],
        },
    )


def images(text: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)]


def test_full_report_is_self_contained_with_three_figures(tmp_path):
    text = html_of(full_report())
    pngs = images(text)
    assert len(pngs) == 3 and all(p.startswith(b"\x89PNG") for p in pngs)
    assert "<script" not in text and "&lt;script&gt;" in text  # user text is escaped, nothing executable
    assert not re.search(r'(src|href)="(?!data:)', text)  # no external assets
    # banner names the most likely finding; the table lists them in rank order
    assert "TAP_OFF_BY_ONE</b> —" in text and text.index("TAP_OFF_BY_ONE") < text.index("NO_TTT")
    assert "first divergent stage: target.aux (round 0)" in text
    path = write_html(full_report(), tmp_path / "sub" / "r.html")
    assert path.read_text() == text and not list(path.parent.glob(".*"))  # no temp file left behind


@pytest.mark.parametrize("drop", ["acceptance", "segment_norms", "stage_table", "all"])
def test_missing_parts_render_gracefully(drop):
    r = full_report()
    r.context = {} if drop == "all" else {k: v for k, v in r.context.items() if k != drop}
    text = html_of(r)
    assert text.rstrip().endswith("</html>")
    assert len(images(text)) == (0 if drop == "all" else 2)
    assert "no trace compared" in text or "no acceptance measured" in text


def test_malformed_context_does_not_lose_the_report():
    r = full_report()
    r.context["stage_table"] = [{"stage": "target.aux", "round": "not a round"}]
    text = html_of(r)
    assert "could not draw this figure" in text and "NO_TTT" in text


def test_healthy_report():
    r = DoctorReport(True, [], {})
    text = html_of(r)
    assert "Healthy</b>: no findings" in text
    assert json.loads(report_json(r))["healthy"] is True
    assert format_report(r).startswith("healthy")


def test_json_has_the_documented_keys_and_no_nan():
    d = json.loads(report_json(full_report()))  # allow_nan=False inside: NaN would raise
    assert d["healthy"] is False and [f["code"] for f in d["findings"]] == ["TAP_OFF_BY_ONE", "NO_TTT"]
    for f in d["findings"]:
        assert {"code", "stage", "verdict", "evidence", "fix", "support", "round"} <= set(f)
        assert "confidence" not in f and "weight" not in f  # evidence, never a probability
    assert d["codes"] == CODES and d["context"]["acceptance"]["served"]["alpha"][2] is None


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt-get install chromium)")
def test_report_renders_in_headless_chromium(tmp_path):
    html = write_html(full_report(), tmp_path / "report.html")
    png = tmp_path / "shot.png"
    subprocess.run(
        [str(ROOT / "scripts" / "screenshot_report.sh"), str(html), str(png), "1280x1600"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG")
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 1600)
    assert len(data) > 20_000  # a rendered page with figures, not a blank one
