#!/usr/bin/env bash
# eaglescope end to end on the embedded default (CPU, minutes): installs into .venv, then runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
eaglescope demo "$@"
