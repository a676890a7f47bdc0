"""Finding the SGLang environment (scripts/sglang_env.sh) and running its interpreter, for tests/sglang."""

from __future__ import annotations

import os
from pathlib import Path

from engine_envs import EngineEnv

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# This project's plain-torch stand-ins for SGLang's CPU kernels (`sgl_kernel`), and the start-up fix that lets PyPI's
# CUDA torchvision import beside a CPU torch: on the path of SGLang's processes only.
STAND_INS = HERE / "stand_ins"
PROBE_TIMEOUT_S = 180
ENV = EngineEnv("SGLang", "SGLANG", ".venv-sglang", ".eaglescope-sglang-complete", ".eaglescope-sglang-error",
                "scripts/sglang_env.sh")  # fmt: skip


def sglang_env() -> dict[str, str]:
    """The environment for SGLang's interpreter: ours, less what belongs to eaglescope's environment, the stand-ins and
    this checkout's src on the path, offline, one OpenMP thread (on 2 cores SGLang's scheduler and the test process
    would otherwise wait on each other's threads: a 16-token request took 30 s instead of 0.3 s), and torch.compile
    off: SGLang decorates a few small helpers with it (speculative/spec_utils.py `_select_top_k_tokens_later`, run at
    every draft step after the first), which on a CPU cost every engine 17-22 s of inductor loading and C++ probing
    at its first decode, most of an engine's life here; they run eagerly, the same ops (the tests/vllm engines run
    with enforce_eager for the same reason)."""
    env = dict(os.environ)
    for key in ("TRITON_INTERPRET", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(key, None)
    # the stand-ins, and this checkout's eaglescope, whichever one the environment's editable install points at (the
    # capture plugin and hooks run in SGLang's processes: they must be the code under test)
    env["PYTHONPATH"] = os.pathsep.join([str(STAND_INS), str(REPO / "src")])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DO_NOT_TRACK="1", SGLANG_USE_CPU_ENGINE="1",
               OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1")  # fmt: skip
    return env


def probe_import(python: str) -> str:
    """ "" when SGLang's engine imports in `python` (with the stand-ins), else one line saying why."""
    return ENV.probe(python, "import sglang.srt.entrypoints.engine, sgl_kernel", sglang_env(), PROBE_TIMEOUT_S)
