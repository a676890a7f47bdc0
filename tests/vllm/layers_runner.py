"""capture_runner.py with vLLM's own tap capture broken at run time, the way a bug in the engine would break it (for
tests/vllm/test_vllm_layers.py). Runs in the vLLM environment, engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
so the patch is in the process that runs the model:

    LAYERS_FAULT=order   LlamaModel.forward hands on its captured states high to low (what the drafter concatenates)
    LAYERS_FAULT=normed  each captured state is passed through its layer's input RMSNorm first

    python layers_runner.py SPEC.json OUT_DIR      (as capture_runner.py)
"""

from __future__ import annotations

import os
import sys

from capture_runner import main


def patch(fault: str) -> None:
    from vllm.model_executor.models.llama import LlamaModel

    if fault == "order":
        forward = LlamaModel.forward

        def high_to_low(self, *a, **kw):
            out = forward(self, *a, **kw)
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
                return out[0], out[1][::-1]
            return out

        LlamaModel.forward = high_to_low
    elif fault == "normed":

        def normed(self, aux_hidden_states, layer_idx, hidden_states, residual):
            if layer_idx in self.aux_hidden_state_layers:
                value = hidden_states + residual if residual is not None else hidden_states
                aux_hidden_states.append(self.layers[layer_idx].input_layernorm(value.clone()))
            return aux_hidden_states

        LlamaModel._maybe_add_hidden_state = normed
    else:
        raise SystemExit(f"layers_runner.py: unknown LAYERS_FAULT {fault!r}")


if __name__ == "__main__":
    patch(os.environ["LAYERS_FAULT"])
    sys.exit(main(sys.argv))
