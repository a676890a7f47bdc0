"""`eaglescope demo` trains its target by steps, so it gives the same target on a fast, a slow or a busy machine and
finishes on any of them; a wall-clock cap runs only when the user sets one (--time-budget), and a target that cap
left too weak to mean anything is refused in one line that names the cap."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from eaglescope.cli import build_parser
from eaglescope.cli import demo as cli_demo
from eaglescope.corpus import COMPLETION_TEMPLATE, stdlib_corpus, train_tokenizer
from eaglescope.demo import DemoConfig, check_target_sound
from eaglescope.errors import EagleScopeError
from eaglescope.pretrain import PretrainConfig, pretrain, save_target


def _slow_clock(monkeypatch, seconds_per_reading: float) -> None:
    """pretrain's clock on a machine as slow as asked: each reading `seconds_per_reading` later than the last."""
    n = itertools.count()
    fake = types.SimpleNamespace(perf_counter=lambda: next(n) * seconds_per_reading)
    monkeypatch.setattr("eaglescope.pretrain.time", fake)


def _tiny(vocab_size: int = 64, **kw) -> PretrainConfig:
    shape = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, seq_len=16)
    return PretrainConfig(vocab_size=vocab_size, batch_size=2, warmup=2, **shape, **kw)


def _tokens(n: int, vocab_size: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(0))


def test_the_demo_has_no_time_cap_unless_the_user_sets_one(monkeypatch, tmp_path):
    assert DemoConfig(workdir=str(tmp_path)).pretrain_budget_s is None
    assert DemoConfig(workdir=str(tmp_path), fast=True).pretrain_budget_s is None
    seen = []
    monkeypatch.setattr(cli_demo, "run_demo", lambda cfg: seen.append(cfg) or {"identical": True})
    for flags, cap in (([], None), (["--time-budget", "30"], 30.0), (["--time-budget", "0"], None)):
        args = build_parser().parse_args(["demo", "--fast", "--workdir", str(tmp_path), *flags])
        assert cli_demo.cmd_demo(args) == 0
        assert seen[-1].pretrain_budget_s == cap and seen[-1].pretrain_steps == 200


def test_pretraining_runs_every_step_on_a_slow_machine_unless_capped(monkeypatch):
    _slow_clock(monkeypatch, 10.0)  # 2 s a step at the fit (one reading at the start, one after 5 steps)
    _, stats = pretrain(_tiny(steps=40), _tokens(4000), None, progress=False)
    assert stats["steps"] == 40  # no cap: slow, but every step
    _slow_clock(monkeypatch, 10.0)
    cfg = _tiny(steps=40, time_budget_s=30.0)
    _, stats = pretrain(cfg, _tokens(4000), None, progress=False)
    assert stats["steps"] == 15 and cfg.steps == 15  # the user's cap: the schedule shrinks to the 15 steps that fit


@pytest.fixture(scope="module")
def weak_target(tmp_path_factory):
    """A real, saved target trained for 10 steps: its held-out loss is near uniform guessing."""
    work = tmp_path_factory.mktemp("weak")
    corpus = stdlib_corpus()
    tok = train_tokenizer(corpus.read(corpus.train[:40]), 300, work / "tok", COMPLETION_TEMPLATE)
    ids = torch.tensor(tok(corpus.read(corpus.train[40:60]))["input_ids"][0][:20000] + [0] * 100)
    pcfg = _tiny(vocab_size=len(tok), steps=10, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model, stats = pretrain(pcfg, ids, ids[-5000:], progress=False)
    save_target(model, pcfg, work / "target", work / "tok")
    return work / "target", stats, len(tok)


def test_a_target_the_users_cap_left_weak_is_refused_naming_the_cap(weak_target, tmp_path):
    target, stats, vocab = weak_target
    cfg = DemoConfig(workdir=str(tmp_path), fast=True, vocab_size=vocab, pretrain_budget_s=5.0)  # 200 steps asked
    with pytest.raises(EagleScopeError) as e:
        check_target_sound(cfg, target, stats)
    msg = str(e.value)
    assert "too weak" in msg and "held-out loss" in msg
    assert "5 s time cap stopped it after 10 of 200 steps" in msg and "without --time-budget" in msg


def test_a_weak_target_without_a_cap_asks_for_more_steps_not_less_cap(weak_target, tmp_path):
    target, stats, vocab = weak_target
    cfg = DemoConfig(workdir=str(tmp_path), vocab_size=vocab, pretrain_steps=10)  # every asked step ran
    with pytest.raises(EagleScopeError) as e:
        check_target_sound(cfg, target, stats)
    msg = str(e.value)
    assert "too weak" in msg and "--pretrain-steps" in msg and "time cap" not in msg and "--time-budget" not in msg
