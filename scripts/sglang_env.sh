#!/usr/bin/env bash
# A separate, cached virtual environment with SGLang 0.5.23 on a CPU torch, for tests/sglang (eaglescope drafts
# served, captured and diagnosed by a real SGLang). Separate from .venv because SGLang pins its own transformers,
# tokenizers and ~150 other packages, which must not move what the rest of the suite runs on. eaglescope is installed
# into it too, editable and without dependencies (`pip install --no-deps -e .`), so that SGLang finds eaglescope's
# `sglang.srt.plugins` entry point (the hooks of `eaglescope capture --engine sglang`); the install is checked to
# leave every one of SGLang's packages as it was.
#
#   bash scripts/sglang_env.sh        # prints the environment's python on stdout; progress goes to stderr
#
# How SGLang is installed, and why: the sglang 0.5.23 wheel requires torch==2.14.1 and a set of CUDA-only packages
# (kernels, CUDA bindings, flash attention). It is installed with --no-deps, then its own requirements (read from the
# installed wheel's metadata) are installed minus those CUDA-only packages, with torch 2.13.0+cpu instead. Its CPU
# kernels (`sgl_kernel`, built from SGLang's repository, not on PyPI) are not installed at all: tests/sglang runs
# SGLang with this project's plain-torch stand-ins for the ops its EAGLE-3 path calls (tests/sglang/stand_ins).
# PyPI's torchvision is a CUDA build whose native library does not load beside a CPU torch; it is installed anyway
# (SGLang imports torchvision.transforms at start-up) and tests/sglang/stand_ins/sitecustomize.py lets it import.
#
# EAGLESCOPE_SGLANG_VENV: where (default .venv-sglang in the repository root). EAGLESCOPE_SGLANG_CONSTRAINTS=none
# resolves afresh instead of installing the pinned set; EAGLESCOPE_SGLANG_PIP_ARGS adds pip arguments (e.g. an index
# that has torch 2.13.0+cpu, on machines whose pip does not already find it). A complete environment is reused as it
# is: the marker file records the pins it was installed from and pyproject.toml's hash, so changing the pin or the
# constraints file reinstalls SGLang, and changing pyproject.toml only reinstalls eaglescope (seconds). Exits non-zero
# with one line on stderr when SGLang cannot be installed or imported.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_PIN="sglang==0.5.23"
TORCH_PIN="torch==2.13.0+cpu"
TORCHVISION_PIN="torchvision==0.28.0"
# The wheel's requirements left out: CUDA/ROCm-only kernels and bindings (they do not install or do nothing on a CPU),
# the CPU kernels' CUDA wheel (sglang-kernel), audio/video decoders whose native libraries need a CUDA torch, and timm
# (vision models only; it would pull in torchvision's dependencies), apache-tvm-ffi (pinned for the CUDA kernels; the
# version another requirement asks for is kept). torch and torchvision are pinned separately.
SKIP="cuda-python flash-attn-4 flashinfer-python humming-kernels nvidia-cutlass-dsl nvidia-mathdx nvshmem4py-cu13
quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla sglang-kernel tilelang torch-memory-saver torchaudio torchcodec
timm torch torchvision apache-tvm-ffi"
VENV="${EAGLESCOPE_SGLANG_VENV:-.venv-sglang}"
CONSTRAINTS="${EAGLESCOPE_SGLANG_CONSTRAINTS:-scripts/sglang-constraints.txt}"
STAND_INS="$(pwd)/tests/sglang/stand_ins"
MARKER="$VENV/.eaglescope-sglang-complete" # SGLang and eaglescope installed: "<SGLang key> eaglescope=<pyproject hash>"
INSTALLED="$VENV/.eaglescope-sglang-installed" # SGLang alone installed and imports: "<SGLang key>"
FAILED="$VENV/.eaglescope-sglang-error" # the last failure's line, which tests/sglang repeats in its skip reason

NAME=sglang_env
# shellcheck source=scripts/env_common.sh
. scripts/env_common.sh

pinned_key "$SGLANG_PIN $TORCH_PIN"
sglang_key="$key"
key="$sglang_key eaglescope=$(sha256sum pyproject.toml | cut -d' ' -f1)"
reuse_if_complete "$key" "$SGLANG_PIN"

sglang_ready=no
if [ -x "$VENV/bin/python" ] && [ -f "$INSTALLED" ] && [ "$(cat "$INSTALLED")" = "$sglang_key" ]; then
    sglang_ready=yes
fi
rm -f "$MARKER"
LOG="$VENV/install.log"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() { # pip install ARGS..., logged; fails with pip's last ERROR line
    # shellcheck disable=SC2086 # EAGLESCOPE_SGLANG_PIP_ARGS is a list of words on purpose
    if ! "$VENV/bin/python" -m pip install "${pin[@]}" ${EAGLESCOPE_SGLANG_PIP_ARGS:-} "$@" >>"$LOG" 2>&1; then
        why="$(grep -E '^ERROR' "$LOG" | tail -n 1 || true)"
        fail "could not install $* into $VENV: ${why:-pip failed} (full log: $LOG)"
    fi
}
if [ "$sglang_ready" = yes ]; then
    say "reusing SGLang in $VENV ($SGLANG_PIN)"
else
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating $VENV"
        python3 -m venv "$VENV" || fail "could not create a virtual environment at $VENV with python3"
    fi
    rm -f "$INSTALLED"
    : >"$LOG"
    say "installing $SGLANG_PIN (no CUDA packages) on $TORCH_PIN into $VENV (pinned set: $CONSTRAINTS; about 3.4 GB; log: $LOG)"
    pip_install "$TORCH_PIN"
    pip_install --no-deps "$SGLANG_PIN" "$TORCHVISION_PIN"
    # SGLang's own requirements, as the installed wheel states them, less the skipped ones
    if ! reqs="$("$VENV/bin/python" - "$SKIP" <<'PY'
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

skip = {canonicalize_name(n) for n in sys.argv[1].split()}
for line in requires("sglang") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue  # an extra's, or another platform's
    if canonicalize_name(r.name) not in skip:
        r.marker, r.extras = None, set()
        print(r)
PY
    )"; then
        fail "could not read $SGLANG_PIN's requirements in $VENV (full log: $LOG)"
    fi
    mapfile -t reqs_list <<<"$reqs"
    pip_install "${reqs_list[@]}"

    say "checking that SGLang imports (with tests/sglang/stand_ins on the path)"
    if ! out="$(PYTHONPATH="$STAND_INS" "$VENV/bin/python" -c 'import sglang, sglang.srt.entrypoints.engine
print(sglang.__version__)' 2>&1)"; then
        fail "$SGLANG_PIN installed but does not import: $(echo "$out" | grep -v '^\s*$' | tail -n 1)"
    fi
    echo "$sglang_key" >"$INSTALLED"
    say "sglang $(echo "$out" | tail -n 1) installed in $VENV"
fi

install_eaglescope_beside SGLang "$LOG"
rm -f "$FAILED"
echo "$key" >"$MARKER"
say "ready: $SGLANG_PIN and eaglescope in $VENV"
venv_python
