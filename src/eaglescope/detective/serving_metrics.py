"""Served acceptance from a running engine's Prometheus `/metrics` (docs/watch.md): one scrape → cumulative counts,
two scrapes → the counts served between them, as an `Acceptance` with its intervals.

vLLM v1 (vllm/v1/spec_decode/metrics.py, SpecDecodingProm; counters made at start, so present and 0 before traffic):
    vllm:spec_decode_num_drafts_total                       verify rounds (one draft of K tokens each)
    vllm:spec_decode_num_draft_tokens_total                 drafted tokens (K per round)
    vllm:spec_decode_num_accepted_tokens_total              accepted draft tokens
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="k"}  rounds that accepted position k (from 0)
  Position k is accepted only if k-1 was, so reached_k = accepted at k-1 (reached_1 = rounds) and the conditional
  α_k = accepted_k / accepted_{k-1}: exact counts, so each α_k has a binomial (Wilson) interval.
SGLang 0.5.23 (srt/observability/metrics_collector.py, with --enable-metrics):
    sglang:spec_verify_calls_total      counter: verify rounds of FINISHED requests (tokenizer_manager.py adds a
                                        request's spec_verify_ct when it finishes)
    sglang:generation_tokens_total      counter: output tokens of finished requests ({is_streaming} summed)
    sglang:num_requests_total           counter: finished requests
    sglang:spec_accept_length           gauge, WINDOWED: τ of the scheduler's last decode-log interval
    sglang:spec_accept_rate             gauge, windowed: accepted / proposed drafts of that interval
    sglang:spec_num_steps, sglang:spec_num_draft_tokens   gauges: the chain depth K (draft tokens = K + 1)
  A request's first output token comes from prefill, every other from a verify round, so over finished requests
  τ = (generation tokens − requests) / verify rounds (SGLang's own meta_info spec_accept_length is completion tokens
  / verify rounds, which counts the prefill token too). No per-position counts: τ only, with a Hoeffding interval
  (each round emits between 1 and K+1 tokens; rounds taken as independent). The gauges are shown, never summed:
  they describe the engine's last log interval, not the window. Labelled series appear only once set, so before the
  first finished request the counters are absent (their # HELP/# TYPE lines are there).
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace

from eaglescope.decode.stats import alpha_from_unconditional
from eaglescope.detective.acceptance import LEVEL, Acceptance, alpha_of
from eaglescope.detective.engine_logs import EngineAcceptance
from eaglescope.errors import EagleScopeError

VLLM, SGLANG = "vllm", "sglang"
VLLM_NAMES = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
}
SGLANG_NAMES = {
    "rounds": "sglang:spec_verify_calls_total",
    "generation": "sglang:generation_tokens_total",
    "requests": "sglang:num_requests_total",
    "accept_length": "sglang:spec_accept_length",
    "accept_rate": "sglang:spec_accept_rate",
    "steps": "sglang:spec_num_steps",
    "draft_tokens": "sglang:spec_num_draft_tokens",
}
# What a server of each engine always names, speculative or not: proof of which engine it is.
_ENGINE_MARK = {VLLM: "vllm:", SGLANG: "sglang:"}

_SAMPLE = re.compile(
    r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+([-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|NaN|Inf))(?:\s+-?\d+)?$"
)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class Exposition:
    """One scrape: every sample as (name, labels, value), and every metric name the text declares (# HELP/# TYPE
    lines, which prometheus_client writes even for a labelled metric with no series yet)."""

    samples: list[tuple[str, dict[str, str], float]]
    declared: set[str]

    def names(self) -> set[str]:
        return self.declared | {n for n, _, _ in self.samples}

    def total(self, name: str) -> float | None:
        """The sum over every series of `name` (engines, DP ranks, is_streaming); None when it has none."""
        values = [v for n, _, v in self.samples if n == name]
        return sum(values) if values else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, labels, v in self.samples:
            if n == name and label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out


def parse_exposition(text: str) -> Exposition:
    """Prometheus text exposition format 0.0.4 (and OpenMetrics' sample lines): unknown lines are skipped."""
    samples: list[tuple[str, dict[str, str], float]] = []
    declared: set[str] = set()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                declared.add(parts[2])
                if parts[1] == "TYPE" and len(parts) == 4 and parts[3].strip() == "counter":
                    declared.add(parts[2] + "_total")  # OpenMetrics declares a counter without its _total suffix
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group(2) or "")}
        samples.append((m.group(1), labels, float(m.group(3))))
    return Exposition(samples, declared)


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def detect_engine(expo: Exposition) -> str | None:
    names = expo.names()
    for engine, prefix in _ENGINE_MARK.items():
        if any(n.startswith(prefix) for n in names):
            return engine
    return None


@dataclass(frozen=True)
class Counts:
    """Cumulative speculative-decoding counts of one scrape (or the difference of two): `rounds` verify rounds,
    `accepted` accepted draft tokens, and (vLLM) `per_pos[k]` rounds that accepted position k+1. `depth` is K."""

    engine: str
    rounds: float
    accepted: float
    per_pos: tuple[float, ...] | None = None
    depth: int | None = None
    gauges: dict = field(default_factory=dict, compare=False)  # SGLang's windowed gauges, as scraped

    def minus(self, base: Counts) -> Counts:
        per_pos = None
        if self.per_pos is not None and base.per_pos is not None:
            n = max(len(self.per_pos), len(base.per_pos))
            mine = self.per_pos + (0.0,) * (n - len(self.per_pos))
            theirs = base.per_pos + (0.0,) * (n - len(base.per_pos))
            per_pos = tuple(a - b for a, b in zip(mine, theirs, strict=True))
        return replace(self, rounds=self.rounds - base.rounds, accepted=self.accepted - base.accepted,
                       per_pos=per_pos)  # fmt: skip

    def went_down(self, earlier: Counts) -> bool:
        """Whether any counter is below its earlier value: counters only grow, so the server restarted."""
        if self.rounds < earlier.rounds or self.accepted < earlier.accepted:
            return True
        if self.per_pos is not None and earlier.per_pos is not None:
            return any(a < b for a, b in zip(self.per_pos, earlier.per_pos, strict=False))
        return False

    @classmethod
    def zero(cls, like: Counts) -> Counts:
        per_pos = None if like.per_pos is None else (0.0,) * len(like.per_pos)
        return replace(like, rounds=0.0, accepted=0.0, per_pos=per_pos)

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.rounds if self.rounds > 0 else None

    def acceptance(self, source: str) -> Acceptance:
        """These counts as an Acceptance: vLLM's with per-position counts (Wilson intervals per α_k, doctor's τ
        interval), SGLang's with τ alone."""
        if self.per_pos is not None and self.rounds > 0:
            accepted = list(self.per_pos)
            reached = [self.rounds, *accepted[:-1]]
            return Acceptance(source, alpha_of(reached, accepted), self.tau, None, reached, accepted, None,
                              int(self.rounds))  # fmt: skip
        return Acceptance(source, [], self.tau, rounds=int(self.rounds))

    def tau_interval(self, level: float = LEVEL) -> tuple[float, float] | None:
        """SGLang's τ interval over the rounds (Hoeffding: each round emits 1..K+1 tokens; rounds independent)."""
        if self.rounds <= 0 or not self.depth or self.tau is None:
            return None
        half = self.depth * math.sqrt(math.log(2 / (1 - level)) / (2 * self.rounds))
        return max(1.0, self.tau - half), min(self.depth + 1.0, self.tau + half)


class MetricsRenamed(EagleScopeError):
    """The server is vLLM or SGLang but serves none of the speculative metrics this reader knows."""


def counts_of(expo: Exposition, version: str | None = None) -> Counts | None:
    """The speculative counts of one scrape; None while the engine has nothing to count yet (SGLang before its
    first finished request). Raises MetricsRenamed for a vLLM/SGLang server without the names this reader knows,
    and EagleScopeError for a server that is neither."""
    engine = detect_engine(expo)
    names = expo.names()
    said = f" {version}" if version else ""
    if engine == VLLM:
        if VLLM_NAMES["drafts"] not in names or VLLM_NAMES["accepted"] not in names:
            spec = sorted(n for n in names if "spec" in n)
            raise MetricsRenamed(
                f"vLLM{said} serves no {VLLM_NAMES['drafts']} / {VLLM_NAMES['accepted']} "
                + (f"(its speculative metrics: {', '.join(spec[:6])}): a version that renamed them, which this "
                   "reader does not know" if spec else "nor any other speculative metric: is speculative decoding on?")
            )  # fmt: skip
        drafts, accepted = expo.total(VLLM_NAMES["drafts"]), expo.total(VLLM_NAMES["accepted"])
        if drafts is None or accepted is None:
            return None
        pos = expo.by_label(VLLM_NAMES["per_pos"], "position")
        per_pos = tuple(pos.get(str(k), 0.0) for k in range(max(int(p) for p in pos) + 1)) if pos else None
        return Counts(VLLM, drafts, accepted, per_pos, len(per_pos) if per_pos else None)
    if engine == SGLANG:
        # Its counters exist only once a request finished (multiprocess prometheus writes no name before its first
        # sample; a restarted server's warm-up request may still be running): missing names are "nothing yet" until
        # requests have produced tokens past their prefill one, which only verify rounds make on a speculative server.
        generation, requests = expo.total(SGLANG_NAMES["generation"]), expo.total(SGLANG_NAMES["requests"]) or 0.0
        if SGLANG_NAMES["rounds"] not in names and (generation is None or generation <= requests):
            gauges = {k: expo.total(SGLANG_NAMES[k]) for k in ("accept_length", "accept_rate", "steps", "draft_tokens")}
            gauges = {k: v for k, v in gauges.items() if v is not None}
            return Counts(SGLANG, 0.0, 0.0, None, int(gauges["steps"]) if gauges.get("steps") else None, gauges)
        if SGLANG_NAMES["rounds"] not in names or SGLANG_NAMES["generation"] not in names:
            spec = sorted(n for n in names if "spec" in n)
            raise MetricsRenamed(
                f"SGLang{said} serves no {SGLANG_NAMES['rounds']} / {SGLANG_NAMES['generation']} "
                + (f"(its speculative metrics: {', '.join(spec[:6])}): a version that renamed them, which this "
                   "reader does not know" if spec else "nor any other speculative metric: is speculative decoding on?")
            )  # fmt: skip
        gauges = {k: expo.total(SGLANG_NAMES[k]) for k in ("accept_length", "accept_rate", "steps", "draft_tokens")}
        gauges = {k: v for k, v in gauges.items() if v is not None}
        depth = int(gauges["steps"]) if gauges.get("steps") else None
        rounds = expo.total(SGLANG_NAMES["rounds"])
        if rounds is None or generation is None:
            return Counts(SGLANG, 0.0, 0.0, None, depth, gauges)
        # tokens from verify rounds (every output token but each request's first), less one bonus token per round
        return Counts(SGLANG, rounds, max(0.0, generation - requests - rounds), None, depth, gauges)
    raise EagleScopeError("the metrics name neither vllm: nor sglang: series: is this a vLLM or SGLang /metrics "
                          "(SGLang needs --enable-metrics)?")  # fmt: skip


# -- over HTTP ---------------------------------------------------------------------------------------------------
class Unreachable(Exception):
    """The server did not answer (refused, timed out, an HTTP error): worth trying again."""


def _get(url: str, timeout: float) -> str:
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the user's own server
            return r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        raise Unreachable(f"HTTP {e.code} from {url}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"{url}: {reason}") from None


def metrics_url(url: str) -> str:
    """The /metrics address of a server given as http://HOST:PORT (or already ending in /metrics)."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise EagleScopeError(f"--metrics-url/--url {url!r} is not an http:// address")
    return url if url.endswith("/metrics") else url + "/metrics"


def server_version(url: str, engine: str, timeout: float = 5.0) -> str | None:
    """The engine's version as the server reports it (vLLM: GET /version; SGLang: GET /server_info), or None."""
    base = metrics_url(url).removesuffix("/metrics")
    for path in ("/version",) if engine == VLLM else ("/server_info", "/get_server_info"):
        try:
            obj = json.loads(_get(base + path, timeout))
        except (Unreachable, ValueError):
            continue
        if isinstance(obj, dict) and isinstance(obj.get("version"), str):
            return obj["version"]
    return None


def scrape(url: str, timeout: float = 5.0) -> Exposition:
    """One GET of the server's /metrics, parsed; Unreachable when it does not answer."""
    return parse_exposition(_get(metrics_url(url), timeout))


def read_metrics_url(url: str, timeout: float = 10.0) -> EngineAcceptance:
    """doctor --metrics-url: everything the server counted since it started, as the served acceptance (exact counts
    where a log has only rounded rates), with the mean prompt length of its requests for doctor's traffic check."""
    try:
        expo = scrape(url, timeout)
    except Unreachable as e:
        raise EagleScopeError(f"--metrics-url: no answer from {e}") from None
    engine = detect_engine(expo)
    version = server_version(url, engine, timeout) if engine else None
    counts = counts_of(expo, version)
    if counts is None or counts.rounds <= 0:
        raise EagleScopeError(f"--metrics-url: {engine or 'the server'} at {url} has counted no verify rounds yet: "
                              "read it after requests were served with speculative decoding")  # fmt: skip
    if counts.engine == VLLM:
        per_pos = [p / counts.rounds for p in counts.per_pos] if counts.per_pos else None
        alpha = alpha_from_unconditional(per_pos) if per_pos else None
        out = EngineAcceptance(VLLM, counts.tau, alpha, per_pos, 1, counts.rounds, kind="metrics")
        prompt_sum, prompt_count = (
            expo.total("vllm:request_prompt_tokens_sum"),
            expo.total("vllm:request_prompt_tokens_count"),
        )
    else:
        out = EngineAcceptance(SGLANG, counts.tau, None, None, 1, counts.rounds, kind="metrics")
        prompt_sum, prompt_count = expo.total("sglang:prompt_tokens_total"), expo.total(SGLANG_NAMES["requests"])
    if prompt_sum is not None and prompt_count:
        out.prompt_tokens, out.requests = prompt_sum, prompt_count
    return out
