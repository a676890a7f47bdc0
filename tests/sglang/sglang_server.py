"""`python -m sglang.launch_server` on this CPU: the same start as SGLang's own entry point, with the platform said to
have AMX while the server arguments are resolved (sglang_runner.py's docstring says why: without it SGLang swaps the
`intel_amx` backend for `torch_native`, which EAGLE refuses). Runs in the SGLang environment with the stand-ins on the
path (sglang_support.sglang_env); arguments are launch_server's own.

    python sglang_server.py --model-path T --speculative-algorithm EAGLE3 ... --enable-metrics --port P
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang.launch_server import run_server  # noqa: E402 - after the environment is set
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.runtime_context import override_platform  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.utils import kill_process_tree  # noqa: E402

if __name__ == "__main__":
    load_plugins()
    with override_platform(has_amx=True):
        server_args = prepare_server_args(sys.argv[1:])
        try:
            run_server(server_args)
        finally:
            kill_process_tree(os.getpid(), include_parent=False)
