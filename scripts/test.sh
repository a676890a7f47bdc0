#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs into .venv, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
# tests/vllm serve drafts in a real vLLM from its own cached environment (.venv-vllm: ~1.5 min and 3.4 GB the first
# time, instant after). If it cannot be installed, its one error line is printed and those tests skip with it.
bash scripts/vllm_env.sh >/dev/null || true
# tests/sglang serve, capture and diagnose drafts in a real SGLang 0.5.23 (CPU torch, this project's stand-ins for its
# CPU kernels) from its own cached environment (.venv-sglang: ~3 min and 3.4 GB the first time). The same rule.
bash scripts/sglang_env.sh >/dev/null || true
# tests/test_speculators.py converts drafts with vLLM's speculators library, in its own cached environment (it pins
# another transformers): ~1.2 min and 1.5 GB the first time. The same rule: its one error line, then a skip.
bash scripts/speculators_env.sh >/dev/null || true
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
