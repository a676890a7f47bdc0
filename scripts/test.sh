#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs into .venv, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The real engines are the suite's judges, each in its own cached environment: tests/vllm serve, capture and diagnose
# drafts in vLLM's CPU build (.venv-vllm, 3.4 GB), tests/sglang in SGLang 0.5.23 (.venv-sglang, 3.4 GB),
# tests/test_speculators.py and tests/foreign in vLLM's speculators library (1.5 GB); instant once built. The three
# build at once, beside .venv's: their time is mostly downloads, which overlap (fresh, no pip cache, on the 2-core
# machine: 166 s together against 299 s one after another). A judge that cannot run fails the run: an environment
# that cannot be built stops it with its script's one error line (after the others finish, so nothing is left
# half-written), and a suite that skips fails pytest's run (tests/suite_rules.py).
engine_builds=()
for engine in vllm sglang speculators; do
    bash "scripts/${engine}_env.sh" >/dev/null &
    engine_builds+=("$!")
done
. scripts/setup.sh
engines_built=yes
for build in "${engine_builds[@]}"; do
    wait "$build" || engines_built=no
done
if [ "$engines_built" = no ]; then
    echo "test.sh: an engine environment could not be built (its error is above); the suite does not run without it" >&2
    exit 1
fi
ruff check src tests bench
ruff format --check src tests bench
set +e
# Two workers, one per core of CI's two (EAGLESCOPE_TEST_WORKERS=0 runs in one process): tests/conftest.py keeps each
# module on one worker and the vLLM and SGLang suites together on one.
python -m pytest -q -p no:cacheprovider -n "${EAGLESCOPE_TEST_WORKERS:-2}" --dist loadscope "$@"
rc=$?
set -e
# pytest's 5 means "no tests collected": a selection that matched nothing is not a failure here.
if [ "$rc" -eq 5 ]; then
    echo "no tests were collected"
    exit 0
fi
exit "$rc"
