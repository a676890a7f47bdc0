"""The fast path records traces too: `generate --fast --trace` writes, round by round, the stages the reference loop
writes (copied out of the static round's buffers), doctor calls a clean one healthy, and a wiring fault made in the
fast path itself (its target tapping other layers than the draft was trained on) is named from its trace."""

from __future__ import annotations

import json

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint
from tolerance import assert_close_float32

from eaglescope import trace as T
from eaglescope.cli import main
from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.decode.vanilla import generate_vanilla
from eaglescope.detective.diagnose import diagnose_trace
from eaglescope.detective.doctor import run_doctor
from eaglescope.fast import FastEagle, FastTarget
from eaglescope.models.draft import load_draft, save_draft
from eaglescope.models.targets import load_target

PROMPT = "5,9,14,2,33,7,21,4,17,11"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-trace")
    target = make_checkpoint("llama", root / "target")
    draft, contract = make_draft(target, draft_vocab_size=48, scale=3.0)
    save_draft(draft, contract, root / "draft")
    return root, target, root / "draft"


def traced(capsys, dirs, name: str, *extra: str) -> tuple[T.Trace, dict]:
    root, target, draft = dirs
    out = root / name
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--prompt-ids", PROMPT, "--device", "cpu"]
    argv += ["--dtype", "float32", "--max-new-tokens", "20", "--trace", str(out), "--json", *extra]
    capsys.readouterr()
    assert main(argv) == 0
    return T.load_trace(out), json.loads(capsys.readouterr().out)


def depth_of(stage: str, num_layers: int) -> int:
    """Dependent layers between the prompt and a traced value: the target's layers up to a tap (all of them for aux,
    the decisions and what is handed on), then fc, then one draft layer per step (its log-probs add the head)."""
    family, k = T.parse_stage(stage)
    if family == "target.tap":
        return max(k, 1)
    if family == "draft.embed_in":
        return 1  # a table lookup
    if stage.startswith("draft."):
        return num_layers + 1 + (k + 1 if k is not None else 0) + (1 if family == "draft.topk" else 0)
    return num_layers + 1


@pytest.mark.parametrize("shape", [["--chain", "3"], ["--tree", "3,2,6"]])
def test_fast_trace_has_the_reference_stages_and_values(capsys, dirs, shape):
    """Same stages, same integers, and float32 values equal up to summation order: the two backends accumulate
    in different orders, so each value may differ by 32 float32 eps per dependent layer (`depth_of`) relative to
    the tensor's largest magnitude (tests/tolerance.py), e.g. ~3e-4 for a draft step-1 state around 100; a wiring
    difference moves values by 1e-2 and more relative."""
    ref, ref_out = traced(capsys, dirs, f"ref-{shape[1]}", *shape)
    fast, fast_out = traced(capsys, dirs, f"fast-{shape[1]}", *shape, "--fast")
    assert fast_out["token_ids"] == ref_out["token_ids"]
    assert [(e.round, e.stage, e.part) for e in fast.events] == [(e.round, e.stage, e.part) for e in ref.events]
    num_layers = json.loads((dirs[1] / "config.json").read_text())["num_hidden_layers"]
    for e in ref.events:
        a, b = ref.get(e.stage, e.round, part=e.part), fast.get(e.stage, e.round, part=e.part)
        assert a.shape == b.shape, (e.key, a.shape, b.shape)
        if a.is_floating_point():
            assert_close_float32(b, a, depth=depth_of(e.stage, num_layers), key=e.key)
        else:
            assert torch.equal(a, b), e.key
    assert fast.meta["settings"]["fast"] is True


def test_doctor_calls_a_clean_fast_trace_healthy(capsys, dirs):
    root, target, draft = dirs
    traced(capsys, dirs, "clean", "--tree", "3,2,6", "--fast")
    report = run_doctor(str(target), str(draft), trace=str(root / "clean"), device="cpu")
    assert report.healthy, [(f.code, f.stage, f.verdict) for f in report.findings]


def test_doctor_names_a_tap_fault_made_in_the_fast_path(dirs, tmp_path):
    """The fast path's target taps the layers one above the draft's contract (an engine reading layer ids in the
    other convention): the fault is in what FastTarget computes, not in any recorded tensor."""
    _, target_dir, draft_dir = dirs
    target = load_target(target_dir, device="cpu")
    loaded = load_draft(draft_dir, target.num_layers)
    loaded.model.load_target_embedding(target_embedding(target))
    taps = loaded.contract.taps.layers
    wrong = tuple(i + 1 for i in taps)
    prompt = [int(t) for t in PROMPT.split(",")]
    rec = T.TraceRecorder(tmp_path / "t", producer="test-fast-engine")
    rec.set_meta(prompt_ids=prompt, settings={"chain": None, "tree": "3,2,6"}, taps=loaded.contract.taps.to_dict())
    max_len = len(prompt) + 24
    ft = FastTarget(target.model, max_len + 6 + 4 + 2, taps=wrong)
    fe = FastEagle(ft, loaded.model, 3, 2, 6, max_len=max_len, recorder=rec)
    fe.generate(prompt, 16)
    rec.close()
    findings, ctx = diagnose_trace(target, load_draft(draft_dir, target.num_layers), tmp_path / "t")
    assert findings, ctx.get("first_divergence")
    top = findings[0]
    assert top.code == "TAP_OFF_BY_ONE" and top.stage.startswith("target."), [(f.code, f.stage) for f in findings]


class _FeedbackPostnorm(Eagle3Proposer):
    """A tree step fed its parent's normed output instead of the pre-norm one (an engine's wiring mistake)."""

    def child_hidden(self, parent_out):
        return self.draft.norm(parent_out)


def test_doctor_names_a_hook_fault_run_on_the_fast_path(dirs, tmp_path):
    """The static backend runs the draft side of the round through Eagle3Proposer, the code doctor's hypotheses
    hook: one hook overridden there (the fault) runs inside the static round, and doctor names it from that trace."""
    _, target_dir, draft_dir = dirs
    target = load_target(target_dir, device="cpu")
    loaded = load_draft(draft_dir, target.num_layers)
    loaded.model.load_target_embedding(target_embedding(target))
    prompt = [int(t) for t in PROMPT.split(",")]
    rec = T.TraceRecorder(tmp_path / "t", producer="test-fast-engine")
    rec.set_meta(prompt_ids=prompt, settings={"chain": None, "tree": "3,2,6"}, taps=loaded.contract.taps.to_dict())
    max_len = len(prompt) + 24
    ft = FastTarget(target.model, max_len + 6 + 4 + 2, taps=loaded.contract.taps.layers)
    fe = FastEagle(ft, loaded.model, 3, 2, 6, max_len=max_len, recorder=rec, proposer_cls=_FeedbackPostnorm)
    out = fe.generate(prompt, 16)
    rec.close()
    assert out.tokens == generate_vanilla(target, prompt, 16, stop_ids=[]).token_ids  # still lossless
    findings, ctx = diagnose_trace(target, load_draft(draft_dir, target.num_layers), tmp_path / "t")
    assert findings, ctx.get("first_divergence")
    top = findings[0]
    assert (top.code, top.stage, top.round) == ("FEEDBACK_POSTNORM", T.draft_hidden_in(1), 1), [
        (f.code, f.stage, f.round) for f in findings
    ]
