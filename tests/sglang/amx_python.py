"""An `--engine-python` for `prepare --engine sglang` on this CPU (for tests/sglang/test_sglang_features.py): SGLang's
`intel_amx` attention backend kept on a CPU without AMX, as sglang_runner.py keeps it for serving (SGLang would swap
it for `torch_native`, srt/arg_groups/overrides.py `_attention_backend_platform_fallbacks`, which has no latent
attention for DeepSeek-V3 targets), so that the features come from the attention path the drafts are served on. The
backend is chosen while `sglang.Engine` resolves its arguments, in this process; then the worker runs unchanged.

    python amx_python.py -m eaglescope.features.sglang_worker SPOOL
"""

from __future__ import annotations

import runpy
import sys


def keep_amx() -> None:
    # The class itself: `sglang.Engine` is a LazyImport proxy (sglang/utils.py), so an `__init__` set on it is never
    # called (it once was, and SGLang ran torch_native unnoticed: right for Llama, wrong for DeepSeek-V3's MLA, which
    # prepare --engine sglang now refuses on torch_native, so the DeepSeek-V3 test fails if this stops working).
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.runtime_context import override_platform

    init = Engine.__init__

    def engine_init(self, *a, **kw):
        with override_platform(has_amx=True):
            init(self, *a, **kw)

    Engine.__init__ = engine_init


if __name__ == "__main__":  # SGLang spawns its scheduler: the main module is re-imported there, and must not run
    keep_amx()
    sys.argv = ["sglang_worker", sys.argv[-1]]
    runpy.run_module("eaglescope.features.sglang_worker", run_name="__main__", alter_sys=True)
