# Sourced by scripts/test.sh and scripts/demo.sh: a virtual environment with eaglescope installed.
# torch is installed first and pinned to a CPU build where this machine provides one, so that the
# package's own `torch` requirement is already satisfied and never pulls a multi-GB CUDA build.
set -euo pipefail
VENV="${EAGLESCOPE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Every version the suite runs on is pinned there (a fresh clone installs the same set next month);
# EAGLESCOPE_CONSTRAINTS=none installs from pyproject's ranges instead.
CONSTRAINTS="${EAGLESCOPE_CONSTRAINTS:-scripts/constraints.txt}"
pin=()
if [ "$CONSTRAINTS" != none ]; then
    pin=(-c "$CONSTRAINTS")
fi
if ! python -c "import torch" >/dev/null 2>&1; then
    # Override with e.g. EAGLESCOPE_TORCH="torch --index-url <your CPU wheel index>" elsewhere.
    python -m pip install -q "${pin[@]}" ${EAGLESCOPE_TORCH:-torch==2.13.0}
fi
python -m pip install -q "${pin[@]}" -e ".[test]"
