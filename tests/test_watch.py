"""`eaglescope watch`'s reader and rules without an engine: the Prometheus text of vLLM 0.32 and SGLang 0.5.23 (metric
names and label layout as their sources write them: vllm/v1/spec_decode/metrics.py, sglang/srt/observability/
metrics_collector.py), the sliding window and its restart rule, the judgement, and the CLI against a local HTTP
server on 127.0.0.1 that serves scripted scrapes. The real engines: tests/vllm/test_vllm_watch.py and
tests/sglang/test_sglang_watch.py."""

from __future__ import annotations

import contextlib
import io
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglescope.cli import main
from eaglescope.detective.acceptance import Acceptance
from eaglescope.detective.serving_metrics import (
    Counts,
    MetricsRenamed,
    Unreachable,
    counts_of,
    parse_exposition,
)
from eaglescope.detective.watch import Expected, WatchSettings, Window, judge, run_watch
from eaglescope.errors import EagleScopeError

LABELS = 'engine="0",model_name="/tmp/target"'


def vllm_text(drafts: float, per_pos: list[float], engines: int = 1, extra: str = "") -> str:
    """What vLLM 0.32's /metrics says (prometheus_client's text: HELP, TYPE, the _total and _created samples)."""
    out = []
    for name, value in (("num_drafts", drafts), ("num_draft_tokens", drafts * len(per_pos)),
                        ("num_accepted_tokens", sum(per_pos))):  # fmt: skip
        out += [f"# HELP vllm:spec_decode_{name}_total x", f"# TYPE vllm:spec_decode_{name}_total counter"]
        for e in range(engines):
            lab = LABELS.replace('engine="0"', f'engine="{e}"')
            out += [f"vllm:spec_decode_{name}_total{{{lab}}} {value / engines}",
                    f"vllm:spec_decode_{name}_created{{{lab}}} 1.7e9"]  # fmt: skip
    out += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]  # fmt: skip
    for e in range(engines):
        for k, v in enumerate(per_pos):
            lab = LABELS.replace('engine="0"', f'engine="{e}"')
            out.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{k}"}} {v / engines}')
    out.append('vllm:num_requests_running{engine="0",model_name="m"} 0.0')
    return "\n".join(out) + "\n" + extra


def sglang_text(rounds: float | None, generation: float, requests: float, steps: int = 3,
                tau_gauge: float = 2.5) -> str:  # fmt: skip
    out = [
        "# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.",
        "# TYPE sglang:spec_verify_calls_total counter",
        "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
        "# TYPE sglang:generation_tokens_total counter",
        "# HELP sglang:num_requests_total Number of requests processed.",
        "# TYPE sglang:num_requests_total counter",
        "# HELP sglang:spec_accept_length Mean acceptance length of speculative decoding.",
        "# TYPE sglang:spec_accept_length gauge",
        'sglang:token_usage{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0"} 0.01',
    ]
    if rounds is not None:
        lab = 'model_name="m",engine_type="unified"'
        out += [
            f"sglang:spec_verify_calls_total{{{lab}}} {rounds}",
            f'sglang:generation_tokens_total{{{lab},is_streaming="false"}} {generation - 2}',
            f'sglang:generation_tokens_total{{{lab},is_streaming="true"}} 2.0',
            f'sglang:num_requests_total{{{lab},is_streaming="false"}} {requests}',
            f"sglang:spec_accept_length{{{lab}}} {tau_gauge}",
            f"sglang:spec_num_steps{{{lab}}} {steps}",
            f"sglang:spec_num_draft_tokens{{{lab}}} {steps + 1}",
        ]
    return "\n".join(out) + "\n"


# -- the parser ---------------------------------------------------------------------------------------------------
def test_exposition_reads_labels_escapes_special_values_and_declarations():
    expo = parse_exposition(
        '# HELP a_total doc with "quotes"\n# TYPE a_total counter\n'
        'a_total{x="1",path="C:\\\\dir",q="say \\"hi\\""} 3.5 1700000000000\n'
        "b NaN\nc +Inf\nd -2e-3\ngarbage line here\n"
    )
    assert ("a_total", {"x": "1", "path": "C:\\dir", "q": 'say "hi"'}, 3.5) in expo.samples
    assert math.isnan(expo.total("b")) and expo.total("c") == math.inf and expo.total("d") == -0.002
    assert "a_total" in expo.declared and expo.total("missing") is None


def test_vllm_counts_sum_engines_and_order_positions_numerically():
    per_pos = [90.0, 60.0, 30.0] + [1.0] * 8  # 11 positions: "10" must come after "9", not after "1"
    c = counts_of(parse_exposition(vllm_text(100.0, per_pos, engines=2)))
    assert c.engine == "vllm" and c.rounds == pytest.approx(100.0) and c.depth == 11
    assert c.per_pos == pytest.approx(tuple(per_pos))
    a = c.acceptance("w")
    # conditional α_k = accepted_k / accepted_{k-1}; α_1 = accepted_1 / rounds
    assert a.alpha[:3] == pytest.approx([0.9, 60 / 90, 0.5]) and a.reached[:3] == pytest.approx([100, 90, 60])
    assert c.tau == pytest.approx(1 + sum(per_pos) / 100)


def test_sglang_counts_take_tau_from_finished_requests_without_their_prefill_token():
    # 10 requests, 40 verify rounds, 130 output tokens: 120 from the rounds, τ = 3.0
    c = counts_of(parse_exposition(sglang_text(40.0, 130.0, 10.0)))
    assert c.engine == "sglang" and c.tau == pytest.approx(3.0) and c.depth == 3 and c.per_pos is None
    assert c.gauges["accept_length"] == 2.5  # shown, never used for the window
    lo, hi = c.tau_interval()
    assert 1.0 <= lo < 3.0 < hi <= 4.0
    # before the first finished request the labelled counters have no series: nothing to count yet, no refusal
    empty = counts_of(parse_exposition(sglang_text(None, 0, 0)))
    assert empty.rounds == 0 and empty.tau is None


def test_renamed_metrics_are_refused_in_one_line_naming_the_version():
    renamed = vllm_text(10.0, [5.0, 2.0]).replace("vllm:spec_decode_num_drafts", "vllm:spec_decode_drafts")
    with pytest.raises(MetricsRenamed, match=r"vLLM 9\.9\.0 serves no vllm:spec_decode_num_drafts_total .*renamed"):
        counts_of(parse_exposition(renamed), "9.9.0")
    with pytest.raises(MetricsRenamed, match="is speculative decoding on"):
        counts_of(parse_exposition('vllm:num_requests_running{engine="0"} 0\n'))
    # SGLang writes no counter name before its first sample (a restarted server mid warm-up): nothing yet, no refusal
    fresh = "\n".join(x for x in sglang_text(4.0, 20.0, 1.0).splitlines() if "_total" not in x)
    assert counts_of(parse_exposition(fresh), "0.5.23").rounds == 0
    sg = sglang_text(4.0, 20.0, 1.0).replace("sglang:spec_verify_calls", "sglang:spec_verify_ct")
    with pytest.raises(MetricsRenamed, match=r"SGLang 0\.6\.0 serves no sglang:spec_verify_calls_total"):
        counts_of(parse_exposition(sg), "0.6.0")
    with pytest.raises(EagleScopeError, match="neither vllm: nor sglang:"):
        counts_of(parse_exposition("node_cpu_seconds_total 5\n"))


# -- the window ---------------------------------------------------------------------------------------------------
def _vllm(rounds: float, pos: tuple[float, ...]) -> Counts:
    return Counts("vllm", rounds, sum(pos), pos, len(pos))


step = st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50), st.booleans())


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=30), size=st.integers(1, 6))
def test_window_is_the_sum_of_the_last_increments_and_a_restart_starts_it_from_zero(steps, size):
    """Whatever the traffic and restarts: the window holds exactly the counts served over its last `size` polls
    since the latest restart, and a restart (counters below the last scrape) is reported at that scrape only."""
    w = Window(size)
    total = (0, 0, 0)  # the server's cumulative counters: rounds, accepted at position 1, at position 2
    increments: list[tuple[int, int, int]] = []  # since the latest restart, one per scrape
    w.push(_vllm(0, (0, 0)))
    for r, a1, a2, restart in steps:
        a1, a2 = min(a1, r), min(a2, a1)  # position 2 is reached only through position 1
        if restart and total[0] > r:  # the new process counts from zero: lower than before, so detectable
            total, increments = (0, 0, 0), []
            expect_reset = True
        else:
            expect_reset = False
        total = (total[0] + r, total[1] + a1, total[2] + a2)
        increments.append((r, a1, a2))
        assert w.push(_vllm(total[0], (total[1], total[2]))) is expect_reset
        got = w.counts()
        last = increments[-size:]
        assert got.rounds == sum(x[0] for x in last)
        assert got.per_pos == (sum(x[1] for x in last), sum(x[2] for x in last))
        assert got.rounds >= 0 and all(p >= 0 for p in got.per_pos)


def test_window_needs_a_size():
    with pytest.raises(EagleScopeError):
        Window(0)


# -- the judgement ------------------------------------------------------------------------------------------------
EXPECTED = Expected.of(Acceptance.from_groups("rounds simulated on data", [([400, 320, 240], [320, 240, 160])]),
                       True, "rounds simulated on data.jsonl")  # fmt: skip


def test_a_window_like_the_expectation_is_in_band_and_a_collapsed_one_is_low():
    ok = judge(_vllm(200, (160, 118, 80)), EXPECTED, 40)
    assert ok.status == "ok" and ok.low_positions == []
    low = judge(_vllm(200, (40, 10, 2)), EXPECTED, 40)
    assert low.status == "low" and 1 in low.low_positions
    assert judge(_vllm(20, (2, 0, 0)), EXPECTED, 40).status == "thin"  # too few rounds: never an alert
    # only the later positions collapse: the served α_1 is as expected
    late = judge(_vllm(300, (240, 40, 5)), EXPECTED, 40)
    assert late.status == "low" and 1 not in late.low_positions and 2 in late.low_positions


def test_sglang_tau_alone_is_judged_with_its_hoeffding_interval():
    ok = judge(Counts("sglang", 300, 600, None, 3), EXPECTED, 40)
    low = judge(Counts("sglang", 300, 30, None, 3), EXPECTED, 40)
    assert ok.status == "ok" and low.status == "low" and low.served["positions"] is None


# -- the loop, with scripted scrapes ------------------------------------------------------------------------------
class Script:
    """Scrapes from a list (None = the server does not answer); a clock that only sleep moves."""

    def __init__(self, texts: list[str | None]) -> None:
        self.texts, self.i, self.now, self.sleeps = texts, 0, 0.0, []

    def fetch(self):
        t = self.texts[min(self.i, len(self.texts) - 1)]
        self.i += 1
        if t is None:
            raise Unreachable("connection refused")
        return parse_exposition(t)

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s

    def clock(self) -> float:
        return self.now


def run(texts, **kw):
    s = Script(texts)
    settings_ = WatchSettings("http://127.0.0.1:1", **({"interval": 1.0, "window": 2, "sustain": 2,
                                                          "min_rounds": 40} | kw))  # fmt: skip
    records = list(run_watch(settings_, lambda depth: EXPECTED, s.fetch, lambda code: f"doctor {code}", s.sleep,
                             s.clock))  # fmt: skip
    return records, s


def healthy(n: int) -> str:
    return vllm_text(100.0 * n, [80.0 * n, 59.0 * n, 40.0 * n])


def broken(n: int, base: int = 0) -> str:
    return vllm_text(100.0 * (n + base), [80.0 * base + 20.0 * n, 59.0 * base + 2.0 * n, 40.0 * base])


def test_sustained_low_windows_raise_the_alert_and_stop(caplog):
    records, _ = run([healthy(i) for i in range(4)] + [broken(i, 3) for i in range(1, 8)], max_polls=20)
    status = [r["status"] for r in records]
    assert status[0] == "waiting" and "ok" in status and status[-1] == "low"
    alert = records[-1]["alert"]
    assert alert["code"] == "SERVING_MISMATCH" and "α_1 already collapses" in alert["points_to"]
    assert alert["next"] == "doctor SERVING_MISMATCH" and records[-1]["low_streak"] == 2
    assert sum(1 for r in records if r.get("alert")) == 1  # stops at the first alert


def test_a_restart_starts_a_new_window_and_says_so_once(caplog):
    texts = [healthy(i) for i in range(5)] + [None, None] + [healthy(i) for i in range(1, 4)]
    with caplog.at_level("INFO", logger="eaglescope"):
        records, s = run(texts, max_polls=len(texts))
    assert [r["status"] for r in records[5:7]] == ["unreachable", "unreachable"]
    assert records[7]["reset"] is True and records[7]["window"]["rounds"] == 100  # from zero, not negative
    assert all(r["status"] == "ok" for r in records[8:])
    said = [m for m in caplog.messages if "does not answer" in m or "went down" in m or "answers again" in m]
    assert len(said) == 3  # gone (once for two failed polls), back, restarted
    assert s.sleeps[5:7] == [2.0, 4.0]  # back-off: the interval doubled per failed poll


def sglang_fresh() -> str:
    """A just-started SGLang 0.5.23's /metrics (as read after the restart in tests/sglang/test_sglang_watch.py): the
    counters only declared (# HELP/# TYPE: no series before a request finished), its gauges set to 0."""
    lab = 'model_name="m",engine_type="unified"'
    gauges = [f"sglang:{g}{{{lab}}} 0.0" for g in ("spec_accept_length", "spec_accept_rate", "spec_num_steps",
                                                   "spec_num_draft_tokens")]  # fmt: skip
    return sglang_text(None, 0, 0) + "\n".join(gauges) + "\n"


def test_an_sglang_restart_read_through_its_drain_is_one_reset_at_the_new_servers_first_scrape(caplog):
    """The sequence of SGLang's restart in tests/sglang/test_sglang_watch.py (its run of 2026-12-07 16:13, whose
    restart check failed): on SIGTERM SGLang drains ("Draining requests and shutting down...") and its HTTP server
    still answers /metrics with the old process's counts; then the port is gone; the new server names its counters in
    # HELP/# TYPE lines only, gauges at 0, until a request finishes. The drain's reads are no restart (the counts are
    the old ones, unchanged); the restart is said once, at the new server's first scrape, and its window counts from
    zero. (That run's check took the drain's read for the new server's: the test now looks after watch saw the port
    unanswered.)"""
    served = [sglang_text(40.0 * i, 130.0 * i, 10.0 * i) for i in range(1, 5)]
    drain = [served[-1]] * 2
    texts = served + drain + [None, None] + [sglang_fresh()] * 2 + [sglang_text(40.0, 130.0, 10.0)]
    with caplog.at_level("INFO", logger="eaglescope"):
        records, _ = run(texts, max_polls=len(texts), min_rounds=10)
    status = [r["status"] for r in records]
    assert status[6:8] == ["unreachable", "unreachable"]
    assert [(r["reset"], r["total_rounds"]) for r in records[4:6]] == [(False, 160.0), (False, 160.0)]
    first_new = records[8]
    assert first_new["reset"] is True and first_new["total_rounds"] == 0 and first_new["window"]["rounds"] == 0
    assert records[9]["reset"] is False and records[10]["window"]["rounds"] == 40  # from zero, not from 160
    assert records[10]["window"]["tau"] == pytest.approx(3.0)
    assert sum("went down" in m for m in caplog.messages) == 1


def test_a_server_that_never_answers_fails_after_give_up_after():
    with pytest.raises(EagleScopeError, match="has not answered for"):
        run([None], give_up_after=10.0, max_polls=100)


def test_max_polls_and_duration_end_the_run():
    assert len(run([healthy(i) for i in range(10)], max_polls=3)[0]) == 3
    assert len(run([healthy(i) for i in range(10)], duration=4.5)[0]) == 5  # polls at t = 0, 1, 2, 3, 4


# -- the CLI against a local HTTP server --------------------------------------------------------------------------
@contextlib.contextmanager
def metrics_server(texts: list[str]):
    """127.0.0.1, /metrics answers the next scripted text each time (the last one repeats); /version says 0.32.0."""
    served = {"i": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/version":
                body = json.dumps({"version": "0.32.0"}).encode()
            elif self.path == "/metrics":
                body = texts[min(served["i"], len(texts) - 1)].encode()
                served["i"] += 1
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def expect_file(tmp_path):
    p = tmp_path / "expect.json"
    p.write_text(json.dumps(EXPECTED.acceptance.to_dict()))
    return p


def test_cli_json_lines_and_exit_status(tmp_path, expect_file):
    draft = tmp_path / "draft"  # watch reads nothing of it with --expect
    fast = ["--interval", "0.05", "--window", "2", "--sustain", "2", "--min-rounds", "40", "--json"]
    with metrics_server([healthy(i) for i in range(6)]) as url:
        rc, out, err = cli(["watch", "--url", url, "--draft", str(draft), "--expect", str(expect_file), *fast,
                            "--max-polls", "5"])  # fmt: skip
    lines = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and len(lines) == 5 and lines[-1]["status"] == "ok", err
    assert lines[-1]["engine"] == "vllm" and lines[-1]["version"] == "0.32.0" and lines[-1]["format"] == 1
    with metrics_server([healthy(i) for i in range(3)] + [broken(i, 2) for i in range(1, 9)]) as url:
        rc, out, err = cli(["watch", "--url", url, "--draft", str(draft), "--expect", str(expect_file), *fast,
                            "--max-polls", "20", "--target", "T"])  # fmt: skip
    last = json.loads(out.splitlines()[-1])
    assert rc == 1 and last["alert"]["code"] == "SERVING_MISMATCH"
    assert "ALERT served τ" in err and f"eaglescope doctor --target T --draft {draft} --metrics-url {url}" in err


def test_cli_refuses_renamed_metrics_in_one_line(tmp_path, expect_file):
    renamed = healthy(1).replace("vllm:spec_decode_num_drafts", "vllm:spec_decode_drafts")
    with metrics_server([renamed]) as url:
        rc, out, err = cli(["watch", "--url", url, "--draft", str(tmp_path), "--expect", str(expect_file),
                            "--max-polls", "2", "--interval", "0.05"])  # fmt: skip
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "vLLM 0.32.0 serves no vllm:spec_decode_num_drafts_total" in err


def test_cli_table_is_plain_when_not_a_terminal(tmp_path, expect_file):
    with metrics_server([healthy(i) for i in range(4)]) as url:
        rc, out, _ = cli(["watch", "--url", url, "--draft", str(tmp_path), "--expect", str(expect_file),
                          "--max-polls", "3", "--interval", "0.05", "--min-rounds", "40"])  # fmt: skip
    assert rc == 0 and "\x1b[" not in out and "α_1" in out and "ok: in band" in out


def test_cli_without_an_expectation_says_what_to_pass(tmp_path):
    rc, _, err = cli(["watch", "--url", "http://127.0.0.1:9", "--draft", str(tmp_path)])
    assert rc == 2 and "pass --expect FILE or --target with --data" in err


def test_doctor_metrics_url_reads_the_servers_counts_since_its_start():
    from eaglescope.detective.acceptance_sources import from_engine
    from eaglescope.detective.serving_metrics import read_metrics_url

    prompt = 'vllm:request_prompt_tokens_sum{engine="0"} 120\nvllm:request_prompt_tokens_count{engine="0"} 10\n'
    with metrics_server([vllm_text(100.0, [80.0, 40.0, 10.0], extra=prompt)]) as url:
        e = read_metrics_url(url)
    assert (e.engine, e.kind, e.drafts, e.prompt_mean) == ("vllm", "metrics", 100.0, 12.0)
    a = from_engine(e)  # what doctor's behaviour rules read: exact counts per position
    assert a.reached == pytest.approx([100, 80, 40]) and a.accepted == pytest.approx([80, 40, 10])
    assert a.accept_length == pytest.approx(2.3)
    with metrics_server([sglang_text(40.0, 130.0, 10.0)]) as url:
        e = read_metrics_url(url)
    assert (e.engine, e.accept_length, e.drafts, e.alpha) == ("sglang", pytest.approx(3.0), 40.0, None)
    with metrics_server([vllm_text(0.0, [0.0, 0.0, 0.0])]) as url, pytest.raises(EagleScopeError, match="no verify"):
        read_metrics_url(url)
    with pytest.raises(EagleScopeError, match="--metrics-url: no answer"):
        read_metrics_url("http://127.0.0.1:9")


def test_sglang_waits_for_its_chain_depth_before_the_expectation_is_fixed():
    """SGLang's counters appear when a request finishes and its depth gauge when the scheduler logs a decode step:
    the expectation is asked for once, at the served depth, not at a guess."""
    no_gauge = sglang_text(None, 0, 0)
    asked: list = []

    def expected_for(depth):
        asked.append(depth)
        return EXPECTED

    s = Script([no_gauge, no_gauge, sglang_text(40.0, 130.0, 10.0), sglang_text(90.0, 300.0, 20.0)])
    cfg = WatchSettings("http://127.0.0.1:1", interval=1.0, window=2, sustain=2, min_rounds=10, max_polls=4)
    records = list(run_watch(cfg, expected_for, s.fetch, str, s.sleep, s.clock))
    assert [r["status"] for r in records[:2]] == ["waiting", "waiting"] and asked == [3]
    assert records[-1]["window"]["tau"] == pytest.approx(1 + (300 - 20 - 90) / 90, abs=1e-4)
    assert records[-1]["gauges"]["steps"] == 3
    # a server that never says it: --depth
    asked.clear()
    s = Script([sglang_text(None, 0, 0)] + [sglang_text(40.0 * i, 130.0 * i, 10.0 * i).replace(
        "sglang:spec_num_steps", "x_steps") for i in range(1, 4)])  # fmt: skip
    cfg.depth = 3
    list(run_watch(cfg, expected_for, s.fetch, str, s.sleep, s.clock))
    assert asked == [3]


def test_with_keep_watching_the_alert_lasts_while_low_and_is_raised_once_per_episode():
    records, _ = run([healthy(i) for i in range(4)] + [broken(i, 3) for i in range(1, 8)], max_polls=11,
                     keep_watching=True)  # fmt: skip
    alerts = [r["alert"] for r in records if r.get("alert")]
    assert len(alerts) >= 3 and [a["raised"] for a in alerts].count(True) == 1 and alerts[0]["raised"]


def test_doctor_takes_one_served_source(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(vllm_text(10.0, [5.0, 2.0, 1.0]))
    rc, out, err = cli(["doctor", "--target", str(tmp_path), "--draft", str(tmp_path), "--engine-log", str(log),
                        "--metrics-url", "http://127.0.0.1:9"])  # fmt: skip
    assert rc == 2 and out == "" and "--engine-log and --metrics-url both say what was served" in err


# -- the served files, checked once the engine is known ----------------------------------------------------------
def test_a_lost_norm_before_fc_is_named_from_the_served_files_before_any_window(tmp_path, expect_file):
    """The SGLang 32226 incident: a 3.1 draft (norm_before_fc) served with the flag gone from its config but
    input_norm.weight kept, which engines then skip. Acceptance need not show it (the expectation read from the same
    files lacks the norm too); doctor's static check names it. watch says it at the first scrape: in the JSON line
    ("static"), on stderr, in the table, and in the exit status; a clean draft gets "static": [] and exit 0."""
    from drafts import make_draft
    from models import make_checkpoint

    from eaglescope.models.draft import save_draft

    t = make_checkpoint("llama", tmp_path / "t")
    model, contract = make_draft(t, draft_vocab_size=48, norm_before_fc=True)
    clean = save_draft(model, contract, tmp_path / "clean")
    lost = save_draft(model, contract, tmp_path / "lost")
    cfg = json.loads((lost / "config.json").read_text())
    cfg["eagle_config"].pop("norm_before_fc")
    cfg.pop("norm_before_fc")
    (lost / "config.json").write_text(json.dumps(cfg))
    fast = ["--interval", "0.05", "--window", "2", "--min-rounds", "40", "--max-polls", "3",
            "--expect", str(expect_file)]  # fmt: skip
    for draft, target in ((lost, t), (lost, None), (clean, t)):
        with metrics_server([healthy(i) for i in range(4)]) as url:
            rc, out, err = cli(["watch", "--url", url, "--draft", str(draft), *fast, "--json"]
                               + (["--target", str(target)] if target else []))  # fmt: skip
        lines = [json.loads(x) for x in out.splitlines()]
        assert [("static" in r) for r in lines] == [True, False, False], err  # once, when the engine is known
        static = lines[0]["static"]
        if draft == clean:
            assert static == [] and rc == 0 and "FINDING" not in err
            continue
        assert [(f["code"], f["evidence"]["flag"]) for f in static] == [("EAGLE31_IGNORED", "norm_before_fc")]
        assert rc == 1 and all(r["status"] != "low" and not r.get("alert") for r in lines)  # acceptance in band
        assert err.count("FINDING EAGLE31_IGNORED") == 1 and "input_norm.weight" in err
    with metrics_server([healthy(i) for i in range(4)]) as url:
        rc, out, _ = cli(["watch", "--url", url, "--draft", str(lost), *fast, "--target", str(t)])
    assert rc == 1 and out.count("FINDING EAGLE31_IGNORED") == 3  # on every table, while the run lasts
