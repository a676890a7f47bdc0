"""eaglescope train: learning, the TTT ablation, resume, NaN handling, and a loadable output."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from models import make_checkpoint
from safetensors.torch import load_file, save_file
from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir

from eaglescope.cli import main
from eaglescope.data.prepare import PrepareConfig, prepare
from eaglescope.data.shards import PreparedData
from eaglescope.decode.speculative import Eagle3Proposer, generate_speculative, target_embedding
from eaglescope.decode.stats import SpecStats
from eaglescope.draft import Eagle3Draft, load_draft
from eaglescope.errors import EagleScopeError
from eaglescope.target import load_target
from eaglescope.train.loop import TrainConfig, collate, lr_factor, make_batch, split_indices, train
from eaglescope.train.metrics import (
    acceptance_from_acc,
    acceptance_from_hits,
    evaluate,
    predicted_accept_length,
)
from eaglescope.train.ttt import LOSS_MASK_SHIFT, ttt_loss, ttt_unroll

WORDS = (
    "hello there how are you today the capital of france is paris think step by step two plus four def add "
    "return a b what fine thank"
).split()


@torch.no_grad()
def greedy_continuations(target, prompts: list[list[int]], n_new: int, stop: set[int]) -> list[list[int]]:
    """The target's greedy continuations, batched through the cache-free forward (right padding)."""
    L = max(map(len, prompts)) + n_new
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    lens = [len(p) for p in prompts]
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
        cut = next((j for j, t in enumerate(gen) if t in stop), len(gen))
        out.append(gen[:cut])
    return out


def build_env(root: Path, n: int = 40, n_new: int = 28, seed: int = 0) -> dict:
    """A tiny Llama target with a chat tokenizer, and chat data whose answers are the target's own greedy
    continuations (the EAGLE recipe), rendered by `eaglescope prepare` with and without hidden states."""
    tok_dir = make_tokenizer_dir(root, LLAMA3, vocab_size=300)
    tok = load(tok_dir)
    target_dir = make_checkpoint(
        "llama", root / "target", vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    tok.save_pretrained(target_dir)
    # Random logits have std ~1: a near-uniform teacher. A larger final-norm gain peaks the distribution
    # (greedy outputs are unchanged), so the soft targets carry the argmax the way a trained model's do.
    weights = target_dir / "model.safetensors"
    sd = load_file(weights)
    sd["model.norm.weight"] = sd["model.norm.weight"] * 6
    save_file(sd, str(weights), metadata={"format": "pt"})
    target = load_target(target_dir, device="cpu", dtype=torch.float32)
    rng = random.Random(seed)
    questions = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n)]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    answers = greedy_continuations(target, prompt_ids, n_new, set(tok.all_special_ids))
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": tok.decode(a)}]}
        for q, a in zip(questions, answers, strict=True)
    ]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preps = {}
    for hidden in (False, True):
        out = root / ("prep_hidden" if hidden else "prep")
        cfg = PrepareConfig(
            target=str(target_dir),
            data=str(data),
            out=str(out),
            hidden_states=hidden,
            max_length=96,
            draft_vocab_size=128,
            device="cpu",
            dtype="float32",
        )
        prepare(cfg, progress=False)
        preps[hidden] = out
    return {"root": root, "target": target_dir, "prep": preps[False], "prep_hidden": preps[True], "prompts": prompt_ids}


_ENVS: dict = {}


def shared_env(tmp_path_factory) -> dict:
    """One environment per test session (test_train_ddp uses it too)."""
    if "env" not in _ENVS:
        _ENVS["env"] = build_env(tmp_path_factory.mktemp("train_env"))
    return _ENVS["env"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # Two cores shared with other work: one intra-op thread avoids oversubscription stalls.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield shared_env(tmp_path_factory)
    torch.set_num_threads(threads)


def config(env, out, **kw) -> TrainConfig:
    base = dict(
        target=str(env["target"]),
        data=str(env["prep"]),
        out=str(out),
        batch_size=8,
        lr=1e-3,
        eval_fraction=0.25,
        max_length=96,
        device="cpu",
        dtype="float32",
    )
    return TrainConfig(**{**base, **kw})


def heldout(env, hidden: bool = False):
    """The held-out split as batches, with the target online."""
    data = PreparedData.open(env["prep_hidden" if hidden else "prep"])
    _, ev = split_indices(data.num_samples, 0.25)
    return data, ev


def eval_draft(env, draft, taps, K: int = 7) -> dict:
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    target.set_taps(taps)
    data, ev = heldout(env)
    batches = [
        make_batch(target, collate([data.sample(i) for i in ev[j : j + 8]], 96), torch.device("cpu"), torch.float32)
        for j in range(0, len(ev), 8)
    ]
    return evaluate(draft, batches, K)


def untrained_like(path) -> Eagle3Draft:
    loaded = load_draft(path)
    torch.manual_seed(123)
    for m in loaded.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    return loaded.model


def decode_accept_length(env, draft, taps, depth: int = 4) -> float:
    """τ of a greedy chain over the held-out prompts (the text before each answer)."""
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    target.set_taps(taps)
    draft.load_target_embedding(target_embedding(target))
    data, ev = heldout(env)
    stats = SpecStats()
    for i in ev:
        s = data.sample(i)
        start = int(s["loss_mask"].nonzero()[0])
        prop = Eagle3Proposer(draft, depth, 1, depth + 1, max_len=start + 40)
        res = generate_speculative(target, prop, s["input_ids"][:start].tolist(), 24, stop_ids=[])
        stats.merge(res.stats)
    return stats.accept_length


@pytest.fixture(scope="module")
def trained(env, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "ttt7"
    res = train(config(env, out, ttt_length=7, max_steps=STEPS, eval_every=STEPS // 2), progress=False)
    return out, res


STEPS = 150


def test_training_lowers_the_loss_and_beats_an_untrained_draft(env, trained):
    out, res = trained
    losses = [h["loss"] for h in res.history]
    assert sum(losses[-10:]) / 10 < 0.6 * losses[0]
    loaded = load_draft(out)
    taps = loaded.contract.taps
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    loaded.model.load_target_embedding(target_embedding(target))
    fresh = untrained_like(out)
    fresh.load_target_embedding(target_embedding(target))
    m_trained, m_fresh = eval_draft(env, loaded.model, taps), eval_draft(env, fresh, taps)
    assert m_trained["acc"][0] > m_fresh["acc"][0] + 0.25
    # the loop's own final evaluation is the same held-out measurement
    assert res.metrics["split"] == "held-out"
    assert res.metrics["acc"] == pytest.approx(m_trained["acc"], abs=1e-6)
    tau_trained, tau_fresh = decode_accept_length(env, loaded.model, taps), decode_accept_length(env, fresh, taps)
    assert tau_trained > tau_fresh + 0.3
    assert tau_fresh < 1.2


def test_no_ttt_collapses_after_the_first_step(env, trained, tmp_path):
    out7, _ = trained
    out1 = tmp_path / "ttt1"
    train(config(env, out1, ttt_length=1, max_steps=STEPS), progress=False)
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    m = {}
    for name, path in (("ttt1", out1), ("ttt7", out7)):
        loaded = load_draft(path)
        loaded.model.load_target_embedding(target_embedding(target))
        m[name] = eval_draft(env, loaded.model, loaded.contract.taps, K=7)
    assert load_draft(out1).contract.ttt_length == 1
    acc1, acc7 = m["ttt1"]["acc"], m["ttt7"]["acc"]
    # Step 0 is trained either way; steps 1.. only with TTT. Without it accuracy falls off after the
    # first step ("first step fine, later steps collapse"); with it the later steps hold up.
    later1, later7 = sum(acc1[1:]) / 6, sum(acc7[1:]) / 6
    assert acc1[0] - later1 > (acc7[0] - later7) + 0.05, (acc1, acc7)
    assert later7 > later1, (acc1, acc7)
    assert m["ttt7"]["alpha"][1] > m["ttt1"]["alpha"][1], (m["ttt1"]["alpha"], m["ttt7"]["alpha"])


def _weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def test_kill_and_resume_gives_identical_weights(env, tmp_path):
    N = 8
    full = tmp_path / "full"
    train(config(env, full, data=str(env["prep_hidden"]), max_steps=N, batch_size=4, save_every=2), progress=False)

    part = tmp_path / "part"

    def crash(step, logs):
        if step == N // 2 + 1:  # one step past the checkpoint at N/2: that step's work is lost
            raise KeyboardInterrupt

    cfg = config(env, part, data=str(env["prep_hidden"]), max_steps=N, batch_size=4, save_every=N // 2)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False, on_step=crash)
    state = json.loads((part / "training_state" / "state.json").read_text())
    assert state["step"] == N // 2
    res = train(config(env, part, data=str(env["prep_hidden"]), max_steps=N, batch_size=4, resume=True), progress=False)
    assert res.steps == N
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_refuses_changed_settings(env, tmp_path):
    out = tmp_path / "run"
    train(config(env, out, data=str(env["prep_hidden"]), max_steps=1, batch_size=4), progress=False)
    with pytest.raises(EagleScopeError, match="--lr"):
        train(config(env, out, data=str(env["prep_hidden"]), max_steps=1, batch_size=4, lr=5e-4, resume=True))
    with pytest.raises(EagleScopeError, match="--resume to continue"):
        train(config(env, out, data=str(env["prep_hidden"]), max_steps=1, batch_size=4))


def test_nan_loss_stops_with_one_line_naming_step_and_checkpoint(env, tmp_path, capsys):
    out = tmp_path / "nan"
    argv = ["train", "--target", str(env["target"]), "--data", str(env["prep_hidden"]), "--out", str(out)]
    argv += ["--max-steps", "6", "--batch-size", "4", "--lr", "1e30", "--save-every", "1", "--device", "cpu"]
    argv += ["--dtype", "float32", "--max-length", "96"]
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    m = re.fullmatch(
        r"eaglescope: error: loss became (nan|inf) at step (\d+); last good checkpoint: (.+) \(step (\d+)\)", err
    )
    assert m, err
    step, ckpt, good = int(m.group(2)), Path(m.group(3)), int(m.group(4))
    assert good == step - 1 >= 1
    assert ckpt == out / "training_state"
    # the checkpoint it names is whole: the state loads at that step and the draft has finite weights
    assert json.loads((ckpt / "state.json").read_text())["step"] == good
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert state["step"] == good
    loaded = load_draft(out)
    assert all(torch.isfinite(p).all() for p in loaded.model.parameters())
    assert not any(p.name.startswith(".") for p in out.iterdir()), list(out.iterdir())


def test_stored_hidden_states_fix_the_taps(env, tmp_path):
    with pytest.raises(EagleScopeError, match="conflicts with the hidden states"):
        train(config(env, tmp_path / "x", data=str(env["prep_hidden"]), taps="1,2,3", max_steps=1))
    with pytest.raises(EagleScopeError, match="draft vocabulary"):
        train(config(env, tmp_path / "y", data=str(env["prep_hidden"]), draft_vocab_size=64, max_steps=1))


def test_output_is_a_draft_checkpoint_that_generate_runs(env, trained, capsys):
    out, res = trained
    loaded = load_draft(out)
    c = loaded.contract
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    assert not loaded.has_embedding  # the target's embedding is frozen and not saved
    assert c.ttt_length == 7 and c.loss_mask_shift == LOSS_MASK_SHIFT
    assert c.taps == PreparedData.open(env["prep"]).taps or c.taps.is_default
    assert c.target == target.fingerprint
    assert c.draft_vocab_source.startswith("prepared data token frequencies")
    d2t, t2d = PreparedData.open(env["prep"]).vocab()
    assert torch.equal(loaded.model.d2t, d2t) and torch.equal(loaded.model.t2d, t2d)
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert len(metrics["acc"]) == len(metrics["alpha"]) == 7
    assert metrics["predicted_accept_length"] == pytest.approx(predicted_accept_length(metrics["alpha"]))
    prompt = ",".join(map(str, env["prompts"][0]))
    rc = main(["generate", "--target", str(env["target"]), "--draft", str(out), "--prompt-ids", prompt])
    assert rc == 0
    capsys.readouterr()
    rc = main(
        ["generate", "--target", str(env["target"]), "--draft", str(out), "--prompt-ids", prompt, "--chain", "3"]
        + ["--max-new-tokens", "12", "--json"]
    )
    assert rc == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["accept_length"] >= 1.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"train/loss", "lr", "eval/simulated_tau"}
    want |= {f"train/loss_{k}" for k in range(7)} | {f"train/acc_{k}" for k in range(7)}
    want |= {f"eval/acc_{k}" for k in range(7)} | {f"eval/alpha_{k + 1}" for k in range(7)}
    assert want <= tags, want - tags
    assert len(acc.Scalars("train/loss")) == STEPS
    assert len(acc.Scalars("eval/simulated_tau")) == 2  # mid-run (--eval-every) and final


# -- metrics ---------------------------------------------------------------------------------------
def test_alpha_is_conditional_on_earlier_hits():
    # 4 positions × 3 steps. acc = [3/4, 2/4, 2/4]; but step 1 hits only where step 0 missed once.
    hits = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    sup = torch.ones_like(hits)
    alpha, accepted, reached = acceptance_from_hits(hits, sup)
    assert reached == [4, 3, 2] and accepted == [3, 2, 1]
    assert alpha == pytest.approx([0.75, 2 / 3, 0.5])
    # averages alone would say α_3 = acc_3/acc_2 = 1.0
    assert acceptance_from_acc([0.75, 0.5, 0.5])[2] == pytest.approx(1.0)
    # unsupervised later steps leave the denominator
    sup[0, 2] = False
    alpha, _, reached = acceptance_from_hits(hits, sup)
    assert reached[2] == 1 and alpha[2] == 0.0
    assert predicted_accept_length([0.5, 0.5]) == pytest.approx(1.75)
    assert predicted_accept_length([0.5, float("nan")]) == pytest.approx(1.5)


def test_eval_acc_is_ttt_loss_acc(env):
    from drafts import make_draft

    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    draft, contract = make_draft(env["target"], draft_vocab_size=128, seed=3)
    draft.load_target_embedding(target_embedding(target))
    target.set_taps(contract.taps)
    data, ev = heldout(env)
    batch = make_batch(target, collate([data.sample(i) for i in ev[:6]], 96), torch.device("cpu"), torch.float32)
    m = evaluate(draft, [batch], 4)
    with torch.no_grad():
        ref = ttt_loss(
            draft, ttt_unroll(draft, batch.input_ids, batch.aux, 4), batch.target_logits, batch.loss_mask, batch.valid
        )
    assert m["acc"] == pytest.approx(ref.step_acc)
    assert m["supervised_positions"] == ref.step_count
    assert m["loss"] == pytest.approx(ref.step_loss, rel=1e-5)


def test_lr_schedule_warms_up_then_decays():
    f = [lr_factor(s, 4, 20) for s in range(20)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False))
    assert f[-1] < 0.05
