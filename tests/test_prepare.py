import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import make_checkpoint
from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir
from tolerance import assert_close_float32

from eaglescope.cli import main
from eaglescope.data.chat import chat_template_hash, read_conversations, render
from eaglescope.data.prepare import PrepareConfig, _percentile, prepare
from eaglescope.data.shards import PreparedData
from eaglescope.decode.vanilla import generate_vanilla
from eaglescope.errors import EagleScopeError
from eaglescope.models.targets import load_target
from eaglescope.models.vocab import build_draft_vocab, count_tokens, validate_vocab_map
from eaglescope.outputs import partial_dir

MAXLEN = 128
LONG = "The capital of France is Paris. " * 30  # far beyond MAXLEN: truncated


def conversations() -> list[dict]:
    """A dozen conversations in both JSONL forms, one with no assistant turn, one too long."""
    qa = [
        ("Hello there, how are you today?", "I am fine, thank you."),
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Two plus two?", "Think step by step: two plus two is four."),
        ("def add(a, b):", "    return a + b"),
    ]
    rows = []
    for i in range(12):
        q, a = qa[i % 4]
        if i % 2:
            rows.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
        else:
            msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": q}]
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
            if i % 4 == 0:
                msgs += [{"role": "user", "content": "Thank you."}, {"role": "assistant", "content": "The end."}]
            rows.append({"messages": msgs})
    rows[5] = {"messages": [{"role": "user", "content": "Hello there"}]}  # nothing to supervise: skipped
    rows[7]["conversations"][1]["value"] = LONG
    return rows


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    tok_dir = make_tokenizer_dir(root, LLAMA3, vocab_size=300)
    tok = load(tok_dir)
    target_dir = make_checkpoint(
        "llama", root / "target", vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    tok.save_pretrained(target_dir)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    return {"root": root, "target": target_dir, "data": data, "tok": load(target_dir)}


def config(env, out, **kw) -> PrepareConfig:
    base = dict(
        target=str(env["target"]),
        data=str(env["data"]),
        out=str(out),
        taps="1,3,5",
        max_length=MAXLEN,
        draft_vocab_size=40,
        shard_samples=4,
        batch_size=3,
        device="cpu",
        dtype="float32",
    )
    return PrepareConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def full(env):
    """An uninterrupted run with hidden states (12 conversations → 3 shards)."""
    out = env["root"] / "full"
    prepare(config(env, out, hidden_states=True), progress=False)
    return out


@pytest.fixture(scope="module")
def target(env):
    return load_target(env["target"], device="cpu", dtype=torch.float32, taps="1,3,5")


def test_samples_round_trip_the_chat_renderer(env, full):
    d = PreparedData.open(full)
    expected = [render(c, env["tok"], MAXLEN) for c in read_conversations(env["data"])]
    kept = [r for r in expected if r is not None]
    assert d.num_samples == len(kept) == 11 and d.manifest["skipped"] == 1
    assert d.manifest["truncated"] == 1 and d.manifest["max_length"] == MAXLEN
    for i, r in enumerate(kept):
        s = d.sample(i)
        assert s["input_ids"].tolist() == r.input_ids
        assert s["loss_mask"].tolist() == r.loss_mask
    m = d.manifest
    assert m["num_tokens"] == sum(len(r.input_ids) for r in kept)
    assert m["num_supervised_tokens"] == sum(sum(r.loss_mask) for r in kept)
    assert m["chat_template_sha256"] == chat_template_hash(env["tok"])
    assert m["taps"]["layers"] == [1, 3, 5] and m["target"]["vocab_size"] == len(env["tok"])


def test_vocab_is_built_from_loss_masked_tokens_only(env, full):
    d = PreparedData.open(full)
    d2t, t2d = d.vocab()
    V = len(env["tok"])
    validate_vocab_map(d2t, t2d, V, 40)
    pairs = [(d.sample(i)["input_ids"], d.sample(i)["loss_mask"]) for i in range(d.num_samples)]
    counts = count_tokens(pairs, V)
    assert torch.equal(d.token_counts(), counts)
    ref_d2t, ref_t2d = build_draft_vocab(counts, 40)
    assert torch.equal(d2t, ref_d2t) and torch.equal(t2d, ref_t2d)
    header = env["tok"].convert_tokens_to_ids("<|start_header_id|>")  # in every sample, never supervised
    assert counts[header] == 0 and sum(int((ids == header).sum()) for ids, _ in pairs) > 0
    assert counts[env["tok"].convert_tokens_to_ids("<|eot_id|>")] > 0  # the end-of-turn is supervised


def test_stored_features_equal_the_target_forward(full, target):
    d = PreparedData.open(full)
    assert d.has_hidden_states and len(d.manifest["shards"]) == 3
    for i in (0, 4, d.num_samples - 1):  # first, second and last shard
        s = d.sample(i)
        ref = target.hidden_states(s["input_ids"][None])
        assert s["aux"].shape == (len(s["input_ids"]), 3 * target.hidden_size)
        depth = target.num_layers + 1
        assert_close_float32(s["aux"], ref.aux[0], depth, key=f"sample {i} aux")
        assert_close_float32(s["final_hidden"], ref.final_hidden[0], depth, key=f"sample {i} final_hidden")
        assert_close_float32(target.head(s["final_hidden"]), ref.logits[0], depth + 1, key=f"sample {i} logits")


def test_tap_statistics_describe_the_stored_features(full):
    d = PreparedData.open(full)
    stats = d.manifest["tap_stats"]
    assert sorted(stats, key=int) == ["1", "3", "5"]
    H = d.manifest["target"]["hidden_size"]
    aux = torch.cat([d.sample(i)["aux"] for i in range(d.num_samples)]).double()
    for j, t in enumerate(["1", "3", "5"]):
        x = aux[:, j * H : (j + 1) * H]
        norms = x.norm(dim=-1)
        assert stats[t]["mean"] == pytest.approx(float(x.mean()), abs=1e-6)
        assert stats[t]["std"] == pytest.approx(float(x.std(unbiased=False)), rel=1e-5)
        assert stats[t]["norm_p50"] == pytest.approx(float(norms.quantile(0.5)), rel=1e-5)
        assert stats[t]["norm_p99"] == pytest.approx(float(norms.quantile(0.99)), rel=1e-5)
        assert stats[t]["norm_p50"] <= stats[t]["norm_p90"] <= stats[t]["norm_p99"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=50), st.sampled_from([0, 1, 50, 90, 99, 100]))
def test_norm_percentile_matches_torch_quantile(xs, q):
    x = torch.tensor(xs, dtype=torch.float64)
    assert _percentile(torch.sort(x).values, q) == pytest.approx(float(torch.quantile(x, q / 100)), abs=1e-9)


def test_interrupted_run_resumes_and_equals_an_uninterrupted_one(env, full, capsys):
    out = env["root"] / "resumed"

    def crash_after_first(k):
        if k == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(config(env, out, hidden_states=True), progress=False, on_shard_done=crash_after_first)
    # nothing stands at --out until the preparation is complete; the work so far waits beside it
    staging = partial_dir(out)
    assert not out.exists() and (staging / "hidden/shard-00000.safetensors").exists()
    with pytest.raises(EagleScopeError, match="interrupted run"):
        PreparedData.open(out)
    first = (staging / "hidden/shard-00000.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    m = prepare(config(env, out, hidden_states=True), progress=False)
    assert "1 of 3 shards were already done" in capsys.readouterr().err
    assert (out / "hidden/shard-00000.safetensors").stat().st_mtime_ns == first  # not recomputed
    assert not staging.exists()
    ref = json.loads((full / "prepare.json").read_text())
    for key in ("shards", "samples_file", "vocab_file", "tap_stats", "num_samples", "num_tokens", "inputs"):
        assert m[key] == ref[key], key
    # A complete directory with the same inputs: a no-op that says so.
    prepare(config(env, out, hidden_states=True), progress=False)
    assert "already prepared" in capsys.readouterr().err


def test_damaged_shard_is_named_and_redone(env, full, capsys):
    out = env["root"] / "damaged"
    shutil.copytree(full, out)
    shard = out / "hidden/shard-00001.safetensors"
    good = shard.read_bytes()
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(EagleScopeError, match=r"shard-00001\.safetensors is corrupted"):
        PreparedData.open(out)
    PreparedData.open(out, verify=False)  # same size: only the hash can tell
    shard.write_bytes(good[: len(good) // 2])
    with pytest.raises(EagleScopeError, match=r"shard-00001\.safetensors is truncated"):
        PreparedData.open(out, verify=False)
    capsys.readouterr()
    m = prepare(config(env, out, hidden_states=True), progress=False)
    assert "shard-00001.safetensors" in capsys.readouterr().err
    assert m["shards"] == json.loads((full / "prepare.json").read_text())["shards"]
    PreparedData.open(out)


def test_regenerate_uses_the_targets_greedy_answers(env, tmp_path):
    tok = env["tok"]
    out = tmp_path / "regen"
    m = prepare(config(env, out, regenerate=True, regen_max_new_tokens=5, limit=3, max_length=200), progress=False)
    assert m["regenerated"] and m["num_samples"] == 3
    target = load_target(env["target"], device="cpu", dtype=torch.float32)
    d = PreparedData.open(out)
    for i, conv in enumerate(list(read_conversations(env["data"]))[:3]):
        history = []
        for msg in conv:
            if msg["role"] != "assistant":
                history.append(msg)
                continue
            prompt = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            new = generate_vanilla(target, prompt, 5).token_ids
            if new[-1] == tok.eos_token_id:
                new = new[:-1]
            history.append({"role": "assistant", "content": tok.decode(new)})
        assert history != conv  # the dataset's answers are gone
        assert d.sample(i)["input_ids"].tolist() == render(history, tok, 200).input_ids


def test_regeneration_stops_where_the_prompt_leaves_no_room(env, tmp_path):
    tok = env["tok"]
    convs = list(read_conversations(env["data"]))[:2]
    # max_length = the first prompt's length: its answer has no room; the second, shorter one does.
    p0 = len(tok(tok.apply_chat_template(convs[0][:2], add_generation_prompt=True, tokenize=False))["input_ids"])
    p1 = len(tok(tok.apply_chat_template(convs[1][:1], add_generation_prompt=True, tokenize=False))["input_ids"])
    m = prepare(config(env, tmp_path / "o", regenerate=True, regen_max_new_tokens=3, limit=2, max_length=p0), False)
    assert p1 + 3 < p0 and m["regen_cut"] == 1 and m["skipped"] == 1 and m["num_samples"] == 1


def test_conversations_the_template_rejects_are_skipped_and_counted(env, tmp_path, capsys):
    strict = tmp_path / "strict"
    shutil.copytree(env["target"], strict)
    tok = load(strict)
    tok.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ raise_exception('no system role') }}{%- endif %}"
        "{%- endfor %}" + LLAMA3.template
    )
    tok.save_pretrained(strict)
    capsys.readouterr()
    m = prepare(config(env, tmp_path / "o", target=str(strict)), progress=False)
    with_system = sum(any(x["role"] == "system" for x in c) for c in read_conversations(env["data"]))
    assert m["invalid"] == with_system == 6 and m["num_samples"] == 12 - 1 - with_system
    assert "6 conversations could not be rendered" in capsys.readouterr().err
    assert m["chat_template_sha256"] != chat_template_hash(env["tok"])


def run_cli(argv, capsys):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


def test_cli_prepares_and_errors_are_one_line(env, tmp_path, capsys):
    out = tmp_path / "cli"
    base = ["prepare", "--target", str(env["target"]), "--out", str(out), "--device", "cpu", "--taps", "1,3,5"]
    base += ["--max-length", str(MAXLEN)]
    rc = main([*base, "--data", str(env["data"]), "--limit", "6"])
    assert rc == 0 and "5 samples" in capsys.readouterr().out
    assert PreparedData.open(out).manifest["draft_vocab_size"] == len(env["tok"])  # min(32000, V)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(conversations()[0]) + "\n{not json\n")
    no_answer = tmp_path / "none.jsonl"
    no_answer.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    small = make_checkpoint("llama", tmp_path / "small", vocab_size=len(env["tok"]) - 10)
    env["tok"].save_pretrained(small)
    bare = make_checkpoint("llama", tmp_path / "bare", vocab_size=len(env["tok"]))
    capsys.readouterr()

    def cmd(target, data, out_dir):
        return ["prepare", "--target", str(target), "--data", str(data), "--out", str(out_dir)]

    tgt = env["target"]
    cases = [
        ([*base, "--data", str(env["data"]), "--limit", "5"], "different inputs (limit)"),
        (cmd(tgt, bad, tmp_path / "o1"), ":2: invalid JSON"),
        (cmd(tgt, no_answer, tmp_path / "o2"), "no usable sample"),
        (cmd(small, env["data"], tmp_path / "o3"), "do not belong"),
        (cmd(bare, env["data"], tmp_path / "o4"), "no tokenizer"),
        (cmd(tgt, tmp_path / "x", out), "no such data file"),
        ([*base, "--data", str(env["data"]), "--taps", "1,9"], "out of range"),
        (cmd(tgt, env["data"], bad), "not a directory"),
    ]
    for argv, expect in cases:
        rc, err = run_cli(argv, capsys)
        assert rc == 2 and expect in err and len(err.splitlines()) == 1, (argv, err)
    # --overwrite replaces a preparation made from other inputs
    assert main([*base, "--data", str(env["data"]), "--limit", "5", "--overwrite"]) == 0
    assert PreparedData.open(out).manifest["num_conversations"] == 5
