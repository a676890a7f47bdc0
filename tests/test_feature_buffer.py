"""The bounded on-disk feature buffer (eaglescope.features.buffer) between a producer and the consumer, with a
producer thread standing in for an engine: back-pressure holds the buffer at its bound, the consumer's record lets a
restart resume without training on a shard twice. The same buffer fed by a real vLLM is in
tests/vllm/test_vllm_features.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from eaglescope.errors import EagleScopeError
from eaglescope.features.buffer import FeatureBuffer

H, N_TAPS = 8, 3


def _samples(seed: int, n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(3, 9, (1,), generator=g))
        out.append(
            {
                "input_ids": torch.randint(0, 50, (T,), generator=g),
                "loss_mask": torch.ones(T, dtype=torch.long),
                "aux": torch.randn(T, N_TAPS * H, generator=g),
                "final_hidden": torch.randn(T, H, generator=g),
            }
        )
    return out


def _create(root, capacity: int) -> FeatureBuffer:
    buf = FeatureBuffer(root)
    vocab = {"d2t": torch.zeros(4, dtype=torch.long), "t2d": torch.zeros(50, dtype=torch.bool)}
    buf.create({"capacity": capacity, "producers": 1, "taps": {"layers": [1, 2, 3]}}, vocab, _samples(99, 1))
    return buf


def test_the_producer_blocks_at_the_bound_and_the_consumer_gets_every_shard_in_order(tmp_path):
    buf = _create(tmp_path / "buf", capacity=2)
    stats: dict = {}
    produced = []
    failed: list[BaseException] = []

    def producer():
        try:
            for k in range(6):
                seq, _ = buf.put(_samples(k), "p", stats)
                produced.append(seq)
            buf.report("p", stats, done=True)
        except BaseException as e:  # the consumer would otherwise wait out its timeout and hide the cause
            failed.append(e)
            raise

    t = threading.Thread(target=producer)
    t.start()
    # The consumer has not started: the producer must stop at the bound. Wait for it to get there (a loaded machine
    # may take a while), then give it time to go past the bound if it would.
    deadline = time.monotonic() + 60
    while len(produced) < 2 and not failed and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    assert not failed, f"the producer failed: {failed[0]!r}"
    assert len(buf.waiting()) == 2 and len(produced) == 2
    got = []
    while not failed and (item := buf.next_shard(timeout=30)) is not None:
        seq, samples = item
        assert torch.equal(samples[0]["aux"], _samples(seq)[0]["aux"])
        got.append(seq)
        buf.mark_consumed(seq, len(samples), sum(len(s["input_ids"]) for s in samples))
    t.join()
    assert not failed, f"the producer failed: {failed[0]!r}"
    assert got == list(range(6))
    assert stats["peak_waiting"] <= 2
    assert buf.consumed()["shards"] == got and not list(buf.root.glob("shard-*"))
    assert len(buf.eval_samples()) == 1


def test_the_size_survives_a_shard_freed_while_it_is_listed(tmp_path, monkeypatch):
    # The consumer deletes a shard between the producer's listing and its stat (CI saw exactly this race).
    buf = _create(tmp_path / "buf", capacity=4)
    seq, _ = buf.put(_samples(0), "p", {})
    kept = buf.size_bytes()
    listed = [*buf.root.glob("shard-*.safetensors"), buf.root / "shard-000099.safetensors"]
    monkeypatch.setattr(type(buf.root), "glob", lambda self, pattern: iter(listed))
    assert buf.size_bytes() == kept > 0


def test_a_restart_resumes_after_the_last_recorded_shard(tmp_path):
    buf = _create(tmp_path / "buf", capacity=4)
    for k in range(3):
        buf.put(_samples(k), "p", {})
    seq, samples = buf.next_shard()
    buf.mark_consumed(seq, len(samples), 1)
    again = FeatureBuffer(tmp_path / "buf")  # another process, after a crash
    assert again.next_shard()[0] == 1


def test_a_corrupted_shard_is_named(tmp_path):
    buf = _create(tmp_path / "buf", capacity=4)
    seq, _ = buf.put(_samples(0), "p", {})
    path = buf.root / f"shard-{seq:06d}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(EagleScopeError, match="corrupted"):
        buf.next_shard()


def test_a_second_producer_of_other_features_is_refused(tmp_path):
    _create(tmp_path / "buf", capacity=4)
    with pytest.raises(EagleScopeError, match="other features"):
        FeatureBuffer(tmp_path / "buf").create({"capacity": 4, "producers": 1, "taps": {"layers": [0, 2, 3]}}, {}, [])
