"""Every layer's hidden state of a traced request's prefill inside vLLM 0.32 (`eaglescope capture --layers`), for the
trace's `target.layer.<i>` stages (docs/trace-format.md): what lets doctor check the taps without the target's layers.

Where vLLM 0.32 holds them (model_executor/models/llama.py, `LlamaDecoderLayer.forward` and `LlamaModel.forward`):
each decoder layer begins with its input RMSNorm, layer 0 as `input_layernorm(hidden_states)` over the embedding
output, layer i > 0 as the fused `input_layernorm(hidden_states, residual)`, which returns (normed, hidden_states +
residual): that sum is the residual stream entering layer i, the very state `EagleModelMixin._maybe_add_hidden_state`
captures for an auxiliary layer (HF `output_hidden_states[i]`). The model's final `norm(hidden_states, residual)`
returns the final normed state first (`output_hidden_states[L]`, what lm_head reads). Forward hooks on those norms
read each state and the normed input beside it; both are copied at once, because vLLM's fused norms write in place
into the same buffers later in the forward. The hooks only read: what vLLM computes is unchanged.
"""

from __future__ import annotations

import torch

from eaglescope.trace import target_layer, target_layer_normed


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class LayerStates:
    """Forward hooks on the target's input norms and final norm; while `active`, one target forward's states, whole
    batch, by stage name (`rows` then slices one request's)."""

    def __init__(self) -> None:
        self.active = False
        self.hooked: object | None = None  # the model the hooks are on
        self.states: dict[str, torch.Tensor] = {}

    def install(self, model: torch.nn.Module) -> str | None:
        """Hook `model` (vLLM's runner.model) once; None, or why its layers cannot be read."""
        if self.hooked is model:
            return None
        holder = getattr(model, "model", model)
        layers, final = getattr(holder, "layers", None), getattr(holder, "norm", None)
        norms = [getattr(layer, "input_layernorm", None) for layer in layers or ()]
        if not norms or any(n is None for n in norms) or not isinstance(final, torch.nn.Module):
            return f"{type(model).__name__} has no input_layernorm on every layer and a final norm to read"
        for i, norm in enumerate(norms):
            norm.register_forward_hook(self._layer_hook(i))
        final.register_forward_hook(self._final_hook(len(norms)))
        self.hooked = model
        return None

    def _layer_hook(self, i: int):
        def hook(module, args, out) -> None:
            if not self.active:
                return
            # layer 0: norm(x) → normed, x the embedding output; layer i > 0: norm(x, residual) → (normed, x + residual)
            normed, state = out if isinstance(out, tuple) else (out, args[0])
            self.states[target_layer(i)] = _cpu(state)
            self.states[target_layer_normed(i)] = _cpu(normed)

        return hook

    def _final_hook(self, L: int):
        def hook(module, args, out) -> None:
            if self.active:
                self.states[target_layer(L)] = _cpu(out[0] if isinstance(out, tuple) else out)

        return hook

    def begin(self, active: bool) -> None:
        """A new engine step: record its target forward's states or not."""
        self.active, self.states = active, {}

    def rows(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """One request's rows [a, b) of each recorded state (empty if this step recorded none)."""
        return {stage: t[a:b] for stage, t in self.states.items()}


def record_prefill(rec, chunks: list[dict[str, torch.Tensor]]) -> str | None:
    """Record a prefill's per-layer states, its chunks joined, with `rec.record_layers`; None, or why they are not
    recorded (a chunk whose engine step kept none: the trace is then written without them)."""
    if not chunks or not chunks[0] or any(c.keys() != chunks[0].keys() for c in chunks):
        return "a chunk of its prefill has no per-layer states; the trace has none"
    cat = {stage: torch.cat([c[stage] for c in chunks]) for stage in chunks[0]}
    L = sum(1 for i in range(len(cat)) if target_layer_normed(i) in cat)
    normed = [cat[target_layer_normed(i)] for i in range(L)]
    rec.record_layers([cat[target_layer(i)] for i in range(L)], cat.get(target_layer(L)), normed)
    return None
