"""Served acceptance from an SGLang or vLLM server log (docs/field.md §5).

SGLang (0.5.23: managers/scheduler_components/metrics_reporter.py report_decode_stats, every
decode_log_interval decode steps, default 40):
    [2026-11-20 10:00:00 TP0] Decode batch, #running-req: 2, #token: 812, token usage: 0.01, accept len: 3.12,
    accept rate: 0.53, cuda graph: True, gen throughput (token/s): 96.55, #queue-req: 0
  "accept len" is τ (bonus included) over the interval: generated tokens / the batch sizes of its decode steps
  summed (update_spec_metrics), so a line of a larger batch stands for more rounds. The line prints no round count,
  only #running-req (the batch at the printing step): lines are weighted by it, the nearest printed proxy. "accept
  rate" is correct drafts / drafted tokens; optional "cap len" and "block accept len" (ragged verify) follow it and
  are not τ. Older builds print "Decode batch." and spell τ "#accept length" or "accept_length". No per-position
  numbers.
vLLM v1 (vllm/v1/spec_decode/metrics.py, every log interval):
    SpecDecoding metrics: Mean acceptance length: 1.13, Accepted throughput: 9.10 tokens/s, Drafted
    throughput: 240.50 tokens/s, Accepted: 91 tokens, Drafted: 2405 tokens, Per-position acceptance rate:
    0.112, 0.013, 0.001, 0.000, 0.000, Avg Draft acceptance rate: 3.8%
  The per-position rate is UNCONDITIONAL (rounds accepting position k / rounds): α_k = a_k / a_{k-1}.
  Lines are weighted by their number of drafts (Drafted tokens / positions) before that conversion.
vLLM v0 ("Speculative metrics: Draft acceptance rate: ..., Number of speculative tokens: k, Number of
  accepted tokens: A, Number of draft tokens: D, Number of emitted tokens: E"): τ = E / (D / k).
vLLM's counters, exact and cumulative (vllm/v1/spec_decode/metrics.py SpecDecodingProm), in either form:
  Prometheus text (a server's /metrics, or prometheus_client.generate_latest() after LLM.generate):
    vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 28.0
    vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 36.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 17.0
  JSON of LLM.get_metrics(): json.dump([dataclasses.asdict(m) for m in llm.get_metrics()], f), i.e.
    [{"name": "vllm:spec_decode_num_drafts", "labels": {...}, "value": 28},
     {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "labels": {...}, "values": [17, 14, 5]}, ...]
  τ = 1 + accepted / drafts; per-position rate_k = accepted_per_pos[k] / drafts (unconditional, as above). Series
  of several engines (data parallel) are summed; in Prometheus text a series given twice keeps its last value
  (several scrapes in one file: the latest counts).

SGLang's per-request counts (srt/managers/tokenizer_manager.py, 0.5.23), exact: the `meta_info` of each response
(`Engine.generate`'s return value, or the HTTP /generate response's "meta_info"), saved as JSON (one response, a list
of them, or a list of their meta_info objects):
    {"spec_verify_ct": 15, "spec_num_proposed_drafts": 45, "spec_correct_drafts_histogram": [6, 4, 3, 2], ...}
  spec_verify_ct is the request's verify rounds, spec_num_proposed_drafts its drafted tokens (K per round), and
  histogram[n] the rounds that accepted exactly n drafts (the list may stop at the largest n seen). Summed over the
  requests: τ = 1 + Σ n·hist[n] / rounds, and the unconditional per-position rate_k = Σ_{n≥k} hist[n] / rounds.

Counts. Where the engine says how many drafts stand behind its rates (vLLM), position k's conditional α_k rests on
the drafts that accepted k-1 positions (drafts × rate_{k-1}): `position_counts` gives them, so a position reached by
a handful of rounds carries a handful's weight. SGLang prints no round counts, only τ.

Traffic. What the log says about the requests themselves, to tell whether --data is the served traffic: the mean
prompt length, from vLLM's request_prompt_tokens histogram (sum / count; Prometheus text or get_metrics() JSON)
and from SGLang's prefill lines ("Prefill batch. #new-seq: n, #new-token: t, #cached-token: c": t + c prompt
tokens for n new requests; a prompt prefilled in chunks counts once per chunk, so long prompts read shorter).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from eaglescope.decode.stats import alpha_from_unconditional
from eaglescope.errors import EagleScopeError

_NUM = r"([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|nan)"
# "block accept len" (SGLang's ragged verify) is another quantity: never τ.
_SGLANG = re.compile(r"(?<!block )(?:#\s*)?accept(?:[ _]len(?:gth)?|ance[ _]length)\s*[:=]\s*" + _NUM, re.IGNORECASE)
_SGLANG_RUNNING = re.compile(r"#running-req:\s*([0-9]+)")
_SGLANG_PREFILL = re.compile(
    r"Prefill batch.*?#new-seq:\s*([0-9]+),\s*#new-token:\s*([0-9]+)(?:,\s*#cached-token:\s*([0-9]+))?"
)
_VLLM_TAU = re.compile(r"Mean acceptance length:\s*" + _NUM)
_VLLM_DRAFTED = re.compile(r"Drafted:\s*([0-9]+)\s*tokens")
_VLLM_ACCEPTED = re.compile(r"Accepted:\s*([0-9]+)\s*tokens")
_VLLM_POS = re.compile(r"Per-position acceptance rate:\s*((?:[0-9.]+(?:,\s*)?)+)")
_PROM = re.compile(
    r"^(vllm:(?:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)(?:_total)?"
    r"|request_prompt_tokens_(?:sum|count)))"
    r"(?:\{([^}]*)\})?\s+(" + _NUM + r"|NaN|[+-]Inf)\s*(?:[0-9]+)?$"
)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_VLLM0 = re.compile(
    r"Number of speculative tokens:\s*([0-9]+).*?Number of draft tokens:\s*([0-9]+).*?"
    r"Number of emitted tokens:\s*([0-9]+)"
)


@dataclass
class EngineAcceptance:
    engine: str  # "sglang" | "vllm"
    accept_length: float  # τ, bonus included
    alpha: list[float] | None  # conditional α_1.. (vLLM, and SGLang's meta_info)
    per_position: list[float] | None  # unconditional, as the engine logs it (vLLM, and SGLang's meta_info)
    lines: int  # metric lines used
    drafts: float | None  # verify rounds behind the numbers, when the log says
    kind: str = "log"  # "log" (periodic lines), "metrics" (vLLM's counters: Prometheus text or get_metrics JSON) or
    # "meta_info" (SGLang's per-request counts)
    prompt_tokens: float | None = None  # prompt tokens of the requests the log saw, when it says
    requests: float | None = None  # how many requests those were

    @property
    def source(self) -> str:
        return f"{self.engine} {self.kind}"

    @property
    def prompt_mean(self) -> float | None:
        return self.prompt_tokens / self.requests if self.prompt_tokens is not None and self.requests else None

    def position_counts(self) -> tuple[list[float], list[float]] | None:
        """(reached, accepted) per position: drafts that reached position k (all drafts for k = 1, those that
        accepted k-1 after) and those that accepted k. None unless the engine gave drafts and per-position rates."""
        if not self.drafts or not self.per_position:
            return None
        accepted = [r * self.drafts for r in self.per_position]
        return [self.drafts, *accepted[:-1]], accepted

    def to_dict(self) -> dict:
        def clean(xs):
            return None if xs is None else [None if math.isnan(x) else x for x in xs]

        return {
            "source": self.source,
            "engine": self.engine,
            "accept_length": self.accept_length,
            "alpha": clean(self.alpha),
            "per_position": clean(self.per_position),
            "lines": self.lines,
            "drafts": self.drafts,
            "prompt_tokens": self.prompt_tokens,
            "requests": self.requests,
        }


def _vllm_line(line: str) -> tuple[float, list[float] | None, float | None] | None:
    m = _VLLM_TAU.search(line)
    if m:
        tau = float(m.group(1))
        pos = None
        if p := _VLLM_POS.search(line):
            pos = [float(x) for x in p.group(1).replace(" ", "").strip(",").split(",") if x]
        drafts = None
        d = _VLLM_DRAFTED.search(line)
        if d and pos:
            drafts = int(d.group(1)) / len(pos)  # every draft proposes len(pos) tokens
        elif d and (a := _VLLM_ACCEPTED.search(line)) and tau > 1:
            drafts = int(a.group(1)) / (tau - 1)
        return tau, pos, drafts
    m = _VLLM0.search(line)
    if m:
        k, drafted, emitted = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if k and drafted:
            drafts = drafted / k
            return emitted / drafts, None, drafts
    return None


def parse_engine_log(text: str) -> EngineAcceptance:
    """Served τ (and α_k where the engine logs per-position rates) from a log's text, or from vLLM's metrics
    (Prometheus text or get_metrics() JSON; exact counters, preferred when a file holds both)."""
    metrics = _sglang_meta_info(text) or _vllm_metrics(text)
    if metrics is not None:
        return metrics
    sg: list[tuple[float, int | None]] = []
    vl: list[tuple[float, list[float] | None, float | None]] = []
    requests = prompt_tokens = 0
    for line in text.splitlines():
        if (p := _SGLANG_PREFILL.search(line)) is not None:
            requests += int(p.group(1))
            prompt_tokens += int(p.group(2)) + int(p.group(3) or 0)
            continue
        if (v := _vllm_line(line)) is not None:
            if not math.isnan(v[0]) and not (v[2] == 0):  # an interval with no drafts says nothing
                vl.append(v)
            continue
        if (s := _sglang_line(line)) is not None:
            sg.append(s)
    if not sg and not vl:
        raise EagleScopeError(
            "the engine log has no acceptance lines (SGLang 'Decode batch. ... accept len: X' or vLLM "
            "'SpecDecoding metrics: Mean acceptance length: X'); was speculative decoding on and logging enabled?"
        )
    if len(vl) >= len(sg):
        return _merge_vllm(vl)
    out = _merge_sglang(sg)
    if requests:
        out.prompt_tokens, out.requests = float(prompt_tokens), float(requests)
    return out


def _sglang_line(line: str) -> tuple[float, int | None] | None:
    """(τ, #running-req or None) of an SGLang decode line; None for any other line."""
    if "Decode batch" not in line and "accept" not in line.lower():
        return None
    m = _SGLANG.search(line)
    if m is None or math.isnan(float(m.group(1))):
        return None
    r = _SGLANG_RUNNING.search(line)
    return float(m.group(1)), int(r.group(1)) if r else None


def _merge_sglang(sg: list[tuple[float, int | None]]) -> EngineAcceptance:
    # Weighted by #running-req where every line prints one (see the module docstring); otherwise unweighted.
    weights = [float(r) if r else 0.0 for _, r in sg]
    if not all(weights):
        weights = [1.0] * len(sg)
    tau = sum(t * w for (t, _), w in zip(sg, weights, strict=True)) / sum(weights)
    return EngineAcceptance("sglang", tau, None, None, len(sg), None)


def _merge_vllm(vl: list[tuple[float, list[float] | None, float | None]]) -> EngineAcceptance:
    # Weighted by drafts where every line says how many; otherwise each interval counts once.
    weights = [d for _, _, d in vl]
    if any(w is None for w in weights):
        weights = [1.0] * len(vl)
    total = sum(weights)
    tau = sum(t * w for (t, _, _), w in zip(vl, weights, strict=True)) / total
    with_pos = [(p, w) for (_, p, _), w in zip(vl, weights, strict=True) if p]
    per_pos = alpha = None
    if with_pos:
        K = max(len(p) for p, _ in with_pos)
        per_pos = []
        for k in range(K):
            num = sum(p[k] * w for p, w in with_pos if len(p) > k)
            den = sum(w for p, w in with_pos if len(p) > k)
            per_pos.append(num / den if den else math.nan)
        alpha = alpha_from_unconditional(per_pos)
    drafts = None if any(d is None for _, _, d in vl) else total
    return EngineAcceptance("vllm", tau, alpha, per_pos, len(vl), drafts)


# -- vLLM's counters -------------------------------------------------------------------------------------------
_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _sglang_meta_info(text: str) -> EngineAcceptance | None:
    """SGLang's per-request spec counts from saved responses (JSON); None when the text holds none."""
    stripped = text.lstrip()
    if stripped[:1] not in ("[", "{"):
        return None
    try:
        obj = json.loads(stripped)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    metas = [m.get("meta_info", m) for m in items if isinstance(m, dict)]
    metas = [m for m in metas if isinstance(m, dict) and "spec_correct_drafts_histogram" in m]
    if not metas:
        return None
    rounds = sum(int(m.get("spec_verify_ct", 0)) for m in metas)
    if rounds <= 0:
        raise EagleScopeError("SGLang's meta_info counts no verify rounds (spec_verify_ct is 0): were the requests "
                              "served with speculative decoding?")  # fmt: skip
    proposed = sum(int(m.get("spec_num_proposed_drafts", 0)) for m in metas)
    k = max([proposed // rounds] + [len(m["spec_correct_drafts_histogram"]) - 1 for m in metas])
    hist = [0.0] * (k + 1)
    for m in metas:
        for n, c in enumerate(m["spec_correct_drafts_histogram"]):
            hist[n] += float(c)
    per_pos = [sum(hist[n:]) / rounds for n in range(1, k + 1)]
    accepted = sum(n * c for n, c in enumerate(hist))
    alpha = alpha_from_unconditional(per_pos) if per_pos else None
    out = EngineAcceptance("sglang", 1.0 + accepted / rounds, alpha, per_pos or None, len(metas), float(rounds),
                           kind="meta_info")  # fmt: skip
    if all(isinstance(m.get("prompt_tokens"), int) for m in metas):
        out.prompt_tokens, out.requests = float(sum(m["prompt_tokens"] for m in metas)), float(len(metas))
    return out


def _vllm_metrics(text: str) -> EngineAcceptance | None:
    """vLLM's spec-decode counters from Prometheus text or get_metrics() JSON; None when the text holds neither."""
    stripped = text.lstrip()
    if stripped[:1] in ("[", "{"):
        try:
            obj = json.loads(stripped)
        except ValueError:
            obj = None
        if obj is not None:
            return _from_metrics_json(obj)
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    series: dict[tuple, float] = {}
    for line in text.splitlines():
        m = _PROM.match(line.strip())
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        series[(m.group(1), tuple(sorted(labels.items())))] = float(m.group(3))  # a later scrape replaces
    if not series:
        return None
    for (name, labels), value in series.items():
        short = name.removeprefix("vllm:spec_decode_").removeprefix("vllm:").removesuffix("_total")
        if short == "num_accepted_tokens_per_pos":
            pos = dict(labels).get("position")
            if pos is not None and pos.isdigit():
                per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + value
        else:
            totals[short] = totals.get(short, 0.0) + value
    counts = [per_pos.get(k, 0.0) for k in range(max(per_pos) + 1)] if per_pos else []
    out = _from_counters(totals, counts, "Prometheus text")
    if "request_prompt_tokens_count" in totals:
        out.prompt_tokens, out.requests = totals.get("request_prompt_tokens_sum"), totals["request_prompt_tokens_count"]
    return out


def _from_metrics_json(obj) -> EngineAcceptance | None:
    items = obj.get("metrics") if isinstance(obj, dict) else obj
    if not isinstance(items, list):
        return None
    totals: dict[str, float] = {}
    counts: list[float] = []
    found = False
    for m in items:
        if not isinstance(m, dict) or not str(m.get("name", "")).startswith("vllm:spec_decode_"):
            continue
        found = True
        short = str(m["name"]).removeprefix("vllm:spec_decode_")
        if short == "num_accepted_tokens_per_pos" and isinstance(m.get("values"), list):
            vals = [float(v) for v in m["values"]]
            counts = [(counts[k] if k < len(counts) else 0.0) + (vals[k] if k < len(vals) else 0.0)
                      for k in range(max(len(counts), len(vals)))]  # fmt: skip
        elif short in _COUNTERS and isinstance(m.get("value"), (int, float)):
            totals[short] = totals.get(short, 0.0) + float(m["value"])
    for m in items:  # vLLM's Histogram dataclass: count and sum of the requests' prompt lengths
        if isinstance(m, dict) and m.get("name") == "vllm:request_prompt_tokens":
            if isinstance(m.get("count"), (int, float)) and isinstance(m.get("sum"), (int, float)):
                totals["request_prompt_tokens_count"] = totals.get("request_prompt_tokens_count", 0.0) + m["count"]
                totals["request_prompt_tokens_sum"] = totals.get("request_prompt_tokens_sum", 0.0) + m["sum"]
    if not found:
        return None
    out = _from_counters(totals, counts, "get_metrics() JSON")
    if "request_prompt_tokens_count" in totals:
        out.prompt_tokens, out.requests = totals["request_prompt_tokens_sum"], totals["request_prompt_tokens_count"]
    return out


def _from_counters(totals: dict[str, float], counts: list[float], form: str) -> EngineAcceptance:
    drafts, accepted = totals.get("num_drafts"), totals.get("num_accepted_tokens")
    if drafts is None or accepted is None:
        raise EagleScopeError(
            f"vLLM's metrics ({form}) lack vllm:spec_decode_num_drafts or vllm:spec_decode_num_accepted_tokens: "
            "were they read from an engine serving with speculative decoding?"
        )
    if not drafts > 0:
        raise EagleScopeError(
            f"vLLM's metrics ({form}) count no speculative drafts yet (vllm:spec_decode_num_drafts is 0): read them "
            "after requests were served with speculative decoding"
        )
    per_pos = [c / drafts for c in counts] if counts else None
    alpha = alpha_from_unconditional(per_pos) if per_pos else None
    return EngineAcceptance("vllm", 1.0 + accepted / drafts, alpha, per_pos, 1, drafts, kind="metrics")


def read_engine_log(path: Path | str) -> EngineAcceptance:
    path = Path(path)
    if not path.is_file():
        raise EagleScopeError(f"engine log {str(path)!r} does not exist")
    return parse_engine_log(path.read_text(encoding="utf-8", errors="replace"))
