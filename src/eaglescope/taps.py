"""The tap contract: which hidden states of the target an EAGLE-3 draft reads.

One convention inside eaglescope: Hugging Face ``output_hidden_states`` indices.
``hs[0]`` is the embedding output, ``hs[i]`` the un-normed residual stream entering
decoder layer ``i``. The final normed state is never a tap, so valid taps are
``0 .. num_layers-1``. Concatenation order is tap order, low to high.

Engines store explicit ids in their own conventions (docs/field.md §1); this module is the
only place that translates. Nothing else in eaglescope computes a layer index.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglescope.errors import EagleScopeError

INDEX_CONVENTION = "hf_output_hidden_states"

# Engines and how they read `eagle_config.eagle_aux_hidden_state_layer_ids`.
#   vllm:          ids used as-is ("state entering layer i")           -> hs[i]
#   sglang:        +1 only when the first id is 1 (SGLang's DeepSeek-V2 family) -> heuristic
#   sglang-legacy: id i means "output of layer i", +1 (SGLang's other targets) -> hs[i+1]
#   specforge:     writes "output of layer i" ids                       -> hs[i+1]
ENGINES = ("vllm", "sglang", "sglang-legacy", "specforge")

# SGLang reads the ids in the *target* model's `set_eagle3_layers_to_capture` (python/sglang/srt/models/*.py), so
# the rule is per target architecture. At SGLang 0.5.23 (the version read for docs/sglang.md) the DeepSeek-V2
# family adds 1 only when the first id is 1 (the "sglang" convention here); every other model with EAGLE-3 support
# (llama.py, qwen2.py, qwen3.py, mistral via llama, ...) adds 1 to every id (the "sglang-legacy" convention here:
# the name is historical, it is the rule for most targets today).
SGLANG_VERSION_READ = "0.5.23"
SGLANG_FIRST_ID_ONE_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",  # deepseek_v2.py
        "DeepseekV3ForCausalLM",  # deepseek_v2.py (also Kimi-K2's architecture)
        "DeepseekV32ForCausalLM",  # deepseek_v2.py
        "KimiK25ForConditionalGeneration",  # kimi_k25.py delegates to DeepseekV3ForCausalLM
        "MistralLarge3ForCausalLM",  # mistral_large_3.py subclasses DeepseekV3ForCausalLM
        "GlmMoeDsaForCausalLM",  # glm4_moe.py subclasses DeepseekV2ForCausalLM
        "Glm4MoeLiteForCausalLM",  # glm4_moe_lite.py
    }
)


def sglang_convention(architecture: str | None) -> str | None:
    """The convention SGLang applies to a target of `architecture` (None: architecture unknown)."""
    if not architecture:
        return None
    return "sglang" if architecture in SGLANG_FIRST_ID_ONE_ARCHITECTURES else "sglang-legacy"


SERVING_ENGINES = ("sglang", "sglang-legacy", "vllm")  # those `export` writes for and `inspect` reports on


def default_tap_layers(num_layers: int) -> tuple[int, ...]:
    """What EAGLE, SGLang and vLLM capture when a checkpoint names no ids."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class TapContract:
    """Taps in HF hidden-state indices for a target with ``num_layers`` decoder layers."""

    layers: tuple[int, ...]
    num_layers: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        self.validate()

    @classmethod
    def default(cls, num_layers: int) -> TapContract:
        if num_layers < 7:
            raise EagleScopeError(
                f"the default taps [2, L//2, L-3] are distinct only for 7 or more layers; this target has"
                f" {num_layers}: pass explicit taps"
            )
        return cls(default_tap_layers(num_layers), num_layers)

    @classmethod
    def parse(cls, text: str | None, num_layers: int) -> TapContract:
        """`"2,8,13"` → contract; None or "" or "default" → the default."""
        if text is None or text.strip() == "default":
            return cls.default(num_layers)
        if not text.strip():
            raise EagleScopeError("--taps is empty; give tap indices like '2,8,13', or 'default'")
        try:
            layers = tuple(int(t) for t in text.replace(" ", "").split(","))
        except ValueError:
            raise EagleScopeError(f"taps must be comma-separated integers, got {text!r}") from None
        return cls(layers, num_layers)

    def validate(self) -> None:
        L = self.num_layers
        if L < 1:
            raise EagleScopeError(f"a target needs at least one layer, got num_layers={L}")
        if not self.layers:
            raise EagleScopeError("a tap contract needs at least one tap")
        bad = [i for i in self.layers if not 0 <= i <= L - 1]
        if bad:
            raise EagleScopeError(
                f"taps {bad} are out of range for a {L}-layer target: valid hidden-state indices are "
                f"0 (embedding) .. {L - 1} (entering the last layer); the final normed state is never a tap"
            )
        if len(set(self.layers)) != len(self.layers):
            raise EagleScopeError(f"taps {list(self.layers)} contain duplicates")
        if list(self.layers) != sorted(self.layers):
            raise EagleScopeError(
                f"taps {list(self.layers)} are not in increasing order: EAGLE-3 concatenates low to high"
            )

    @property
    def count(self) -> int:
        return len(self.layers)

    @property
    def is_default(self) -> bool:
        return self.num_layers >= 7 and self.layers == default_tap_layers(self.num_layers)

    def describe(self) -> list[str]:
        """Human names of the tapped tensors."""
        out = []
        for i in self.layers:
            out.append("embedding output" if i == 0 else f"input of layer {i} (output of layer {i - 1})")
        return out

    # -- engine conventions -------------------------------------------------------------
    def to_engine_ids(self, engine: str) -> list[int]:
        """The explicit ids to write so that `engine` captures exactly these taps."""
        _check_engine(engine)
        if engine == "vllm":
            return list(self.layers)
        if engine in ("sglang-legacy", "specforge"):
            if 0 in self.layers:
                raise EagleScopeError(
                    f"{engine} ids mean 'output of layer i'; the embedding (tap 0) cannot be expressed"
                )
            return [i - 1 for i in self.layers]
        # newer SGLang: +1 only when the first id is 1
        shifted = [i - 1 for i in self.layers]
        if shifted[0] == 1:
            return shifted
        if self.layers[0] != 1:
            return list(self.layers)
        raise EagleScopeError(
            "newer SGLang adds +1 only when the first id is 1, so a first tap of hs[1] cannot be expressed"
        )

    @classmethod
    def from_engine_ids(cls, ids: list[int] | None, engine: str, num_layers: int) -> TapContract:
        """What `engine` actually captures for these explicit ids (None → engine default)."""
        return cls(tuple(engine_capture(ids, engine, num_layers)), num_layers)

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "index_convention": INDEX_CONVENTION, "num_layers": self.num_layers}

    def engines_that_cannot_serve(self, architecture: str | None = None) -> dict[str, str]:
        """{engine: why} for the serving engines whose layer-id convention cannot express these taps; for SGLang only
        the rule it applies to a target of `architecture` (both rules when it is unknown)."""
        out = {}
        rule = sglang_convention(architecture)
        engines = ["vllm", rule] if rule else ["vllm", "sglang", "sglang-legacy"]
        for engine in engines:
            try:
                self.to_engine_ids(engine)
            except EagleScopeError as e:
                out[engine] = str(e)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> TapContract:
        layers, n = (d.get("layers"), d.get("num_layers")) if isinstance(d, dict) else (None, None)
        if not (isinstance(layers, list) and all(type(i) is int for i in layers) and type(n) is int):
            raise EagleScopeError(
                f"a taps entry must be {{'layers': [int, ...], 'num_layers': int, 'index_convention': ...}}, got "
                f"{d!r:.100}"
            )
        conv = d.get("index_convention", INDEX_CONVENTION)
        if conv != INDEX_CONVENTION:
            raise EagleScopeError(f"unknown tap index convention {conv!r}; expected {INDEX_CONVENTION!r}")
        return cls(tuple(d["layers"]), int(d["num_layers"]))


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise EagleScopeError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


def engine_capture(ids: list[int] | None, engine: str, num_layers: int) -> list[int]:
    """HF hidden-state indices `engine` captures given checkpoint ids (None = no ids written)."""
    _check_engine(engine)
    if ids is None:
        return list(default_tap_layers(num_layers))
    ids = [int(i) for i in ids]
    if engine == "vllm":
        return ids
    if engine in ("sglang-legacy", "specforge"):
        return [i + 1 for i in ids]
    return [i + 1 for i in ids] if ids and ids[0] == 1 else ids
