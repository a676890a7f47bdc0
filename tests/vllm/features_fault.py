"""eaglescope's vLLM feature worker with vLLM's capture broken at run time, the way an engine bug or a patched fork
would break it (for tests/vllm/test_vllm_features.py). Given as `prepare --engine-python` through a shell wrapper; runs
in the vLLM environment, engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the patch is in the process that
runs the model:

    FEATURES_FAULT=post-norm   the final state (vLLM id L) is handed on after the final norm (SGLang's convention)
    FEATURES_FAULT=zero-layer  the first tap's state is all zeros (vLLM PR 46301: hybrid targets returned zeros)

    python features_fault.py -m eaglescope.features.vllm_worker SPOOL
"""

from __future__ import annotations

import os
import runpy
import sys


def patch(fault: str) -> None:
    import torch
    from vllm.model_executor.models.llama import LlamaModel

    add = LlamaModel._maybe_add_hidden_state

    def broken(self, aux_hidden_states, layer_idx, hidden_states, residual):
        if layer_idx not in self.aux_hidden_state_layers:
            return aux_hidden_states
        value = hidden_states + residual if residual is not None else hidden_states
        if fault == "post-norm" and layer_idx == len(self.layers):
            aux_hidden_states.append(self.norm(value.clone()))
            return aux_hidden_states
        if fault == "zero-layer" and layer_idx == min(self.aux_hidden_state_layers):
            aux_hidden_states.append(torch.zeros_like(value))
            return aux_hidden_states
        return add(self, aux_hidden_states, layer_idx, hidden_states, residual)

    if fault not in ("post-norm", "zero-layer"):
        raise SystemExit(f"features_fault.py: unknown FEATURES_FAULT {fault!r}")
    LlamaModel._maybe_add_hidden_state = broken


if __name__ == "__main__":
    patch(os.environ["FEATURES_FAULT"])
    sys.argv = ["vllm_worker", sys.argv[-1]]
    runpy.run_module("eaglescope.features.vllm_worker", run_name="__main__", alter_sys=True)
