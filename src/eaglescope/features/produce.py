"""`eaglescope prepare --engine vllm --buffer DIR`: the engine's features streamed into a bounded buffer
(features/buffer.py) that `train --data DIR` consumes while they are made, instead of a prepared directory.

Every conversation is rendered first (cheap), so the draft vocabulary is counted over all of them and the held-out
samples (the same split `train` makes of a prepared directory) are computed and stored before any training shard.
Then the engine computes shard after shard; each write waits while the buffer holds --buffer-shards unconsumed
shards. Several producers share one buffer with `--producer I/N`: producer I takes every N-th shard. A restarted
producer skips the shards it already wrote.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from eaglescope.config import PrepareConfig
from eaglescope.data.chat import read_conversations, render, rendered_messages
from eaglescope.data.prepare import _engine_source, _load_engine_target
from eaglescope.errors import EagleScopeError
from eaglescope.features.buffer import FeatureBuffer
from eaglescope.features.engine import Sample
from eaglescope.models.vocab import build_draft_vocab, count_tokens

log = logging.getLogger(__name__)


def parse_producer(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise EagleScopeError(f"--producer must be I/N (producer I of N, from 0), got {text!r}") from None
    if not 0 <= i < n:
        raise EagleScopeError(f"--producer {text}: I must be in 0..N-1")
    return i, n


def _samples(cfg: PrepareConfig, tok, L: int) -> list[tuple[Sample, list[int]]]:
    convs = list(read_conversations(Path(cfg.data)))
    if cfg.limit is not None:
        convs = convs[: cfg.limit]
    out = []
    for conv in convs:
        try:
            r = render(conv, tok)
        except EagleScopeError:
            continue  # prepare counts these; the stream just leaves them out
        if r is None:
            continue
        full = len(r.input_ids)
        ids, mask = r.input_ids[:L], r.loss_mask[:L]
        if any(mask):
            out.append((Sample(rendered_messages(conv), ids, full > L, full), mask))
    if not out:
        raise EagleScopeError(f"{cfg.data} holds no conversation with anything to supervise.")
    return out


def _with_features(engine, part: list[tuple[Sample, list[int]]], first: int) -> list[dict]:
    rows = engine.features([s for s, _ in part], first)
    return [{"input_ids": torch.tensor(s.ids), "loss_mask": torch.tensor(m), "aux": a, "final_hidden": f}
            for (s, m), (a, f) in zip(part, rows, strict=True)]  # fmt: skip


def produce(cfg: PrepareConfig, buffer: str, capacity: int, producer: str = "0/1", eval_fraction: float = 0.05) -> dict:
    """Fill `buffer` with the engine's features of cfg.data; → this producer's stats."""
    from eaglescope.train.loop import split_indices  # the same held-out split as a prepared directory's

    cfg.validate()
    if cfg.engine is None:
        raise EagleScopeError("--buffer needs --engine: the buffer is fed by a serving engine.")
    if capacity < 1:
        raise EagleScopeError(f"--buffer-shards must be >= 1, got {capacity}")
    index, count = parse_producer(producer)
    target, tok, taps, template_sha = _load_engine_target(cfg)
    L = min(cfg.max_length, target.max_positions)
    samples = _samples(cfg, tok, L)
    n_vocab = cfg.draft_vocab_size or min(32000, target.vocab_size)
    ids = torch.tensor([t for s, _ in samples for t in s.ids])
    mask = torch.tensor([m for _, ms in samples for m in ms])
    counts = count_tokens([(ids.long(), mask)], target.vocab_size)
    d2t, t2d = build_draft_vocab(counts, n_vocab)
    train_idx, eval_idx = split_indices(len(samples), eval_fraction)
    buf = FeatureBuffer(buffer)
    header = {"taps": taps.to_dict(), "target": target.fingerprint.to_dict(), "chat_template_sha256": template_sha,
              "draft_vocab_size": n_vocab, "max_length": L, "capacity": capacity, "num_samples": len(samples),
              "num_train_samples": len(train_idx), "shard_samples": cfg.shard_samples, "dtype": str(target.dtype),
              "engine": cfg.engine, "eval_fraction": eval_fraction, "producers": count}  # fmt: skip
    name = f"{index}of{count}"
    stats = {"producer": producer, "tokens": 0, "samples": 0, "engine_seconds": 0.0, "blocked_seconds": 0.0,
             "shards_done": []}  # fmt: skip
    old = buf.producers().get(name)
    if old is not None and (buf.root / f"done-{name}").exists():
        log.info(f"producer {producer} already finished filling {buffer}; nothing to do.")
        return old
    if old is not None:
        stats = old
    engine = _engine_source(cfg, target, taps)
    t0 = time.perf_counter()
    try:
        if not (buf.root / "buffer.json").is_file():
            held_out = [samples[i] for i in eval_idx]
            evals = _with_features(engine, held_out, 0) if held_out else []
            buf.create(header, {"d2t": d2t, "t2d": t2d, "token_counts": counts}, evals)
        else:
            buf.create(header, {}, [])  # checks it holds these features
        num_shards = math.ceil(len(train_idx) / cfg.shard_samples)
        for k in range(index, num_shards, count):
            if k in stats["shards_done"]:
                continue
            part_idx = train_idx[k * cfg.shard_samples : (k + 1) * cfg.shard_samples]
            before = engine.seconds
            rows = _with_features(engine, [samples[i] for i in part_idx], part_idx[0])
            stats["engine_seconds"] += engine.seconds - before
            _, blocked = buf.put(rows, name, stats)
            stats["blocked_seconds"] += blocked
            stats["tokens"] += sum(len(r["input_ids"]) for r in rows)
            stats["samples"] += len(rows)
            stats["shards_done"].append(k)
            stats["wall_seconds"] = stats.get("wall_before", 0.0) + time.perf_counter() - t0
            stats["tokens_per_s"] = stats["tokens"] / max(1e-9, stats["engine_seconds"])  # the engine's own time
            buf.report(name, stats)
            log.info(f"producer {producer}: shard {k} in the buffer ({stats['tokens_per_s']:.0f} tokens/s, "
                     f"{stats['blocked_seconds']:.1f} s blocked by a full buffer)")  # fmt: skip
    finally:
        engine.close()
    stats["wall_before"] = stats.get("wall_seconds", 0.0)
    buf.report(name, stats, done=True)
    return stats
