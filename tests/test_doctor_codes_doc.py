"""docs/doctor-codes.md is generated from doctor's own tables (findings.CODES and findings.GUIDE), so it cannot drift:
this fails when the committed file differs from what `python scripts/doctor_codes.py` writes, or when a code has no
evidence and fix to document."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eaglescope.detective import codes_doc, findings

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "doctor-codes.md"


def test_the_committed_doctor_codes_reference_is_what_the_code_renders():
    assert DOC.read_text(encoding="utf-8") == codes_doc.render(), "run: PYTHONPATH=src python scripts/doctor_codes.py"


def test_every_code_has_its_section_with_evidence_and_a_fix():
    text = codes_doc.render()
    for code, meaning in findings.CODES.items():
        section = text.split(f"\n## {code}\n", 1)[1].split("\n## ", 1)[0]
        guide = findings.GUIDE[code]
        assert meaning[1:] in section and guide.evidence[1:] in section and guide.fix[1:] in section, code
        assert len(guide.evidence) > 40 and len(guide.fix) > 20, code


def test_a_code_added_without_its_guide_entry_cannot_be_rendered(monkeypatch):
    monkeypatch.setitem(findings.CODES, "NEW_CAUSE", "a cause added to CODES alone")
    with pytest.raises(ValueError, match="missing \\['NEW_CAUSE'\\]"):
        codes_doc.render()


def test_the_script_checks_the_committed_file():
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "doctor_codes.py"), "--check"], env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr
