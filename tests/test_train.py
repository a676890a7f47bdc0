"""eaglescope train: learning, the TTT ablation, resume, NaN handling, and a loadable output.

The target is a tiny Llama pretrained here on an order-2 Markov chain: token t+2 is a fixed
permutation (chosen by token t+1) of token t, so the previous token alone says nothing about the next
one. A draft predicts token t+2 from the target's features at t (which know tokens t and t-1) and the
embedding of token t+1. At deeper steps the features are replaced by the draft's own output, which
must carry the earlier token itself: training-time test (TTT) teaches that; without it the draft is
as good as blind after the first step, the seed scenario's "first step fine, later steps collapse".
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglescope.cli import main
from eaglescope.corpus import COMPLETION_TEMPLATE, train_tokenizer
from eaglescope.data.prepare import PrepareConfig, prepare
from eaglescope.data.shards import PreparedData
from eaglescope.decode.loop import generate_speculative
from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.decode.stats import SpecStats
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import Eagle3Draft, load_draft
from eaglescope.models.targets import load_target
from eaglescope.outputs import partial_dir
from eaglescope.pretrain import PretrainConfig, pretrain, save_target
from eaglescope.train import loop as train_loop
from eaglescope.train.loop import TrainConfig, collate, lr_factor, make_batch, split_indices, train
from eaglescope.train.metrics import (
    acceptance_from_acc,
    acceptance_from_hits,
    evaluate,
    predicted_accept_length,
)
from eaglescope.train.ttt import LOSS_MASK_SHIFT, draft_vocab_ids, ttt_loss, ttt_unroll

SYMBOLS = "abcdefgh"  # one byte-level token each: the tokenizer below learns no merges
TAPS = "0,1,2"  # all three layer inputs of the 3-layer target (the default taps need 7 layers)
MAX_LEN = 64  # prompt (8-16) + answer (<= 40) + end of text; the target is pretrained on 64-token windows
TTT = 7
STEPS = 150
CHAIN = 4  # served chain depth


def order2_chain(rng: random.Random, perm: list[list[int]], n: int, p: float = 0.9) -> str:
    """n symbols: x[t+2] = perm[x[t+1]][x[t]] with probability p, else uniform."""
    x = [rng.randrange(len(perm)), rng.randrange(len(perm))]
    while len(x) < n:
        x.append(perm[x[-1]][x[-2]] if rng.random() < p else rng.randrange(len(perm)))
    return "".join(SYMBOLS[i] for i in x)


def build_env(root: Path, n: int = 48, seed: int = 0) -> dict:
    """Pretrain the order-2 target (~10 s of CPU), then data whose answers are its own greedy continuations
    of held-back chain prefixes (the EAGLE recipe, via `prepare --regenerate`), with and without hidden states."""
    rng = random.Random(seed)
    perm = [rng.sample(range(len(SYMBOLS)), len(SYMBOLS)) for _ in SYMBOLS]
    # 256 bytes + 2 specials fill the vocabulary, so every symbol stays a token of its own.
    tok = train_tokenizer([SYMBOLS], 258, root / "tokenizer", COMPLETION_TEMPLATE)

    def ids(text: str) -> torch.Tensor:
        return torch.tensor(tok(text)["input_ids"])

    pcfg = PretrainConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        seq_len=MAX_LEN,
        batch_size=16,
        steps=300,
        lr=2e-3,
        warmup=20,
        seed=seed,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model, stats = pretrain(
        pcfg, ids(order2_chain(rng, perm, 40_000)), ids(order2_chain(rng, perm, 4000)), "cpu", False
    )
    target_dir = save_target(model, pcfg, root / "target", root / "tokenizer", extra={"stats": stats})
    # The user turn is a chain prefix; the assistant placeholder is replaced by the target's greedy answer.
    rows = [
        {
            "messages": [
                {"role": "user", "content": order2_chain(rng, perm, rng.randint(8, 16))},
                {"role": "assistant", "content": "a"},
            ]
        }
        for _ in range(n)
    ]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = dict(
        target=str(target_dir), taps=TAPS, max_length=MAX_LEN, draft_vocab_size=32, device="cpu", dtype="float32"
    )
    prep_hidden = root / "prep_hidden"
    prepare(
        PrepareConfig(
            data=str(data), out=str(prep_hidden), regenerate=True, regen_max_new_tokens=40, hidden_states=True, **common
        ),
        progress=False,
    )
    # Online-mode data: the same regenerated conversations, written back out and rendered without hidden states.
    stored = PreparedData.open(prep_hidden)
    regen = root / "regenerated.jsonl"
    with regen.open("w") as f:
        for i in range(stored.num_samples):
            s = stored.sample(i)
            start = int(s["loss_mask"].nonzero()[0])
            user, answer = tok.decode(s["input_ids"][:start]), tok.decode(s["input_ids"][start:-1])  # [-1]: eos
            f.write(
                json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
                + "\n"
            )
    prep = root / "prep"
    prepare(PrepareConfig(data=str(regen), out=str(prep), **common), progress=False)
    prompts = [
        stored.sample(i)["input_ids"][: int(stored.sample(i)["loss_mask"].nonzero()[0])].tolist() for i in range(4)
    ]
    return {
        "root": root,
        "target": target_dir,
        "prep": prep,
        "prep_hidden": prep_hidden,
        "prompts": prompts,
        "perm": perm,
    }


_ENVS: dict = {}


def shared_env(tmp_path_factory) -> dict:
    """One environment per test session (test_train_ddp uses it too)."""
    if "env" not in _ENVS:
        _ENVS["env"] = build_env(tmp_path_factory.mktemp("train_env"))
    return _ENVS["env"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return shared_env(tmp_path_factory)


def config(env, out, **kw) -> TrainConfig:
    base = dict(
        target=str(env["target"]),
        data=str(env["prep_hidden"]),
        out=str(out),
        batch_size=8,
        lr=2e-3,
        eval_fraction=0.25,
        max_length=MAX_LEN,
        device="cpu",
        dtype="float32",
    )
    return TrainConfig(**{**base, **kw})


def heldout(env, hidden: bool = True):
    """The held-out split (the one train() evaluates on)."""
    data = PreparedData.open(env["prep_hidden" if hidden else "prep"])
    _, ev = split_indices(data.num_samples, 0.25)
    return data, ev


def with_target(env, path) -> tuple[Eagle3Draft, object]:
    """A saved draft with the target's embedding, and the target tapped where the draft reads."""
    loaded = load_draft(path)
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    target.set_taps(loaded.contract.taps)
    loaded.model.load_target_embedding(target_embedding(target))
    return loaded.model, target


def untrained_like(env, path) -> Eagle3Draft:
    draft, _ = with_target(env, path)
    torch.manual_seed(123)
    for m in draft.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    return draft


def eval_draft(env, draft: Eagle3Draft, K: int = TTT) -> dict:
    """Teacher-forced acc_k / α_k over the held-out split (stored hidden states)."""
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    data, ev = heldout(env)
    vocab_ids = draft_vocab_ids(draft)
    batches = [
        make_batch(
            target,
            collate([data.sample(i) for i in ev[j : j + 8]], MAX_LEN),
            torch.device("cpu"),
            torch.float32,
            vocab_ids,
        )
        for j in range(0, len(ev), 8)
    ]
    return evaluate(draft, batches, K)


def served(env, draft: Eagle3Draft, depth: int = CHAIN) -> SpecStats:
    """Greedy chain decoding from each held-out prompt (the text before its answer): served τ and α_k."""
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    target.set_taps(PreparedData.open(env["prep_hidden"]).taps)
    data, ev = heldout(env)
    stats = SpecStats()
    for i in ev:
        s = data.sample(i)
        start = int(s["loss_mask"].nonzero()[0])
        prop = Eagle3Proposer(draft, depth, 1, depth + 1, max_len=start + 40)
        stats.merge(generate_speculative(target, prop, s["input_ids"][:start].tolist(), 32, stop_ids=[]).stats)
    return stats


def mean(xs: list[float]) -> float:
    """Mean, where a step that no round reached counts as 0 (the step before it accepted nothing)."""
    xs = [0.0 if math.isnan(x) else x for x in xs]
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def trained(env, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / f"ttt{TTT}"
    res = train(config(env, out, ttt_length=TTT, max_steps=STEPS, eval_every=STEPS // 2), progress=False)
    return out, res


def test_the_target_learned_its_chain(env):
    # Everything below rests on this: the target's own greedy answers follow the order-2 rule.
    perm, tok = env["perm"], load_target(env["target"], device="cpu").tokenizer
    data, online = PreparedData.open(env["prep_hidden"]), PreparedData.open(env["prep"])
    follows, answered = 0, 0
    for i in range(data.num_samples):
        s = data.sample(i)
        start = int(s["loss_mask"].nonzero()[0])
        x = [SYMBOLS.index(c) for c in tok.decode(s["input_ids"][:-1])]  # [-1]: the end-of-text token
        follows += sum(x[t] == perm[x[t - 1]][x[t - 2]] for t in range(start, len(x)))
        answered += len(x) - start
        # the online-mode data holds the same regenerated conversations
        assert torch.equal(online.sample(i)["input_ids"], s["input_ids"])
        assert torch.equal(online.sample(i)["loss_mask"], s["loss_mask"])
    assert answered > 30 * data.num_samples  # regenerated answers, not the one-symbol placeholder
    assert follows > 0.95 * answered, follows / answered


def test_training_lowers_the_loss_and_beats_an_untrained_draft(env, trained):
    out, res = trained
    losses = [h["loss"] for h in res.history]
    assert sum(losses[-10:]) / 10 < 0.4 * losses[0]
    draft, _ = with_target(env, out)
    fresh = untrained_like(env, out)
    m_trained, m_fresh = eval_draft(env, draft), eval_draft(env, fresh)
    assert m_trained["acc"][0] > m_fresh["acc"][0] + 0.5, (m_trained["acc"], m_fresh["acc"])
    # the loop's own final evaluation is the same held-out measurement
    assert res.metrics["split"] == "held-out"
    assert res.metrics["acc"] == pytest.approx(m_trained["acc"], abs=1e-6)
    s_trained, s_fresh = served(env, draft), served(env, fresh)
    assert s_trained.accept_length > s_fresh.accept_length + 1.5, (s_trained.to_dict(), s_fresh.to_dict())
    assert s_fresh.accept_length < 1.3


def test_online_training_equals_training_on_stored_hidden_states(env, tmp_path):
    # The target run per batch and the features prepare stored are the same numbers (to float noise).
    a, b = tmp_path / "online", tmp_path / "stored"
    train(config(env, a, data=str(env["prep"]), taps=TAPS, max_steps=3, ttt_length=3), progress=False)
    train(config(env, b, max_steps=3, ttt_length=3), progress=False)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_stored_hidden_states_need_only_the_targets_embedding_and_head(env, tmp_path):
    # A copy of the target with its decoder layers gone, as if they lived on GPUs this machine does not have: a draft
    # trained on stored hidden states is the same, and the run never needs them. Sharded, as large targets are.
    from layerless import layerless_copy

    slim = layerless_copy(env["target"], tmp_path / "slim-target")
    assert len(json.loads((slim / "model.safetensors.index.json").read_text())["weight_map"]) == 1  # a tied head
    a, b = tmp_path / "full", tmp_path / "slim"
    train(config(env, a, max_steps=3, ttt_length=3), progress=False)
    train(config(env, b, target=str(slim), max_steps=3, ttt_length=3), progress=False)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # and the online path still needs the whole target: one clear error, not a draft trained on a broken target
    with pytest.raises(EagleScopeError):
        train(config(env, tmp_path / "online", target=str(slim), data=str(env["prep"]), taps=TAPS, max_steps=1),
              progress=False)  # fmt: skip


def test_no_ttt_collapses_after_the_first_step(env, trained, tmp_path):
    out_ttt, _ = trained
    out1 = tmp_path / "ttt1"
    train(config(env, out1, ttt_length=1, max_steps=STEPS), progress=False)  # the same budget
    assert load_draft(out1).contract.ttt_length == 1
    d1, dk = with_target(env, out1)[0], with_target(env, out_ttt)[0]
    m1, mk = eval_draft(env, d1, K=CHAIN), eval_draft(env, dk, K=CHAIN)
    a1, ak = m1["alpha"], mk["alpha"]
    # Step 0 is trained either way: the first draft token is about equally good ...
    assert min(a1[0], ak[0]) > 0.8 and abs(a1[0] - ak[0]) < 0.1, (a1, ak)
    # ... but only TTT taught the draft to read its own output; without it step 1 is near chance (1/8).
    assert ak[1] > 0.85 and a1[1] < ak[1] - 0.4, (a1, ak)
    # Deeper conditional α of the ttt-1 draft is measured on the few positions that got lucky twice,
    # so it can be high by chance; their mean still lags, and acc_k (all positions) lags by far.
    assert mean(a1[1:]) < mean(ak[1:]) - 0.2, (a1, ak)
    assert mean(m1["acc"][1:]) < 0.4 and mean(m1["acc"][1:]) < mean(mk["acc"][1:]) - 0.4, (m1["acc"], mk["acc"])
    assert mk["predicted_accept_length"] > m1["predicted_accept_length"] + 1.5
    # The same, served by the real decoder (chain of 4).
    s1, sk = served(env, d1), served(env, dk)
    # Served α_1 is measured at round starts, which follow the draft's misses: a noisier sample than the above.
    assert min(s1.alpha[0], sk.alpha[0]) > 0.6 and abs(s1.alpha[0] - sk.alpha[0]) < 0.35, (s1.alpha, sk.alpha)
    assert sk.alpha[1] > 0.8 and s1.alpha[1] < sk.alpha[1] - 0.4, (s1.alpha, sk.alpha)
    assert mean(s1.alpha[1:]) < mean(sk.alpha[1:]) - 0.2, (s1.alpha, sk.alpha)
    reach1, reachk = s1.accepted_per_position, sk.accepted_per_position  # P(accepted >= k) per round
    assert mean(reach1[1:]) < mean(reachk[1:]) - 0.4, (reach1, reachk)
    assert sk.accept_length > s1.accept_length + 1.0, (s1.accept_length, sk.accept_length)


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
    # the interrupted run waits beside --out, which stays empty until a run completes
    assert not part.exists()
    state = json.loads((partial_dir(part) / "training_state" / "state.json").read_text())
    assert state["step"] == N // 2
    res = train(config(env, part, data=str(env["prep_hidden"]), max_steps=N, batch_size=4, resume=True), progress=False)
    assert res.steps == N and not partial_dir(part).exists()
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sigkill_then_resume_gives_identical_weights(env, tmp_path):
    """A real kill (no handler runs) between checkpoints: the interrupted run waits beside --out, and --resume
    finishes it with the weights of a run that was never interrupted, bit for bit."""
    N = 30
    full = tmp_path / "full"
    train(config(env, full, max_steps=N, batch_size=4), progress=False)
    out = tmp_path / "killed"
    argv = ["train", "--target", str(env["target"]), "--data", str(env["prep_hidden"]), "--out", str(out)]
    argv += ["--max-steps", str(N), "--batch-size", "4", "--lr", "2e-3", "--eval-fraction", "0.25", "--save-every", "5"]
    argv += ["--max-length", str(MAX_LEN), "--device", "cpu", "--dtype", "float32"]
    state = partial_dir(out) / "training_state" / "state.json"
    proc = subprocess.Popen([sys.executable, "-m", "eaglescope.cli", *argv], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (state.is_file() and json.loads(state.read_text())["step"] >= 10):
            assert proc.poll() is None, proc.communicate()[1][-800:]
            assert time.monotonic() < deadline, "no checkpoint in 240 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL and not out.exists()
    killed_at = json.loads(state.read_text())["step"]
    assert 10 <= killed_at < N
    res = train(config(env, out, max_steps=N, batch_size=4, save_every=5, resume=True), progress=False)
    assert res.steps == N and not partial_dir(out).exists()
    a, b = _weights(full), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _ticks(seconds_per_call: float = 1.0):
    """A deterministic clock for the time budget: each reading is `seconds_per_call` later than the last."""
    n = itertools.count()
    return lambda: next(n) * seconds_per_call


def test_max_seconds_fits_the_schedule_to_the_steps_that_fit(env, tmp_path, monkeypatch):
    # one clock reading at the start and one per step until the fit: 1 s a step, fitted after FIT_AFTER steps
    monkeypatch.setattr(train_loop, "_clock", _ticks())
    res = train(config(env, tmp_path / "a", max_steps=1000, max_seconds=20, warmup_steps=5, batch_size=4), False)
    assert res.steps == 20  # 5 steps timed at 1 s, 15 more fit in the 15 s left
    lrs = [h["lr"] for h in res.history]
    # the whole run is on the fitted schedule (warmup >= FIT_AFTER: the steps before the fit too), ending near 0
    assert lrs == pytest.approx([2e-3 * lr_factor(s, 5, 20) for s in range(20)])
    assert lrs[-1] < 0.05 * max(lrs)
    state = json.loads((tmp_path / "a" / "training_state" / "state.json").read_text())
    assert state["fit"]["total"] == 20 and state["fit"]["fitted"]
    # never longer than --max-steps / --epochs give
    monkeypatch.setattr(train_loop, "_clock", _ticks())
    assert train(config(env, tmp_path / "b", max_steps=12, max_seconds=1000, batch_size=4), False).steps == 12
    # a budget spent before the fit ends the run there
    monkeypatch.setattr(train_loop, "_clock", _ticks())
    assert train(config(env, tmp_path / "c", max_steps=1000, max_seconds=2, batch_size=4), False).steps == 2


def test_max_seconds_on_the_real_clock(env, tmp_path):
    t = []
    res = train(config(env, tmp_path / "r", epochs=1000.0, max_seconds=3.0, batch_size=4), False,
                on_step=lambda step, logs: t.append(time.perf_counter()))  # fmt: skip
    assert train_loop.FIT_AFTER < res.steps < 1000 * 4  # fitted, far below the nominal length
    assert t[-1] - t[0] < 2 * 3.0 + 2.0, t[-1] - t[0]  # the steps kept (roughly) to the budget
    assert res.history[-1]["lr"] < 0.05 * max(h["lr"] for h in res.history)  # and the schedule ran to its end


def test_resume_of_a_timed_run_reaches_the_same_steps_with_the_same_weights(env, tmp_path, monkeypatch):
    cfg = dict(max_steps=1000, max_seconds=20, warmup_steps=5, batch_size=4)
    monkeypatch.setattr(train_loop, "_clock", _ticks())
    full = tmp_path / "full"
    assert train(config(env, full, **cfg), False).steps == 20

    def crash(step, logs):
        if step == 10:  # two steps past the checkpoint at 8, after the fit at 5
            raise KeyboardInterrupt

    part = tmp_path / "part"
    monkeypatch.setattr(train_loop, "_clock", _ticks())
    with pytest.raises(KeyboardInterrupt):
        train(config(env, part, save_every=8, **cfg), False, on_step=crash)
    # the resumed run runs on a clock 100x slower: it keeps the saved length instead of fitting again
    monkeypatch.setattr(train_loop, "_clock", _ticks(100.0))
    with pytest.raises(EagleScopeError, match="--max-seconds"):
        train(config(env, part, resume=True, **{**cfg, "max_seconds": 30}), False)
    res = train(config(env, part, resume=True, **cfg), False)
    assert res.steps == 20 and [h["step"] for h in res.history] == list(range(9, 21))
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_max_seconds_must_be_positive(env, tmp_path, capsys):
    argv = ["train", "--target", str(env["target"]), "--data", str(env["prep_hidden"]), "--out", str(tmp_path / "x")]
    for bad in ("0", "-1", "nan"):
        assert main([*argv, "--max-seconds", bad, "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"eaglescope: error: --max-seconds must be a positive number of seconds, got {float(bad)}.", err
    assert not (tmp_path / "x").exists()


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
    argv += ["--dtype", "float32", "--max-length", str(MAX_LEN)]
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
    assert ckpt == partial_dir(out) / "training_state"  # kept beside --out, where --resume finds it
    # the checkpoint it names is whole: the state loads at that step and the draft has finite weights
    assert json.loads((ckpt / "state.json").read_text())["step"] == good
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert state["step"] == good
    loaded = load_draft(ckpt.parent)
    assert all(torch.isfinite(p).all() for p in loaded.model.parameters())
    assert not out.exists()  # nothing half-trained stands at --out


def test_stored_hidden_states_fix_the_taps(env, tmp_path):
    with pytest.raises(EagleScopeError, match="conflicts with the hidden states"):
        train(config(env, tmp_path / "x", data=str(env["prep_hidden"]), taps="0,2", max_steps=1))
    with pytest.raises(EagleScopeError, match="draft vocabulary"):
        train(config(env, tmp_path / "y", data=str(env["prep_hidden"]), draft_vocab_size=64, max_steps=1))


def test_output_is_a_draft_checkpoint_that_generate_runs(env, trained, capsys):
    out, res = trained
    loaded = load_draft(out)
    c = loaded.contract
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    assert not loaded.has_embedding  # the target's embedding is frozen and not saved
    assert c.ttt_length == TTT and c.loss_mask_shift == LOSS_MASK_SHIFT
    assert c.taps == PreparedData.open(env["prep_hidden"]).taps
    assert c.target == target.fingerprint
    assert c.draft_vocab_source.startswith("prepared data token frequencies")
    d2t, t2d = PreparedData.open(env["prep_hidden"]).vocab()
    assert torch.equal(loaded.model.d2t, d2t) and torch.equal(loaded.model.t2d, t2d)
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert len(metrics["acc"]) == len(metrics["alpha"]) == TTT
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
    want |= {f"train/loss_{k}" for k in range(TTT)} | {f"train/acc_{k}" for k in range(TTT)}
    want |= {f"eval/acc_{k}" for k in range(TTT)} | {f"eval/alpha_{k + 1}" for k in range(TTT)}
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
    draft, contract = make_draft(env["target"], PreparedData.open(env["prep"]).taps, draft_vocab_size=128, seed=3)
    draft.load_target_embedding(target_embedding(target))
    target.set_taps(contract.taps)
    data, ev = heldout(env, hidden=False)  # the target runs online here
    raw = collate([data.sample(i) for i in ev[:6]], MAX_LEN)
    batch = make_batch(target, raw, torch.device("cpu"), torch.float32, draft_vocab_ids(draft))
    m = evaluate(draft, [batch], 4)
    with torch.no_grad():
        ref = ttt_loss(
            draft, ttt_unroll(draft, batch.input_ids, batch.aux, 4), batch.teacher, batch.loss_mask, batch.valid
        )
    assert m["acc"] == pytest.approx(ref.step_acc)
    assert m["supervised_positions"] == ref.step_count
    assert m["loss"] == pytest.approx(ref.step_loss, rel=1e-5)


def test_lr_schedule_warms_up_then_decays():
    f = [lr_factor(s, 4, 20) for s in range(20)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False))
    assert f[-1] < 0.05
