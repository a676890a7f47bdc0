"""`eaglescope doctor --training-data`: the foreign pipeline's training data (vLLM-extracted hidden states, as
speculators trains on them) against the target's own states for the same tokens. Each data fault made in that
pipeline (pipeline.py) is named with its code; the clean data, and the data of the two faults that live in the
trainer and not in the data (the unshifted pairing, TTT 1), are clean.

The same vLLM-extracted states written in SpecForge's per-sample layout (a dict of tensors, torch.save) are read with
torch.load(weights_only=True) only; a file that needs more than that is refused in one line.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
from pathlib import Path

import pipeline as P
import pytest
import torch
from safetensors.torch import load_file

from eaglescope.cli import main


def doctor(p: P.Pipeline, data: Path, draft: Path | None, json_out: bool = True) -> tuple[int, dict | str, str]:
    """`eaglescope doctor --training-data` in process: (exit status, the --json report or the text, stderr)."""
    argv = ["doctor", "--target", str(p.target), "--training-data", str(data)]
    argv += ["--draft", str(draft)] if draft is not None else []
    argv += ["--json"] if json_out else []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    text = out.getvalue()
    return rc, (json.loads(text) if json_out and rc in (0, 1) else text), err.getvalue()


def codes(report: dict) -> list[str]:
    return [f["code"] for f in report["findings"]]


@pytest.mark.parametrize("case", [P.CLEAN, P.UNSHIFTED, P.TTT_1])
def test_clean_data_is_clean(foreign_pipeline, case):
    """The unshifted pairing and TTT 1 are the trainer's faults: their data is the clean extraction, and the report
    says what it cannot see."""
    p = foreign_pipeline
    rc, report, err = doctor(p, p.hidden[P.CLEAN], p.drafts[case])
    assert rc == 0 and report["healthy"], (report["findings"], err)
    ctx = report["context"]
    assert ctx["format"] == "speculators"
    assert [s["state"] for s in ctx["segments"]] == P.DEFAULT_IDS and {s["shift"] for s in ctx["segments"]} == {0}
    assert ctx["final"]["state"] == "final"  # vLLM's id L: the residual before the norm, as speculators expects
    assert ctx["served_taps"] == P.DEFAULT_IDS
    assert "shift_batch" in ctx["cannot_see"]


def test_hidden_states_one_layer_off_are_named(foreign_pipeline):
    p = foreign_pipeline
    rc, report, _ = doctor(p, p.hidden[P.TAPS_OFF_BY_ONE], p.drafts[P.TAPS_OFF_BY_ONE])
    assert rc == 1 and codes(report) == ["DATA_TAP_MISMATCH"]
    ev = report["findings"][0]["evidence"]
    assert ev["trained_on"] == P.OFF_BY_ONE_IDS and ev["served"] == P.DEFAULT_IDS


def test_a_post_norm_final_state_is_named(foreign_pipeline):
    p = foreign_pipeline
    rc, report, _ = doctor(p, p.hidden[P.FINAL_POST_NORM], p.drafts[P.FINAL_POST_NORM])
    assert rc == 1 and codes(report) == ["DATA_FINAL_NORM"]
    assert report["findings"][0]["evidence"]["holds"] == "final.normed"


def test_features_a_position_off_their_tokens_are_named(foreign_pipeline):
    p = foreign_pipeline
    rc, report, _ = doctor(p, p.hidden[P.FEATURES_SHIFTED], p.drafts[P.CLEAN])
    assert rc == 1 and codes(report) == ["DATA_SHIFT"]
    assert report["findings"][0]["evidence"]["shifts"] == [1]


def test_the_text_report_says_which_layer_each_segment_holds(foreign_pipeline):
    p = foreign_pipeline
    rc, text, _ = doctor(p, p.hidden[P.TAPS_OFF_BY_ONE], p.drafts[P.TAPS_OFF_BY_ONE], json_out=False)
    assert rc == 1
    assert text.splitlines()[0] == "NOT HEALTHY: 1 finding(s); most likely DATA_TAP_MISMATCH"
    assert "segment 0  layer id 3" in text and "served     [2, 4, 5]" in text


def as_specforge(src: Path, dst: Path, n: int, normed_final: torch.Tensor | None = None) -> Path:
    """The extracted samples in SpecForge's offline layout: one torch.save'd dict per sample."""
    dst.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        d = load_file(str(src / f"hs_{i}.safetensors"))
        hs, ids = d["hidden_states"], d["token_ids"]
        final = hs[:, -1] if normed_final is None else normed_final(hs[:, -1])
        sample = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "aux_hidden_state": hs[None, :, :-1].flatten(2),
                  "hidden_state": final[None]}  # fmt: skip
        torch.save(sample, dst / f"data_{i}.ckpt")
    return dst


def test_specforge_samples_are_read_and_their_final_state_judged_by_specforges_convention(foreign_pipeline, tmp_path):
    """SpecForge's TargetHead is the lm_head alone: its hidden_state must be normed. vLLM's raw id-L state stored
    there is DATA_FINAL_NORM; the normed one is clean."""
    p = foreign_pipeline
    w, eps = P.final_norm_weight(p.target)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    raw = as_specforge(p.hidden[P.CLEAN], tmp_path / "raw", 4)
    rc, report, _ = doctor(p, raw, p.drafts[P.CLEAN])
    assert rc == 1 and codes(report) == ["DATA_FINAL_NORM"] and report["context"]["format"] == "specforge"
    normed = as_specforge(p.hidden[P.CLEAN], tmp_path / "normed", 4, norm)
    rc, report, _ = doctor(p, normed, p.drafts[P.CLEAN])
    assert rc == 0 and report["healthy"], report["findings"]


class Payload:  # anything that is not a tensor, a container or a number needs full unpickling
    pass


def test_a_sample_that_needs_full_unpickling_is_refused_in_one_line(foreign_pipeline, tmp_path):
    p = foreign_pipeline
    d = tmp_path / "pickled"
    d.mkdir()
    with (d / "data_0.ckpt").open("wb") as f:
        pickle.dump({"input_ids": torch.arange(4), "aux_hidden_state": Payload()}, f)
    rc, out, err = doctor(p, d, None, json_out=False)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "weights_only=True" in lines[0] and "data_0.ckpt" in lines[0]


def test_an_eaglescope_prepared_directory_is_checked_against_its_own_taps(foreign_pipeline, tmp_path):
    from eaglescope.config import PrepareConfig
    from eaglescope.data.prepare import prepare

    p = foreign_pipeline
    out = tmp_path / "prepared"
    prepare(PrepareConfig(target=str(p.target), data=str(p.root / "conversations.jsonl"), out=str(out),
                          max_length=P.SAMPLE_LEN, hidden_states=True, taps="1,3,6", limit=4, device="cpu",
                          dtype="float32"), progress=False)  # fmt: skip
    rc, report, _ = doctor(p, out, None)
    assert rc == 0 and report["healthy"], report["findings"]
    assert [s["state"] for s in report["context"]["segments"]] == [1, 3, 6]
    assert report["context"]["final"]["state"] == "final.normed"
