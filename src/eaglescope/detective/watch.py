"""`eaglescope watch`: a serving engine's live acceptance against what the draft should give (docs/watch.md).

Every --interval seconds one scrape of the server's /metrics (serving_metrics.py) gives cumulative counts; the
window is the difference between the newest scrape and the one --window polls before it (a sliding window of
counter deltas). Each window is judged by doctor's serving rule (behaviour.py, SERVING_MISMATCH): served τ is LOW
when its interval lies wholly below the expected τ's interval AND it is below `ratio` × the expected τ (0.8 against
what a correct server gets on the same kind of text, 0.45 against training's own held-out numbers, which count every
position as a round start). --sustain consecutive LOW windows raise the alert, which names what the per-position
picture points to and the doctor command to run next.

Once the engine is known (the first scrape), doctor's static file checks run on --draft, the directory the server
should be serving (static.py: its config against its weights, its layer ids as this engine reads them, its vocabulary
map; against --target when given). What they name is said at once, before any window: a fault that does not lower
acceptance (an EAGLE 3.1 norm whose flag the served config lost, on a target whose features it barely rescales) is
invisible to the window's rule, but its files show it.

Counters that go down mean a restarted server: the window starts again from zero (the new process's counts since
its start). A server that does not answer is retried with back-off; one line says so, one line says it is back.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from eaglescope.config import DEFAULT_DEPTH
from eaglescope.decode.stats import predicted_accept_length
from eaglescope.detective.acceptance import MIN_REACHED, Acceptance, compare
from eaglescope.detective.acceptance_sources import (
    TRAINING_METRICS,
    load_samples,
    predict_on_data,
    read_training_metrics,
)
from eaglescope.detective.behaviour import SERVING_RATIO, TRAINING_SERVING_RATIO
from eaglescope.detective.serving_metrics import (
    SGLANG,
    Counts,
    Exposition,
    Unreachable,
    counts_of,
    detect_engine,
    server_version,
)
from eaglescope.detective.static import check_layer, check_vocab_map, static_checks
from eaglescope.errors import EagleScopeError
from eaglescope.jsonfile import read_object
from eaglescope.models.drafts.formats import read_draft_files

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Back-off while the server does not answer: the interval, doubled each failed poll, at most MAX_BACKOFF_POLLS
# intervals or MAX_BACKOFF_S (a restarted server is seen within a few intervals of its return, and a dead one is
# asked at most every 30 s).
MAX_BACKOFF_POLLS = 8
MAX_BACKOFF_S = 30.0


def backoff_cap(interval: float) -> float:
    return max(interval, min(MAX_BACKOFF_S, MAX_BACKOFF_POLLS * interval))


@dataclass
class Expected:
    """What a correct server should accept, and how far below it served τ must fall to count (`ratio`)."""

    acceptance: Acceptance
    ratio: float  # SERVING_RATIO for a same-traffic prediction, TRAINING_SERVING_RATIO for training's numbers
    what: str  # one phrase for the alert: "rounds simulated on --data", "training's held-out numbers", ...

    @classmethod
    def of(cls, acceptance: Acceptance, same_traffic: bool, what: str) -> Expected:
        return cls(acceptance, SERVING_RATIO if same_traffic else TRAINING_SERVING_RATIO, what)


class Window:
    """The last `size` poll intervals of cumulative counts. A scrape whose counters went down restarts the window
    from zero: the restarted process counts from 0, so its counts are all served since the restart."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise EagleScopeError("--window must be >= 1 poll")
        self.snaps: deque[Counts] = deque(maxlen=size + 1)

    def push(self, counts: Counts) -> bool:
        """Adds one scrape; True when it shows a restart (the counts went down)."""
        reset = bool(self.snaps) and counts.went_down(self.snaps[-1])
        if reset:
            self.snaps.clear()
            self.snaps.append(Counts.zero(counts))
        self.snaps.append(counts)
        return reset

    def counts(self) -> Counts | None:
        """Counts served within the window; None before two scrapes."""
        return self.snaps[-1].minus(self.snaps[0]) if len(self.snaps) >= 2 else None


@dataclass
class Judgement:
    status: str  # "ok" | "low" | "thin" (too few rounds in the window to judge)
    served: dict
    expected: dict
    low_positions: list[int] = field(default_factory=list)  # k (from 1) whose α_k interval lies below expected's


def _tau_of(acceptance: Acceptance, depth: int | None) -> tuple[float | None, tuple[float, float] | None]:
    return acceptance.tau(depth), acceptance.tau_interval(depth)


def _round(x, nd: int = 4):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return round(float(x), nd)


def judge(window: Counts, expected: Expected, min_rounds: int) -> Judgement:
    """One window against the expectation by doctor's serving rule (module docstring)."""
    served = window.acceptance(f"{window.engine} metrics window")
    depth = window.depth or len(expected.acceptance.alpha) or None
    if depth and expected.acceptance.alpha:
        depth = min(depth, len(expected.acceptance.alpha))
    t_e, i_e = _tau_of(expected.acceptance, depth)
    if window.per_pos is not None:
        cmp = compare(served, expected.acceptance, depth, expected.ratio)
        t_s, i_s = cmp["tau"][0], cmp["interval"][0]
        low_positions = [p["k"] for p in cmp["positions"] if p["separated"]]
        positions = [p["low"] for p in cmp["positions"]]
        exp_positions = [p["high"] for p in cmp["positions"]]
    else:  # SGLang: τ alone, with a Hoeffding interval
        t_s, i_s = window.tau, window.tau_interval()
        low_positions, positions = [], None
        exp_positions = [expected.acceptance.position(k) for k in range(depth or 0)]
    served_d = {"rounds": window.rounds, "accepted": window.accepted, "tau": _round(t_s),
                "tau_interval": [_round(x) for x in i_s] if i_s else None,
                "alpha": [_round(x) for x in served.alpha] or None,
                "positions": _clean_positions(positions)}  # fmt: skip
    expected_d = {"source": expected.acceptance.source, "what": expected.what, "depth": depth, "tau": _round(t_e),
                  "tau_interval": [_round(x) for x in i_e] if i_e else None, "ratio": expected.ratio,
                  "floor": _round(expected.ratio * t_e) if t_e is not None else None,
                  "alpha": [_round(x) for x in expected.acceptance.alpha[: depth or None]] or None,
                  "positions": _clean_positions(exp_positions)}  # fmt: skip
    if window.rounds < min_rounds or t_s is None or t_e is None:
        return Judgement("thin", served_d, expected_d)
    separated = (i_s[1] if i_s else t_s) < (i_e[0] if i_e else t_e)
    low = separated and t_s < expected.ratio * t_e
    return Judgement("low" if low else "ok", served_d, expected_d, low_positions)


def _clean_positions(positions) -> list | None:
    if positions is None:
        return None
    return [None if p is None else {k: _round(v) for k, v in p.items()} for p in positions]


def points_to(j: Judgement, expected: Expected, engine: str) -> tuple[str, str]:
    """(diagnosis code, one sentence) of what a LOW window points to, by doctor's behaviour rules."""
    low = j.low_positions
    alpha_s = j.served.get("alpha") or []
    alpha_e = j.expected.get("alpha") or []
    if engine == SGLANG or not alpha_s:
        why = ("served τ below what the draft should give (SGLang reports no per-position counts): a wiring or "
               "serving-config fault (taps/layer-id convention, norm_before_fc, embedding, vocabulary map) or other "
               "traffic; doctor with --data tells which")  # fmt: skip
        return "SERVING_MISMATCH", why
    if 1 in low or (alpha_s and alpha_e and alpha_s[0] is not None and alpha_e[0] is not None
                    and alpha_s[0] < expected.ratio * alpha_e[0]):  # fmt: skip
        why = (f"α_1 already collapses ({alpha_s[0]:.2f} served against {alpha_e[0]:.2f}), so every position is "
               "low: the draft reads the wrong input — taps or layer-id convention, norm_before_fc/fc_norm, embedding "
               "or vocabulary map — a wiring or serving-config fault (predicted high, served low)")  # fmt: skip
        return "SERVING_MISMATCH", why
    if low:
        ks = ", ".join(f"α_{k}" for k in low)
        why = (f"α_1 is as expected but {ks} collapse: the draft's own features are handed to the next step wrongly "
               "(feedback, norm_output) in the server; if the expected numbers collapse there too it is the draft "
               "(NO_TTT)")  # fmt: skip
        return "SERVING_MISMATCH", why
    why = "every position a little lower, none alone out of its interval: other traffic than the expectation's"
    if expected.ratio == TRAINING_SERVING_RATIO:
        why += " (training's held-out data), or a serving fault doctor with --data on the served traffic can name"
        return "OVERFIT_OR_OTHER_TRAFFIC", why
    return "SERVING_MISMATCH", why + ", or precision"


@dataclass
class WatchSettings:
    url: str
    interval: float = 10.0
    window: int = 6
    sustain: int = 3
    min_rounds: int = 4 * MIN_REACHED
    max_polls: int | None = None
    duration: float | None = None
    keep_watching: bool = False
    give_up_after: float = 600.0  # seconds without an answer (from the first failure) before the run fails
    depth: int | None = None  # the served chain depth K where the metrics do not say it


def run_watch(settings: WatchSettings, expected_for: Callable[[int | None], Expected],
              fetch: Callable[[], Exposition], doctor_command: Callable[[str], str],
              sleep: Callable[[float], None] = time.sleep,
              clock: Callable[[], float] = time.monotonic,
              static_for: Callable[[str], list[dict] | None] | None = None) -> Iterator[dict]:  # fmt: skip
    """Polls until --max-polls / --duration (or an alert, unless keep_watching), yielding one record per poll (the
    --json line of docs/watch.md). `expected_for(depth)` is asked once, when the served chain depth is first known;
    `static_for(engine)` once, when the engine is (its findings are the record's "static", said on stderr)."""
    s = settings
    window = Window(s.window)
    start = clock()
    poll = streak = 0
    engine = version = None
    expected: Expected | None = None
    down_since: float | None = None
    failures = 0
    static_done = False
    while True:
        poll += 1
        t = clock()
        record: dict = {"format": FORMAT_VERSION, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "poll": poll, "url": s.url, "engine": engine, "version": version}  # fmt: skip
        try:
            expo = fetch()
        except Unreachable as e:
            failures += 1
            if down_since is None:
                down_since = t
                log.warning("server %s does not answer (%s); trying again with back-off", s.url, e)
            if t - down_since > s.give_up_after:
                raise EagleScopeError(f"server {s.url} has not answered for {t - down_since:.0f} s ({e})") from None
            yield record | {"status": "unreachable", "error": str(e)}
        else:
            if down_since is not None:
                log.info("server %s answers again after %.0f s", s.url, t - down_since)
                down_since, failures = None, 0
            if engine is None:
                engine = detect_engine(expo)
                version = server_version(s.url, engine) if engine else None
                record |= {"engine": engine, "version": version}
            counts = counts_of(expo, version)  # metrics it cannot read are refused before anything else is said
            if engine and static_for is not None and not static_done:
                static_done = True
                record["static"] = static_for(engine)
                for f in record["static"] or []:
                    log.warning("FINDING %s (static, %s's reading of --draft): %s; fix: %s", f["code"], engine,
                                f["verdict"], f["fix"])  # fmt: skip
            if counts is None:
                yield record | {"status": "waiting"}
            else:
                reset = window.push(counts)
                if reset:
                    streak = 0
                    log.warning("counters of %s went down (the server restarted): a new window from zero", s.url)
                record["reset"] = reset
                if counts.gauges:
                    record["gauges"] = counts.gauges
                record["total_rounds"] = counts.rounds
                served = window.counts()
                if served is not None and served.depth is None and s.depth:
                    served = replace(served, depth=s.depth)
                if served is None or (expected is None and served.depth is None and served.rounds <= 0):
                    # SGLang says its chain depth once its scheduler logged a decode step: wait for it (or traffic)
                    yield record | {"status": "waiting"}
                else:
                    if expected is None:
                        if served.depth is None:
                            log.warning("watch: the server does not say its chain depth; judging at the "
                                        "expectation's own (pass --depth K)")  # fmt: skip
                        expected = expected_for(served.depth)
                    j = judge(served, expected, s.min_rounds)
                    streak = streak + 1 if j.status == "low" else (streak if j.status == "thin" else 0)
                    record |= {"status": j.status, "window": {"polls": len(window.snaps) - 1, **j.served},
                               "expected": j.expected, "low_positions": j.low_positions, "low_streak": streak,
                               "sustain": s.sustain, "alert": None}  # fmt: skip
                    if streak >= s.sustain:
                        code, why = points_to(j, expected, engine)
                        record["alert"] = {"code": code, "points_to": why, "next": doctor_command(code),
                                           "line": alert_line(j, why, s.sustain),
                                           "raised": streak == s.sustain}  # fmt: skip
                    yield record
                    if record["alert"] and not s.keep_watching:
                        return
        if s.max_polls is not None and poll >= s.max_polls:
            return
        if s.duration is not None and clock() - start >= s.duration:
            return
        # the next poll: one interval after this one began, or the back-off after a failure
        wait = s.interval if down_since is None else min(backoff_cap(s.interval), s.interval * 2 ** min(failures, 10))
        if s.duration is not None and t + wait > start + s.duration:
            return  # it would fall after the end
        sleep(max(0.0, t + wait - clock()))


def alert_line(j: Judgement, why: str, sustain: int) -> str:
    s, e = j.served, j.expected
    return (f"ALERT served τ {s['tau']:.2f} over {s['rounds']:.0f} rounds is below the expected band "
            f"(τ {e['tau']:.2f}, floor {e['floor']:.2f}) for {sustain} windows: {why}")  # fmt: skip


# -- what the draft's files say ---------------------------------------------------------------------------------
def static_findings_for(draft: str | Path, target: str | Path | None = None) -> Callable[[str], list[dict] | None]:
    """doctor's static checks on the served draft directory, for the engine serving it (known at the first scrape):
    with --target every one of them (static.static_checks; SGLang's layer ids by the rule of the target's
    architecture), without it those that need no target (the layer and its EAGLE 3.1 options against the weights,
    the vocabulary map). None (with one line) where --draft holds no draft files to read."""

    def findings(engine: str) -> list[dict] | None:
        if not (Path(draft) / "config.json").is_file():
            log.info("watch: %s holds no config.json: no static check of the served files", draft)
            return None
        if target is not None:
            found, _ = static_checks(target, draft, (engine,), sglang_rule_of_target=engine == SGLANG)
        else:
            files = read_draft_files(draft)
            found = check_vocab_map(files.config, files.state_dict)[0]
            found += check_layer(files.config, files.state_dict, (engine,))[0]
        found = sorted(found, key=lambda f: -f.weight)  # doctor's order: the likeliest cause first
        return [{k: v for k, v in f.to_dict().items() if k != "round"} for f in found]

    return findings


# -- what the draft should give -----------------------------------------------------------------------------------
def acceptance_from_dict(obj: dict, source: str) -> Acceptance:
    """An Acceptance from its to_dict() form (doctor --json's context.acceptance.expected, or a hand-written
    {"alpha": [...]} with optional "reached"/"accepted" counts)."""
    alpha = obj.get("alpha")
    if not isinstance(alpha, list) or not alpha:
        raise EagleScopeError(f'{source}: no "alpha" list (conditional α_1..α_K) in the expectation')
    alpha = [math.nan if x is None else float(x) for x in alpha]
    reached, accepted = obj.get("reached"), obj.get("accepted")
    if not (isinstance(reached, list) and isinstance(accepted, list) and len(reached) == len(accepted)):
        reached = accepted = None
    tau = obj.get("accept_length")
    if not isinstance(tau, (int, float)):
        tau = predicted_accept_length([x for x in alpha if not math.isnan(x)])
    return Acceptance(str(obj.get("source") or source), alpha, float(tau), obj.get("acc"), reached, accepted,
                      None, obj.get("rounds"))  # fmt: skip


def expectation_from_file(path) -> Expected:
    """--expect FILE: a doctor --json report (its expected, else training numbers), an Acceptance's dict, or a
    training_metrics.json."""
    path = Path(path)
    if not path.is_file():
        raise EagleScopeError(f"--expect {str(path)!r} does not exist")
    if path.name == TRAINING_METRICS:
        training = read_training_metrics(path.parent)
        if training is None:
            raise EagleScopeError(f"--expect {str(path)!r} holds no acc_k")
        return Expected.of(training, False, "training's held-out numbers")
    obj = read_object(path, EagleScopeError)
    acc = ((obj.get("context") or {}).get("acceptance") or {}) if isinstance(obj, dict) else {}
    if acc.get("expected"):
        return Expected.of(acceptance_from_dict(acc["expected"], str(path)), True, "doctor's rounds simulated on data")
    if acc.get("training"):
        return Expected.of(acceptance_from_dict(acc["training"], str(path)), False, "training's held-out numbers")
    # teacher-forced acc_k marks training's numbers (every position a round start); otherwise a same-traffic prediction
    same = obj.get("same_traffic", obj.get("acc") is None)
    return Expected.of(acceptance_from_dict(obj, str(path)), bool(same), f"the expectation in {path.name}")


def expectation_for(draft: str | Path, expect: str | Path | None = None, target: str | Path | None = None,
                    data: str | Path | None = None, eval_samples: int = 32, device: str | None = None,
                    dtype=None) -> Callable[[int | None], Expected]:  # fmt: skip
    """What the draft should give, as a function of the served chain depth (known at the first scrape), from the
    first source there is: --expect FILE; --target with --data (serving simulated on --data's text by the
    teacher-forced draft: what a correct greedy server gets on that traffic, doctor's "expected"); training's
    held-out numbers in the draft directory. Inputs are read and models loaded now, before the first poll."""
    if expect is not None:
        fixed = expectation_from_file(expect)
        return lambda _depth: fixed
    if target is not None and data is not None:
        from eaglescope.detective.doctor import _load_models

        if not Path(data).exists():
            raise EagleScopeError(f"--data {data} does not exist")
        tgt, loaded = _load_models(target, draft, device, dtype, "auto")
        samples = load_samples(data, getattr(tgt, "tokenizer", None), eval_samples)

        def predicted(depth: int | None) -> Expected:
            log.info("watch: serving simulated on %d samples of %s (chain of %d)", len(samples), data,
                     depth or DEFAULT_DEPTH)  # fmt: skip
            rounds = predict_on_data(tgt, loaded.model, samples, depth or DEFAULT_DEPTH).rounds
            return Expected.of(rounds, True, f"rounds simulated on {Path(data).name}")

        return predicted
    if target is not None or data is not None:
        raise EagleScopeError("--target and --data go together (the prediction needs both)")
    training = read_training_metrics(draft)
    if training is None:
        raise EagleScopeError(
            f"no expected acceptance for {draft}: it has no {TRAINING_METRICS} (training's record); pass --expect "
            "FILE or --target with --data"
        )
    return lambda _depth: Expected.of(training, False, "training's held-out numbers")
