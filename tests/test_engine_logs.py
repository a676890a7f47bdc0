"""Served acceptance parsed from real-format SGLang and vLLM log lines."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglescope.decode.stats import SpecStats
from eaglescope.detective.engine_logs import parse_engine_log, read_engine_log
from eaglescope.errors import EagleScopeError

# Lines in the exact shape the engines print (SGLang scheduler log; vLLM v1 spec_decode/metrics.py).
SGLANG = """\
[2025-06-01 10:00:00] Prefill batch. #new-seq: 1, #new-token: 57, #cached-token: 0, token usage: 0.00, #running-req: 0, #queue-req: 0
[2025-06-01 10:00:02] Decode batch. #running-req: 1, #token: 812, token usage: 0.01, accept len: 1.12, accept rate: 0.03, cuda graph: True, gen throughput (token/s): 96.55, #queue-req: 0
[2025-06-01 10:00:04] Decode batch. #running-req: 1, #token: 852, token usage: 0.01, accept len: 1.10, accept rate: 0.02, cuda graph: True, gen throughput (token/s): 94.10, #queue-req: 0
[2025-06-01 10:00:06] Decode batch. #running-req: 1, #token: 894, token usage: 0.01, accept len: 1.14, accept rate: 0.03, cuda graph: True, gen throughput (token/s): 97.80, #queue-req: 0
"""  # noqa: E501
SGLANG_OLD = "[2024-12-01 09:00:00 TP0] Decode batch. #running-req: 4, #token: 4100, token usage: 0.02, #accept length: 3.47, gen throughput (token/s): 310.2, #queue-req: 0"  # noqa: E501
VLLM = """\
INFO 06-01 10:00:10 [loggers.py:118] Engine 000: Avg prompt throughput: 5.7 tokens/s, Avg generation throughput: 10.2 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.1%, Prefix cache hit rate: 0.0%
INFO 06-01 10:00:10 [metrics.py:96] SpecDecoding metrics: Mean acceptance length: 1.13, Accepted throughput: 1.20 tokens/s, Drafted throughput: 45.00 tokens/s, Accepted: 12 tokens, Drafted: 450 tokens, Per-position acceptance rate: 0.111, 0.013, 0.009, 0.000, 0.000, Avg Draft acceptance rate: 2.7%
INFO 06-01 10:00:20 [metrics.py:96] SpecDecoding metrics: Mean acceptance length: 1.16, Accepted throughput: 3.00 tokens/s, Drafted throughput: 95.00 tokens/s, Accepted: 30 tokens, Drafted: 950 tokens, Per-position acceptance rate: 0.126, 0.021, 0.011, 0.000, 0.000, Avg Draft acceptance rate: 3.2%
"""  # noqa: E501
VLLM_V0 = "INFO 01-01 00:00:00 metrics.py:455] Speculative metrics: Draft acceptance rate: 0.651, System efficiency: 0.570, Number of speculative tokens: 3, Number of accepted tokens: 1953, Number of draft tokens: 3000, Number of emitted tokens: 2860."  # noqa: E501


def test_sglang_accept_len_is_averaged_over_decode_lines():
    r = parse_engine_log(SGLANG)
    assert r.engine == "sglang" and r.lines == 3
    assert r.accept_length == pytest.approx((1.12 + 1.10 + 1.14) / 3)
    assert r.alpha is None and r.per_position is None


def test_sglang_legacy_spelling():
    r = parse_engine_log(SGLANG_OLD)
    assert r.engine == "sglang" and r.accept_length == pytest.approx(3.47)
    assert parse_engine_log("Decode batch. #running-req: 1, accept_length=2.5, x").accept_length == 2.5


# SGLang 0.5.23 (managers/scheduler_components/metrics_reporter.py report_decode_stats): "Decode batch," with a comma,
# an optional " [forward iteration]", a TP/DP rank in the prefix, and ragged-verify fields after "accept rate".
SGLANG_0523 = """\
[2026-11-20 10:00:02 TP0] Decode batch, #running-req: 1, #token: 812, token usage: 0.01, accept len: 3.00, accept rate: 0.50, cuda graph: True, gen throughput (token/s): 96.55, #queue-req: 0
[2026-11-20 10:00:04 TP0] Decode batch [1240], #running-req: 3, #token: 2300, token usage: 0.02, accept len: 2.00, accept rate: 0.25, cap len: 3.10, block accept len: 3.50, cuda graph: True, gen throughput (token/s): 240.10, #queue-req: 0
"""  # noqa: E501


def test_sglang_0523_lines_are_weighted_by_their_batch_and_block_accept_len_is_not_tau():
    r = parse_engine_log(SGLANG_0523)
    assert r.engine == "sglang" and r.lines == 2
    # accept len is tokens / (batch sizes summed over the interval): a line of 3 running requests stands for 3x the
    # rounds of a line of 1; the unweighted mean would be 2.5, and "block accept len: 3.50" is never read as τ
    assert r.accept_length == pytest.approx((3.00 * 1 + 2.00 * 3) / 4)
    with pytest.raises(EagleScopeError, match="no acceptance lines"):
        parse_engine_log("[2026-11-20 10:00:04] Decode batch, #running-req: 3, block accept len: 3.50, #queue-req: 0")


def test_sglang_lines_without_a_batch_size_are_averaged_unweighted():
    text = SGLANG_0523.splitlines()[1] + "\naccept_length=1.0\n"  # the second prints no #running-req
    assert parse_engine_log(text).accept_length == pytest.approx((2.00 + 1.0) / 2)


def test_vllm_lines_weighted_by_drafts_and_made_conditional():
    r = parse_engine_log(VLLM)
    assert r.engine == "vllm" and r.lines == 2
    w1, w2 = 450 / 5, 950 / 5  # drafts per interval
    assert r.drafts == pytest.approx(w1 + w2)
    assert r.accept_length == pytest.approx((1.13 * w1 + 1.16 * w2) / (w1 + w2))
    a1 = (0.111 * w1 + 0.126 * w2) / (w1 + w2)
    a2 = (0.013 * w1 + 0.021 * w2) / (w1 + w2)
    assert r.per_position[0] == pytest.approx(a1)
    assert r.alpha[0] == pytest.approx(a1) and r.alpha[1] == pytest.approx(a2 / a1)
    assert math.isnan(r.alpha[4])  # nothing reached position 4, so α_5 is undefined


def test_vllm_v0_line():
    r = parse_engine_log(VLLM_V0)
    assert r.engine == "vllm" and r.accept_length == pytest.approx(2860 / 1000)


def test_mixed_log_takes_the_engine_with_more_lines():
    assert parse_engine_log(SGLANG + VLLM.splitlines()[1]).engine == "sglang"


def test_log_without_metric_lines_is_refused(tmp_path):
    with pytest.raises(EagleScopeError, match="no acceptance lines"):
        parse_engine_log("INFO server started\nINFO Avg prompt throughput: 1.0 tokens/s\n")
    with pytest.raises(EagleScopeError, match="does not exist"):
        read_engine_log(tmp_path / "missing.log")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=5, max_size=40), min_size=1, max_size=4))
def test_vllm_conversion_recovers_decoder_alpha(intervals):
    """A vLLM log written from known rounds (depth 4 chains) gives back SpecStats' τ and conditional α."""
    lines, all_stats = [], SpecStats()
    for accepted in intervals:
        s = SpecStats()
        for a in accepted:
            s.record_round(4, a)
        all_stats.merge(s)
        pos = ", ".join(f"{p:.6f}" for p in s.accepted_per_position + [0.0] * (4 - s.depth))
        lines.append(
            f"SpecDecoding metrics: Mean acceptance length: {s.accept_length:.6f}, Accepted throughput: 1.00 tokens/s,"
            f" Drafted throughput: 2.00 tokens/s, Accepted: {sum(accepted)} tokens, Drafted: {4 * s.rounds} tokens,"
            f" Per-position acceptance rate: {pos}, Avg Draft acceptance rate: 10.0%"
        )
    r = parse_engine_log("\n".join(lines))
    assert r.accept_length == pytest.approx(all_stats.accept_length, abs=1e-5)
    for got, want in zip(r.alpha, all_stats.alpha + [math.nan] * 4, strict=False):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-4)


def test_request_prompt_lengths_are_read_where_the_engine_prints_them():
    # what tells --data's traffic from another workload: the mean prompt length of the served requests
    sglang = parse_engine_log(SGLANG + "[2025-06-01 10:00:08] Prefill batch. #new-seq: 2, #new-token: 30, "
                              "#cached-token: 13, token usage: 0.00, #running-req: 1, #queue-req: 0\n")  # fmt: skip
    assert (sglang.requests, sglang.prompt_tokens) == (3, 57 + 30 + 13)
    assert sglang.prompt_mean == pytest.approx(100 / 3)
    metrics = [
        {"name": "vllm:spec_decode_num_drafts", "labels": {}, "value": 40},
        {"name": "vllm:spec_decode_num_accepted_tokens", "labels": {}, "value": 30},
        {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "labels": {}, "values": [20, 10]},
        {"name": "vllm:request_prompt_tokens", "labels": {}, "count": 4, "sum": 410.0, "buckets": {"+Inf": 4}},
    ]
    v = parse_engine_log(json.dumps(metrics))
    assert v.prompt_mean == pytest.approx(102.5)
    # drafts behind each position: all 40 reach position 1, the 20 that accepted it reach position 2
    assert v.position_counts() == ([40, 20], [20, 10])
    assert parse_engine_log(VLLM).prompt_mean is None  # vLLM's log lines say nothing about requests


# Two responses' meta_info exactly as SGLang 0.5.23's Engine.generate returned them (tests/sglang's MLA draft, 3 draft
# tokens per round), trimmed of the non-spec keys; the second request accepted 1 draft once and 2 drafts once.
SGLANG_META = [
    {"meta_info": {"prompt_tokens": 9, "spec_accept_rate": 0.0, "spec_accept_length": 1.032258064516129,
                   "spec_num_correct_drafts": 0, "spec_num_proposed_drafts": 93, "spec_verify_ct": 31,
                   "spec_correct_drafts_histogram": [31]}},
    {"meta_info": {"prompt_tokens": 13, "spec_accept_rate": 0.03571428571428571,
                   "spec_accept_length": 1.1428571428571428, "spec_num_correct_drafts": 3,
                   "spec_num_proposed_drafts": 84, "spec_verify_ct": 28, "spec_correct_drafts_histogram": [26, 1, 1]}},
]  # fmt: skip


def test_sglang_meta_info_gives_exact_rounds_and_per_position_rates(tmp_path):
    path = tmp_path / "responses.json"
    path.write_text(json.dumps(SGLANG_META))
    got = read_engine_log(path)
    assert (got.engine, got.kind, got.drafts, got.lines) == ("sglang", "meta_info", 59.0, 2)
    assert got.accept_length == pytest.approx(1 + 3 / 59)  # 1·1 + 2·1 drafts accepted over 59 rounds
    # K = 93 / 31 = 3 positions, although the histograms stop at 2 accepted
    assert got.per_position == pytest.approx([2 / 59, 1 / 59, 0.0])
    assert got.alpha == pytest.approx([2 / 59, 0.5, 0.0])
    assert got.prompt_mean == pytest.approx(11.0)
    # SGLang's own spec_accept_length is not τ: it is the request's output tokens over its rounds, and so counts the
    # token the prefill produced, which no round drafted (31 rounds, 32 tokens: 1.032 with nothing accepted)
    for m in SGLANG_META:
        meta = m["meta_info"]
        tokens = meta["spec_verify_ct"] + sum(n * c for n, c in enumerate(meta["spec_correct_drafts_histogram"]))
        assert meta["spec_accept_length"] == pytest.approx((tokens + 1) / meta["spec_verify_ct"])
    # bare meta_info objects, and one response alone, read the same way
    bare = parse_engine_log(json.dumps([m["meta_info"] for m in SGLANG_META]))
    assert bare.per_position == pytest.approx(got.per_position)
    assert parse_engine_log(json.dumps(SGLANG_META[1])).drafts == 28.0


def test_sglang_meta_info_without_rounds_is_refused():
    meta = {"spec_verify_ct": 0, "spec_num_proposed_drafts": 0, "spec_correct_drafts_histogram": []}
    with pytest.raises(EagleScopeError, match="no verify rounds"):
        parse_engine_log(json.dumps([meta]))
