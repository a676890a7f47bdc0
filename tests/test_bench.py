"""`eaglescope bench` on the CPU (the reference backend): one row per method with τ, α_k, tokens/s, speedup, η and
identical-to-vanilla; --json parseable; prompts as token ids, text or conversations; an HTML report; bad input is
one line."""

from __future__ import annotations

import json

import pytest
from drafts import make_draft
from models import make_checkpoint
from tokenizers_fixtures import LLAMA3, make_tokenizer_dir

from eaglescope.bench import parse_method, read_prompts
from eaglescope.cli import main
from eaglescope.decode.loop import generate_vanilla
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import save_draft
from eaglescope.models.targets import load_target


def make_bench_env(root):
    """A tiny target, its draft and two prompts under `root` → (root, target, draft, prompts)."""
    target = make_checkpoint("llama", root / "target")
    draft, contract = make_draft(target, draft_vocab_size=48, scale=3.0)
    save_draft(draft, contract, root / "draft")
    prompts = root / "prompts.jsonl"
    # the second prompt repeats itself, so prompt lookup (n-gram) has something to find
    rows = [{"prompt_ids": list(range(5, 17))}, {"prompt_ids": [7, 8, 9, 10] * 4}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, target, root / "draft", prompts


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_bench_env(tmp_path_factory.mktemp("bench"))


def bench(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["bench", "--device", "cpu", "--dtype", "float32", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bench_rows_are_consistent_with_generate(capsys, env):
    root, target, draft, prompts = env
    argv = ["--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--max-new-tokens", "16"]
    rc, out, _ = bench(capsys, *argv, "--method", "vanilla", "--method", "chain=3", "--method", "tree=3,2,6",
                       "--method", "ngram=3", "--json")  # fmt: skip
    assert rc == 0
    res = json.loads(out)
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows) == ["vanilla", "chain=3", "tree=3,2,6", "ngram=3"]
    for r in rows.values():
        assert r["prompts"] == 2 and r["new_tokens"] == 32 and r["identical_to_vanilla"] == 2
        assert r["tokens_per_second"] > 0 and r["backend"] == "reference"
    assert rows["vanilla"]["speedup"] == 1.0 and "accept_length" not in rows["vanilla"]
    for name in ("chain=3", "tree=3,2,6", "ngram=3"):
        r = rows[name]
        assert 1.0 <= r["accept_length"] <= 4.0
        assert r["eta"] == pytest.approx(r["speedup"] / r["accept_length"])
        assert all(a is None or 0.0 <= a <= 1.0 for a in r["alpha"])
    assert rows["ngram=3"]["accept_length"] > 1.0  # the repeating prompt is found
    # the vanilla row's tokens are what `generate` emits
    t = load_target(target, device="cpu")
    want = sum(len(generate_vanilla(t, p, 16, stop_ids=[]).token_ids) for p in read_prompts(prompts, None, False))
    assert want == rows["vanilla"]["new_tokens"]


def test_bench_table_and_html_report(capsys, env):
    root, target, draft, prompts = env
    html = root / "bench.html"
    argv = ["--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--max-new-tokens", "8"]
    rc, out, _ = bench(capsys, *argv, "--method", "chain=2", "--html", str(html))
    assert rc == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["method", "backend", "τ"]
    assert lines[1].startswith("vanilla") and lines[2].startswith("chain=2")  # vanilla added as the baseline
    text = html.read_text()
    assert 'content="eaglescope bench"' in text and "data:image/png;base64," in text and "chain=2" in text
    # a second run replaces its own report, never another file
    other = root / "notes.html"
    other.write_text("<html>mine</html>")
    rc, _, err = bench(capsys, *argv, "--method", "chain=2", "--html", str(other))
    assert rc == 2 and other.read_text() == "<html>mine</html>" and len(err.strip().splitlines()) == 1


def test_text_and_chat_prompts(tmp_path):
    tok_dir = make_tokenizer_dir(tmp_path / "tok", LLAMA3)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    f = tmp_path / "p.txt"
    f.write_text("hello there\n\nsecond prompt\n")
    plain = read_prompts(f, tok, chat=False)
    chat = read_prompts(f, tok, chat=True)
    assert len(plain) == len(chat) == 2 and all(len(c) > len(p) for c, p in zip(chat, plain))
    conv = tmp_path / "c.jsonl"
    conv.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]})
    )
    (ids,) = read_prompts(conv, tok, chat=False)
    want = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    assert ids == list(want["input_ids"] if hasattr(want, "input_ids") or isinstance(want, dict) else want)


@pytest.mark.parametrize(
    "method, match", [("tree=3", "DEPTH,TOPK,TOTAL"), ("chain=x", "not an integer"), ("beam=2", "use vanilla")]
)
def test_bad_methods(method, match):
    with pytest.raises(EagleScopeError, match=match):
        parse_method(method)


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"prompt_ids": []}\n', "non-empty"),
        ("{broken\n", "invalid JSON"),
        ("\n\n", "no prompts"),
    ],
)
def test_bad_prompt_files_are_one_line(capsys, env, content, match):
    root, target, draft, _ = env
    f = root / "bad.jsonl"
    f.write_text(content)
    rc, out, err = bench(capsys, "--target", str(target), "--draft", str(draft), "--prompts", str(f))
    assert rc == 2 and out == "" and match in err and len(err.strip().splitlines()) == 1
