"""The capture contract of engine-made features, checked at run time: one line per mismatch.

Training wants, per sample, the tap states `aux` [T, nH] (HF `output_hidden_states` indices, the tap contract in
taps.py) and the target's final *normed* state `final_hidden` [T, H] (train applies only the lm_head to it). Engines
hand on something close, under their own conventions:

    engine  layer ids                                   final state                      who says so
    vllm    id k = hs[k] (output of layer k-1); the     id L = the last layer's output,  model_executor/models/
            final state is asked for as id L            BEFORE the final norm            interfaces.py
                                                                                         _maybe_add_hidden_state
    sglang  its own EAGLE-3 capture, asked for by ids   after the final norm (the        models/llama.py,
            (llama.py: id i = hs[i+1]; deepseek_v2.py:  model body's output, which the   deepseek_v2.py
            +1 only when the first id is 1), read by    logits processor reads)          set_eagle3_layers_to_capture
            capture/sglang_features.py

`FINAL_STATE` states each engine's convention; `normalise_final` turns the engine's final state into training's
(the target's final RMSNorm applied to vLLM's pre-norm state; SGLang's is taken as is). Each check below is a known
way engine features have gone wrong in the field: ids read in another convention (vLLM PR 43671: aux off by one),
a final state taken one layer early (TorchSpec issue 87) or normed twice, all-zero layers from hybrid targets (vLLM
PR 46301), a chat template or BOS that differs between the engine and the training data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglescope.taps import TapContract

# engine → whether the final state it hands on is already normed
FINAL_STATE = {"vllm": "pre-norm", "sglang": "post-norm"}
# |rms(x / w) - 1| below this at every token: the state is some RMSNorm's output with weight w (eps keeps it a hair
# under 1; a residual stream's rms is nowhere near constant)
NORMED_TOL = 2e-3


@dataclass
class FinalNorm:
    """The target's final RMSNorm (weight [H] and eps), read from its checkpoint without its layers."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # as the target computes it (models/targets/llama.py RMSNorm): normalise in float32, cast, then the weight
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * xf.to(x.dtype)

    def looks_normed(self, x: torch.Tensor) -> bool:
        """Whether every row of x [T, H] is this norm's output (rms(x / w) == 1 up to eps)."""
        w = self.weight.float()
        ok = w.abs() > 1e-6
        if x.shape[0] == 0 or not bool(ok.any()):
            return False
        rms = (x.float()[:, ok] / w[ok]).pow(2).mean(-1).sqrt()
        return bool(((rms - 1).abs() < NORMED_TOL).all())


def engine_layer_ids(taps: TapContract) -> list[int]:
    """The ids to ask vLLM's extract_hidden_states for: the taps in vLLM's convention, then L (the final state)."""
    return [*taps.to_engine_ids("vllm"), taps.num_layers]


def check_captured_ids(captured: list[int] | None, taps: TapContract) -> list[str]:
    """vLLM's read-back `aux_hidden_state_layers` against what the taps ask, through the tap contract."""
    if captured is None:
        return ["the engine did not say which layers it captured (no aux_hidden_state_layers read back)"]
    L = taps.num_layers
    asked = engine_layer_ids(taps)
    if sorted(captured) == asked:
        return []
    lines = []
    got = sorted(set(captured))
    # vLLM hands the states on in layer order: the last is what is read as the final state, the others as the taps
    final, aux = (got[-1] if got else None), got[:-1]
    if final != L:
        lines.append(
            f"the engine captures id {final} last, read as the final state; vLLM's id {L} is the last layer's output "
            "(before the final norm)"
        )
    try:
        captured_taps = list(TapContract.from_engine_ids(aux, "vllm", L).layers) if aux else []
    except Exception as e:  # noqa: BLE001 - an id set the contract cannot hold is itself the mismatch
        captured_taps = aux
        lines.append(f"the engine's aux ids {aux} are not a tap set ({e})")
    if captured_taps != list(taps.layers):
        lines.append(
            f"the engine captures hs{captured_taps} (vLLM ids {aux}), the taps asked are hs{list(taps.layers)} "
            f"(vLLM ids {asked[:-1]})"
        )
    return lines


def _first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check_token_ids(engine_ids: list[int], ours: list[int], truncated: bool, decode=None) -> list[str]:
    """The engine processed eaglescope's rendering (template, BOS), or, when eaglescope truncated, a longer one
    that starts with it."""
    same = engine_ids[: len(ours)] == ours if truncated else engine_ids == ours
    if same:
        return []
    i = _first_difference(engine_ids, ours)

    def tok(ids: list[int]) -> str:
        if i >= len(ids):
            return "end"
        return f"{ids[i]}" + (f" {decode([ids[i]])!r}" if decode is not None else "")

    why = "another chat template, or a BOS token added or dropped" if i < 2 else "another chat template"
    return [
        f"the engine processed other token ids than eaglescope's rendering: {why} ({len(engine_ids)} vs "
        f"{len(ours)} tokens, first difference at position {i}: engine {tok(engine_ids)}, eaglescope {tok(ours)})"
    ]


def check_states(states: torch.Tensor, n_ids: int, T: int, H: int, ids: list[int | str]) -> list[str]:
    """states [T, n_ids, H]: the shape, then no NaN / inf, no all-zero layer. `ids` name the columns: an engine's
    layer id (int, "layer id k") or a name ("hs[2]", "the final state")."""
    if states.dim() != 3 or list(states.shape) != [T, n_ids, H]:
        return [f"the engine's hidden states have shape {list(states.shape)}, expected [{T}, {n_ids}, {H}]"]

    def name(j: int) -> str:
        return f"layer id {ids[j]}" if isinstance(ids[j], int) else str(ids[j])

    lines = []
    finite = torch.isfinite(states).all(dim=(0, 2))
    for j in (~finite).nonzero().flatten().tolist():
        lines.append(f"the engine's state of {name(j)} holds NaN or inf")
    zero = (states == 0).all(dim=(0, 2))
    for j in zero.nonzero().flatten().tolist():
        lines.append(f"the engine's state of {name(j)} is all zeros")
    return lines


def check_sglang_layers(captured: list[int] | None, taps: TapContract, given: list[int] | None,
                        asked: list[int]) -> list[str]:  # fmt: skip
    """SGLang's read-back `layers_to_capture` (HF indices: the state entering layer i, once the target model applied
    its id rule to the ids it was `given`) against the taps, which eaglescope asks for as ids `asked`."""
    if captured is None:
        return [
            "the engine did not say which layers it captures (eaglescope's capture plugin did not report from "
            "SGLang's scheduler: is eaglescope installed in SGLang's environment?)"
        ]
    if sorted(captured) == list(taps.layers):
        return []
    return [
        f"the engine captures hs{sorted(int(i) for i in captured)} (SGLang ids {given}), the taps asked are "
        f"hs{list(taps.layers)} (SGLang ids {asked})"
    ]


def check_prefill_chunks(chunks: list[list[int]], T: int) -> list[str]:
    """The engine's prefill of one request, as [start, tokens] per forward it ran in, covers positions 0..T-1 once,
    in order (a prefill split in chunks is joined; a cached prefix never ran, so it has no features)."""
    pos = 0
    for start, n in chunks:
        if start != pos:
            why = "a cached prefix never runs: radix cache on?" if pos == 0 else "a chunk missing or repeated"
            return [f"the engine's prefill of the prompt ran from position {start} where {pos} was due ({why})"]
        pos += n
    if pos != T:
        return [f"the engine's prefill covered {pos} of the prompt's {T} positions"]
    return []


def normalise_final(engine: str, final: torch.Tensor, norm: FinalNorm) -> tuple[torch.Tensor, list[str]]:
    """The engine's final state [T, H] as training wants it (post-norm); a state that is not in the engine's stated
    convention is refused, never normed twice or left un-normed."""
    normed = norm.looks_normed(final)
    if FINAL_STATE[engine] == "pre-norm":
        if normed:
            return final, [
                f"the engine's final state is already normed (rms(x / w) = 1 at every token); {engine} "
                "hands it on before the final norm, and norming it again would train on the wrong teacher"
            ]
        return norm(final), []
    if not normed:
        return final, [
            f"the engine's final state is not the final norm's output (rms(x / w) != 1); {engine} hands "
            "it on after the norm"
        ]
    return final, []


def check_final_token(logits_last: torch.Tensor, sampled: list[int]) -> list[str]:
    """The engine's greedy token after the prompt is the argmax of the head on the normed final state's last row (a
    final state from another layer, TorchSpec issue 87, predicts other tokens). Near-ties pass."""
    if not sampled:
        return []
    tok = int(sampled[0])
    if not 0 <= tok < logits_last.numel():
        return [f"the engine sampled token {tok}, outside the target's vocabulary"]
    top = float(logits_last.max())
    gap = top - float(logits_last[tok])
    if gap <= 1e-3 * max(1.0, abs(top)):
        return []
    best = int(logits_last.argmax())
    return [
        f"the head on the engine's final state predicts token {best}, the engine itself took {tok} "
        f"(logit {gap:.3g} below): the final state is not the last layer's"
    ]


__all__ = [
    "FINAL_STATE",
    "FinalNorm",
    "engine_layer_ids",
    "check_captured_ids",
    "check_token_ids",
    "check_states",
    "check_sglang_layers",
    "check_prefill_chunks",
    "normalise_final",
    "check_final_token",
]
