"""eaglescope's side of `prepare --engine vllm|sglang`, what every engine shares: start the engine's worker in the
engine's own Python environment, hand it each shard's conversations through a spool directory (features/spool.py is
the worker's half), and turn the file it writes per request into the aux and final state training wants, every sample
checked against the capture contract (features/contract.py).

Every engine's worker writes, per request, one safetensors file with `hidden_states [T, n_taps + 1, H]` (the taps low
to high, then the final state in the engine's own norm convention) and `token_ids [T]` (the layout of vLLM's
hidden-states connector). What differs between engines (how the worker gets the states, which ids the engine is
asked for and reads back, the final state's convention) lives in vllm_engine.py and sglang_engine.py.

The engine renders each conversation with its own chat template (as it does when it serves), so the token ids it
processed are compared with eaglescope's rendering, which the loss mask belongs to. A conversation eaglescope truncates
to --max-length goes as token ids when its whole rendering would not fit the engine's context.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import eaglescope
from eaglescope.errors import EagleScopeError
from eaglescope.features.contract import check_final_token, check_states, check_token_ids, normalise_final
from eaglescope.features.target import EngineTarget
from eaglescope.taps import TapContract

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0
POLL_S = 0.05
SHOWN = 4  # sample numbers named per mismatch line


@dataclass
class Sample:
    """One rendered conversation: eaglescope's token ids (truncated to --max-length) and the messages."""

    messages: list[dict]
    ids: list[int]
    truncated: bool
    full_length: int  # tokens of the untruncated rendering


@dataclass
class Mismatches:
    """Mismatch lines with the samples each was seen in: one line per kind of mismatch, not per sample."""

    seen: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # kind → (first sample's line, samples)

    def add(self, k: int | None, lines: list[str]) -> None:
        for line in lines:
            kind = re.sub(r" \([^()]*\)", "", line)  # the same mismatch with other numbers in parentheses
            first, ks = self.seen.setdefault(kind, (line, []))
            if k is not None:
                ks.append(k)

    def lines(self) -> list[str]:
        out = []
        for first, ks in self.seen.values():
            if not ks:
                out.append(first)
                continue
            named = ", ".join(map(str, ks[:SHOWN])) + (f" (+{len(ks) - SHOWN} more)" if len(ks) > SHOWN else "")
            where = f" (numbers of sample {ks[0]})" if len(ks) > 1 and "(" in first else ""
            out.append(f"sample{'s' if len(ks) > 1 else ''} {named}: {first}{where}")
        return out

    def raise_if_any(self, what: str) -> None:
        lines = self.lines()
        if not lines:
            return
        for extra in lines[1:]:
            log.error("capture contract: %s", extra)
        more = f" (and {len(lines) - 1} more mismatch(es), above)" if len(lines) > 1 else ""
        raise EagleScopeError(f"{what} breaks the capture contract: {lines[0]}{more}")


def engine_env() -> dict[str, str]:
    """The engine's interpreter gets this eaglescope's worker (its own environment may have none, or another copy)."""
    env = dict(os.environ)
    for key in ("PYTHONHOME", "VIRTUAL_ENV", "TRITON_INTERPRET"):
        env.pop(key, None)
    src = str(Path(eaglescope.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


class EngineFeatures:
    """A running engine that computes the target's features; `features(samples)` → per sample (aux, final_hidden).
    Subclasses name the engine and its worker, say what the worker is configured with and check what it reports
    when it is ready."""

    engine = ""  # features/contract.py's key: "vllm" | "sglang"
    name = ""  # how lines name it: "vLLM" | "SGLang"
    worker = ""  # the worker's module, run in the engine's environment
    no_file_why = "no reason given"  # the likely cause when the worker hands on no file

    def __init__(self, target: EngineTarget, taps: TapContract, python: str, engine_args: dict | None = None,
                 max_model_len: int | None = None) -> None:  # fmt: skip
        self.target, self.taps, self.python = target, taps, python
        self.engine_args = dict(engine_args or {})
        self.max_model_len = int(max_model_len or target.max_positions)
        self.layer_ids: list[int] = []  # what the engine is asked to capture, in its own convention
        self.state_names: list[int | str] = []  # per hidden_states column: what check_states calls it
        self.proc: subprocess.Popen | None = None
        self.spool: Path | None = None
        self.batch = 0
        self.ready: dict = {}
        self.seconds = 0.0  # engine time over the batches
        self.tokens = 0  # prompt tokens the engine processed
        self.log_path = Path(tempfile.gettempdir()) / f"eaglescope-{self.engine}-{os.getpid()}.log"

    # -- what each engine says ----------------------------------------------------------------------------------------
    def worker_config(self) -> dict:
        """config.json for the worker."""
        return {
            "target": str(self.target.path.resolve()),
            "layer_ids": self.layer_ids,
            "dtype": str(self.target.dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len,
            "engine_args": self.engine_args,
        }

    def check_ready(self, found: Mismatches) -> None:
        """The engine's own report at start (ready.json) against what was asked."""

    @property
    def version(self) -> str:
        return str(self.ready.get("version", "")).strip()

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def start(self) -> dict:
        self.spool = Path(tempfile.mkdtemp(prefix=f"eaglescope-{self.engine}-"))
        (self.spool / "config.json").write_text(json.dumps(self.worker_config()))
        engine_log = open(self.spool / "engine.log", "wb")  # noqa: SIM115 - the child writes it until it ends
        try:
            self.proc = subprocess.Popen(
                [self.python, "-m", self.worker, str(self.spool)],
                env=engine_env(), stdout=engine_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except OSError as e:
            raise EagleScopeError(f"cannot run --engine-python {self.python!r}: {e.strerror or e}") from None
        finally:
            engine_log.close()
        log.info("%s starting (%s; its log: %s, then %s)", self.name, self.python, self.spool / "engine.log",
                 self.log_path)  # fmt: skip
        self.ready = self._wait_for("ready.json", START_TIMEOUT_S, "start")
        found = Mismatches()
        self.check_ready(found)
        if found.seen:
            self.close()
        found.raise_if_any(f"{self.name} {self.version}".strip())
        log.info("%s %s ready: captures %s", self.name, self.version, self.ready.get("captured_layers"))
        return self.ready

    def close(self) -> None:
        if self.spool is not None and (self.spool / "engine.log").is_file():
            # the engine's own log outlives the run (a failure's line points at it)
            shutil.copyfile(self.spool / "engine.log", self.log_path)
        if self.spool is not None and self.spool.is_dir():
            (self.spool / "stop").write_text("")
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)
            self.spool = None

    def __enter__(self) -> EngineFeatures:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wait_for(self, name: str, timeout: float, what: str) -> dict:
        assert self.spool is not None and self.proc is not None
        path, failed = self.spool / name, self.spool / "failed.json"
        deadline = time.monotonic() + timeout
        while not path.is_file():
            if failed.is_file():
                err = json.loads(failed.read_text()).get("error", "unknown error")
                self.close()
                raise EagleScopeError(f"{self.name} failed to {what}: {err} (its log: {self.log_path})")
            if self.proc.poll() is not None:
                tail, rc = _last_line(self.spool / "engine.log"), self.proc.returncode
                self.close()
                raise EagleScopeError(
                    f"{self.name} exited ({rc}) before it could {what}: {tail} (its log: {self.log_path})"
                )
            if time.monotonic() > deadline:
                self.close()
                raise EagleScopeError(f"{self.name} did not {what} within {timeout:.0f} s")
            time.sleep(POLL_S)
        return json.loads(path.read_text())

    # -- features ---------------------------------------------------------------------------------------------------
    def _requests(self, samples: list[Sample]) -> list[dict]:
        reqs = []
        for s in samples:
            # The whole rendering must fit the engine's context (it computes every token it is given).
            if s.full_length < self.max_model_len:
                reqs.append({"messages": s.messages})
            else:
                reqs.append({"prompt_ids": s.ids})
        return reqs

    def features(self, samples: list[Sample], first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each sample's (aux [T, nH], final_hidden [T, H]) in the target dtype, T = len(sample.ids); `first` numbers
        the samples in mismatch lines. Raises on any contract mismatch, naming every kind found."""
        if not self.ready:
            self.start()
        out = self._compute(self._requests(samples))
        self.batch += 1
        self.seconds += float(out.get("seconds", 0.0))
        results = out["results"]
        found = Mismatches()
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        for j, (s, r) in enumerate(zip(samples, results, strict=True)):
            n = first + j
            got = self._one(s, r, n, found)
            if got is not None:
                rows.append(got)
            self.tokens += len(r.get("prompt_ids") or [])
        found.raise_if_any(f"{self.name} {self.version}'s features".replace(" 's", "'s"))
        return rows

    def _compute(self, reqs: list[dict]) -> dict:
        """One batch through the engine → {"results": [{"file", "prompt_ids", "sampled", ...}], "seconds"}: here
        through the worker's spool (a running server's class sends them over HTTP instead)."""
        assert self.spool is not None, "start() first"
        k = self.batch
        (self.spool / f"batch-{k:05d}.json.tmp").write_text(json.dumps({"requests": reqs}))
        os.replace(self.spool / f"batch-{k:05d}.json.tmp", self.spool / f"batch-{k:05d}.json")
        return self._wait_for(f"batch-{k:05d}.out.json", float("inf"), f"compute batch {k}")

    def _one(self, s: Sample, r: dict, n: int, found: Mismatches) -> tuple[torch.Tensor, torch.Tensor] | None:
        H, names = self.target.hidden_size, self.state_names
        engine_ids = [int(x) for x in r.get("prompt_ids") or []]
        bad = check_token_ids(engine_ids, s.ids, s.truncated, self.target.tokenizer.decode)
        found.add(n, bad)
        found.add(n, r.get("mismatches") or [])  # what the worker found itself (e.g. a prefill that left positions)
        if not r.get("file"):
            if not r.get("mismatches"):
                found.add(n, [f"the engine wrote no hidden-states file ({r.get('why') or self.no_file_why})"])
            return None
        try:
            data = load_file(r["file"])
        except (SafetensorError, OSError) as e:
            found.add(n, [f"the engine's hidden-states file could not be read ({e})"])
            return None
        finally:
            Path(r["file"]).unlink(missing_ok=True)
        states, file_ids = data.get("hidden_states"), data.get("token_ids")
        if states is None or file_ids is None:
            found.add(n, ["the engine's file holds no hidden_states / token_ids"])
            return None
        if [int(x) for x in file_ids.tolist()] != engine_ids:
            found.add(n, ["the engine's file holds other token ids than the request it answers"])
            return None
        shape_bad = check_states(states, len(names), len(engine_ids), H, names)
        found.add(n, shape_bad)
        if shape_bad or bad:
            return None
        n_taps = self.taps.count
        final, norm_bad = normalise_final(self.engine, states[:, n_taps], self.target.norm)
        found.add(n, norm_bad)
        if norm_bad:
            return None
        found.add(n, check_final_token(self.target.logits(final[-1:].float())[0], r.get("sampled") or []))
        T = len(s.ids)
        aux = states[:T, :n_taps].reshape(T, n_taps * H)  # taps low to high: every worker writes them in layer order
        return aux.to(self.target.dtype), final[:T].to(self.target.dtype)

    def stats(self) -> dict:
        return {"engine": self.engine, "version": self.ready.get("version"), "seconds": self.seconds,
                "tokens": self.tokens, "layer_ids": self.layer_ids,
                "captured_layer_ids": self.ready.get("captured_layers")}  # fmt: skip


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"
