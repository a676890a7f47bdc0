#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs into .venv, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
ruff check src tests bench
ruff format --check src tests bench
set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
# pytest's 5 means "no tests collected": a selection that matched nothing is not a failure here.
if [ "$rc" -eq 5 ]; then
    echo "no tests were collected"
    exit 0
fi
exit "$rc"
