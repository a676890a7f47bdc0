"""doctor at the scale users debug: an 8B-shaped target (Llama-3-8B's shape, random bf16 weights built on the GPU and
saved as a normal checkpoint) and a random draft, a 48-token trace of the default tree from the default (static-shape)
decoder, in both trace modes: clean → healthy; the trace's target.aux segments permuted → TAP_ORDER.
EAGLESCOPE_GPU_WORK=DIR keeps the checkpoints there (bench/doctor_speed.py reads the same pair)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from drafts import save_random_draft
from faults import edit_trace, permute_segments
from models import LLAMA_8B, make_llama8b

from eaglescope import trace as T

PROMPT = ",".join(str((i * 7919) % 120000 + 100) for i in range(64))
NEW = 48


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = Path(os.environ.get("EAGLESCOPE_GPU_WORK") or tmp_path_factory.mktemp("gpu-8b"))
    target = make_llama8b(root / "llama8b")
    return root, target, save_random_draft(target, root / "llama8b-draft", 32000)


@pytest.fixture(scope="module")
def traces(llama8b, run_cli) -> dict[str, Path]:
    """generate --trace in each mode (bench/doctor_speed.py records the same traces under EAGLESCOPE_GPU_WORK: a run
    of both reuses them)."""
    root, target, draft = llama8b
    out = {}
    for mode in ("full", "fingerprint"):
        out[mode] = root / f"trace-{mode}"
        if not (out[mode] / "manifest.json").is_file():
            assert run_cli("generate", "--target", target, "--draft", draft, "--prompt-ids", PROMPT, "--json",
                           "--max-new-tokens", NEW, "--trace", out[mode], "--trace-mode", mode) == 0  # fmt: skip
    return out


def test_the_trace_is_of_an_8b_shaped_run(traces):
    tr = T.load_trace(traces["full"])
    aux = tr.get(T.TARGET_AUX, 0)
    assert aux.shape == (64, 3 * LLAMA_8B["hidden_size"])
    assert len(tr.rounds()) > 4


@pytest.mark.parametrize("mode", ["full", "fingerprint"])
def test_doctor_calls_a_clean_8b_trace_healthy(cli, llama8b, traces, mode):
    _, target, draft = llama8b
    t = time.perf_counter()
    rc, report, top = cli.doctor(target, draft, traces[mode])
    print(f"doctor on the 8B-shaped {mode} trace: {time.perf_counter() - t:.1f} s in this process")
    assert (rc, top) == (0, None), report["findings"][:1]


def test_doctor_names_permuted_taps_in_an_8b_trace(cli, llama8b, traces, tmp_path):
    _, target, draft = llama8b
    bad = edit_trace(traces["full"], tmp_path / "permuted", {(T.TARGET_AUX, 0): permute_segments([0, 2, 1])})
    rc, report, top = cli.doctor(target, draft, bad)
    assert (rc, top) == (1, ("TAP_ORDER", T.TARGET_AUX, 0)), report["findings"][:1]
