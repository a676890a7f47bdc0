"""Write docs/doctor-codes.md from doctor's own tables (src/eaglescope/detective/findings.py: CODES and GUIDE).

    PYTHONPATH=src python scripts/doctor_codes.py [--check]

--check writes nothing and exits 1 when the committed file differs (tests/test_doctor_codes_doc.py asserts the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eaglescope.detective.codes_doc import render

DOC = Path(__file__).resolve().parent.parent / "docs" / "doctor-codes.md"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the committed file is not the rendering")
    args = p.parse_args()
    text = render()
    if args.check:
        same = DOC.is_file() and DOC.read_text(encoding="utf-8") == text
        print(f"{DOC}: {'up to date' if same else 'differs from the code; run scripts/doctor_codes.py'}")
        return 0 if same else 1
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
