import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, settings

# Property tests are reproducible: the same examples on every run and machine (derandomize), no example
# database left behind, and a failure prints the example and the blob to replay it. HYPOTHESIS_PROFILE=explore
# searches with fresh randomness instead (then add any failure it finds as an @example).
settings.register_profile(
    "ci", derandomize=True, database=None, print_blob=True, phases=[Phase.explicit, Phase.generate, Phase.shrink]
)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# tests import their shared builders (models.py, …) as plain modules
sys.path.insert(0, str(Path(__file__).parent))
# the engine servers' shared checks assert as tests do: pytest explains their failures the same way
pytest.register_assert_rewrite("engine_servers")

# A judge that cannot run fails the run: the only skips allowed, and the engine suites' counts (suite_rules.py)
pytest_plugins = ["suite_rules"]

# tests/foreign builds the foreign pipeline (vLLM's extract_hidden_states, drafts trained by speculators' own trainer on
# the CPU, each served by vLLM) once per session, on the worker that runs the rest of the suite beside the engine
# suites' (its vLLM runs are short; speculators' training is most of its time).

# Triton kernels (the batch-invariant ones) run under Triton's interpreter on a machine without a GPU;
# this must be set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The real-engine suites: one engine on the machine at a time
ENGINE_SUITES = ("tests/vllm/", "tests/sglang/")


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    # scripts/test.sh runs two pytest-xdist workers, one per core of CI's two. A module's tests stay on one worker, so
    # its module fixtures are built once, and the vLLM and SGLang suites share one worker, one engine at a time, while
    # the other worker runs the rest of the suite. (pytest-xdist's own xdist_group marks do not reach its scheduler
    # under pytest 9, so the grouping is said here, where the scheduler reads it.)
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.startswith(ENGINE_SUITES):
                return "engines"
            # one worker builds the foreign pipeline, once, for both of its modules
            return "foreign" if path.startswith("tests/foreign/") else path

    return SuiteScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def product_logging():
    # The library reports through logging; the CLI installs the one stderr handler (eaglescope.log). Tests that call
    # library functions directly see the same lines on stderr as a command would print.
    from eaglescope.log import configure

    configure()


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    # The suite's models are tiny and CI has 2 cores: thread hand-off costs more than the matmuls, and
    # a second thread only contends with the other core's work (measured 10-20x slower on a loaded machine).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
