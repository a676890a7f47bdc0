"""Bad input, every command: one stderr line `eaglescope: error: …`, exit code 2, and the user's files untouched.

The product's rule: whatever nonsense a user gives, the command answers with exactly one line on stderr
starting `eaglescope: error: ` and exit status 2: never a traceback, never `eaglescope: internal error`, never a
Python or library warning beside it, never exit 0. Nothing the user owns changes: every guarded file and directory
is byte-identical afterwards (an output is built beside its destination and swapped in only when complete, and a
destination is replaced only when it is the same kind of output the command writes).

Each case builds what it needs (damaged copies of the shared artifacts) in its own directory, which is guarded
whole together with the shared artifacts: a failed command may not create, change or delete anything there. The
CLI runs in-process through `eaglescope.cli.main` (no interpreter start per case); warnings are collected and
printed the way a plain `python` process would print them, so a stray UserWarning shows up on stderr as it would
for a user. Read-only destinations are made read-only for an ordinary user; when the suite runs as root the
command runs under an unprivileged uid for that case, since root writes through any permission bits.

EAGLESCOPE_BADINPUT_LOG=FILE appends each case's exit status and stderr to FILE as JSON lines (for reading what
users would see, passing cases included).

The few subprocess tests at the end interrupt `prepare`, `train` and `export` (SIGINT, SIGKILL) while they are
writing over a previous good output, and check that output survives byte-identical and a re-run completes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from badinput_fixtures import (
    DRAFT_VOCAB,
    MAX_LEN,
    NOBODY,
    PROMPT,
    Shared,
    build_shared,
    chown_tree,
    conversations,
    copy,
    corrupt_safetensors_header,
    describe_diff,
    drop_chat_template,
    drop_tokenizer,
    edit_json,
    flip_bytes,
    make_readonly,
    make_writable,
    nan_weight,
    ordinary_user,
    other_target,
    pickle_only,
    restore,
    shard_in_two,
    shard_index_outside,
    snapshot,
    target_with_tokenizer_of,
    truncate,
    write_jsonl,
)

from eaglescope.cli import main

PREFIX = "eaglescope: error: "
NOTES = "my notes: not eaglescope's to delete\n"


# -- the shared artifacts --------------------------------------------------------------------------------------
@dataclass
class Env:
    shared: Shared
    pristine: Path  # a copy of the shared root, to restore it after a case that damaged it
    cases: Path  # one directory per case below this


@pytest.fixture(scope="module")
def env():
    root = Path(tempfile.mkdtemp(prefix="eaglescope-badinput-"))
    try:
        shared = build_shared(root / "shared")
        # readable by the unprivileged user the read-only cases run as (mkstemp/mkdtemp leave 0600/0700)
        for p in [root, *root.rglob("*")]:
            p.chmod(p.stat().st_mode | (0o555 if p.is_dir() else 0o444))
        pristine = root / "pristine"
        shutil.copytree(shared.root, pristine)
        cases = root / "cases"
        cases.mkdir()
        yield Env(shared, pristine, cases)
    finally:
        make_writable(root)
        shutil.rmtree(root, ignore_errors=True)


# -- one case --------------------------------------------------------------------------------------------------
@dataclass
class Spec:
    argv: list[str]
    match: str | None = None  # a word the error line must contain (e.g. the flag it is about)
    cwd: Path | None = None  # run from this directory
    readonly: tuple[Path, ...] = ()  # made read-only for an ordinary user; the command runs as one


@dataclass
class Case:
    id: str
    make: Callable[[Env, Path], Spec]
    needs_no_gpu: bool = False


@dataclass
class Ctx:
    """What a case builder gets: the shared artifacts (s), its own directory (d) and helpers."""

    s: Shared
    d: Path

    def cp(self, what: str, name: str | None = None) -> Path:
        return copy(getattr(self.s, what), self.d / (name or what))

    def notes_dir(self, name: str) -> Path:
        p = self.d / name
        p.mkdir(parents=True)
        (p / "notes.txt").write_text(NOTES)
        return p

    def file(self, name: str, text: str = NOTES) -> Path:
        p = self.d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p


CASES: list[Case] = []


def case(cmd: str, name: str, needs_no_gpu: bool = False):
    def deco(fn: Callable[[Ctx], Spec]):
        CASES.append(Case(f"{cmd}-{name}", lambda env, d: fn(Ctx(env.shared, d)), needs_no_gpu))
        return fn

    return deco


def flag_cases(cmd: str, base: Callable[[Ctx], list[str]], table: list[tuple], needs_no_gpu=()) -> None:
    """Cases that are `base(ctx)` plus some flags: (name, flags, match)."""
    for name, flags, match in table:

        def make(c: Ctx, flags=flags, match=match) -> Spec:
            return Spec([*base(c), *flags], match=match)

        case(cmd, name, needs_no_gpu=name in needs_no_gpu)(make)


CPU = ["--device", "cpu", "--dtype", "float32"]


def gen(c: Ctx, target: Path | None = None, draft: Path | None = None, device: list[str] = CPU) -> list[str]:
    argv = ["generate", "--target", str(target or c.s.target), "--prompt-ids", PROMPT, "--max-new-tokens", "4"]
    if draft is not None:
        argv += ["--draft", str(draft)]
    return [*argv, *device]


def prep(c: Ctx, out: Path, target: Path | None = None, data: Path | None = None, device=CPU) -> list[str]:
    argv = ["prepare", "--target", str(target or c.s.target), "--data", str(data or c.s.data), "--out", str(out)]
    argv += ["--max-length", str(MAX_LEN), "--draft-vocab-size", str(DRAFT_VOCAB), "--shard-samples", "4"]
    return [*argv, "--hidden-states", *device]


def train(c: Ctx, out: Path, target: Path | None = None, data: Path | None = None, device=CPU) -> list[str]:
    argv = ["train", "--target", str(target or c.s.target), "--data", str(data or c.s.prep), "--out", str(out)]
    argv += ["--max-steps", "2", "--batch-size", "2", "--eval-fraction", "0.25", "--max-length", str(MAX_LEN)]
    return [*argv, *device]


def export(c: Ctx, out: Path, draft: Path | None = None) -> list[str]:
    return ["export", "--draft", str(draft or c.s.draft), "--to", "vllm", "--out", str(out)]


def replay(c: Ctx, out: Path, trace: Path | None = None, target=None, draft=None, device=CPU) -> list[str]:
    argv = ["replay", "--target", str(target or c.s.target), "--draft", str(draft or c.s.draft)]
    return [*argv, "--trace", str(trace or c.s.trace), "--out", str(out), *device]


def doctor(c: Ctx, target: Path | None = None, draft: Path | None = None) -> list[str]:
    return ["doctor", "--target", str(target or c.s.target), "--draft", str(draft or c.s.draft), *CPU]


# -- damaged drafts and targets (in the case directory) ----------------------------------------------------------
def draft_with(c: Ctx, fn, name: str = "draft") -> Path:
    d = c.cp("draft", name)
    edit_json(d / "config.json", fn)
    return d


def taps_string(cfg: dict) -> None:
    cfg["eaglescope"]["taps"] = "2,4,5"


def taps_out_of_range(cfg: dict) -> None:
    cfg["eaglescope"]["taps"]["layers"] = [2, 4, 20]


def no_contract(cfg: dict) -> None:
    cfg.pop("eaglescope")


def target_with(c: Ctx, fn, name: str = "target") -> Path:
    t = c.cp("target", name)
    fn(t)
    return t


def bad_config(text: str):
    return lambda t: (t / "config.json").write_text(text)


def config_edit(fn):
    return lambda t: edit_json(t / "config.json", fn)


def nan_draft(c: Ctx) -> Path:
    d = c.cp("draft")
    nan_weight(d, "midlayer.self_attn.q_proj.weight")
    return d


def vocab_mismatch_target(c: Ctx) -> Path:
    """A checkpoint whose vocab_size is smaller than its tokenizer (tokenizer and weights do not belong together)."""
    n = json.loads((c.s.target / "config.json").read_text())["vocab_size"]
    return target_with_tokenizer_of(c.d / "small-vocab", c.s.target, vocab_size=n - 20)


# == generate ===================================================================================================
flag_cases(
    "generate",
    gen,
    [
        ("temperature-nan", ["--temperature", "nan"], "temperature"),
        ("temperature-inf", ["--temperature", "inf"], "temperature"),
        ("temperature-negative", ["--temperature", "-1"], "temperature"),
        ("top-p-zero", ["--temperature", "0.7", "--top-p", "0"], "top-p"),
        ("top-p-above-one", ["--temperature", "0.7", "--top-p", "1.5"], "top-p"),
        ("top-p-nan", ["--temperature", "0.7", "--top-p", "nan"], "top-p"),
        ("top-k-zero", ["--temperature", "0.7", "--top-k", "0"], "top-k"),
        ("max-new-tokens-zero", ["--max-new-tokens", "0"], "max-new-tokens"),
        ("max-new-tokens-negative", ["--max-new-tokens", "-5"], "max-new-tokens"),
        ("device-cuda-without-gpu", ["--device", "cuda"], "cuda"),
        ("device-bogus", ["--device", "bogus"], "bogus"),
        ("dtype-bogus", ["--dtype", "float7"], "float7"),
        ("prompt-ids-empty", ["--prompt-ids", ""], None),
        ("prompt-ids-not-integers", ["--prompt-ids", "1,two,3"], "--prompt-ids"),
        ("prompt-id-negative", ["--prompt-ids=-1,2"], None),
        ("prompt-id-outside-vocab", ["--prompt-ids", "1,300"], "vocabulary"),
        ("prompt-longer-than-context", ["--prompt-ids", ",".join(["5"] * 300)], "context"),
        ("chain-negative-without-draft", ["--chain", "-1"], "--chain"),
        ("tree-without-draft", ["--tree", "3,2,6"], "--tree"),
        ("stop-ids-not-integers", ["--stop-ids", "1,x"], "--stop-ids"),
        ("stop-ids-negative", ["--stop-ids=-3"], "--stop-ids"),
        ("stop-ids-outside-vocab", ["--stop-ids", "5000"], "--stop-ids"),
        ("chat-with-prompt-ids", ["--chat"], "--chat"),
        ("no-batch-invariant-without-fast", ["--no-batch-invariant"], "--fast"),
        ("compile-without-fast", ["--compile"], "--fast"),
        ("fast-with-temperature", ["--fast", "--temperature", "0.7"], None),
    ],
    needs_no_gpu={"device-cuda-without-gpu"},
)

flag_cases(
    "generate",
    lambda c: gen(c, draft=c.s.draft),
    [
        ("chain-zero", ["--chain", "0"], "--chain"),
        ("chain-negative", ["--chain", "-1"], "--chain"),
        ("chain-longer-than-context", ["--chain", "300"], None),
        ("tree-two-fields", ["--tree", "3,2"], "--tree"),
        ("tree-not-integers", ["--tree", "x,y,z"], "--tree"),
        ("tree-depth-zero", ["--tree", "0,1,5"], "--tree"),
        ("tree-topk-zero", ["--tree", "3,0,6"], "--tree"),
        ("tree-total-one", ["--tree", "3,2,1"], "--tree"),
        ("tree-four-fields", ["--tree", "3,2,6,9"], "--tree"),
        ("tree-negative-depth", ["--tree=-1,2,6"], "--tree"),
        ("tree-topk-above-draft-vocab", ["--tree", f"3,{DRAFT_VOCAB + 36},{DRAFT_VOCAB + 60}"], None),
    ],
)


@case("generate", "draft-nan-weights")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, draft=nan_draft(c)), match="nan")


@case("generate", "draft-contract-taps-is-a-string")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, draft=draft_with(c, taps_string)), match="taps")


@case("generate", "draft-contract-taps-out-of-range")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, draft=draft_with(c, taps_out_of_range)))


@case("generate", "draft-for-a-target-of-another-hidden-size")
def _(c: Ctx) -> Spec:
    other = other_target(c.d / "other", vocab_size=300, hidden_size=32, intermediate_size=64)
    return Spec(gen(c, target=other, draft=c.s.draft), match="hidden_size")


@case("generate", "draft-without-contract-for-another-target")
def _(c: Ctx) -> Spec:
    # an official-format draft (no eaglescope section) served with a narrower target: the contract is inferred (a
    # UserWarning inside), the shapes do not fit; one error line and no warning printed beside it
    other = other_target(c.d / "other", vocab_size=300, hidden_size=32, intermediate_size=64)
    return Spec(gen(c, target=other, draft=draft_with(c, no_contract)))


@case("generate", "draft-vocab-differs-from-target")
def _(c: Ctx) -> Spec:
    other = other_target(c.d / "other", vocab_size=96)
    return Spec(gen(c, target=other, draft=c.s.draft), match="vocab")


@case("generate", "draft-missing")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, draft=c.d / "nope"), match="does not exist")


@case("generate", "draft-is-a-target-checkpoint")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, draft=c.cp("target", "not-a-draft")))


@case("generate", "draft-truncated-weights")
def _(c: Ctx) -> Spec:
    d = c.cp("draft")
    truncate(d / "model.safetensors")
    return Spec(gen(c, draft=d))


@case("generate", "draft-malformed-config")
def _(c: Ctx) -> Spec:
    d = c.cp("draft")
    (d / "config.json").write_text("{not json")
    return Spec(gen(c, draft=d), match="config.json")


@case("generate", "target-missing")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=c.d / "nope"), match="does not exist")


@case("generate", "target-is-a-file")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=c.file("model.bin")))


@case("generate", "target-missing-config")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=target_with(c, lambda t: (t / "config.json").unlink())), match="config.json")


@case("generate", "target-malformed-config")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=target_with(c, bad_config("{not json"))), match="config.json")


@case("generate", "target-config-is-a-list")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=target_with(c, bad_config("[1, 2]"))), match="config.json")


@case("generate", "target-config-layers-not-a-number")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=target_with(c, config_edit(lambda cfg: cfg.update(num_hidden_layers="eight")))))


@case("generate", "target-config-zero-layers")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=target_with(c, config_edit(lambda cfg: cfg.update(num_hidden_layers=0)))))


@case("generate", "target-truncated-safetensors")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=target_with(c, lambda t: truncate(t / "model.safetensors"))))


@case("generate", "target-corrupted-safetensors-header")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=target_with(c, lambda t: corrupt_safetensors_header(t / "model.safetensors"))))


@case("generate", "target-nan-weight")
def _(c: Ctx) -> Spec:
    return Spec(gen(c, target=target_with(c, lambda t: nan_weight(t, "model.layers.0.mlp.up_proj.weight"))))


@case("generate", "target-pickled-module-native")
def _(c: Ctx) -> Spec:
    t = target_with(c, lambda t: pickle_only(t, whole_module=True))
    return Spec([*gen(c, target=t), "--backend", "native"], match="pytorch_model.bin")


@case("generate", "target-pickled-module-hf")
def _(c: Ctx) -> Spec:
    t = target_with(c, lambda t: pickle_only(t, whole_module=True))
    return Spec([*gen(c, target=t), "--backend", "hf"])


@case("generate", "target-index-names-a-shard-outside")
def _(c: Ctx) -> Spec:
    t = c.cp("target")
    shard_index_outside(t, c.d / "outside.safetensors")
    return Spec(gen(c, target=t), match="outside.safetensors")


@case("generate", "target-index-names-an-absolute-shard")
def _(c: Ctx) -> Spec:
    t = c.cp("target")
    shard_index_outside(t, c.d / "elsewhere.safetensors")
    edit_json(
        t / "model.safetensors.index.json",
        lambda i: i.update(weight_map={k: str(c.d / "elsewhere.safetensors") for k in i["weight_map"]}),
    )
    return Spec(gen(c, target=t), match="elsewhere.safetensors")


@case("generate", "target-index-malformed")
def _(c: Ctx) -> Spec:
    t = c.cp("target")
    shard_index_outside(t, t / "model-00001-of-00001.safetensors")
    (t / "model.safetensors.index.json").write_text("{not json")
    return Spec(gen(c, target=t), match="index")


@case("generate", "target-index-shard-missing")
def _(c: Ctx) -> Spec:
    t = c.cp("target")
    shard_index_outside(t, t / "model-00001-of-00001.safetensors")
    (t / "model-00001-of-00001.safetensors").unlink()
    return Spec(gen(c, target=t), match="missing")


@case("generate", "target-sharded-second-shard-truncated")
def _(c: Ctx) -> Spec:
    t = c.cp("target")
    truncate(shard_in_two(t)[1])
    return Spec(gen(c, target=t), match="model-00002-of-00002")


@case("generate", "target-sharded-shard-header-corrupted")
def _(c: Ctx) -> Spec:
    t = c.cp("target")
    corrupt_safetensors_header(shard_in_two(t)[0])
    return Spec(gen(c, target=t), match="model-00001-of-00002")


@case("generate", "proposer-draft-lm-without-draft")
def _(c: Ctx) -> Spec:
    return Spec([*gen(c), "--proposer", "draft-lm", "--chain", "2"], match="--draft")


@case("generate", "proposer-draft-lm-given-an-eagle3-draft")
def _(c: Ctx) -> Spec:
    return Spec([*gen(c, draft=c.s.draft), "--proposer", "draft-lm", "--chain", "2"])


@case("generate", "target-tokenizer-larger-than-vocab")
def _(c: Ctx) -> Spec:
    return Spec(["generate", "--target", str(vocab_mismatch_target(c)), "--prompt", "The capital of France", *CPU])


@case("generate", "target-tokenizer-json-garbage")
def _(c: Ctx) -> Spec:
    t = target_with(c, lambda t: (t / "tokenizer.json").write_text("{garbage"))
    return Spec(["generate", "--target", str(t), "--prompt", "hello", *CPU], match="tokenizer")


@case("generate", "chat-without-chat-template")
def _(c: Ctx) -> Spec:
    t = target_with(c, drop_chat_template)
    return Spec(["generate", "--target", str(t), "--prompt", "hello", "--chat", *CPU], match="chat template")


@case("generate", "text-prompt-without-tokenizer")
def _(c: Ctx) -> Spec:
    t = target_with(c, drop_tokenizer)
    return Spec(["generate", "--target", str(t), "--prompt", "hello", *CPU], match="tokenizer")


@case("generate", "trace-onto-a-non-trace-dir")
def _(c: Ctx) -> Spec:
    return Spec([*gen(c, draft=c.s.draft), "--chain", "2", "--trace", str(c.notes_dir("mine"))])


@case("generate", "trace-onto-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec([*gen(c, draft=c.s.draft), "--chain", "2", "--trace", str(c.file("trace.txt"))])


@case("generate", "trace-onto-the-draft")
def _(c: Ctx) -> Spec:
    d = c.cp("draft")
    return Spec([*gen(c, draft=d), "--chain", "2", "--trace", str(d)])


@case("generate", "trace-onto-the-current-dir")
def _(c: Ctx) -> Spec:
    work = c.d / "work"
    work.mkdir()
    return Spec([*gen(c, draft=c.s.draft), "--chain", "2", "--trace", "."], cwd=work)


@case("generate", "trace-onto-a-read-only-dir")
def _(c: Ctx) -> Spec:
    ro = c.d / "ro"
    ro.mkdir()
    return Spec([*gen(c, draft=c.s.draft), "--chain", "2", "--trace", str(ro)], readonly=(ro,))


@case("generate", "trace-without-a-draft")
def _(c: Ctx) -> Spec:
    return Spec([*gen(c), "--trace", str(c.d / "t")], match="--trace")


# == prepare ====================================================================================================
def good_prep(c: Ctx) -> Path:
    return c.cp("prep", "out")


@case("prepare", "overwrite-good-prep-with-jsonl-without-assistant-turns")
def _(c: Ctx) -> Spec:
    data = write_jsonl(c.d / "none.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    return Spec([*prep(c, good_prep(c), data=data), "--overwrite"])


@case("prepare", "overwrite-good-prep-with-broken-jsonl")
def _(c: Ctx) -> Spec:
    data = c.file("bad.jsonl", json.dumps(conversations(1)[0]) + "\n{not json\n")
    return Spec([*prep(c, good_prep(c), data=data), "--overwrite"], match=":2")


@case("prepare", "overwrite-good-prep-with-non-utf8-jsonl")
def _(c: Ctx) -> Spec:
    data = c.d / "latin1.jsonl"
    data.write_bytes(json.dumps(conversations(1)[0]).encode() + b"\n" + b'{"messages": "caf\xe9"}\n')
    return Spec([*prep(c, good_prep(c), data=data), "--overwrite"])


@case("prepare", "overwrite-good-prep-with-jsonl-row-not-an-object")
def _(c: Ctx) -> Spec:
    data = c.file("list.jsonl", "[1, 2, 3]\n")
    return Spec([*prep(c, good_prep(c), data=data), "--overwrite"])


@case("prepare", "overwrite-good-prep-with-nan-target")
def _(c: Ctx) -> Spec:
    t = target_with(c, lambda t: nan_weight(t, "model.layers.0.mlp.up_proj.weight"))
    return Spec([*prep(c, good_prep(c), target=t), "--overwrite"])


@case("prepare", "out-read-only-empty-dir")
def _(c: Ctx) -> Spec:
    ro = c.d / "ro"
    ro.mkdir()
    return Spec(prep(c, ro), readonly=(ro,))


@case("prepare", "overwrite-read-only-good-prep")
def _(c: Ctx) -> Spec:
    out = good_prep(c)
    return Spec([*prep(c, out, data=write_jsonl(c.d / "d.jsonl", conversations(8))), "--overwrite"], readonly=(out,))


@case("prepare", "overwrite-out-is-the-target")
def _(c: Ctx) -> Spec:
    t = c.cp("target")
    return Spec([*prep(c, t, target=t), "--overwrite"])


@case("prepare", "overwrite-out-is-a-target-dir")
def _(c: Ctx) -> Spec:
    return Spec([*prep(c, c.cp("target", "some-model")), "--overwrite"])


@case("prepare", "overwrite-out-is-the-parent-of-data")
def _(c: Ctx) -> Spec:
    inputs = c.d / "inputs"
    data = copy(c.s.data, inputs / "data.jsonl")
    return Spec([*prep(c, inputs, data=data), "--overwrite"])


@case("prepare", "out-is-the-data-file")
def _(c: Ctx) -> Spec:
    data = c.cp("data", "data.jsonl")
    return Spec([*prep(c, data, data=data), "--overwrite"])


@case("prepare", "overwrite-out-is-the-current-dir")
def _(c: Ctx) -> Spec:
    work = c.notes_dir("work")
    return Spec([*prep(c, Path(".")), "--overwrite"], cwd=work)


@case("prepare", "out-is-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec(prep(c, c.file("out.txt")))


@case("prepare", "out-below-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec(prep(c, c.file("out.txt") / "sub"))


@case("prepare", "overwrite-out-holds-other-files")
def _(c: Ctx) -> Spec:
    return Spec([*prep(c, c.notes_dir("mine")), "--overwrite"])


@case("prepare", "overwrite-out-is-a-draft")
def _(c: Ctx) -> Spec:
    return Spec([*prep(c, c.cp("draft")), "--overwrite"])


@case("prepare", "out-holds-a-prep-of-other-inputs")
def _(c: Ctx) -> Spec:
    return Spec([*prep(c, good_prep(c)), "--limit", "5"], match="--overwrite")


@case("prepare", "data-missing")
def _(c: Ctx) -> Spec:
    return Spec(prep(c, c.d / "out", data=c.d / "nope.jsonl"))


@case("prepare", "data-is-a-directory")
def _(c: Ctx) -> Spec:
    return Spec(prep(c, c.d / "out", data=c.notes_dir("datadir")))


@case("prepare", "data-empty-file")
def _(c: Ctx) -> Spec:
    return Spec(prep(c, c.d / "out", data=c.file("empty.jsonl", "")))


@case("prepare", "target-without-chat-template")
def _(c: Ctx) -> Spec:
    return Spec(prep(c, c.d / "out", target=target_with(c, drop_chat_template)), match="chat template")


@case("prepare", "target-without-tokenizer")
def _(c: Ctx) -> Spec:
    return Spec(prep(c, c.d / "out", target=target_with(c, drop_tokenizer)), match="tokenizer")


@case("prepare", "target-tokenizer-larger-than-vocab")
def _(c: Ctx) -> Spec:
    return Spec(prep(c, c.d / "out", target=vocab_mismatch_target(c)))


@case("prepare", "target-truncated-safetensors")
def _(c: Ctx) -> Spec:
    return Spec(prep(c, c.d / "out", target=target_with(c, lambda t: truncate(t / "model.safetensors"))))


flag_cases(
    "prepare",
    lambda c: prep(c, c.d / "out"),
    [
        ("taps-not-integers", ["--taps", "2,x"], "taps"),
        ("taps-out-of-range", ["--taps", "1,9"], "range"),
        ("taps-negative", ["--taps=-1,2,4"], None),
        ("taps-empty", ["--taps", ""], None),
        ("taps-duplicated", ["--taps", "2,2,4"], None),
        ("max-length-zero", ["--max-length", "0"], "--max-length"),
        ("batch-size-zero", ["--batch-size", "0"], "--batch-size"),
        ("shard-samples-zero", ["--shard-samples", "0"], "--shard-samples"),
        ("limit-zero", ["--limit", "0"], "--limit"),
        ("draft-vocab-size-zero", ["--draft-vocab-size", "0"], "--draft-vocab-size"),
        ("draft-vocab-size-above-vocab", ["--draft-vocab-size", "100000"], "--draft-vocab-size"),
        ("regen-max-new-tokens-zero", ["--regenerate", "--regen-max-new-tokens", "0"], "--regen-max-new-tokens"),
        ("device-cuda-without-gpu", ["--device", "cuda"], "cuda"),
        ("device-bogus", ["--device", "bogus"], "bogus"),
        ("dtype-bogus", ["--dtype", "float7"], "float7"),
    ],
    needs_no_gpu={"device-cuda-without-gpu"},
)


# == train ======================================================================================================
def good_draft(c: Ctx) -> Path:
    return c.cp("draft", "out")


@case("train", "overwrite-good-draft-with-a-corrupted-shard")
def _(c: Ctx) -> Spec:
    data = c.cp("prep")
    flip_bytes(data / "hidden/shard-00001.safetensors", offset=-5)
    return Spec([*train(c, good_draft(c), data=data), "--overwrite"], match="shard-00001")


@case("train", "overwrite-good-draft-with-a-truncated-shard")
def _(c: Ctx) -> Spec:
    data = c.cp("prep")
    truncate(data / "hidden/shard-00002.safetensors")
    return Spec([*train(c, good_draft(c), data=data), "--overwrite"], match="shard-00002")


@case("train", "overwrite-good-draft-with-a-nan-target")
def _(c: Ctx) -> Spec:
    t = target_with(c, lambda t: nan_weight(t, "lm_head.weight"))
    return Spec([*train(c, good_draft(c), target=t), "--overwrite"])


@case("train", "overwrite-good-draft-with-batch-larger-than-the-data")
def _(c: Ctx) -> Spec:
    return Spec([*train(c, good_draft(c)), "--overwrite", "--batch-size", "1000"], match="--batch-size")


@case("train", "overwrite-good-draft-with-taps-conflicting-with-the-data")
def _(c: Ctx) -> Spec:
    return Spec([*train(c, good_draft(c)), "--overwrite", "--taps", "1,3,5"], match="--taps")


@case("train", "overwrite-good-draft-with-data-of-another-target")
def _(c: Ctx) -> Spec:
    other = target_with_tokenizer_of(c.d / "other", c.s.target, vocab_size=300, hidden_size=32, intermediate_size=64)
    return Spec([*train(c, good_draft(c), target=other), "--overwrite"], match="hidden_size")


@case("train", "out-read-only-empty-dir")
def _(c: Ctx) -> Spec:
    ro = c.d / "ro"
    ro.mkdir()
    return Spec(train(c, ro), readonly=(ro,))


@case("train", "overwrite-read-only-good-draft")
def _(c: Ctx) -> Spec:
    out = good_draft(c)
    return Spec([*train(c, out), "--overwrite"], readonly=(out,))


@case("train", "overwrite-out-is-the-target")
def _(c: Ctx) -> Spec:
    t = c.cp("target")
    return Spec([*train(c, t, target=t), "--overwrite"])


@case("train", "overwrite-out-is-a-target-dir")
def _(c: Ctx) -> Spec:
    return Spec([*train(c, c.cp("target", "some-model")), "--overwrite"])


@case("train", "overwrite-out-is-the-data")
def _(c: Ctx) -> Spec:
    data = c.cp("prep")
    return Spec([*train(c, data, data=data), "--overwrite"])


@case("train", "overwrite-out-is-the-parent-of-the-data")
def _(c: Ctx) -> Spec:
    inputs = c.d / "inputs"
    data = copy(c.s.prep, inputs / "prep")
    return Spec([*train(c, inputs, data=data), "--overwrite"])


@case("train", "overwrite-out-is-the-current-dir")
def _(c: Ctx) -> Spec:
    return Spec([*train(c, Path(".")), "--overwrite"], cwd=c.notes_dir("work"))


@case("train", "out-is-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec(train(c, c.file("out.txt")))


@case("train", "overwrite-out-holds-other-files")
def _(c: Ctx) -> Spec:
    return Spec([*train(c, c.notes_dir("mine")), "--overwrite"])


@case("train", "overwrite-out-is-a-prepared-dir")
def _(c: Ctx) -> Spec:
    return Spec([*train(c, c.cp("prep", "other-prep")), "--overwrite"])


@case("train", "resume-without-a-run")
def _(c: Ctx) -> Spec:
    out = c.d / "empty"
    out.mkdir()
    return Spec([*train(c, out), "--resume"], match="--resume")


@case("train", "resume-with-a-corrupted-state")
def _(c: Ctx) -> Spec:
    out = good_draft(c)
    flip_bytes(out / "training_state/state.pt", offset=64, count=32)
    return Spec([*train(c, out), "--resume"], match="--resume")


@case("train", "resume-with-a-changed-lr")
def _(c: Ctx) -> Spec:
    return Spec([*train(c, good_draft(c)), "--resume", "--lr", "0.5"], match="--lr")


@case("train", "data-manifest-names-a-file-outside")
def _(c: Ctx) -> Spec:
    inputs = c.d / "inputs"
    data = copy(c.s.prep, inputs / "prep")
    (data / "hidden/shard-00000.safetensors").rename(inputs / "outside.safetensors")
    edit_json(data / "prepare.json", lambda m: m["shards"][0].update(file="../outside.safetensors"))
    return Spec(train(c, c.d / "out", data=data), match="outside")


@case("train", "data-manifest-names-an-absolute-file")
def _(c: Ctx) -> Spec:
    data = c.cp("prep")
    elsewhere = data.parent / "elsewhere.safetensors"
    (data / "hidden/shard-00000.safetensors").rename(elsewhere)
    edit_json(data / "prepare.json", lambda m: m["shards"][0].update(file=str(elsewhere)))
    return Spec(train(c, c.d / "out", data=data), match="elsewhere")


@case("train", "data-is-a-jsonl-not-a-prepared-dir")
def _(c: Ctx) -> Spec:
    return Spec(train(c, c.d / "out", data=c.s.data))


@case("train", "data-is-an-interrupted-preparation")
def _(c: Ctx) -> Spec:
    data = c.cp("prep")
    (data / "prepare.json").unlink()
    return Spec(train(c, c.d / "out", data=data))


@case("train", "target-tokenizer-larger-than-vocab")
def _(c: Ctx) -> Spec:
    return Spec(train(c, c.d / "out", target=vocab_mismatch_target(c)))


@case("train", "log-dir-is-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec([*train(c, c.d / "out"), "--log-dir", str(c.file("tb.txt"))])


flag_cases(
    "train",
    lambda c: train(c, c.d / "out"),
    [
        ("max-steps-zero", ["--max-steps", "0"], "--max-steps"),
        ("batch-size-zero", ["--batch-size", "0"], "--batch-size"),
        ("ttt-length-zero", ["--ttt-length", "0"], "--ttt-length"),
        ("grad-accum-zero", ["--grad-accum", "0"], "--grad-accum"),
        ("lr-zero", ["--lr", "0"], "--lr"),
        ("lr-nan", ["--lr", "nan"], "--lr"),
        ("eval-fraction-one", ["--eval-fraction", "1"], "--eval-fraction"),
        ("clip-negative", ["--clip=-1"], "--clip"),
        ("clip-nan", ["--clip", "nan"], "--clip"),
        ("weight-decay-nan", ["--weight-decay", "nan"], "--weight-decay"),
        ("warmup-ratio-nan", ["--warmup-ratio", "nan"], "--warmup-ratio"),
        ("warmup-steps-negative", ["--warmup-steps=-1"], "--warmup-steps"),
        ("draft-vocab-size-conflicts-with-data", ["--draft-vocab-size", "32"], "--draft-vocab-size"),
        ("taps-not-integers", ["--taps", "2,x"], "taps"),
        ("device-cuda-without-gpu", ["--device", "cuda"], "cuda"),
        ("device-bogus", ["--device", "bogus"], "bogus"),
    ],
    needs_no_gpu={"device-cuda-without-gpu"},
)


# == export =====================================================================================================
@case("export", "out-is-a-target-dir")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.cp("target")))


@case("export", "out-is-the-target-given")
def _(c: Ctx) -> Spec:
    t = c.cp("target")
    return Spec([*export(c, t), "--target", str(t)])


@case("export", "out-is-the-drafts-parent")
def _(c: Ctx) -> Spec:
    models = c.d / "models"
    draft = copy(c.s.draft, models / "draft")
    return Spec(export(c, models, draft=draft))


@case("export", "out-inside-the-draft")
def _(c: Ctx) -> Spec:
    draft = c.cp("draft")
    return Spec(export(c, draft / "vllm", draft=draft))


@case("export", "out-is-the-draft")
def _(c: Ctx) -> Spec:
    draft = c.cp("draft")
    return Spec(export(c, draft, draft=draft), match="--out")


@case("export", "out-is-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.file("out.txt")))


@case("export", "out-below-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.file("out.txt") / "sub"))


@case("export", "out-is-the-current-dir")
def _(c: Ctx) -> Spec:
    return Spec(export(c, Path(".")), cwd=c.notes_dir("work"))


@case("export", "out-is-the-current-dir-empty")
def _(c: Ctx) -> Spec:
    work = c.d / "work"
    work.mkdir()
    return Spec(export(c, Path(".")), cwd=work)


@case("export", "out-read-only-empty-dir")
def _(c: Ctx) -> Spec:
    ro = c.d / "ro"
    ro.mkdir()
    return Spec(export(c, ro), readonly=(ro,))


@case("export", "out-read-only-previous-export")
def _(c: Ctx) -> Spec:
    out = c.cp("export")
    return Spec(export(c, out), readonly=(out,))


@case("export", "out-holds-other-files")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.notes_dir("mine")))


@case("export", "out-is-a-prepared-dir")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.cp("prep")))


@case("export", "out-is-a-trace")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.cp("trace")))


@case("export", "draft-missing")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.d / "out", draft=c.d / "nope"), match="does not exist")


@case("export", "draft-is-a-target-checkpoint")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.d / "out", draft=c.cp("target")))


@case("export", "draft-contract-taps-is-a-string")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.d / "out", draft=draft_with(c, taps_string)), match="taps")


@case("export", "draft-malformed-config")
def _(c: Ctx) -> Spec:
    d = c.cp("draft")
    (d / "config.json").write_text("{not json")
    return Spec(export(c, c.d / "out", draft=d), match="config.json")


@case("export", "draft-truncated-weights")
def _(c: Ctx) -> Spec:
    d = c.cp("draft")
    truncate(d / "model.safetensors")
    return Spec(export(c, c.d / "out", draft=d))


@case("export", "draft-nan-weights")
def _(c: Ctx) -> Spec:
    return Spec(export(c, c.d / "out", draft=nan_draft(c)), match="nan")


@case("export", "target-of-another-vocab")
def _(c: Ctx) -> Spec:
    return Spec([*export(c, c.d / "out"), "--target", str(other_target(c.d / "other", vocab_size=100))], match="vocab")


@case("export", "with-embedding-without-target")
def _(c: Ctx) -> Spec:
    return Spec([*export(c, c.d / "out"), "--with-embedding"], match="--target")


@case("export", "with-embedding-from-a-corrupted-target")
def _(c: Ctx) -> Spec:
    t = target_with(c, lambda t: corrupt_safetensors_header(t / "model.safetensors"))
    return Spec([*export(c, c.d / "out"), "--with-embedding", "--target", str(t)])


# == inspect ====================================================================================================
@case("inspect", "draft-missing")
def _(c: Ctx) -> Spec:
    return Spec(["inspect", str(c.d / "nope")], match="does not exist")


@case("inspect", "draft-is-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec(["inspect", str(c.file("draft.txt"))])


@case("inspect", "draft-is-a-target-checkpoint")
def _(c: Ctx) -> Spec:
    return Spec(["inspect", str(c.cp("target"))])


@case("inspect", "draft-is-a-prepared-dir")
def _(c: Ctx) -> Spec:
    return Spec(["inspect", str(c.cp("prep"))])


@case("inspect", "draft-contract-taps-is-a-string")
def _(c: Ctx) -> Spec:
    return Spec(["inspect", str(draft_with(c, taps_string))], match="taps")


@case("inspect", "draft-contract-taps-out-of-range")
def _(c: Ctx) -> Spec:
    return Spec(["inspect", str(draft_with(c, taps_out_of_range))])


@case("inspect", "draft-malformed-config")
def _(c: Ctx) -> Spec:
    d = c.cp("draft")
    (d / "config.json").write_text("{not json")
    return Spec(["inspect", str(d)], match="config.json")


@case("inspect", "draft-truncated-weights")
def _(c: Ctx) -> Spec:
    d = c.cp("draft")
    truncate(d / "model.safetensors")
    return Spec(["inspect", str(d)])


@case("inspect", "target-missing")
def _(c: Ctx) -> Spec:
    return Spec(["inspect", str(c.s.draft), "--target", str(c.d / "nope")], match="does not exist")


@case("inspect", "target-malformed-config")
def _(c: Ctx) -> Spec:
    return Spec(["inspect", str(c.s.draft), "--target", str(target_with(c, bad_config("{not json")))])


# == replay =====================================================================================================
@case("replay", "out-is-a-non-trace-dir")
def _(c: Ctx) -> Spec:
    return Spec(replay(c, c.notes_dir("mine")))


@case("replay", "out-is-the-input-trace")
def _(c: Ctx) -> Spec:
    tr = c.cp("trace")
    return Spec(replay(c, tr, trace=tr))


@case("replay", "out-is-the-parent-of-the-trace")
def _(c: Ctx) -> Spec:
    inputs = c.d / "inputs"
    tr = copy(c.s.trace, inputs / "trace")
    return Spec(replay(c, inputs, trace=tr))


@case("replay", "out-is-a-target-dir")
def _(c: Ctx) -> Spec:
    return Spec(replay(c, c.cp("target")))


@case("replay", "out-is-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec(replay(c, c.file("golden.txt")))


@case("replay", "out-is-the-current-dir")
def _(c: Ctx) -> Spec:
    work = c.d / "work"
    work.mkdir()
    return Spec(replay(c, Path(".")), cwd=work)


@case("replay", "out-read-only-empty-dir")
def _(c: Ctx) -> Spec:
    ro = c.d / "ro"
    ro.mkdir()
    return Spec(replay(c, ro), readonly=(ro,))


@case("replay", "trace-missing")
def _(c: Ctx) -> Spec:
    return Spec(replay(c, c.d / "golden", trace=c.d / "nope"))


@case("replay", "trace-is-not-a-trace")
def _(c: Ctx) -> Spec:
    return Spec(replay(c, c.d / "golden", trace=c.notes_dir("mine")))


@case("replay", "trace-malformed-manifest")
def _(c: Ctx) -> Spec:
    tr = c.cp("trace")
    (tr / "manifest.json").write_text("{not json")
    return Spec(replay(c, c.d / "golden", trace=tr))


@case("replay", "trace-truncated-tensors")
def _(c: Ctx) -> Spec:
    tr = c.cp("trace")
    truncate(tr / "trace-00000.safetensors")
    return Spec(replay(c, c.d / "golden", trace=tr))


@case("replay", "trace-prompt-outside-the-vocabulary")
def _(c: Ctx) -> Spec:
    tr = c.cp("trace")
    edit_json(tr / "manifest.json", lambda m: m["meta"].update(prompt_ids=[1, 2, 5000]))
    return Spec(replay(c, c.d / "golden", trace=tr))


@case("replay", "draft-for-a-target-of-another-hidden-size")
def _(c: Ctx) -> Spec:
    other = other_target(c.d / "other", vocab_size=300, hidden_size=32, intermediate_size=64)
    return Spec(replay(c, c.d / "golden", target=other))


@case("replay", "device-bogus")
def _(c: Ctx) -> Spec:
    return Spec(replay(c, c.d / "golden", device=["--device", "bogus"]), match="bogus")


# == doctor =====================================================================================================
@case("doctor", "trace-missing")
def _(c: Ctx) -> Spec:
    return Spec([*doctor(c), "--trace", str(c.d / "nope")], match="trace")


@case("doctor", "trace-is-not-a-trace")
def _(c: Ctx) -> Spec:
    return Spec([*doctor(c), "--trace", str(c.notes_dir("mine"))], match="trace")


@case("doctor", "html-onto-an-existing-non-report-file")
def _(c: Ctx) -> Spec:
    page = c.file("index.html", "<html><body>my own page</body></html>\n")
    return Spec([*doctor(c), "--html", str(page)], match="--html")


@case("doctor", "html-onto-a-directory")
def _(c: Ctx) -> Spec:
    return Spec([*doctor(c), "--html", str(c.notes_dir("report.html"))], match="--html")


@case("doctor", "html-below-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec([*doctor(c), "--html", str(c.file("notes.txt") / "report.html")], match="--html")


@case("doctor", "html-onto-the-drafts-config")
def _(c: Ctx) -> Spec:
    d = c.cp("draft")
    return Spec([*doctor(c, draft=d), "--html", str(d / "config.json")], match="--html")


@case("doctor", "html-in-a-read-only-dir")
def _(c: Ctx) -> Spec:
    ro = c.d / "ro"
    ro.mkdir()
    return Spec([*doctor(c), "--html", str(ro / "report.html")], readonly=(ro,), match="--html")


@case("doctor", "data-missing")
def _(c: Ctx) -> Spec:
    return Spec([*doctor(c), "--data", str(c.d / "nope.jsonl")], match="--data")


@case("doctor", "engine-log-missing")
def _(c: Ctx) -> Spec:
    return Spec([*doctor(c), "--engine-log", str(c.d / "nope.log")])


@case("doctor", "engine-log-without-acceptance-lines")
def _(c: Ctx) -> Spec:
    return Spec([*doctor(c), "--engine-log", str(c.file("server.log", "INFO started\nINFO ready\n"))])


@case("doctor", "data-broken-jsonl")
def _(c: Ctx) -> Spec:
    return Spec([*doctor(c), "--data", str(c.file("held_out.jsonl", "{not json\n"))])


@case("doctor", "prompts-zero")
def _(c: Ctx) -> Spec:
    return Spec([*doctor(c), "--data", str(c.s.data), "--prompts", "0"], match="--prompts")


@case("doctor", "draft-missing")
def _(c: Ctx) -> Spec:
    return Spec(doctor(c, draft=c.d / "nope"), match="does not exist")


@case("doctor", "target-missing")
def _(c: Ctx) -> Spec:
    return Spec(doctor(c, target=c.d / "nope"), match="does not exist")


# == demo (only what fails before any work) =====================================================================
@case("demo", "workdir-is-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec(["demo", "--fast", "--workdir", str(c.file("work.txt"))], match="--workdir")


@case("demo", "workdir-below-a-plain-file")
def _(c: Ctx) -> Spec:
    return Spec(["demo", "--fast", "--workdir", str(c.file("work.txt") / "sub")], match="--workdir")


# == argument parsing: the same one-line rule ===================================================================
@case("args", "generate-max-new-tokens-not-a-number")
def _(c: Ctx) -> Spec:
    return Spec([*gen(c), "--max-new-tokens", "many"], match="--max-new-tokens")


@case("args", "generate-without-target")
def _(c: Ctx) -> Spec:
    return Spec(["generate", "--prompt-ids", PROMPT], match="--target")


@case("args", "export-to-an-unknown-engine")
def _(c: Ctx) -> Spec:
    return Spec(["export", "--draft", str(c.s.draft), "--to", "tgi", "--out", str(c.d / "out")], match="tgi")


@case("args", "train-lr-not-a-number")
def _(c: Ctx) -> Spec:
    return Spec([*train(c, c.d / "out"), "--lr", "fast"], match="--lr")


@case("args", "unknown-command")
def _(c: Ctx) -> Spec:
    return Spec(["serve", "--target", str(c.s.target)], match="serve")


# -- running a case --------------------------------------------------------------------------------------------
def _python_default_warning_filters() -> None:
    """The filters of a plain `python` process (pytest installs its own)."""
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for cat in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=cat, append=True)


def run_cli(argv: list[str]) -> int:
    """`eaglescope ARGV` in this process → exit status; warnings are printed to stderr as python would."""
    with warnings.catch_warnings(record=True) as caught:
        _python_default_warning_filters()
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    for w in caught:
        sys.stderr.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    return rc


def problems_with(rc: int, err: str, match: str | None) -> list[str]:
    found = []
    if rc != 2:
        found.append(f"exit code {rc}, not 2")
    lines = err.strip("\n").splitlines()
    if len(lines) != 1:
        found.append(f"{len(lines)} stderr lines, not 1")
    if not lines or not lines[0].startswith(PREFIX) or not lines[0][len(PREFIX) :].strip():
        found.append(f"stderr does not start with {PREFIX!r} and a message")
    for bad in ("Traceback", "internal error", "Warning"):
        if bad in err:
            found.append(f"{bad!r} on stderr")
    if match is not None and lines and match.lower() not in lines[0].lower():
        found.append(f"the error line does not mention {match!r}")
    return found


def _ids(cases: list[Case]) -> list[str]:
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return ids


@pytest.mark.parametrize("bad", CASES, ids=_ids(CASES))
def test_bad_input(env: Env, bad: Case, capfd, monkeypatch):
    if bad.needs_no_gpu and torch.cuda.is_available():
        pytest.skip("a GPU is present: cuda is not a bad device here")
    d = env.cases / bad.id
    d.mkdir()
    spec = bad.make(env, d)
    guarded = [env.shared.root, d]  # the case's own directory holds its inputs, outputs and cwd
    if spec.cwd is not None:
        monkeypatch.chdir(spec.cwd)
    user = contextlib.nullcontext()
    if spec.readonly:
        if os.geteuid() == 0:
            chown_tree(d, NOBODY, NOBODY)  # the case directory is the user's; only the read-only paths are not
            user = ordinary_user()
        for p in spec.readonly:
            make_readonly(p)
    before = snapshot(guarded)
    capfd.readouterr()
    with user:
        assert not any(os.access(p, os.W_OK) for p in spec.readonly), "could not make the destination read-only"
        rc = run_cli(spec.argv)
    out, err = capfd.readouterr()
    after = snapshot(guarded)
    for p in spec.readonly:
        make_writable(p)
    if os.environ.get("EAGLESCOPE_BADINPUT_LOG"):  # a record of what the user saw, case by case
        with open(os.environ["EAGLESCOPE_BADINPUT_LOG"], "a") as f:
            f.write(json.dumps({"id": bad.id, "rc": rc, "stderr": err}) + "\n")
    found = problems_with(rc, err, spec.match)
    if after != before:
        found.append(f"guarded files changed ({describe_diff(before, after)})")
        shared = str(env.shared.root)
        if any(k.startswith(shared) and before.get(k) != after.get(k) for k in {*before, *after}):
            restore(env.shared.root, env.pristine)  # later cases start from good artifacts again
    assert not found, f"{'; '.join(found)}\nstderr: {err.strip()[-800:]!r}"


# -- controls: the harness sees success when the input is good -------------------------------------------------
def test_good_inputs_succeed(env: Env, capfd):
    d = env.cases / "control"
    d.mkdir()
    c = Ctx(env.shared, d)
    out = c.cp("export", "previous-export")
    assert run_cli(export(c, out)) == 0  # an export replaces a previous export
    assert json.loads((out / "config.json").read_text())["eaglescope"]["exported_for"] == "vllm"
    assert run_cli([*gen(c, draft=c.s.draft), "--chain", "2", "--json"]) == 0
    _, err = capfd.readouterr()
    assert PREFIX not in err and "Traceback" not in err


# -- interrupted while writing over a good output (subprocesses) ----------------------------------------------
# When to signal: once this many paths below --out's parent are new, changed or gone (the command is writing: a
# staging directory with shards in it, a training run's logs and first checkpoint, an export's weights file), and
# then after this many seconds more.
KILL_AFTER = {"prepare": (6, 0.2), "train": (5, 0.2), "export": (2, 0.0)}


def _tree_state(root: Path) -> dict[str, tuple]:
    """Cheap change detector: (is a directory, size, mtime) of every path below root (os.walk skips what vanishes
    while it looks)."""
    state = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(top, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            state[p] = (name in dirs, st.st_size, st.st_mtime_ns)
    return state


def _default_sigint() -> None:
    # A user's Ctrl-C reaches a command whose SIGINT is the default; a child inherits an ignored SIGINT, as pytest-xdist
    # workers have it, and Python then never raises KeyboardInterrupt (the command would run on, rightly).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(argv: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "eaglescope.cli", *argv]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)  # fmt: skip


def _changes(base: dict, now: dict) -> int:
    return sum(1 for k in base.keys() | now.keys() if base.get(k) != now.get(k))


def interrupt_mid_work(argv: list[str], watch: Path, sig: int, min_changes: int, settle: float) -> tuple[int, str]:
    """Start `eaglescope ARGV`, wait until it has written `min_changes` paths below `watch` (staging beside
    --out, or --out itself), let it work `settle` seconds more, then send `sig`. → (exit status, stderr)."""
    base = _tree_state(watch)
    proc = _cli(argv, watch)
    t0 = time.monotonic()
    try:
        while _changes(base, _tree_state(watch)) < min_changes:
            if proc.poll() is not None:
                pytest.fail(f"exited {proc.returncode} before it was interrupted: {proc.communicate()[1][-600:]}")
            if time.monotonic() - t0 > 120:
                pytest.fail("wrote nothing in 120 s")
            time.sleep(0.005)
        time.sleep(settle)
        if proc.poll() is not None:
            pytest.fail(f"finished (exit {proc.returncode}) before it could be interrupted; make the job bigger")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.fixture(scope="module")
def big_draft(env: Env) -> Path:
    from badinput_fixtures import big_draft as build

    return build(env.cases / "big")


def _kill_job(cmd: str, env: Env, d: Path, big: Path | None) -> tuple[list[str], Path, Callable[[Path], None]]:
    """(argv, --out holding a previous good output, a check that --out holds the re-run's complete output)."""
    c = Ctx(env.shared, d)
    if cmd == "prepare":
        out = c.cp("prep", "out")
        data = write_jsonl(d / "more.jsonl", conversations(500))
        argv = [*prep(c, out, data=data), "--shard-samples", "16", "--overwrite"]

        def check(out: Path) -> None:
            from eaglescope.data.shards import PreparedData

            assert PreparedData.open(out).manifest["num_conversations"] == 500

    elif cmd == "train":
        out = c.cp("draft", "out")
        argv = [*train(c, out), "--max-steps", "100", "--save-every", "20", "--overwrite"]

        def check(out: Path) -> None:
            from eaglescope.models.draft import load_draft

            load_draft(out)
            assert json.loads((out / "training_metrics.json").read_text())["step"] == 100

    else:
        out = c.cp("export", "out")
        argv = ["export", "--draft", str(big), "--to", "sglang", "--out", str(out)]

        def check(out: Path) -> None:
            cfg = json.loads((out / "config.json").read_text())
            assert cfg["eaglescope"]["exported_for"] == "sglang" and cfg["hidden_size"] == 1024

    return argv, out, check


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
@pytest.mark.parametrize("cmd", ["prepare", "train", "export"])
def test_interrupt_keeps_the_previous_output(env: Env, cmd: str, sig: int, request):
    big = request.getfixturevalue("big_draft") if cmd == "export" else None
    d = env.cases / f"interrupt-{cmd}-{signal.Signals(sig).name.lower()}"
    d.mkdir()
    argv, out, check = _kill_job(cmd, env, d, big)
    before = snapshot([out])
    shared_before = snapshot([env.shared.root])
    rc, err = interrupt_mid_work(argv, d, sig, *KILL_AFTER[cmd])
    if sig == signal.SIGINT:
        assert rc == 130 and "Traceback" not in err, (rc, err[-800:])
    else:
        assert rc == -signal.SIGKILL, (rc, err[-800:])
    after = snapshot([out])
    assert after == before, f"--out is not the previous output any more: {describe_diff(before, after)}"
    assert snapshot([env.shared.root]) == shared_before, "an input changed"
    # the same command again completes, and leaves nothing of either run beside --out
    res = subprocess.run(
        [sys.executable, "-m", "eaglescope.cli", *argv], cwd=d, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-800:]
    assert "error" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-800:]
    check(out)
    leftovers = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}"))
    assert leftovers == [], f"left beside --out after the re-run: {leftovers}"
