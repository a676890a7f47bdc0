"""Every hidden state of one target forward: what the golden replay records of each forward (`replay.hs.<i>`), and
what `generate --trace-layers` records of the prefill (`target.layer.<i>`, docs/trace-format.md), so that doctor can
tell which layer each tap holds without running the target again.

The states come from the target's own tap capture (every layer tapped for one forward), the final normed state from
the input of its output head, and each layer's normed input from that layer's input RMSNorm: on the native Llama
path and on transformers' models alike (`model.model.layers[i].input_layernorm`, or the generic target's `layers`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from eaglescope.models.targets.base import Target, TargetOutput
from eaglescope.taps import TapContract


def output_head(target: Target) -> torch.nn.Module | None:
    """The module that turns the final normed state into logits (transformers' output embedding, or lm_head)."""
    model = getattr(target, "model", None)
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else getattr(model, "lm_head", None)


def input_norm(target: Target, i: int) -> torch.nn.Module | None:
    """Layer i's input RMSNorm (None where the target's layers do not expose one)."""
    body = getattr(getattr(target, "model", None), "model", None)
    layers = getattr(body, "layers", None) or getattr(target, "layers", None)
    if layers is None or not 0 <= i < len(layers):
        return None
    return getattr(layers[i], "input_layernorm", None)


def forward_all_layers(
    target: Target, fn: Callable[[], TargetOutput], contract: TapContract | None = None
) -> tuple[TargetOutput, list[torch.Tensor], torch.Tensor | None]:
    """Run `fn()`, a forward of `target`, with every layer tapped; the target keeps `contract` (default: its own
    taps) afterwards. → (the output, with the aux of `contract`'s taps; hs[0..L-1] [T, H] each; the final normed
    state [T, H] where lm_head receives it, None if no head is found)."""
    contract = contract if contract is not None else target.taps
    L, H = target.num_layers, target.hidden_size
    final: list[torch.Tensor] = []
    head = output_head(target)
    hook = head.register_forward_pre_hook(lambda m, args: final.append(args[0])) if head is not None else None
    target.set_taps(TapContract(tuple(range(L)), L))
    try:
        out = fn()
    finally:
        target.set_taps(contract)
        if hook is not None:
            hook.remove()
    states = [out.aux[:, i * H : (i + 1) * H] for i in range(L)]
    aux = torch.cat([states[i] for i in contract.layers], dim=-1) if contract is not None else None
    last = final[-1].reshape(-1, H) if final and final[-1].shape[-1] == H else None
    return TargetOutput(out.logits, aux), states, last


@torch.no_grad()
def normed_inputs(target: Target, states: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each layer's input RMSNorm of its input state (what its attention reads); None if a layer has none."""
    norms = [input_norm(target, i) for i in range(len(states))]
    if any(n is None for n in norms):
        return None
    return [n(h) for n, h in zip(norms, states, strict=True)]
