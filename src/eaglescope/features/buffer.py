"""A bounded on-disk buffer of engine features between producers (engines) and one consumer (`train`), on a file
system every side can reach (one machine, or a shared one across machines).

    BUF/buffer.json              what every shard holds: taps, target fingerprint, chat template, draft vocabulary,
                                 capacity; written first by the first producer
    BUF/vocab.safetensors        d2t, t2d, token_counts: counted over every sample's rendering before any feature
    BUF/eval.safetensors         the held-out samples (never consumed): input_ids, loss_mask, aux, final_hidden, offsets
    BUF/shard-<seq>.safetensors  a shard of training samples (same tensors)
    BUF/shard-<seq>.json         its size, sha256, samples and tokens: written after the shard, so present = complete
    BUF/claims/<seq>             a producer took this sequence number (mkdir: atomic, also on NFS)
    BUF/consumed.json            the consumer's record: the shards it trained on and its totals (a restart resumes)
    BUF/producer-<id>.json       each producer's progress and throughput; BUF/done-<id> once it has finished

Back-pressure: a producer blocks before writing while `capacity` complete shards are waiting; the consumer deletes a
shard once it has recorded it consumed. Nothing but the buffer's bound is ever held on disk or in memory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from eaglescope.data.shards import open_safetensors, save_atomic, sha256_of, write_json_atomic
from eaglescope.errors import EagleScopeError

HEADER = "buffer.json"
VOCAB = "vocab.safetensors"
EVAL = "eval.safetensors"
CONSUMED = "consumed.json"
CLAIMS = "claims"
FORMAT = 1
POLL_S = 0.1


def shard_file(seq: int) -> str:
    return f"shard-{seq:06d}.safetensors"


def _seq_of(name: str) -> int:
    return int(name.split("-")[1].split(".")[0])


def pack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Samples ({input_ids, loss_mask, aux, final_hidden}) concatenated, with offsets."""
    lengths = torch.tensor([0] + [len(s["input_ids"]) for s in samples], dtype=torch.int64)
    return {
        "input_ids": torch.cat([s["input_ids"].to(torch.int32) for s in samples]),
        "loss_mask": torch.cat([s["loss_mask"].to(torch.uint8) for s in samples]),
        "aux": torch.cat([s["aux"] for s in samples]),
        "final_hidden": torch.cat([s["final_hidden"] for s in samples]),
        "offsets": lengths.cumsum(0),
    }


def unpack(path: Path) -> list[dict[str, torch.Tensor]]:
    h = open_safetensors(path)
    off = h.get_tensor("offsets").tolist()
    t = {k: h.get_tensor(k) for k in ("input_ids", "loss_mask", "aux", "final_hidden")}
    out = []
    for a, b in zip(off[:-1], off[1:], strict=True):
        out.append({"input_ids": t["input_ids"][a:b].to(torch.int64), "loss_mask": t["loss_mask"][a:b].to(torch.int64),
                    "aux": t["aux"][a:b], "final_hidden": t["final_hidden"][a:b]})  # fmt: skip
    return out


class FeatureBuffer:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    # -- both sides -------------------------------------------------------------------------------------------------
    def header(self) -> dict:
        path = self.root / HEADER
        if not path.is_file():
            raise EagleScopeError(f"{self.root} is not a feature buffer: {HEADER} is missing.")
        return json.loads(path.read_text())

    def complete(self) -> list[int]:
        """Sequence numbers of the complete shards on disk, in order."""
        return sorted(_seq_of(p.name) for p in self.root.glob("shard-*.json"))

    def consumed(self) -> dict:
        path = self.root / CONSUMED
        return json.loads(path.read_text()) if path.is_file() else {"shards": [], "samples": 0, "tokens": 0}

    def waiting(self) -> list[int]:
        done = set(self.consumed()["shards"])
        return [s for s in self.complete() if s not in done]

    def producers(self) -> dict[str, dict]:
        return {p.stem.removeprefix("producer-"): json.loads(p.read_text()) for p in self.root.glob("producer-*.json")}

    def finished(self) -> bool:
        """Every producer the buffer was made for (--producer I/N: N of them) has finished."""
        if not (self.root / HEADER).is_file():
            return False
        return len(list(self.root.glob("done-*"))) >= int(self.header().get("producers", 1))

    def size_bytes(self) -> int:
        total = 0
        for p in self.root.glob("shard-*.safetensors"):
            try:
                total += p.stat().st_size
            except FileNotFoundError:  # the consumer freed it between the listing and the stat
                continue
        return total

    # -- producer side ----------------------------------------------------------------------------------------------
    def create(self, header: dict, vocab: dict[str, torch.Tensor], eval_samples: list[dict]) -> None:
        """The buffer's fixed part, written once (a second producer, or a restarted one, checks it is the same)."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / CLAIMS).mkdir(exist_ok=True)
        path = self.root / HEADER
        header = {"format": FORMAT, **header}
        if path.is_file():
            old = json.loads(path.read_text())
            if old != header:
                diff = sorted(k for k in set(old) | set(header) if old.get(k) != header.get(k))
                raise EagleScopeError(f"{self.root} is a buffer of other features ({', '.join(diff)} differ).")
            return
        save_atomic(vocab, self.root / VOCAB)
        if eval_samples:
            save_atomic(pack(eval_samples), self.root / EVAL)
        write_json_atomic(header, path)

    def put(self, samples: list[dict], producer: str, stats: dict) -> tuple[int, float]:
        """Write one shard, blocking while the buffer is full → (its sequence number, seconds blocked)."""
        cap = int(self.header()["capacity"])
        t0 = time.perf_counter()
        while len(self.waiting()) >= cap:
            time.sleep(POLL_S)
        blocked = time.perf_counter() - t0
        seq = self._claim()
        path = self.root / shard_file(seq)
        entry = save_atomic(pack(samples), path)
        entry |= {"file": path.name, "samples": len(samples), "tokens": sum(len(s["input_ids"]) for s in samples),
                  "producer": producer}  # fmt: skip
        write_json_atomic(entry, path.with_suffix(".json"))
        stats["peak_waiting"] = max(stats.get("peak_waiting", 0), len(self.waiting()))
        stats["peak_bytes"] = max(stats.get("peak_bytes", 0), self.size_bytes())
        return seq, blocked

    def _claim(self) -> int:
        seq = len(list((self.root / CLAIMS).iterdir()))
        while True:
            try:
                os.mkdir(self.root / CLAIMS / str(seq))
                return seq
            except FileExistsError:
                seq += 1

    def report(self, producer: str, stats: dict, done: bool = False) -> None:
        write_json_atomic(stats, self.root / f"producer-{producer}.json")
        if done:
            (self.root / f"done-{producer}").write_text("")

    # -- consumer side ----------------------------------------------------------------------------------------------
    def next_shard(self, timeout: float | None = None) -> tuple[int, list[dict]] | None:
        """The oldest complete shard not consumed yet, waiting for one; None once every producer has finished and
        nothing is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            waiting = self.waiting()
            if waiting:
                seq = waiting[0]
                entry = json.loads((self.root / shard_file(seq)).with_suffix(".json").read_text())
                path = self.root / shard_file(seq)
                if sha256_of(path) != entry["sha256"]:
                    raise EagleScopeError(f"{path} is corrupted: its sha256 differs from {path.with_suffix('.json')}.")
                return seq, unpack(path)
            if self.finished():
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise EagleScopeError(f"no feature shard arrived in {self.root} within {timeout:.0f} s")
            time.sleep(POLL_S)

    def mark_consumed(self, seq: int, samples: int, tokens: int) -> None:
        """Record the shard consumed (the record is what a restart resumes from), then free its place."""
        rec = self.consumed()
        if seq not in rec["shards"]:
            rec["shards"].append(seq)
            rec["samples"] += samples
            rec["tokens"] += tokens
            write_json_atomic(rec, self.root / CONSUMED)
        for p in (self.root / shard_file(seq), (self.root / shard_file(seq)).with_suffix(".json")):
            p.unlink(missing_ok=True)

    def eval_samples(self) -> list[dict]:
        path = self.root / EVAL
        return unpack(path) if path.is_file() else []

    def vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        h = open_safetensors(self.root / VOCAB)
        return h.get_tensor("d2t"), h.get_tensor("t2d")
