"""The trace recorder: round trips, atomic writes, fingerprints, comparison, malformed traces, isolation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import eaglescope.trace as tr
from eaglescope.errors import EagleScopeError
from eaglescope.trace import (
    TARGET_AUX,
    VERIFY_TOKENS,
    Fingerprint,
    TraceError,
    TraceRecorder,
    compare,
    draft_hidden_in,
    draft_topk,
    fingerprint,
    load_trace,
    parse_stage,
    target_tap,
)

TRACE_PY = Path(tr.__file__).resolve()


def _fp_equal(a: Fingerprint, b: Fingerprint) -> bool:
    same_meta = (tuple(a.shape), a.dtype, a.segments, a.seed) == (tuple(b.shape), b.dtype, b.segments, b.seed)
    return same_meta and all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values(), strict=True))


def _record_demo(path: Path, mode: str, dtype: torch.dtype, **kw) -> dict:
    """Two rounds of a plausible EAGLE-3 loop; returns what was recorded, keyed by (stage, round[, part])."""
    g = torch.Generator().manual_seed(0)
    H = 8
    want = {}
    with TraceRecorder(path, mode=mode, producer="test-engine", meta={"taps": [1, 2, 3]}, **kw) as rec:
        rec.set_meta(prompt_ids=torch.tensor([5, 6, 7]), decoding={"temperature": 0.0, "topk": 2})
        for r in range(2):
            T = 4 - r
            aux = torch.randn(T, 3 * H, generator=g).to(dtype)
            rec.record(TARGET_AUX, aux, segments=3, note=f"round {r}")
            hid = torch.randn(2, H, generator=g).to(dtype)
            rec.record(draft_hidden_in(1), hid)
            ids, lps = torch.tensor([[3, 9], [4, 1]]), torch.randn(2, 2, generator=g).log_softmax(-1)
            rec.record(draft_topk(0), {"ids": ids, "logprobs": lps})
            toks = torch.tensor([11, 12, 13])
            rec.record(VERIFY_TOKENS, toks)
            want |= {(TARGET_AUX, r): aux, (draft_hidden_in(1), r): hid, (VERIFY_TOKENS, r): toks}
            want |= {(draft_topk(0), r, "ids"): ids, (draft_topk(0), r, "logprobs"): lps}
            rec.next_round()
    return want


def test_parse_stage_names_families_and_indices():
    assert parse_stage(target_tap(3)) == ("target.tap", 3)
    assert parse_stage("target.aux") == ("target.aux", None)
    assert parse_stage(draft_hidden_in(2)) == ("draft.hidden_in", 2)
    assert parse_stage(draft_topk(0)) == ("draft.topk", 0)
    assert parse_stage("verify.bonus") == ("verify.bonus", None)
    assert parse_stage("my.custom.stage") == ("my.custom.stage", None)
    assert tr.is_canonical("draft.step7.hidden_out") and tr.is_canonical(tr.NEXT_HIDDEN_IN)
    assert not tr.is_canonical("my.custom.stage")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_full_trace_round_trips_values_dtypes_and_structure(tmp_path, dtype):
    want = _record_demo(tmp_path / "t", "full", dtype)
    t = load_trace(tmp_path / "t")
    assert t.manifest["format_version"] == 1 and t.producer == "test-engine" and t.mode == "full"
    assert t.meta == {"taps": [1, 2, 3], "prompt_ids": [5, 6, 7], "decoding": {"temperature": 0.0, "topk": 2}}
    assert t.stages() == [TARGET_AUX, draft_hidden_in(1), draft_topk(0), VERIFY_TOKENS]
    assert t.rounds() == [0, 1]
    assert [(e.round, e.stage, e.part) for e in t][:5] == [
        (0, TARGET_AUX, None),
        (0, draft_hidden_in(1), None),
        (0, draft_topk(0), "ids"),
        (0, draft_topk(0), "logprobs"),
        (0, VERIFY_TOKENS, None),
    ]
    assert t.events[0].extra == {"note": "round 0"} and all(e.kind == "full" for e in t)
    assert t.events[0].segments == 3 and t.events[1].segments == 1
    for key, value in want.items():
        got = t.get(*key)
        assert got.dtype == value.dtype and torch.equal(got, value), key
    both = t.get(draft_topk(1 - 1), 1)
    assert set(both) == {"ids", "logprobs"} and torch.equal(both["ids"], want[(draft_topk(0), 1, "ids")])
    assert (TARGET_AUX, 1) in t and (TARGET_AUX, 2) not in t
    with pytest.raises(KeyError):
        t.get(TARGET_AUX)  # two rounds: ambiguous


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fingerprint_trace_stores_fingerprints_of_floats_and_integers_in_full(tmp_path, dtype):
    want = _record_demo(tmp_path / "t", "fingerprint", dtype)
    t = load_trace(tmp_path / "t")
    aux = t.get(TARGET_AUX, 1)
    assert isinstance(aux, Fingerprint) and aux.segments == 3 and aux.dtype == str(dtype).removeprefix("torch.")
    assert _fp_equal(aux, fingerprint(want[(TARGET_AUX, 1)], segments=3))
    assert aux.proj.shape == (3, 3, 16) and aux.head.shape == (2, 3, 8)
    toks = t.get(VERIFY_TOKENS, 0)
    assert isinstance(toks, torch.Tensor) and torch.equal(toks, want[(VERIFY_TOKENS, 0)])
    kinds = {(e.stage, e.part): e.kind for e in t}
    assert kinds[(draft_topk(0), "ids")] == "full" and kinds[(draft_topk(0), "logprobs")] == "fingerprint"
    # a fingerprint trace is much smaller than the tensors it describes
    big = torch.randn(64, 4096)
    with TraceRecorder(tmp_path / "big", mode="fingerprint", producer="x") as rec:
        rec.record(target_tap(2), big)
        rec.record(target_tap(3), big, full=True)
    t2 = load_trace(tmp_path / "big")
    assert isinstance(t2.get(target_tap(2)), Fingerprint) and torch.equal(t2.get(target_tap(3)), big)


def test_recorded_tensor_is_a_snapshot_not_a_view_of_a_reused_buffer(tmp_path):
    buf = torch.zeros(6, 4)
    with TraceRecorder(tmp_path / "t", producer="x") as rec:
        rec.record("target.tap.1", buf[2:4])
        buf.fill_(7.0)
    assert torch.equal(load_trace(tmp_path / "t").get("target.tap.1"), torch.zeros(2, 4))


def test_many_shards_round_trip(tmp_path):
    xs = [torch.randn(16, 32) for _ in range(5)]
    with TraceRecorder(tmp_path / "t", producer="x", shard_bytes=3000) as rec:  # two 2 KiB tensors per shard
        for i, x in enumerate(xs):
            rec.record(target_tap(i), x)
    assert len(list((tmp_path / "t").glob("*.safetensors"))) == 3
    t = load_trace(tmp_path / "t")
    assert all(torch.equal(t.get(target_tap(i)), x) for i, x in enumerate(xs))


def test_exception_inside_recorder_leaves_the_good_trace_and_no_temp_dirs(tmp_path):
    out = tmp_path / "t"
    _record_demo(out, "full", torch.float32)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RuntimeError, match="engine crashed"):
        with TraceRecorder(out, producer="test-engine", shard_bytes=1) as rec:  # shard_bytes=1: temp files exist
            rec.record(TARGET_AUX, torch.ones(2, 6))
            raise RuntimeError("engine crashed")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    assert load_trace(out).producer == "test-engine"


def test_close_replaces_its_own_old_trace_but_refuses_anything_else(tmp_path):
    out = tmp_path / "t"
    _record_demo(out, "full", torch.float32)
    with TraceRecorder(out, producer="test-engine") as rec:
        rec.record("custom.stage", torch.ones(3))
    t = load_trace(out)
    assert t.producer == "test-engine" and t.stages() == ["custom.stage"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    # another producer's trace (an engine's capture, say) is not this recorder's to replace
    with pytest.raises(EagleScopeError, match="not a trace written by eaglescope-replay"):
        TraceRecorder(out, producer="eaglescope-replay")
    assert load_trace(out).producer == "test-engine"
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(EagleScopeError, match="notes.txt"):
        TraceRecorder(precious, producer="x")
    assert (precious / "notes.txt").read_text() == "keep me"


def test_empty_trace_is_valid(tmp_path):
    TraceRecorder(tmp_path / "t", producer="x").close()
    t = load_trace(tmp_path / "t")
    assert len(t) == 0 and t.stages() == [] and t.rounds() == []


def test_recorder_misuse_is_a_trace_error(tmp_path):
    rec = TraceRecorder(tmp_path / "t", producer="x")
    rec.record(TARGET_AUX, torch.ones(2, 6))
    with pytest.raises(TraceError, match="twice"):
        rec.record(TARGET_AUX, torch.ones(2, 6))
    rec.record(TARGET_AUX, torch.ones(2, 6), round=5)  # an explicit round is fine
    with pytest.raises(TraceError, match="stage names"):
        rec.record("bad/name", torch.ones(1))
    with pytest.raises(TraceError, match="clash"):
        rec.record("x.y", torch.ones(1), kind="full")
    with pytest.raises(TraceError, match="JSON"):
        rec.record("x.y", torch.ones(1), obj=object())
    with pytest.raises(TraceError, match="Tensor"):
        rec.record("x.z", [1.0, 2.0])
    with pytest.raises(TraceError, match="equal segments"):
        rec.record("x.v", torch.ones(2, 7), segments=2)  # checked in full mode too
    rec.record("x.v", torch.ones(2, 7))  # the failed call recorded nothing
    with pytest.raises(TraceError, match="mode"):
        TraceRecorder(tmp_path / "u", mode="everything", producer="x")
    rec.close()
    with pytest.raises(TraceError, match="after close"):
        rec.record("x.w", torch.ones(1))
    assert load_trace(tmp_path / "t").rounds() == [0, 5]
    fp_rec = TraceRecorder(tmp_path / "v", mode="fingerprint", producer="x")
    with pytest.raises(TraceError, match="equal segments"):
        fp_rec.record(TARGET_AUX, torch.ones(2, 7), segments=3)
    fp_rec.abort()


def test_fingerprints_of_the_same_tensor_from_two_recorders_are_identical(tmp_path):
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(3)).bfloat16()
    for name in ("a", "b"):
        with TraceRecorder(tmp_path / name, mode="fingerprint", producer=name) as rec:
            rec.record(TARGET_AUX, x.clone(), segments=3)
    fa, fb = (load_trace(tmp_path / n).get(TARGET_AUX) for n in ("a", "b"))
    assert _fp_equal(fa, fb)
    assert not _fp_equal(fa, fingerprint(x, segments=3, seed=1))  # the seed matters


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 12),
    segments=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 3),
    data_seed=st.integers(0, 2**16),
)
def test_segment_of_a_fingerprint_is_the_fingerprint_of_the_segment(rows, width, segments, seed, data_seed):
    x = torch.randn(rows, width * segments, generator=torch.Generator().manual_seed(data_seed))
    fp = fingerprint(x, segments, seed)
    assert torch.allclose(fp.row_norm, x.norm(dim=-1), rtol=1e-5)
    for j in range(segments):
        part = fp.segment(j)
        ref = fingerprint(x[:, j * width : (j + 1) * width], 1, seed)
        assert part.shape == ref.shape and torch.equal(part.head, ref.head)
        assert torch.equal(part.proj_check, ref.proj_check)
        for f in ("row_norm", "seg_mean", "seg_std", "seg_norm", "proj"):
            assert torch.allclose(getattr(part, f), getattr(ref, f), rtol=1e-5, atol=1e-5), f


def test_projection_is_deterministic_and_norm_preserving_on_average():
    P = tr.projection_matrix(64, seed=0)
    assert P.dtype == torch.float32 and P.shape == (64, 16) and torch.equal(P, tr.projection_matrix(64, seed=0))
    assert not torch.equal(P[:32], tr.projection_matrix(32, seed=0))  # the width is part of the seed
    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(1))
    ratio = ((x @ P).square().sum() / x.square().sum()).item()
    assert 0.9 < ratio < 1.1


def _forms(a: torch.Tensor, b: torch.Tensor, segments: int):
    """(a, b) as full-vs-full, full-vs-fingerprint, fingerprint-vs-full and fingerprint-vs-fingerprint."""
    fa, fb = fingerprint(a, segments), fingerprint(b, segments)
    return [("full", a, b), ("fingerprint", a, fb), ("fingerprint", fa, b), ("fingerprint", fa, fb)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compare_accepts_identical_tensors_in_every_form(dtype):
    x = torch.randn(6, 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    for method, a, b in _forms(x, x.clone(), 3):
        c = compare(a, b, segments=3)
        assert c["method"] == method and c["match"] and c["shape_match"]
        assert c["rel_l2"] == 0.0 and c["first_bad_row"] is None and c["norm_ratio"] == 1.0
        assert all(r == 1.0 for r in c["row_norm_ratio"]) and len(c["seg_rel_err"]) == 3
        json.dumps(c)  # doctor --json can embed it
    assert compare(x, x)["exact"] is True


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.floats(0.1, 1.0), row=st.integers(0, 4))
def test_compare_detects_a_perturbed_row_in_every_form(seed, scale, row):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 32, generator=g)
    y = x.clone()
    y[row] += scale * x[row].norm() * torch.nn.functional.normalize(torch.randn(32, generator=g), dim=0)
    for _, a, b in _forms(y, x, 1):
        c = compare(a, b)
        assert not c["match"] and c["first_bad_row"] == row
        assert c["row_rel_err"][row] > 0.02 and all(e == 0.0 for i, e in enumerate(c["row_rel_err"]) if i != row)


def test_compare_detects_permuted_rows_and_swapped_segments():
    x = torch.randn(4, 3 * 16, generator=torch.Generator().manual_seed(5))
    rows = x[[1, 0, 2, 3]]
    segs = torch.cat([x[:, 16:32], x[:, :16], x[:, 32:]], dim=-1)  # taps in the wrong order
    for _, a, b in _forms(rows, x, 3):
        c = compare(a, b, segments=3)
        assert not c["match"] and c["first_bad_row"] == 0 and c["row_rel_err"][2] == 0.0
    for _, a, b in _forms(segs, x, 3):
        c = compare(a, b, segments=3)
        assert not c["match"] and c["seg_rel_err"][2] == 0.0 and min(c["seg_rel_err"][:2]) > 0.5
        # the norms of whole rows are unchanged: only the projections see a permutation
        assert all(abs(r - 1.0) < 1e-6 for r in c["row_norm_ratio"])


def test_compare_reports_shape_mismatch_and_refuses_incomparable_fingerprints():
    x = torch.randn(4, 12)
    c = compare(x[:3], fingerprint(x))
    assert not c["shape_match"] and not c["match"] and c["rel_l2"] is None
    with pytest.raises(TraceError, match="segments"):
        compare(fingerprint(x, 3), fingerprint(x, 1))
    tampered = fingerprint(x)
    tampered.proj_check = tampered.proj_check + 1
    with pytest.raises(TraceError, match="projection"):
        compare(tampered, fingerprint(x))


def test_a_segment_of_aux_can_be_matched_against_a_tap():
    g = torch.Generator().manual_seed(2)
    taps = {i: torch.randn(3, 8, generator=g) for i in range(4)}
    aux = torch.cat([taps[2], taps[3], taps[1]], dim=-1)  # what an engine with an off-by-one might feed
    fp = fingerprint(aux, segments=3)
    best = [min(taps, key=lambda i: compare(fp.segment(j), taps[i])["rel_l2"]) for j in range(3)]
    assert best == [2, 3, 1]


def _good_trace(tmp_path: Path, mode: str = "full") -> Path:
    out = tmp_path / "t"
    _record_demo(out, mode, torch.float32)
    return out


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
        (lambda d: (d / "manifest.json").write_text("{not json"), "not valid JSON"),
        (lambda d: _edit_manifest(d, lambda m: m.update(format_version=99)), "format_version 99"),
        (lambda d: _edit_manifest(d, lambda m: m["events"][0].pop("stage")), "malformed event"),
        (lambda d: _edit_manifest(d, lambda m: m["events"][0].update(file="../x.safetensors")), "outside"),
        (lambda d: next(d.glob("*.safetensors")).unlink(), "missing"),
        (lambda d: next(d.glob("*.safetensors")).write_bytes(b"garbage"), "not a readable safetensors"),
        (lambda d: _drop_key(d, "0/target.aux"), "lacks tensor '0/target.aux'"),
    ],
)
def test_malformed_traces_raise_trace_error(tmp_path, damage, message):
    out = _good_trace(tmp_path)
    damage(out)
    with pytest.raises(TraceError, match=message):
        load_trace(out)


def test_fingerprint_missing_a_field_raises_trace_error(tmp_path):
    out = _good_trace(tmp_path, "fingerprint")
    _drop_key(out, "1/target.aux:proj")
    with pytest.raises(TraceError, match="proj"):
        load_trace(out)


def _edit_manifest(d: Path, edit) -> None:
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _drop_key(d: Path, key: str) -> None:
    f = next(d.glob("*.safetensors"))
    tensors = load_file(str(f))
    assert key in tensors
    del tensors[key]
    save_file(tensors, str(f))


_ISOLATED = r"""
import importlib.util, sys, torch
sys.modules["eaglescope"] = None  # an engine's environment, where eaglescope is not installed: importing it fails
spec = importlib.util.spec_from_file_location("trace_standalone", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules["trace_standalone"] = mod  # the standard recipe; dataclasses look the module up there
spec.loader.exec_module(mod)
bad = sorted(m for m in sys.modules if m == "transformers" or m.startswith(("eaglescope.", "transformers.")))
assert not bad, bad
x = torch.randn(3, 12, generator=torch.Generator().manual_seed(7)).bfloat16()
with mod.TraceRecorder(sys.argv[2], mode="fingerprint", producer="standalone") as rec:
    rec.record(mod.TARGET_AUX, x, segments=3)
print("ok")
"""


def test_trace_module_runs_standalone_and_agrees_with_the_package(tmp_path):
    # What a user does: copy trace.py into their engine. It must import nothing from eaglescope (nor
    # transformers), and its fingerprints must agree with the package's in another process.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", _ISOLATED, str(TRACE_PY), str(tmp_path / "t")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(7)).bfloat16()
    got = load_trace(tmp_path / "t").get(TARGET_AUX)
    assert _fp_equal(got, fingerprint(x, segments=3)) and compare(got, x)["match"]
