#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs into .venv, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
# The real engines are the suite's judges, each in its own cached environment: tests/vllm serve, capture and diagnose
# drafts in vLLM's CPU build (.venv-vllm: ~1.5 min and 3.4 GB the first time, instant after), tests/sglang in SGLang
# 0.5.23 (.venv-sglang: ~3 min and 3.4 GB), tests/test_speculators.py in vLLM's speculators library (~1.2 min,
# 1.5 GB). A judge that cannot run fails the run: an environment that cannot be built stops here with its script's
# one error line, and a suite that skips fails pytest's run (tests/suite_rules.py).
bash scripts/vllm_env.sh >/dev/null
bash scripts/sglang_env.sh >/dev/null
bash scripts/speculators_env.sh >/dev/null
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
