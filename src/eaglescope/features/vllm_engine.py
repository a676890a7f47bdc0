"""eaglescope's side of `prepare --engine vllm`: vLLM's worker (features/vllm_worker.py) extracts the states with
vLLM's `extract_hidden_states` method, asked for the taps in vLLM's id convention and for id L, the last layer's
output before the final norm (features/contract.py). What every engine shares is in features/engine.py.
"""

from __future__ import annotations

from pathlib import Path

from eaglescope.features.contract import check_captured_ids, engine_layer_ids
from eaglescope.features.engine import EngineFeatures, Mismatches, Sample  # noqa: F401 - Sample: callers' old import
from eaglescope.features.target import EngineTarget
from eaglescope.taps import TapContract


class VllmFeatures(EngineFeatures):
    """A running vLLM that extracts the target's features."""

    engine, name, worker = "vllm", "vLLM", "eaglescope.features.vllm_worker"
    no_file_why = "is the hidden-states connector configured?"

    def __init__(self, target: EngineTarget, taps: TapContract, python: str, engine_args: dict | None = None,
                 max_model_len: int | None = None) -> None:  # fmt: skip
        super().__init__(target, taps, python, engine_args, max_model_len)
        self.layer_ids = engine_layer_ids(taps)
        self.state_names = list(self.layer_ids)  # "layer id k"

    def check_ready(self, found: Mismatches) -> None:
        captured = self.ready.get("captured_layers")
        if captured is None:
            captured = aux_layers_from_log(self.spool / "engine.log")
            self.ready["captured_layers"] = captured
        found.add(None, check_captured_ids(captured, self.taps))
        if self.ready.get("prefix_caching"):
            found.add(None, ["the engine has prefix caching on: a cached prefix never runs, so it has no features"])
        if self.ready.get("dtype") != str(self.target.dtype).removeprefix("torch."):
            found.add(None, [f"the engine runs in {self.ready.get('dtype')}, eaglescope asked for {self.target.dtype}"])


def aux_layers_from_log(path: Path) -> list[int] | None:
    """vLLM's model runner logs the ids it set (gpu_model_runner.py _setup_eagle3_aux_hidden_state_outputs)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    key = "Using auxiliary layers from speculative config:"
    at = text.rfind(key)
    if at < 0:
        return None
    rest = text[at + len(key) :].splitlines()[0].strip().strip("()[]")
    try:
        return [int(x) for x in rest.replace(" ", "").split(",") if x]
    except ValueError:
        return None
