"""eaglescope's side of `prepare --engine sglang`: SGLang's worker (features/sglang_worker.py) serves the target
without a draft in SGLang's capture-only mode, asked for the taps in the id convention SGLang applies to this target
(taps.py: llama.py adds 1 to every id, deepseek_v2.py only when the first id is 1), and eaglescope's capture plugin
(capture/sglang_features.py) reads the captured states and the final state, after the final norm, in SGLang's
scheduler. What every engine shares is in features/engine.py.
"""

from __future__ import annotations

from eaglescope.features.contract import check_sglang_layers
from eaglescope.features.engine import EngineFeatures, Mismatches
from eaglescope.features.target import EngineTarget
from eaglescope.taps import TapContract, sglang_convention

TORCH_NATIVE = "torch_native"
# SGLang 0.5.23's torch_native extend attention reads keys and values from the KV cache only, while deepseek_v2's
# multi-head prefill passes them uncached (forward_mha.py, save_kv_cache=False): the states come out wrong, and SGLang's
# own next token follows them, so no later check sees it (docs/engine-features.md). SGLang picks torch_native itself
# for an asked intel_amx on a CPU without AMX.
TORCH_NATIVE_MLA = (
    "the engine runs the target's latent attention (MLA) on SGLang's torch_native backend, which computes its prefill "
    "wrong (keys read from the latent cache); on a CPU SGLang uses it in place of intel_amx when the CPU has no AMX: "
    "use a CPU with AMX or a GPU attention backend"
)


class SglangFeatures(EngineFeatures):
    """A running SGLang whose target's own EAGLE-3 capture eaglescope's plugin reads."""

    engine, name, worker = "sglang", "SGLang", "eaglescope.features.sglang_worker"
    no_file_why = "the capture plugin wrote nothing for it"

    def __init__(self, target: EngineTarget, taps: TapContract, python: str, engine_args: dict | None = None,
                 max_model_len: int | None = None) -> None:  # fmt: skip
        super().__init__(target, taps, python, engine_args, max_model_len)
        # raises (one line) for taps SGLang cannot capture on this target: a draft trained on them could not be served
        self.layer_ids = taps.to_engine_ids(sglang_convention(target.fingerprint.architecture) or "sglang-legacy")
        self.state_names = [*(f"hs[{i}]" for i in taps.layers), "the final state"]

    def check_ready(self, found: Mismatches) -> None:
        r = self.ready
        given = r.get("ids_given")
        found.add(None, check_sglang_layers(r.get("captured_layers"), self.taps, given, self.layer_ids))
        if r.get("captured_layers") is not None and not r.get("capture_on"):
            found.add(None, ["the engine's target captures no states (SGLang must run with "
                             "enable_return_aux_hidden_states and speculative_algorithm EAGLE3)"])  # fmt: skip
        if r.get("radix_cache"):
            found.add(None, ["the engine has its radix cache on: a cached prefix never runs, so it has no features"])
        if r.get("dtype") is not None and r.get("dtype") != str(self.target.dtype).removeprefix("torch."):
            found.add(None, [f"the engine runs in {r.get('dtype')}, eaglescope asked for {self.target.dtype}"])
        if r.get("latent_attention") and r.get("attention_backend") == TORCH_NATIVE:
            found.add(None, [TORCH_NATIVE_MLA])

    def stats(self) -> dict:
        # the backend SGLang resolved (it may replace the one asked for): recorded beside the features it computed
        return {**super().stats(), "attention_backend": self.ready.get("attention_backend")}
