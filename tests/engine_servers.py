"""A real engine's HTTP server for a test (tests/vllm/test_vllm_watch.py, tests/sglang/test_sglang_watch.py): started on
127.0.0.1 in its own process group, waited for, asked for bounded completions, and killed with everything it
started. Run such modules under `flock /tmp/eaglescope-engine.lock` (one engine on the machine at a time)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """`argv` as a server on HOST:port, its output in `log`; ready when GET `ready_path` answers 200."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, port: int, ready_path: str = "/health"):
        self.argv, self.env, self.log, self.port, self.ready_path = argv, env, log, port, ready_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout_s: float) -> float:
        """Starts the server and waits until it answers; the seconds that took. Fails with the log's tail."""
        t0 = time.perf_counter()
        with self.log.open("a") as f:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """Kills the server's whole process group (engine core, tokenizer and scheduler processes included)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:  # children that outlived the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def post(self, path: str, body: dict, timeout_s: float = 120) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())


def read_json_lines(path: Path) -> list[dict]:
    """The complete JSON lines written so far (a line being written is left for the next read)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def watch_through_restarts(make_server, phases: list[tuple[str, Path, int]], send_one, watch_argv: list[str],
                           root: Path, start_timeout_s: float, pause_s: float = 1.0, at_end=None) -> dict:  # fmt: skip
    """One `eaglescope watch --json` (watch_argv, without --url) across served configs on one port: the first of
    `phases` (name, draft, requests) is started, then each next one replaces it (stop, start: a restart, its counters
    from zero). `make_server(name, draft, port)` gives a Server; `send_one(server)` sends one bounded request.
    Returns {"lines", "stderr", "phases": {name: {"first", "last", "sent_by_line"}}, "start_s": [...]} (a phase's
    lines are lines[first:last], from the first poll after its server started);
    sent_by_line[i] is how many of the phase's requests had completed when watch had written i lines. `at_end(server)`
    runs against the last server before it is stopped; what it returns is result["at_end"]."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    out, err = root / "watch.jsonl", root / "watch.err"
    result: dict = {"phases": {}, "start_s": [], "url": url}
    server, proc = None, None
    try:
        for name, draft, requests in phases:
            if server is not None:
                server.stop()
                time.sleep(2 * pause_s)  # watch sees the server gone
            server = make_server(name, draft, port)
            result["start_s"].append(server.start(start_timeout_s))
            if proc is None:
                # this checkout's eaglescope, one thread (2 cores: the server needs the other)
                env = os.environ | {"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
                proc = subprocess.Popen([*watch_argv, "--url", url], stdout=out.open("w"), stderr=err.open("w"),
                                        env=env)  # fmt: skip
                _wait(lambda: len(read_json_lines(out)) >= 1, 180, "watch's first poll", proc)
            # the requests are counted from the first poll that sees this server (watch may be in its back-off)
            seen = len(read_json_lines(out))
            _wait(lambda seen=seen: any(r["status"] != "unreachable" for r in read_json_lines(out)[seen:]), 120,
                  f"watch to see the {name} server", proc)  # fmt: skip
            first = len(read_json_lines(out))
            sent_by_line = {first: 0}
            for j in range(requests):
                send_one(server)
                time.sleep(pause_s)
                sent_by_line[len(read_json_lines(out))] = j + 1
            time.sleep(3 * pause_s)  # the last requests' counts reach a window
            result["phases"][name] = {"first": seen, "last": len(read_json_lines(out)), "sent_by_line": sent_by_line}
        if at_end is not None:
            result["at_end"] = at_end(server)
    finally:
        if server is not None:
            server.stop()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    result |= {"lines": read_json_lines(out), "stderr": err.read_text() if err.exists() else ""}
    return result


def requests_until(result: dict, phase: str, pred) -> int | None:
    """How many of `phase`'s requests had completed when watch first wrote a line satisfying `pred` in that phase
    (None: no such line)."""
    p = result["phases"][phase]
    for i in range(p["first"], p["last"]):
        if pred(result["lines"][i]):
            # written during the wait after the last request: after all of them
            return min(
                (sent for n, sent in p["sent_by_line"].items() if n > i), default=max(p["sent_by_line"].values())
            )
    return None


def _wait(pred, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if pred():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: watch exited {proc.returncode}")
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def assert_restart_survived(run: dict) -> None:
    """A watch run through watch_through_restarts: the healthy phase's server stopped and a new one started on the
    same port; watch saw it go, come back and its counters go down, once each, in that order, without a traceback."""
    healthy = run["phases"]["healthy"]
    lines = run["lines"]
    before = next(r for r in reversed(lines[: healthy["last"]]) if "total_rounds" in r)
    # The new server's counts are those read after watch found the port unanswered: a stopped server may still answer
    # /metrics while it shuts down (SGLang drains on SIGTERM and its HTTP server answers meanwhile), and those reads
    # are the old process's counts, unchanged and no restart; a new server may answer /metrics before /health.
    gone = next((i for i in range(healthy["last"], len(lines)) if lines[i]["status"] == "unreachable"), None)
    assert gone is not None, [r["status"] for r in lines[healthy["last"] :]]
    draining = [r for r in lines[healthy["last"] : gone] if "reset" in r]
    assert all(r["reset"] is False and r["total_rounds"] == before["total_rounds"] for r in draining), draining
    first_counts = next(r for r in lines[gone:] if "reset" in r)
    assert first_counts["reset"] is True and first_counts["total_rounds"] < before["total_rounds"]
    err = run["stderr"]
    assert err.count("went down (the server restarted)") == 1
    # gone (the restart), back, counters down, in that order; the test's own end stops the last server too
    assert err.count("answers again") == 1
    assert err.index("does not answer") < err.index("answers again") < err.index("went down")
    assert "Traceback" not in err


def phase_lines(run: dict, phase: str) -> list[dict]:
    """The watch lines written while `phase`'s server was the one watched."""
    p = run["phases"][phase]
    return run["lines"][p["first"] : p["last"]]


def first_alert_within(run: dict, phase: str, within: int) -> tuple[int, dict]:
    """(requests completed, the line) when watch first alerted in `phase`; fails unless that was within `within`."""
    n = requests_until(run, phase, lambda r: bool(r.get("alert")))
    lines = phase_lines(run, phase)
    assert n is not None and n <= within, [(r["status"], (r.get("window") or {}).get("tau")) for r in lines]
    return n, next(r for r in lines if r.get("alert"))


def assert_named_before_any_request(run: dict, phase: str, code: str, flag: str) -> None:
    """watch's static check of the served files named `code` (for `flag`) once, before `phase`'s first request."""
    i, static = next((i, r) for i, r in enumerate(run["lines"]) if "static" in r)
    assert [(f["code"], f["evidence"].get("flag")) for f in static["static"]] == [(code, flag)]
    assert i < min(run["phases"][phase]["sent_by_line"])  # written before the first request was sent
    assert run["stderr"].count(f"FINDING {code}") == 1
