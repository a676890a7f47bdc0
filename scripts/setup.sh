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
if ! python -c "import torch" >/dev/null 2>&1; then
    # Override with e.g. EAGLESCOPE_TORCH="torch --index-url <your CPU wheel index>" elsewhere.
    python -m pip install -q ${EAGLESCOPE_TORCH:-torch==2.13.0}
fi
python -m pip install -q -e ".[test]"
