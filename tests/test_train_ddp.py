"""Data-parallel training under torchrun (gloo, CPU) gives the weights of one process with the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_train import shared_env

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], nproc: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        cmd += ["--master-port", str(free_port()), "-m", "eaglescope.cli", "train", *args]
    else:
        env = {k: v for k, v in env.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        cmd = [sys.executable, "-m", "eaglescope.cli", "train", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_torchrun_two_processes_match_one_process(tmp_path_factory, tmp_path, grad_accum):
    env = shared_env(tmp_path_factory)
    common = ["--target", str(env["target"]), "--data", str(env["prep_hidden"]), "--max-steps", "4"]
    common += ["--lr", "1e-3", "--device", "cpu", "--dtype", "float32", "--max-length", "96", "--seed", "3"]
    one, two = tmp_path / "one", tmp_path / "two"
    # global batch 8 both ways: 1 process × 8 (× accum), 2 processes × 4 (× accum)
    run(common + ["--out", str(one), "--batch-size", "8", "--grad-accum", str(grad_accum)], 1)
    run(common + ["--out", str(two), "--batch-size", "4", "--grad-accum", str(grad_accum)], 2)
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a[k], b[k]), k
    # and training moved the weights: RMSNorm gains start at exactly 1
    assert not torch.equal(a["norm.weight"], torch.ones_like(a["norm.weight"]))
    # only rank 0 wrote: one set of TensorBoard events, no stray temp directories
    assert len(list((two / "tb").iterdir())) == 1
    assert not [p for p in two.iterdir() if p.name.startswith(".")]


def test_torchrun_ranks_agree_on_a_timed_runs_length(tmp_path_factory, tmp_path):
    # each rank times its own steps; rank 0's fit is broadcast, or the ranks would stop at different steps and hang
    env = shared_env(tmp_path_factory)
    out = tmp_path / "timed"
    args = ["--target", str(env["target"]), "--data", str(env["prep_hidden"]), "--out", str(out)]
    args += ["--max-steps", "100000", "--max-seconds", "4", "--batch-size", "4", "--device", "cpu"]
    args += ["--dtype", "float32", "--max-length", "96"]
    run(args, 2)
    state = json.loads((out / "training_state" / "state.json").read_text())
    assert state["fit"]["fitted"] and 5 <= state["step"] == state["fit"]["total"] < 100000
