"""`doctor`'s behavioural checks (behaviour.py), on real components: a tiny Llama target with a chat tokenizer, chat
data whose answers are its own greedy continuations, drafts trained by eaglescope's training loop, served by
eaglescope's decoder, and served numbers written the way vLLM's counters count them.

    the statistics        Wilson intervals solve their score equation; τ's intervals cover the true τ
    the same positions    the teacher-forced draft at the served rounds IS what was served; serving simulated on a
                          text picks the server's own round roots
    the server            a broken vocabulary map behind vLLM-style metrics is SERVING_MISMATCH; the clean one is
                          healthy; too few rounds is a note; other traffic is said instead of blaming the server
    the draft             a draft that memorised its data is OVERFIT_OR_OTHER_TRAFFIC on other data, not on its own
    the seed scenario     taps [0, 3, L-2], TTT length 1 → NO_TTT; trained with TTT → no NO_TTT
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import make_checkpoint
from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir

from eaglescope import trace as T
from eaglescope.cli import main
from eaglescope.decode.loop import generate_speculative
from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.decode.stats import SpecStats, predicted_accept_length
from eaglescope.detective.acceptance import ACC_COLLAPSE_RATIO, MIN_REACHED, Acceptance, effective_alpha, wilson
from eaglescope.detective.acceptance_sources import (
    from_engine,
    load_samples,
    prompt_of,
    read_training_metrics,
    simulate_rounds,
    teacher_hits,
)
from eaglescope.detective.behaviour import diagnose_behaviour
from eaglescope.detective.doctor import format_report, run_doctor
from eaglescope.detective.engine_logs import parse_engine_log
from eaglescope.models.draft import load_draft
from eaglescope.models.targets import load_target


def codes(findings) -> list[str]:
    return [f.code for f in findings]


# -- the statistics -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,n", [(0, 5), (3, 10), (50, 60), (1000, 1000), (7, 400)])
def test_wilson_endpoints_solve_the_score_equation(k, n):
    # The Wilson interval is {p : (k/n - p)^2 <= z^2 p (1 - p) / n}; its ends are the roots of that quadratic.
    z = 1.959963984540054
    lo, hi = wilson(k, n)
    p_hat = k / n
    for p in (lo, hi):
        assert (p_hat - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, abs=1e-12)
    assert lo <= p_hat <= hi
    assert wilson(k, n)[1] - wilson(k, n)[0] > wilson(k * 4, n * 4)[1] - wilson(k * 4, n * 4)[0]  # more data: narrower


def _chain_rounds(alpha: list[float], n: int, rng: random.Random) -> list[int]:
    """n greedy chain rounds len(alpha) deep that accept position k with conditional probability alpha[k]."""
    out = []
    for _ in range(n):
        a = 0
        while a < len(alpha) and rng.random() < alpha[a]:
            a += 1
        out.append(a)
    return out


@pytest.mark.parametrize("groups", [8, 1], ids=["bootstrap-over-prompts", "bonferroni-wilson-box"])
def test_tau_interval_covers_the_true_tau(groups):
    """Rounds drawn from a chain with known α: the 95% interval of τ holds the true τ (docs/field.md §5) in at
    least 90% of 80 draws (a broken interval, e.g. one ignoring the count, covers far less)."""
    rng = random.Random(1)
    covered = 0
    trials = 80
    for _ in range(trials):
        alpha = [rng.uniform(0.3, 0.9) for _ in range(4)]
        per_group = [_chain_rounds(alpha, rng.randint(8, 30), rng) for _ in range(groups)]
        a = Acceptance.from_rounds("simulated", per_group, 4)
        lo, hi = a.tau_interval(4)
        covered += lo <= predicted_accept_length(alpha) <= hi
    assert covered >= 0.9 * trials


def test_a_few_rounds_cannot_separate_and_many_can():
    # the same gap (τ 1.3 against 2.0) with 12 rounds a side is chance; with 600 it is not
    rng = random.Random(2)

    def pair(n):
        low = Acceptance.from_rounds("served", [_chain_rounds([0.25, 0.2, 0.2], n, rng)], 3)
        high = Acceptance.from_rounds("expected", [_chain_rounds([0.6, 0.6, 0.5], n, rng)], 3)
        b = diagnose_behaviour(low, None, None, 7, expected=high)
        return b

    few, many = pair(12), pair(600)
    assert "SERVING_MISMATCH" not in codes(few.findings) and any("too few rounds" in n for n in few.notes)
    assert codes(many.findings) == ["SERVING_MISMATCH"] and many.comparisons["serving"]["separated"]


# -- the rules that need no model -----------------------------------------------------------------------------------
def acc(source: str, alpha, tau=None, acc_k=None) -> Acceptance:
    alpha = [float(x) for x in alpha]
    return Acceptance(source, alpha, predicted_accept_length(alpha) if tau is None else tau, acc_k)


def test_no_ttt_from_teacher_forced_acc_decay_and_contract():
    served = acc("eaglescope decoder", [0.6, 0.12, 0.05, 0.0, 0.0])
    predicted = acc("teacher-forced on data", [0.62, 0.2, 0.1, 0.05, 0.0], acc_k=[0.62, 0.15, 0.08, 0.05, 0.04])
    f = diagnose_behaviour(served, predicted, None, ttt_length=1).findings
    assert codes(f) == ["NO_TTT"] and f[0].weight >= 0.85 and f[0].support == "measured"
    assert f[0].evidence["collapse_predicted"]["ratio"] < ACC_COLLAPSE_RATIO
    assert "α_k" in f[0].verdict and "TTT length 1" in f[0].verdict


def test_no_ttt_is_less_certain_when_the_draft_was_trained_with_ttt():
    predicted = acc("teacher-forced on data", [0.7, 0.3, 0.2], acc_k=[0.7, 0.2, 0.1])
    with_ttt = diagnose_behaviour(None, predicted, None, ttt_length=7).findings
    without = diagnose_behaviour(None, predicted, None, ttt_length=1).findings
    assert codes(with_ttt) == codes(without) == ["NO_TTT"]
    assert with_ttt[0].weight < without[0].weight


def test_engine_log_alone_with_ttt_length_1():
    served = Acceptance("sglang log", [], 1.12)
    assert codes(diagnose_behaviour(served, None, None, ttt_length=1).findings) == ["NO_TTT"]
    # trained with TTT, nothing to compare with: only a weak UNDERTRAINED that asks for --data
    f = diagnose_behaviour(served, None, None, ttt_length=7).findings
    assert codes(f) == ["UNDERTRAINED"] and f[0].support == "suggested" and "--data" in f[0].fix


def test_only_later_positions_falling_short_points_at_feedback():
    # α_1 served as expected, α_2.. collapsed, with counts enough to separate them: the features fed back to steps
    # k > 0 are wrong (feedback), not the taps every step reads
    rng = random.Random(3)
    served = Acceptance.from_rounds("vllm metrics", [_chain_rounds([0.7, 0.1, 0.05, 0.05], 400, rng)], 4)
    expected = Acceptance.from_rounds("rounds simulated on data", [_chain_rounds([0.7, 0.7, 0.7, 0.7], 400, rng)], 4)
    f = diagnose_behaviour(served, None, None, 7, expected=expected).findings
    assert codes(f) == ["SERVING_MISMATCH"] and f[0].stage == "draft.step1.hidden_in"
    assert "FEEDBACK_TARGET_FEATURES" in f[0].verdict


def test_training_metrics_file_is_read(tmp_path):
    (tmp_path / "training_metrics.json").write_text(
        json.dumps(
            {"acc": [0.6, 0.2, 0.1], "alpha": [0.6, 0.25, 0.3], "reached": [500, 300, 75], "accepted": [300, 75, 22]}
        )  # fmt: skip
    )
    t = read_training_metrics(tmp_path)
    assert t.acc == [0.6, 0.2, 0.1] and t.reached == [500, 300, 75] and t.accepted == [300, 75, 22]
    assert codes(diagnose_behaviour(None, None, t, ttt_length=3).findings) == ["NO_TTT"]
    assert read_training_metrics(tmp_path / "nowhere") is None


@settings(max_examples=60, deadline=None)
@given(
    a1=st.floats(0.35, 0.95),
    drift=st.lists(st.floats(0.8, 1.2), min_size=1, max_size=6),
    ttt=st.sampled_from([None, 1, 3, 7]),
    seed=st.integers(0, 1000),
)
def test_a_correct_server_on_the_same_positions_has_no_findings(a1, drift, ttt, seed):
    """A healthy draft (α_k within ±20% of α_1, acc_k flat) served on the same positions as the expectation: both
    sides are draws of one process, and whatever their sampling noise nothing is reported."""
    rng = random.Random(seed)
    alpha = [a1] + [min(0.97, a1 * d) for d in drift]
    acc_k = [a1] + [a1 * max(d, ACC_COLLAPSE_RATIO + 0.1) * 0.95 for d in drift]
    K = len(alpha)
    served = Acceptance.from_rounds("vllm metrics", [_chain_rounds(alpha, 300, rng)], K)
    expected = Acceptance.from_rounds("rounds simulated on data", [_chain_rounds(alpha, 40, rng) for _ in range(8)], K)
    predicted = acc("teacher-forced on data", alpha, acc_k=acc_k)
    assert diagnose_behaviour(served, predicted, None, ttt, expected=expected).findings == []


# -- real components: the seed scenario's target, data and drafts ----------------------------------------------------
WORDS = "hello there how are you today the capital of france is paris think step by step two plus four".split()
# Another workload: other words and prompts five times as long.
OTHER = "zebra quantum violet seven eleven monday river stone apple orange purple jump swim fly run".split()
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


# Training steps per draft: the TTT-1 draft must train long enough for its later steps to visibly fail (acc_k of
# steps ≥ 2 drifts down as step 1 learns to rely on the target's features); the memorising draft long enough to fit
# its three conversations far better than anything else.
STEPS, LR = {"ttt1": 100, "ttt3": 60, "narrow": 150}, 1e-2


def _write(path: Path, convs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return path


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> dict:
    """A tiny Llama target with a chat tokenizer; chat data whose answers are its own greedy continuations; drafts
    trained by eaglescope's training loop on taps [0, 3, L-2]: TTT length 1, TTT length 3, and a TTT-3 draft trained
    on three conversations only (it memorises them)."""
    from eaglescope.data.prepare import PrepareConfig, prepare
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

    def conversations(n: int, n_new: int, words=WORDS, length=(3, 8)) -> list[dict]:
        qs = [" ".join(rng.choice(words) for _ in range(rng.randint(*length))) for _ in range(n)]
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

    narrow = conversations(3, 40)
    data = {
        "train": _write(root / "train.jsonl", conversations(48, 40)),
        "heldout": _write(root / "heldout.jsonl", conversations(16, 40)),
        "other": _write(root / "other.jsonl", conversations(16, 40, OTHER, (20, 40))),
        "narrow": _write(root / "narrow.jsonl", [narrow[i % 3] for i in range(48)]),
        "narrow-own": _write(root / "narrow-own.jsonl", [narrow[i % 3] for i in range(16)]),
    }
    drafts = {}
    for name, (ttt, source) in {"ttt1": (1, "train"), "ttt3": (3, "train"), "narrow": (3, "narrow")}.items():
        prep = root / f"prep-{source}"
        if not prep.exists():
            prepare(
                PrepareConfig(
                    target=str(target_dir),
                    data=str(data[source]),
                    out=str(prep),
                    taps=TAPS,
                    hidden_states=True,
                    max_length=96,
                    draft_vocab_size=128,
                    device="cpu",
                    dtype="float32",
                ),
                progress=False,
            )
        cfg = TrainConfig(
            target=str(target_dir),
            data=str(prep),
            out=str(root / f"draft-{name}"),
            ttt_length=ttt,
            max_steps=STEPS[name],
            batch_size=4,
            lr=LR,
            device="cpu",
            dtype="float32",
            eval_fraction=0.1,
        )
        train(cfg, progress=False)
        drafts[name] = Path(cfg.out)
    return {"root": root, "target": target_dir, "drafts": drafts, **data}


def _doctor(seed, draft: str, data: str = "heldout", **kw):
    return run_doctor(
        seed["target"],
        seed["drafts"][draft],
        data=seed[data],
        prompts=kw.pop("prompts", 8),
        max_new_tokens=kw.pop("max_new_tokens", 32),
        device="cpu",
        dtype="float32",
        **kw,
    )


def _models(seed, draft: str):
    target = load_target(seed["target"], device="cpu", dtype=torch.float32)
    loaded = load_draft(seed["drafts"][draft], target.num_layers)
    loaded.model.load_target_embedding(target_embedding(target))
    target.set_taps(loaded.contract.taps)
    return target, loaded.model


def _prompts(seed, target, data: str, n: int) -> list[list[int]]:
    samples = load_samples(seed[data], target.tokenizer, n)
    return [p for p in (prompt_of(i, m) for i, m in samples) if p][:n]


def _serve(target, draft, prompts, new: int, depth: int = 5) -> tuple[SpecStats, list[list[int]]]:
    """eaglescope's greedy chain decoder over the prompts: (merged stats, prompt + output of each)."""
    stats, seqs = SpecStats(), []
    for p in prompts:
        res = generate_speculative(target, Eagle3Proposer(draft, depth, 1, depth + 1, len(p) + new + 2), p, new)
        stats.merge(res.stats)
        seqs.append(list(p) + list(res.token_ids))
    return stats, seqs


# -- the same positions -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_serving_simulated_on_the_served_text_is_what_the_decoder_served(seed):
    """On the decoder's own output, the teacher-forced draft agrees with the target everywhere (it is the target's
    greedy text), and greedy serving simulated on that text picks the decoder's round roots and accepts what the
    decoder accepted, round for round (training's step k IS decoding's depth k+1: tests/test_ttt_equality.py)."""
    target, draft = _models(seed, "ttt3")
    compared = 0
    for p in _prompts(seed, target, "heldout", 6):
        res = generate_speculative(target, Eagle3Proposer(draft, 5, 1, 6, len(p) + 34), p, 32)
        seq = list(p) + list(res.token_ids)
        mask = [0] * len(p) + [1] * (len(seq) - len(p))
        hits, sup, agree, n = teacher_hits(target, draft, seq, mask, 5)
        assert agree == n  # every output token is the target's own greedy choice
        simulated = simulate_rounds(hits, sup, mask)
        # the simulation stops where the text cannot decide a round (its chain runs past the output): a prefix
        assert simulated == res.stats.accepted[: len(simulated)] and len(simulated) >= len(res.stats.accepted) - 2
        compared += len(simulated)
    assert compared >= 40


@pytest.mark.slow
def test_a_healthy_draft_is_healthy_and_expected_is_what_was_served(seed):
    report = _doctor(seed, "ttt3")
    assert report.healthy, format_report(report)
    acc_ = report.context["acceptance"]
    assert report.context["paired_rounds_agree"] == 1.0
    assert acc_["served"]["reached"] == acc_["expected"]["reached"]  # the same rounds, the same decisions
    assert acc_["comparisons"]["serving"]["ratio"] == pytest.approx(1.0)
    # and the line a user reads carries the interval and the counts
    served_line = next(x for x in format_report(report).splitlines() if x.startswith("served"))
    lo, hi = acc_["served"]["accept_length_interval"]
    assert f"[{lo:.2f}, {hi:.2f}]" in served_line and "reached" in served_line


# -- served numbers from an engine's counters --------------------------------------------------------------------
def vllm_prometheus(stats: SpecStats, prompts: list[list[int]]) -> str:
    """The Prometheus text vLLM 0.32's counters (SpecDecodingProm, request_prompt_tokens) would show for these
    rounds and requests: drafts, drafted and accepted tokens, accepted tokens per position, prompt lengths."""
    lab = 'engine="0",model_name="draft"'
    lines = [
        f"vllm:spec_decode_num_drafts_total{{{lab}}} {stats.rounds}.0",
        f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {sum(stats.drafted_tokens)}.0",
        f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {sum(stats.accepted)}.0",
    ]
    for k in range(stats.depth):
        n = sum(a > k for a in stats.accepted)
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{k}"}} {n}.0')
    lines.append(f"vllm:request_prompt_tokens_sum{{{lab}}} {sum(len(p) for p in prompts)}.0")
    lines.append(f"vllm:request_prompt_tokens_count{{{lab}}} {len(prompts)}.0")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def served_metrics(seed) -> dict:
    """vLLM-style counters of real serving runs of the TTT-3 draft on --data's prompts: correct, and with the draft
    vocabulary map lost (d2t zeroed: draft id i proposed as target id i); many rounds and a handful."""
    out = {}
    for name, (fault, n, new) in {"clean": (None, 16, 32), "d2t-lost": ("d2t", 16, 32),
                                  "d2t-lost-few": ("d2t", 1, 4)}.items():  # fmt: skip
        target, draft = _models(seed, "ttt3")
        if fault == "d2t":
            draft.d2t.zero_()
        ps = _prompts(seed, target, "heldout", n)
        stats, _ = _serve(target, draft, ps, new)
        path = seed["root"] / f"{name}.prom"
        path.write_text(vllm_prometheus(stats, ps))
        out[name] = (path, stats)
    return out


@pytest.mark.slow
def test_engine_counters_keep_the_rounds_behind_each_position(served_metrics):
    # the counts the engine gives are the decoder's own, so a position reached by a handful of rounds weighs a handful
    path, stats = served_metrics["d2t-lost-few"]
    served = from_engine(parse_engine_log(path.read_text()))
    reached = [sum(1 for a in stats.accepted if a >= k) for k in range(stats.depth)]
    assert served.reached == pytest.approx(reached) and served.rounds == stats.rounds
    thin = [k for k, n in enumerate(reached) if n < MIN_REACHED]
    assert thin and all(math.isnan(effective_alpha(served)[k]) for k in thin if reached[k] > 0)


@pytest.mark.slow
def test_a_lost_vocabulary_map_behind_the_counters_is_serving_mismatch(seed, served_metrics):
    report = _doctor(seed, "ttt3", engine_log=served_metrics["d2t-lost"][0])
    top = report.findings[0]
    assert (top.code, top.stage) == ("SERVING_MISMATCH", "target.aux"), format_report(report)
    cmp = top.evidence["comparison"]
    assert cmp["separated"] and cmp["interval"][0][1] < cmp["interval"][1][0]  # the intervals do not overlap
    assert top.evidence["traffic"]["same"] is True  # the log's requests are --data's prompts


@pytest.mark.slow
def test_clean_counters_are_healthy(seed, served_metrics):
    report = _doctor(seed, "ttt3", engine_log=served_metrics["clean"][0])
    assert report.healthy, format_report(report)


@pytest.mark.slow
def test_too_few_served_rounds_is_a_note_not_a_finding(seed, served_metrics):
    report = _doctor(seed, "ttt3", engine_log=served_metrics["d2t-lost-few"][0])
    assert "SERVING_MISMATCH" not in codes(report.findings), format_report(report)
    assert any("too few rounds" in n for n in report.context["notes"])


@pytest.mark.slow
def test_other_traffic_is_said_instead_of_blaming_the_server(seed, served_metrics):
    # the same broken server, compared with --data from another workload: no cause can be read from that
    report = _doctor(seed, "ttt3", data="other", engine_log=served_metrics["d2t-lost"][0])
    assert "SERVING_MISMATCH" not in codes(report.findings), format_report(report)
    assert any("not --data's" in n for n in report.context["notes"])
    assert report.context["acceptance"]["traffic"]["same"] is False


# -- the draft against its own training ----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_draft_that_memorised_its_data_is_overfit_on_other_data(seed):
    report = _doctor(seed, "narrow")
    top = report.findings[0]
    assert top.code == "OVERFIT_OR_OTHER_TRAFFIC", format_report(report)
    cmp = top.evidence["comparison"]
    assert cmp["separated"] and cmp["ratio"] < 0.7
    # on the conversations it was trained on the same draft is what training said it is
    own = _doctor(seed, "narrow", data="narrow-own")
    assert "OVERFIT_OR_OTHER_TRAFFIC" not in codes(own.findings), format_report(own)
    # and a draft trained on the traffic it is checked on is not called overfit
    assert "OVERFIT_OR_OTHER_TRAFFIC" not in codes(_doctor(seed, "ttt3").findings)


# -- the seed scenario ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_seed_scenario_no_ttt_is_named_with_alpha_k(seed):
    report = _doctor(seed, "ttt1", prompts=4)
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
    report = _doctor(seed, "ttt3", prompts=4)
    assert "NO_TTT" not in codes(report.findings), [f.verdict for f in report.findings]
    pred = report.context["acceptance"]["predicted"]
    assert pred["acc"][0] > 0.3 and min(pred["acc"][1:]) >= ACC_COLLAPSE_RATIO * pred["acc"][0]


@pytest.mark.slow
def test_seed_scenario_from_a_clean_trace_alone(seed, tmp_path):
    # eaglescope's own decoding of the TTT-1 draft, traced: the trace replays clean, and its verify decisions are
    # what was served; with the contract's TTT length 1 and training's collapsing acc_k that is NO_TTT
    target, draft = _models(seed, "ttt1")
    p = _prompts(seed, target, "heldout", 1)[0]
    rec = T.TraceRecorder(tmp_path / "trace", mode="full", producer="eaglescope-test")
    rec.set_meta(prompt_ids=p, settings={"chain": 5, "tree": None})
    generate_speculative(target, Eagle3Proposer(draft, 5, 1, 6, len(p) + 34, recorder=rec), p, 32, recorder=rec)
    report = run_doctor(seed["target"], seed["drafts"]["ttt1"], trace=rec.close(), device="cpu", dtype="float32")
    assert codes(report.findings) == ["NO_TTT"], format_report(report)
    served = report.context["acceptance"]["served"]
    assert (
        served["source"] == "eaglescope trace"
        and served["rounds"] == len(T.load_trace(tmp_path / "trace").rounds()) - 1
    )


@pytest.mark.slow
def test_seed_scenario_from_an_sglang_log_via_the_cli(seed, tmp_path, capsys):
    log = tmp_path / "sglang.log"
    log.write_text(
        "[2025-06-01 10:00:02] Decode batch. #running-req: 1, #token: 812, token usage: 0.01, accept len: 1.12, "
        "accept rate: 0.03, cuda graph: True, gen throughput (token/s): 96.55, #queue-req: 0\n"
    )
    html = tmp_path / "report.html"
    argv = ["doctor", "--target", str(seed["target"]), "--draft", str(seed["drafts"]["ttt1"])]
    rc = main([*argv, "--engine-log", str(log), "--json", "--html", str(html), "--device", "cpu"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["healthy"] is False
    codes = [f["code"] for f in out["findings"]]
    # SGLang's log says SGLang served this Llama target, whose llama.py adds 1 to every id: it cannot capture the
    # embedding tap at all (the seed incident's DeepSeek-family target keeps the ids), so that comes first
    assert codes[0] == "ENGINE_TAP_CONVENTION" and "NO_TTT" in codes, codes
    assert {"code", "stage", "verdict", "evidence", "fix"} <= set(out["findings"][0])
    assert out["context"]["acceptance"]["served"]["accept_length"] == pytest.approx(1.12)
    assert out["context"]["inputs"]["engines_checked"] == ["sglang"]
    assert html.read_text().startswith("<!doctype html>")
    # the draft trained with TTT, checked statically: a healthy pipeline says "healthy" and nothing else
    rc = main(["doctor", "--target", str(seed["target"]), "--draft", str(seed["drafts"]["ttt3"]), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["healthy"] is True and out["findings"] == []


def test_doctor_cli_bad_input_exits_2(tmp_path, capsys):
    rc = main(["doctor", "--target", str(tmp_path / "none"), "--draft", str(tmp_path / "none")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
