"""`doctor`'s behavioural checks: the rules on served vs predicted acceptance, and the seed scenario end to end
(a target with an embedding tap, a draft trained with TTT length 1 → NO_TTT; trained with TTT → healthy)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import make_checkpoint
from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir

from eaglescope.cli import main
from eaglescope.decode.stats import predicted_accept_length
from eaglescope.detective.behaviour import (
    ACC_COLLAPSE_RATIO,
    SERVING_RATIO,
    Acceptance,
    diagnose_behaviour,
    read_training_metrics,
)
from eaglescope.detective.doctor import run_doctor


def acc(source: str, alpha, tau=None, acc_k=None) -> Acceptance:
    alpha = [float(x) for x in alpha]
    return Acceptance(source, alpha, predicted_accept_length(alpha) if tau is None else tau, acc_k)


def codes(findings) -> list[str]:
    return [f.code for f in findings]


# -- the rules ------------------------------------------------------------------------------------------------
def test_no_ttt_from_teacher_forced_acc_decay_and_contract():
    served = acc("eaglescope decoder", [0.6, 0.12, 0.05, 0.0, 0.0])
    predicted = acc("teacher-forced on data", [0.62, 0.2, 0.1, 0.05, 0.0], acc_k=[0.62, 0.15, 0.08, 0.05, 0.04])
    f = diagnose_behaviour(served, predicted, None, ttt_length=1)
    assert codes(f) == ["NO_TTT"] and f[0].confidence >= 0.85
    ev = f[0].evidence
    assert ev["served"]["alpha"][:2] == [0.6, 0.12] and ev["predicted"]["acc"][1] == 0.15
    assert ev["collapse_predicted"]["metric"] == "acc" and ev["collapse_predicted"]["ratio"] < ACC_COLLAPSE_RATIO
    assert "α_k" in f[0].verdict and "TTT length 1" in f[0].verdict


def test_no_ttt_is_less_certain_when_the_draft_was_trained_with_ttt():
    predicted = acc("teacher-forced on data", [0.7, 0.3, 0.2], acc_k=[0.7, 0.2, 0.1])
    with_ttt = diagnose_behaviour(None, predicted, None, ttt_length=7)
    without = diagnose_behaviour(None, predicted, None, ttt_length=1)
    assert codes(with_ttt) == codes(without) == ["NO_TTT"]
    assert with_ttt[0].confidence < without[0].confidence


def test_flat_teacher_forced_acc_is_not_no_ttt_even_with_ttt_length_1():
    predicted = acc("teacher-forced on data", [0.7, 0.75, 0.8], acc_k=[0.7, 0.66, 0.64])
    served = acc("eaglescope decoder", [0.68, 0.7, 0.8])
    assert diagnose_behaviour(served, predicted, None, ttt_length=1) == []


def test_served_far_below_predicted_is_serving_mismatch():
    predicted = acc("teacher-forced on data", [0.8, 0.8, 0.8, 0.8], acc_k=[0.8, 0.78, 0.77, 0.75])
    served = Acceptance("sglang log", [], 1.12)
    f = diagnose_behaviour(served, predicted, None, ttt_length=7)
    assert codes(f) == ["SERVING_MISMATCH"] and f[0].stage == "target.aux"
    assert f[0].evidence["served_tau"] == 1.12 and f[0].evidence["predicted_tau"] > 3


def test_only_served_later_positions_collapsing_points_at_feedback():
    predicted = acc("teacher-forced on data", [0.7, 0.75, 0.8, 0.8], acc_k=[0.7, 0.68, 0.66, 0.65])
    served = acc("eaglescope decoder", [0.7, 0.1, 0.05, 0.0])
    f = diagnose_behaviour(served, predicted, None, ttt_length=7)
    assert codes(f) == ["SERVING_MISMATCH"] and f[0].stage == "draft.step1.hidden_in"
    assert "FEEDBACK_TARGET_FEATURES" in f[0].verdict


def test_low_everywhere_is_undertrained():
    predicted = acc("teacher-forced on data", [0.1, 0.3, 0.3], acc_k=[0.1, 0.09, 0.1])
    served = acc("eaglescope decoder", [0.12, 0.2, 0.1])
    f = diagnose_behaviour(served, predicted, None, ttt_length=7)
    assert codes(f) == ["UNDERTRAINED"]


def test_engine_log_alone_with_ttt_length_1():
    served = Acceptance("sglang log", [], 1.12)
    assert codes(diagnose_behaviour(served, None, None, ttt_length=1)) == ["NO_TTT"]
    # trained with TTT, nothing to compare with: only a weak UNDERTRAINED that asks for --data
    f = diagnose_behaviour(served, None, None, ttt_length=7)
    assert codes(f) == ["UNDERTRAINED"] and f[0].confidence < 0.5 and "--data" in f[0].fix


def test_training_metrics_file_is_read(tmp_path):
    (tmp_path / "training_metrics.json").write_text(
        json.dumps({"acc": [0.6, 0.2, 0.1], "alpha": [0.6, 0.25, 0.3], "split": {"eval": 4}})
    )
    t = read_training_metrics(tmp_path)
    assert t.acc == [0.6, 0.2, 0.1] and t.alpha == [0.6, 0.25, 0.3]
    assert codes(diagnose_behaviour(None, None, t, ttt_length=3)) == ["NO_TTT"]
    assert read_training_metrics(tmp_path / "nowhere") is None


@settings(max_examples=60, deadline=None)
@given(
    a1=st.floats(0.35, 0.95),
    drift=st.lists(st.floats(0.8, 1.2), min_size=1, max_size=6),
    served_ratio=st.floats(SERVING_RATIO + 0.05, 1.3),
    ttt=st.sampled_from([None, 1, 3, 7]),
)
def test_healthy_acceptance_has_no_findings(a1, drift, served_ratio, ttt):
    """α_1 healthy, later steps within ±20% of it, served near predicted: nothing to report, whatever the TTT."""
    alpha = [a1] + [min(1.0, a1 * d) for d in drift]
    acc_k = [a1] + [a1 * max(d, ACC_COLLAPSE_RATIO + 0.1) * 0.95 for d in drift]
    predicted = acc("teacher-forced on data", alpha, acc_k=acc_k)
    served = Acceptance("vllm log", alpha, predicted.accept_length * served_ratio)
    assert diagnose_behaviour(served, predicted, None, ttt) == []


# -- the seed scenario, end to end ----------------------------------------------------------------------------
WORDS = "hello there how are you today the capital of france is paris think step by step two plus four".split()
L = 8
TAPS = f"0,3,{L - 2}"  # [embedding, layer 3, L-2]: the seed scenario's taps


@torch.no_grad()
def _greedy(target, prompts: list[list[int]], n_new: int, stop: set[int]) -> list[list[int]]:
    """The target's greedy continuations, all prompts at once through the cache-free forward (right padding)."""
    lens = [len(p) for p in prompts]
    ids = torch.zeros(len(prompts), max(lens) + n_new, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    for _ in range(n_new):
        logits = target.hidden_states(ids[:, : max(lens)]).logits
        for i in range(len(prompts)):
            ids[i, lens[i]] = logits[i, lens[i] - 1].argmax()
            lens[i] += 1
    out = []
    for i, p in enumerate(prompts):
        gen = ids[i, len(p) : lens[i]].tolist()
        out.append(gen[: next((j for j, t in enumerate(gen) if t in stop), len(gen))])
    return out


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> dict:
    """A tiny Llama target with a chat tokenizer; chat data whose answers are its own greedy continuations; two
    drafts trained by eaglescope's training loop on taps [0, 3, L-2]: TTT length 1, and TTT length 3."""
    from eaglescope.data.prepare import PrepareConfig, prepare
    from eaglescope.target import load_target
    from eaglescope.train.loop import TrainConfig, train

    root = tmp_path_factory.mktemp("seed")
    tok = load(make_tokenizer_dir(root, LLAMA3, vocab_size=300))
    target_dir = make_checkpoint(
        "llama",
        root / "target",
        num_hidden_layers=L,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    tok.save_pretrained(target_dir)
    target = load_target(target_dir, device="cpu", dtype=torch.float32)
    rng = random.Random(0)

    def conversations(n: int, n_new: int) -> list[dict]:
        qs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(n)]
        ps = [
            tok(
                tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )["input_ids"]
            for q in qs
        ]
        answers = _greedy(target, ps, n_new, set(tok.all_special_ids))
        return [
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": tok.decode(a)}]}
            for q, a in zip(qs, answers, strict=True)
        ]

    (root / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(48, 40)))
    (root / "heldout.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(8, 40)))
    prepare(
        PrepareConfig(
            target=str(target_dir),
            data=str(root / "train.jsonl"),
            out=str(root / "prep"),
            taps=TAPS,
            hidden_states=True,
            max_length=96,
            draft_vocab_size=128,
            device="cpu",
            dtype="float32",
        ),
        progress=False,
    )
    drafts = {}
    for ttt, steps in STEPS.items():
        cfg = TrainConfig(
            target=str(target_dir),
            data=str(root / "prep"),
            out=str(root / f"draft-ttt{ttt}"),
            ttt_length=ttt,
            max_steps=steps,
            batch_size=4,
            lr=LR,
            device="cpu",
            dtype="float32",
            eval_fraction=0.1,
        )
        train(cfg, progress=False)
        drafts[ttt] = Path(cfg.out)
    return {"root": root, "target": target_dir, "drafts": drafts, "heldout": root / "heldout.jsonl"}


# Training steps per TTT length: the TTT-1 draft must train long enough for its later steps to visibly fail
# (teacher-forced acc_k of steps ≥ 2 drifts down as step 1 learns to rely on the target's features).
STEPS, LR = {1: 100, 3: 60}, 1e-2


def _doctor(seed, ttt, **kw):
    return run_doctor(
        seed["target"],
        seed["drafts"][ttt],
        data=seed["heldout"],
        prompts=4,
        max_new_tokens=32,
        device="cpu",
        dtype="float32",
        **kw,
    )


@pytest.mark.slow
def test_seed_scenario_no_ttt_is_named_with_alpha_k(seed):
    report = _doctor(seed, 1)
    assert not report.healthy
    top = report.findings[0]
    assert top.code == "NO_TTT", [f.verdict for f in report.findings]
    ev = top.evidence
    assert ev["ttt_length"] == 1
    assert len(ev["served"]["alpha"]) == 5 and len(ev["predicted"]["acc"]) == 5  # α_k / acc_k per position
    assert ev["collapse_predicted"]["ratio"] < ACC_COLLAPSE_RATIO
    assert report.context["static"]["taps"] == [0, 3, L - 2]
    assert report.context["acceptance"]["served"]["source"] == "eaglescope decoder"


@pytest.mark.slow
def test_seed_scenario_draft_trained_with_ttt_has_no_no_ttt(seed):
    report = _doctor(seed, 3)
    assert "NO_TTT" not in codes(report.findings), [f.verdict for f in report.findings]
    pred = report.context["acceptance"]["predicted"]
    assert pred["acc"][0] > 0.3 and min(pred["acc"][1:]) >= ACC_COLLAPSE_RATIO * pred["acc"][0]


@pytest.mark.slow
def test_seed_scenario_from_an_sglang_log_via_the_cli(seed, tmp_path, capsys):
    log = tmp_path / "sglang.log"
    log.write_text(
        "[2025-06-01 10:00:02] Decode batch. #running-req: 1, #token: 812, token usage: 0.01, accept len: 1.12, "
        "accept rate: 0.03, cuda graph: True, gen throughput (token/s): 96.55, #queue-req: 0\n"
    )
    html = tmp_path / "report.html"
    argv = ["doctor", "--target", str(seed["target"]), "--draft", str(seed["drafts"][1])]
    rc = main([*argv, "--engine-log", str(log), "--json", "--html", str(html), "--device", "cpu"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["healthy"] is False
    assert out["findings"][0]["code"] == "NO_TTT"
    assert {"code", "stage", "verdict", "evidence", "fix"} <= set(out["findings"][0])
    assert out["context"]["acceptance"]["served"]["accept_length"] == pytest.approx(1.12)
    assert out["context"]["inputs"]["engines_checked"] == ["sglang"]
    assert html.read_text().startswith("<!doctype html>")
    # the draft trained with TTT, checked statically: a healthy pipeline says "healthy" and nothing else
    rc = main(["doctor", "--target", str(seed["target"]), "--draft", str(seed["drafts"][3]), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["healthy"] is True and out["findings"] == []


def test_doctor_cli_bad_input_exits_2(tmp_path, capsys):
    rc = main(["doctor", "--target", str(tmp_path / "none"), "--draft", str(tmp_path / "none")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
