#!/usr/bin/env bash
# A separate, cached virtual environment with vLLM's `speculators` library, for tests/test_speculators.py (an
# eaglescope draft converted by `speculators convert` and run in speculators' own model).
#
#   bash scripts/speculators_env.sh     # prints the environment's python on stdout; progress goes to stderr
#
# Why not .venv or .venv-vllm: speculators 0.9.0 requires transformers<=5.19.0 (.venv has 5.24.0) and datasets<=5.1.0,
# which requires fsspec<=2026.7.0 (.venv-vllm pins 2026.9.0); moving either would change what the rest of the suite or
# the vLLM tests run on. The default location is under the repository's ignored .eaglescope/ directory.
#
# EAGLESCOPE_SPECULATORS_VENV: where (default .eaglescope/venv-speculators). EAGLESCOPE_SPECULATORS_CONSTRAINTS=none
# installs the pins below alone instead of the pinned set; EAGLESCOPE_SPECULATORS_PIP_ARGS adds pip arguments (e.g. an
# index that has torch 2.13.0+cpu, where pip does not already find it). A complete environment is reused as it is: its
# marker records the pins it was installed from. Exits non-zero with one line on stderr (also kept in the venv, for
# the test's skip line) when speculators cannot be installed or imported.
set -euo pipefail
cd "$(dirname "$0")/.."

PINS=("speculators==0.9.0" "torch==2.13.0")
VENV="${EAGLESCOPE_SPECULATORS_VENV:-.eaglescope/venv-speculators}"
CONSTRAINTS="${EAGLESCOPE_SPECULATORS_CONSTRAINTS:-scripts/speculators-constraints.txt}"
MARKER="$VENV/.eaglescope-speculators-complete"
FAILED="$VENV/.eaglescope-speculators-error"

NAME=speculators_env
# shellcheck source=scripts/env_common.sh
. scripts/env_common.sh

pinned_key "${PINS[*]}"
reuse_if_complete "$key" "${PINS[0]}"

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" || fail "could not create a virtual environment at $VENV with python3"
fi
rm -f "$MARKER"
LOG="$VENV/install.log"
say "installing ${PINS[*]} into $VENV (pinned set: ${CONSTRAINTS}; about 1.5 GB; log: $LOG)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, alone: so that speculators' own `torch` requirement is already met by the CPU build and never pulls a
# multi-GB CUDA one (the same order as scripts/setup.sh).
# shellcheck disable=SC2086 # EAGLESCOPE_SPECULATORS_PIP_ARGS is a list of words on purpose
if ! "$VENV/bin/python" -m pip install "${pin[@]}" ${EAGLESCOPE_SPECULATORS_PIP_ARGS:-} "${PINS[1]}" >"$LOG" 2>&1 ||
    ! "$VENV/bin/python" -m pip install "${pin[@]}" ${EAGLESCOPE_SPECULATORS_PIP_ARGS:-} "${PINS[@]}" >>"$LOG" 2>&1; then
    why="$(grep -E '^ERROR' "$LOG" | tail -n 1 || true)"
    fail "could not install ${PINS[0]} into $VENV: ${why:-pip failed} (full log: $LOG)"
fi

# speculators 0.9.0 requires torchvision and torchaudio, and pip resolves them to builds whose native libraries do not
# load beside torch 2.13.0+cpu (the same failure as scripts/vllm_env.sh's); transformers imports torchvision whenever
# it is installed. Converting and running a text EAGLE-3 draft needs neither.
say "removing torchvision, torchaudio (their native libraries do not load with this torch)"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$LOG" 2>&1 ||
    fail "could not uninstall torchvision/torchaudio from $VENV (full log: $LOG)"

say "checking that speculators imports"
probe='import speculators.cli, speculators.models.eagle3.core; from importlib.metadata import version; print(version("speculators"))'
if ! out="$("$VENV/bin/python" -c "$probe" 2>&1)"; then
    fail "${PINS[0]} installed but does not import: $(echo "$out" | grep -v '^\s*$' | tail -n 1)"
fi
rm -f "$FAILED"
echo "$key" >"$MARKER"
say "ready: speculators $(echo "$out" | tail -n 1) in $VENV"
venv_python
