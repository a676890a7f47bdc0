"""`eaglescope watch` on a real SGLang 0.5.23 server (`python -m sglang.launch_server --enable-metrics` on this CPU,
through sglang_server.py; EAGLE-3 chain of K = 3, float32, 127.0.0.1): one watch across two served configs on one port —
  healthy                 the draft as exported for SGLang (`export --to sglang`: for a Llama target SGLang adds 1 to
                          every id, so the export writes [0, 3, 5] for taps [1, 4, 6]): every judged window in band;
  ids_in_vllm_convention  (restart) the export for vLLM (ids [1, 4, 6], as vLLM reads them) served by SGLang, which
                          captures [2, 5, 7]: every tap one layer late.
SGLang's metrics give τ only (no per-position counts), judged with a Hoeffding interval; its counters move when a
request finishes, and appear only after the first one (before that watch waits). The restart is survived (SGLang
drains on SIGTERM and answers /metrics meanwhile with the old counts: no restart until the port went quiet) and the
fault flagged within FLAG_WITHIN requests; `doctor --metrics-url` on the faulty server names SERVING_MISMATCH.
A second watch on a second server: tests/vllm/test_vllm_watch.py's norm_before_fc case, exported for SGLang.

SGLang's own Python (HTTP server, tokenizer manager, scheduler, EAGLE worker, metrics) runs; its CPU kernels are this
project's plain-torch stand-ins (tests/sglang/stand_ins). Target, data and draft as in tests/vllm/test_vllm_watch.py
(teacher-forced τ ≈ 3.7 on the data; the same draft reading [2, 5, 7] ≈ 2.4). Run under
`flock /tmp/eaglescope-engine.lock`; servers started and killed here, every request bounded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sglang_support import HERE, sglang_env

sys.path.insert(0, str(HERE.parent / "vllm"))  # tests/vllm's target, data and helpers are reused as they are
sys.path.insert(0, str(HERE.parent))
from engine_servers import (
    HOST,
    Server,
    assert_named_before_any_request,
    assert_restart_survived,
    first_alert_within,
    phase_lines,
    watch_through_restarts,
)  # noqa: E402
from test_vllm_serving import MAX_LEN, base, cli, order2_chain  # noqa: E402
from test_vllm_watch import NORM_FLAG_WITHIN, NORM_REQUESTS, TRAIN_FLAGS, norm_before_fc_dropped  # noqa: E402

K = 3
MAX_NEW = 64  # ~17 rounds a request at τ ≈ 3.7: a window of a few requests holds --min-rounds
START_TIMEOUT_S = 300
HEALTHY_REQUESTS = 10
FLAG_WITHIN = 8
SERVER = HERE / "sglang_server.py"
WATCH_FLAGS = ["--depth", str(K), "--interval", "1", "--window", "6", "--sustain", "2", "--min-rounds", "30",
               "--json", "--keep-watching", "--duration", "900"]  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    b = base(tmp_path_factory)
    root = tmp_path_factory.mktemp("sglang-watch")
    trained = root / "train-d146"
    common = ["--ttt-length", str(K), "--batch-size", "8", "--lr", "2e-3", "--eval-fraction", "0.25",
              "--max-length", "64", "--device", "cpu", "--dtype", "float32", *TRAIN_FLAGS]  # fmt: skip
    rc, _, err = cli(["train", "--target", str(b["target"]), "--data", str(b["prep"]), "--out", str(trained), *common])
    assert rc == 0, err
    exports = {}
    for engine in ("sglang", "vllm"):
        exports[engine] = root / f"{engine}-d146"
        rc, _, err = cli(["export", "--draft", str(trained), "--to", engine, "--out", str(exports[engine]),
                          "--target", str(b["target"])])  # fmt: skip
        assert rc == 0, err
    rng = b["rng"]
    prompts = [b["tok"](order2_chain(rng, b["perm"], rng.randint(8, 16)))["input_ids"] for _ in range(40)]
    return {"target": b["target"], "prep": b["prep"], "trained": trained, "root": root, "prompts": prompts,
            "phases": [("healthy", exports["sglang"], HEALTHY_REQUESTS),
                       ("ids_in_vllm_convention", exports["vllm"], FLAG_WITHIN)]}  # fmt: skip


def sglang_server(sglang_python: str, target: Path, draft: Path, port: int, log: Path) -> Server:
    argv = [sglang_python, str(SERVER), "--model-path", str(target), "--host", HOST, "--port", str(port),
            "--device", "cpu", "--attention-backend", "intel_amx", "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(draft), "--speculative-num-steps", str(K),
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(K + 1),
            "--disable-overlap-schedule", "--disable-radix-cache", "--dtype", "float32",
            "--mem-fraction-static", "0.5", "--max-total-tokens", "8192", "--context-length", str(MAX_LEN),
            "--skip-tokenizer-init", "--enable-metrics", "--random-seed", "0",
            "--decode-log-interval", "1"]  # fmt: skip
    return Server(argv, sglang_env(), log, port)


@pytest.fixture(scope="module")
def run(built, sglang_python) -> dict:
    root, target = built["root"], built["target"]
    sent = {"n": 0}

    def send_one(server: Server) -> None:
        p = built["prompts"][sent["n"] % len(built["prompts"])]
        sent["n"] += 1
        server.post("/generate", {"input_ids": p, "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW,
                                                                      "ignore_eos": True}}, timeout_s=120)  # fmt: skip

    # --draft: the directory the healthy server serves (watch checks its files statically, its layer ids by SGLang's
    # rule; its expectation is the trained draft's, the same weights)
    watch = [sys.executable, "-m", "eaglescope", "watch", "--draft", str(built["phases"][0][1]), "--target",
             str(target), "--data", str(built["prep"]), *WATCH_FLAGS]  # fmt: skip

    def make_server(name: str, draft: Path, port: int) -> Server:
        return sglang_server(sglang_python, target, draft, port, root / f"sglang-{name}.log")

    def doctor(server: Server) -> tuple[int, str, str]:
        return cli(["doctor", "--target", str(target), "--draft", str(built["trained"]), "--metrics-url", server.url,
                    "--data", str(built["prep"]), "--json", "--device", "cpu", "--dtype", "float32"])  # fmt: skip

    result = watch_through_restarts(make_server, built["phases"], send_one, watch, root, START_TIMEOUT_S,
                                    at_end=doctor)  # fmt: skip
    sys.stderr.write(f"SGLang server starts: {[round(s, 1) for s in result['start_s']]} s\n")
    return result


@pytest.fixture(scope="module")
def norm_run(built, sglang_python) -> dict:
    """The norm_before_fc case (tests/vllm/test_vllm_watch.py's, exported for SGLang): watch --draft on the served
    directory (flag lost), --expect the trained draft's expectation, across NORM_REQUESTS requests."""
    root = built["root"] / "norm"
    root.mkdir()
    case = norm_before_fc_dropped(built["target"], built["prep"], root, "sglang")
    sent = {"n": 0}

    def send_one(server: Server) -> None:
        p = built["prompts"][sent["n"] % len(built["prompts"])]
        sent["n"] += 1
        server.post("/generate", {"input_ids": p, "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW,
                                                                      "ignore_eos": True}}, timeout_s=120)  # fmt: skip

    watch = [sys.executable, "-m", "eaglescope", "watch", "--draft", str(case["served"]), "--target",
             str(case["target"]), "--expect", str(case["expect"]), *WATCH_FLAGS]  # fmt: skip

    def make_server(name: str, draft: Path, port: int) -> Server:
        return sglang_server(sglang_python, case["target"], draft, port, root / f"sglang-{name}.log")

    phases = [("norm_before_fc_dropped", case["served"], NORM_REQUESTS)]
    return watch_through_restarts(make_server, phases, send_one, watch, root, START_TIMEOUT_S) | {"case": case}


def test_a_healthy_draft_stays_in_band(run):
    lines = phase_lines(run, "healthy")
    judged = [r for r in lines if r["status"] in ("ok", "low")]
    # the served directory's files, checked once the engine is known: nothing to say
    assert next(r for r in run["lines"] if "static" in r)["static"] == [] and "FINDING" not in run["stderr"]
    assert len(judged) >= 3, [(r["status"], (r.get("window") or {}).get("tau")) for r in lines]
    assert all(r["status"] == "ok" for r in judged) and not any(r.get("alert") for r in lines)
    r = judged[-1]
    assert r["engine"] == "sglang" and r["version"].startswith("0.5.23") and r["window"]["positions"] is None
    # SGLang's windowed gauges are shown as scraped (its depth gauge too; --depth stands in where it is absent)
    assert r["gauges"].get("steps", K) == K and r["expected"]["depth"] == K and r["gauges"].get("accept_length")


def test_a_served_fault_is_flagged_within_a_few_requests(run):
    fault = "ids_in_vllm_convention"
    n, alert = first_alert_within(run, fault, FLAG_WITHIN)
    assert alert["alert"]["code"] == "SERVING_MISMATCH" and "SGLang reports no per-position" in alert["alert"][
        "points_to"]  # fmt: skip
    sys.stderr.write(f"{fault}: flagged after {n} requests (served τ {alert['window']['tau']}, expected "
                     f"{alert['expected']['tau']})\n")  # fmt: skip


def test_each_restart_is_survived(run):
    assert_restart_survived(run)


def test_doctor_reads_the_same_counters_from_the_metrics_url(run):
    rc, out, err = run["at_end"]
    assert rc == 1, err
    report = json.loads(out)
    served = report["context"]["acceptance"]["served"]
    assert served["source"] == "sglang metrics" and served["accept_length"] > 1
    assert "SERVING_MISMATCH" in [f["code"] for f in report["findings"]], report["findings"]


def test_a_lost_norm_before_fc_is_named_before_any_request_and_its_acceptance_drop_flagged(norm_run):
    """The served config lost norm_before_fc (input_norm.weight kept): SGLang builds no input norm. watch names it from
    the served files at its first scrape, before any request (EAGLE31_IGNORED); on the scaled target the skipped norm
    also lowers τ, flagged against the trained draft's expectation within NORM_FLAG_WITHIN requests."""
    phase = "norm_before_fc_dropped"
    assert_named_before_any_request(norm_run, phase, "EAGLE31_IGNORED", "norm_before_fc")
    n, alert = first_alert_within(norm_run, phase, NORM_FLAG_WITHIN)
    assert alert["alert"]["code"] == "SERVING_MISMATCH"
    sys.stderr.write(f"norm_before_fc dropped: named statically at 0 requests; acceptance alert after {n} requests "
                     f"(served τ {alert['window']['tau']}, expected {alert['expected']['tau']})\n")  # fmt: skip
