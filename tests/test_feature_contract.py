"""The capture-contract checks of engine-made features (eaglescope.features.contract) on tensors made here; the
same checks against a real vLLM are in tests/vllm/test_vllm_features.py."""

from __future__ import annotations

import torch

from eaglescope.features.contract import (
    FinalNorm,
    check_captured_ids,
    check_final_token,
    check_prefill_chunks,
    check_sglang_layers,
    check_states,
    check_token_ids,
    engine_layer_ids,
    normalise_final,
)
from eaglescope.features.engine import Mismatches
from eaglescope.taps import TapContract

TAPS = TapContract((2, 4, 6), 8)


def _norm(H: int = 16) -> FinalNorm:
    g = torch.Generator().manual_seed(0)
    return FinalNorm(1.0 + 0.3 * torch.randn(H, generator=g), 1e-6)


def test_vllm_is_asked_for_the_taps_as_is_and_the_last_layer_for_the_final_state():
    assert engine_layer_ids(TAPS) == [2, 4, 6, 8]
    assert check_captured_ids([2, 4, 6, 8], TAPS) == []


def test_captured_ids_one_off_are_named_through_the_tap_contract():
    (line,) = check_captured_ids([3, 5, 7, 8], TAPS)
    assert "hs[3, 5, 7]" in line and "hs[2, 4, 6]" in line


def test_a_final_state_id_other_than_the_last_layer_is_named():
    (line,) = check_captured_ids([2, 4, 6, 7], TAPS)
    assert "final state" in line


def test_pre_norm_state_is_normed_and_a_post_norm_one_refused():
    norm = _norm()
    x = 5 * torch.randn(7, 16) + torch.linspace(-3, 3, 16)  # a residual stream: rms far from constant
    assert not norm.looks_normed(x)
    y, lines = normalise_final("vllm", x, norm)
    assert lines == [] and torch.allclose(y, norm(x))
    assert norm.looks_normed(y)
    _, lines = normalise_final("vllm", y, norm)  # already normed: never normed twice
    assert len(lines) == 1 and "already normed" in lines[0]
    _, lines = normalise_final("sglang", x, norm)
    assert len(lines) == 1 and "not the final norm's output" in lines[0]


def test_token_ids_other_than_the_rendering_are_named_with_the_first_difference():
    assert check_token_ids([1, 2, 3], [1, 2, 3], truncated=False) == []
    assert check_token_ids([1, 2, 3, 4], [1, 2, 3], truncated=True) == []
    (line,) = check_token_ids([9, 1, 2, 3], [1, 2, 3], truncated=False)
    assert "position 0" in line and "BOS" in line


def test_nan_and_all_zero_layers_and_shapes_are_named():
    s = torch.randn(5, 4, 16)
    assert check_states(s, 4, 5, 16, [2, 4, 6, 8]) == []
    s[:, 1] = 0
    s[2, 3, 0] = float("nan")
    lines = check_states(s, 4, 5, 16, [2, 4, 6, 8])
    assert any("layer id 4 is all zeros" in ln for ln in lines) and any("layer id 8 holds NaN" in ln for ln in lines)
    assert "shape" in check_states(s, 4, 6, 16, [2, 4, 6, 8])[0]


def test_the_final_state_must_predict_the_engines_token():
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert check_final_token(logits, [1]) == []
    assert "predicts token 1" in check_final_token(logits, [2])[0]


def test_mismatches_are_one_line_per_kind_naming_the_samples():
    m = Mismatches()
    for k in range(6):
        m.add(k, ["the engine processed other token ids"])
    m.add(3, ["the engine's state of layer id 2 is all zeros"])
    lines = m.lines()
    assert lines == ["samples 0, 1, 2, 3 (+2 more): the engine processed other token ids",
                     "sample 3: the engine's state of layer id 2 is all zeros"]  # fmt: skip


def test_sglang_captured_layers_are_compared_with_the_taps_and_name_the_ids():
    assert check_sglang_layers([2, 4, 6], TAPS, [1, 3, 5], [1, 3, 5]) == []
    # vLLM-convention ids handed to SGLang's llama.py, which adds 1
    (line,) = check_sglang_layers([3, 5, 7], TAPS, [2, 4, 6], [1, 3, 5])
    assert line == (
        "the engine captures hs[3, 5, 7] (SGLang ids [2, 4, 6]), the taps asked are hs[2, 4, 6] (SGLang ids [1, 3, 5])"
    )
    assert "did not say which layers" in check_sglang_layers(None, TAPS, None, [1, 3, 5])[0]


def test_a_prefill_in_chunks_must_cover_the_prompt_once_from_position_0():
    assert check_prefill_chunks([[0, 16], [16, 16], [32, 5]], 37) == []
    assert "radix cache" in check_prefill_chunks([[8, 29]], 37)[0]  # a cached prefix never ran
    assert "chunk missing or repeated" in check_prefill_chunks([[0, 16], [32, 5]], 37)[0]
    assert "covered 32 of the prompt's 37" in check_prefill_chunks([[0, 16], [16, 16]], 37)[0]


def test_named_states_are_named_in_the_lines():
    s = torch.randn(5, 4, 16)
    s[:, 3] = 0
    (line,) = check_states(s, 4, 5, 16, ["hs[2]", "hs[4]", "hs[6]", "the final state"])
    assert line == "the engine's state of the final state is all zeros"
