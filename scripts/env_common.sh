# Sourced (not run) by scripts/vllm_env.sh, scripts/sglang_env.sh and scripts/speculators_env.sh: what their cached,
# separate environments do alike. The sourcing script sets NAME (its messages' prefix), VENV, CONSTRAINTS (a pip
# constraints file, or `none`), MARKER (written last, when the environment is complete) and FAILED (the last failure's
# line, which the tests repeat in their skip reason) before calling these.

say() { echo "$NAME: $*" >&2; }

fail() {
    echo "$NAME: error: $*" >&2
    if [ -d "$VENV" ]; then echo "$*" >"$FAILED"; fi
    exit 1
}

venv_python() { echo "$(cd "$VENV" && pwd)/bin/python"; }

# pinned_key PINS: sets `pin` (pip's constraint arguments) and `key` (PINS and the constraints file's hash), which a
# complete environment's marker records, so that changing either reinstalls.
pinned_key() {
    pin=()
    key="$1 constraints=none"
    if [ "$CONSTRAINTS" != none ]; then
        [ -f "$CONSTRAINTS" ] || fail "constraints file $CONSTRAINTS does not exist"
        pin=(-c "$CONSTRAINTS")
        key="$1 constraints=$(sha256sum "$CONSTRAINTS" | cut -d' ' -f1)"
    fi
}

# reuse_if_complete KEY LABEL: an environment whose marker records KEY is used as it is (prints its python, exits 0).
reuse_if_complete() {
    if [ -x "$VENV/bin/python" ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$1" ]; then
        say "reusing $VENV ($2)"
        venv_python
        exit 0
    fi
}

# install_eaglescope_beside ENGINE LOG: eaglescope, editable and with no dependencies, so that the engine finds its
# plugin entry point; fails if the install moved any of the engine's pinned packages.
install_eaglescope_beside() {
    say "installing eaglescope (editable, --no-deps) into $VENV for its $1 plugin"
    local before after moved why
    before="$(_freeze_others "$2")"
    if ! "$VENV/bin/python" -m pip install --no-deps --no-build-isolation -e . >>"$2" 2>&1; then
        why="$(grep -E '^ERROR' "$2" | tail -n 1 || true)"
        fail "could not install eaglescope into $VENV: ${why:-pip failed} (full log: $2)"
    fi
    after="$(_freeze_others "$2")"
    if [ "$before" != "$after" ]; then
        moved="$(diff <(echo "$before") <(echo "$after") | grep '^[<>]' | head -n 3 | tr '\n' ' ')"
        fail "installing eaglescope changed $1's packages ($moved); see $2"
    fi
}

_freeze_others() { "$VENV/bin/python" -m pip freeze --all 2>>"$1" | grep -iv '^-e \|^eaglescope\|^# editable' || true; }
