"""vLLM's `ExampleHiddenStatesConnector` for vLLM's CPU platform. Runs inside vLLM (loaded through the connector
config's `kv_connector_module_path`); imports vLLM, torch and the standard library only.

vLLM 0.32.0's connector (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py) copies each
finished request's hidden states out of the cache-only layer with an asynchronous device-to-host copy: a side CUDA
stream, pinned host memory and CUDA events, none of which a CPU-only torch has (`torch.cuda.Event()` raises "Tried to
instantiate dummy base class Event"). On the CPU the cache is host memory already, so this subclass changes that one
step, `_submit_async_write`, into a synchronous gather; slots, file layout (hidden_states [T, n_ids, H], token_ids
[T]), the writer thread and its `.lock` protocol are the parent's. On a GPU the worker uses vLLM's own connector.
"""

from __future__ import annotations

from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Copied:
    """Stands for the parent's CUDA event: the copy is done when the gather returns."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    @staticmethod
    def _write_now(tensors: dict[str, torch.Tensor], filename: str, lock_fd: int | None) -> None:
        ExampleHiddenStatesConnector._write_tensors(tensors, _NoEvent(), filename, lock_fd)

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            import fcntl
            import os

            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_now, tensors, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Copied()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))


class _NoEvent:
    def synchronize(self) -> None:
        pass
