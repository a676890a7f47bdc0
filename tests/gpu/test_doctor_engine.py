"""doctor on the GPU against the independent engine (tests/engines/plain_eagle3.py): its traces, clean and with
faults made as code changes in that engine, diagnosed by `eaglescope doctor --device cuda` through the command line.
The expectations are the CPU suite's own (tests/engines/cases.py, judged by its `verdict`); the replay runs in float32
as it does there, on the GPU's kernels. A selection that covers every family of causes in both trace modes;
EAGLESCOPE_GPU_ALL_CASES=1 runs every case of the catalogue."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from engines.cases import CLEAN, FAULT_CASES, build_setups, record, verdict

CLEAN_IDS = [
    "tree",
    "tree-fingerprint",
    "bf16-tree",
    "12layers-bf16-fingerprint",
    "sampled-tree",
    "eagle31-fc-norm-output-fingerprint",
    "shallow-tree",
]
FAULT_IDS = [
    "tap_plus_one-full",
    "tap_plus_one-from-round2-fingerprint",
    "tap_order-fingerprint",
    "tap_embedding-full",
    "tap_normed-12layers-full",
    "eagle2_wiring-full",
    "fc_skipped-full",
    "fc_repeated-fingerprint",
    "feedback_target-full",
    "feedback_postnorm-fingerprint",
    "stale_first_rows-full",
    "stale_first_rows-12layers-from-round2-fingerprint",
    "rope_tree_offset-full",
    "rope_catchup_offset-from-round2-full",
    "pairing_shift-full",
    "other_embedding-full",
    "vocab_map_lost-full",
    "d2t_arange-fingerprint",
    "d2t_regenerated-full",
    "final_norm_skipped-full",
    "norm_before_fc_ignored-full",
    "fc_norm_as_one-fingerprint",
    "norm_output_other_meaning-full",
    "tap_order-bf16-full",
    "feedback_target-sampled-full",
    "vocab_map_lost-shallow-full",
    "kv_swapped-full",
]
ALL = os.environ.get("EAGLESCOPE_GPU_ALL_CASES") == "1"
CASES = [c for c in CLEAN + FAULT_CASES if ALL or c.id in CLEAN_IDS + FAULT_IDS]
assert ALL or len(CASES) == len(CLEAN_IDS) + len(FAULT_IDS), "a case id above is not in tests/engines/cases.py"


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    return build_setups(tmp_path_factory.mktemp("gpu-independent-engine"))


def as_report(report: dict) -> SimpleNamespace:
    """doctor --json's report as the objects `verdict` reads."""
    findings = [SimpleNamespace(**f) for f in report["findings"]]
    return SimpleNamespace(healthy=report["healthy"], findings=findings)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_doctor_on_the_gpu_judges_the_independent_engine_as_on_the_cpu(cli, setups, tmp_path, case):
    S = setups[case.setup]
    trace = record(case, setups, tmp_path / "trace")
    rc, report, _ = cli.doctor(S.target_dir, S.draft_dir, trace, "--device", "cuda", "--dtype", "float32")
    ok, said = verdict(case, as_report(report))
    assert ok, f"expected {case.expected or 'healthy'} at {case.stage} r{case.round}; doctor said {said}"
    assert rc == (0 if case.healthy else 1)
