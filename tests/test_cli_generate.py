"""`eaglescope generate`: one JSON object on success, one stderr line (no traceback) on bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint
from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir

from eaglescope.cli import main
from eaglescope.models.draft import save_draft
from eaglescope.models.targets import load_target

PROMPT = "1,2,3"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory):
    fp = load_target(target_dir, device="cpu", dtype=torch.float32).fingerprint
    d, contract = make_draft(target_dir, draft_vocab_size=32, seed=2)
    contract.target = fp
    return save_draft(d, contract, tmp_path_factory.mktemp("d") / "draft")


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory):
    """A checkpoint with a chat-templated tokenizer whose vocabulary matches the model's."""
    root = tmp_path_factory.mktemp("chat")
    tok_dir = make_tokenizer_dir(root, LLAMA3, vocab_size=300)
    tok = load(tok_dir)
    path = make_checkpoint("llama", root / "model", seed=1, vocab_size=len(tok))
    for f in tok_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path, tok


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", "--device", "cpu", "--dtype", "float32", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1  # exactly one JSON object on stdout
    return json.loads(lines[0])


def assert_one_line_error(code: int, out: str, err: str, match: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("eaglescope: error:"), err
    assert "Traceback" not in err and match in lines[0], err
    assert out == ""


@pytest.fixture(scope="module")
def vanilla(target_dir):
    from eaglescope.decode.vanilla import generate_vanilla

    t = load_target(target_dir, device="cpu", dtype=torch.float32)
    return generate_vanilla(t, [1, 2, 3], 8).token_ids


def test_vanilla_json(capsys, target_dir, vanilla):
    obj = run_json(capsys, "--target", str(target_dir), "--prompt-ids", PROMPT, "--max-new-tokens", "8")
    assert obj["token_ids"] == vanilla and obj["prompt_ids"] == [1, 2, 3]
    assert obj["text"] is None  # no tokenizer in this checkpoint
    s = obj["stats"]
    assert s["new_tokens"] == len(vanilla) and s["seconds"] > 0 and s["tokens_per_second"] > 0
    assert "accept_length" not in s


def test_vanilla_plain_text_output(capsys, target_dir, vanilla):
    code, out, err = run(capsys, "--target", str(target_dir), "--prompt-ids", PROMPT, "--max-new-tokens", "8")
    assert code == 0
    assert out.strip() == " ".join(map(str, vanilla))  # ids when there is no tokenizer
    assert "tok/s" in err


@pytest.mark.parametrize("shape", [["--chain", "3"], ["--tree", "3,2,6"], []])
def test_eagle3_json_matches_vanilla(capsys, target_dir, draft_dir, vanilla, shape):
    obj = run_json(
        capsys,
        "--target",
        str(target_dir),
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "8",
        "--draft",
        str(draft_dir),
        *shape,
    )
    assert obj["token_ids"] == vanilla
    s = obj["stats"]
    depth = {"--chain": 3, "--tree": 3}.get(shape[0] if shape else None, 7)
    assert s["rounds"] >= 1 and 1.0 <= s["accept_length"] <= depth + 1
    # the deepest level a round drafted: a tree's total budget may stop it short of the requested depth
    assert isinstance(s["alpha"], list) and 1 <= len(s["alpha"]) <= depth
    assert isinstance(s["accepted_per_position"], list) and len(s["accepted_per_position"]) == len(s["alpha"])
    assert s["emitted_tokens"] >= s["new_tokens"] - 1


def test_ngram_json_matches_vanilla(capsys, target_dir, vanilla):
    obj = run_json(
        capsys, "--target", str(target_dir), "--prompt-ids", PROMPT, "--max-new-tokens", "8", "--proposer", "ngram"
    )
    assert obj["token_ids"] == vanilla and obj["stats"]["rounds"] >= 1


def test_draft_lm_json_matches_vanilla(capsys, target_dir, vanilla, tmp_path):
    lm = make_checkpoint("qwen3", tmp_path / "lm", seed=9)
    obj = run_json(
        capsys, "--target", str(target_dir), "--prompt-ids", PROMPT, "--max-new-tokens", "8",
        "--proposer", "draft-lm", "--draft", str(lm), "--chain", "2",
    )  # fmt: skip
    assert obj["token_ids"] == vanilla and len(obj["stats"]["alpha"]) == 2


def test_chat_prompt_uses_the_template(capsys, chat_dirs):
    path, tok = chat_dirs
    obj = run_json(capsys, "--target", str(path), "--prompt", "Hello there", "--chat", "--max-new-tokens", "4")
    expected = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert obj["prompt_ids"] == list(expected)
    assert obj["prompt_ids"][0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert isinstance(obj["text"], str) and len(obj["token_ids"]) <= 4
    assert obj["text"] == tok.decode(obj["token_ids"], skip_special_tokens=False)


def test_plain_text_prompt(capsys, chat_dirs):
    path, tok = chat_dirs
    obj = run_json(capsys, "--target", str(path), "--prompt", "The capital of France", "--max-new-tokens", "3")
    assert obj["prompt_ids"] == tok.encode("The capital of France", add_special_tokens=True)


# -- bad input: one line, no traceback ---------------------------------------------------------------------
def test_missing_target_dir(capsys, tmp_path):
    code, out, err = run(capsys, "--target", str(tmp_path / "nope"), "--prompt-ids", PROMPT)
    assert_one_line_error(code, out, err, "does not exist")


def test_malformed_config(capsys, target_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(target_dir, bad)
    (bad / "config.json").write_text("{not json")
    code, out, err = run(capsys, "--target", str(bad), "--prompt-ids", PROMPT)
    assert_one_line_error(code, out, err, "config.json")


def test_prompt_longer_than_context(capsys, target_dir):
    ids = ",".join(["5"] * 300)  # the tiny target's context is 256
    code, out, err = run(capsys, "--target", str(target_dir), "--prompt-ids", ids)
    assert_one_line_error(code, out, err, "context")


def test_text_prompt_without_tokenizer(capsys, target_dir):
    code, out, err = run(capsys, "--target", str(target_dir), "--prompt", "hello")
    assert_one_line_error(code, out, err, "tokenizer")


@pytest.mark.parametrize("tree", ["3,2", "x,y,z", "0,1,5"])
def test_bad_tree_string(capsys, target_dir, draft_dir, tree):
    code, out, err = run(
        capsys, "--target", str(target_dir), "--prompt-ids", PROMPT, "--draft", str(draft_dir), "--tree", tree
    )
    assert_one_line_error(code, out, err, "--tree")


def test_draft_for_a_different_target(capsys, draft_dir, tmp_path):
    other = make_checkpoint("llama", tmp_path / "other", seed=3, hidden_size=32, intermediate_size=64)
    code, out, err = run(capsys, "--target", str(other), "--prompt-ids", PROMPT, "--draft", str(draft_dir))
    assert_one_line_error(code, out, err, "hidden_size")


def test_malformed_prompt_ids(capsys, target_dir):
    code, out, err = run(capsys, "--target", str(target_dir), "--prompt-ids", "1,two,3")
    assert_one_line_error(code, out, err, "--prompt-ids")


def test_prompt_id_outside_vocabulary(capsys, target_dir):
    code, out, err = run(capsys, "--target", str(target_dir), "--prompt-ids", "1,96")
    assert_one_line_error(code, out, err, "vocabulary")


@pytest.mark.parametrize("shape", [None, ["--chain", "3"], ["--tree", "3,2,6"]])
def test_fast_path_matches_reference_loop(capsys, target_dir, draft_dir, shape):
    """--fast (the static-shape decoders) gives the reference loop's tokens, with and without stop tokens."""
    base = ["--target", str(target_dir), "--prompt-ids", PROMPT, "--max-new-tokens", "24"]
    if shape is not None:
        base += ["--draft", str(draft_dir), *shape]
    ref = run_json(capsys, *base)
    fast = run_json(capsys, *base, "--fast")
    assert fast["token_ids"] == ref["token_ids"]
    assert fast["stats"]["finish_reason"] == ref["stats"]["finish_reason"]
    if shape is not None:
        assert fast["stats"]["rounds"] >= 1 and fast["stats"]["accept_length"] >= 1.0
        # the same rounds draft the same tokens, so vLLM's "draft acceptance rate" agrees too
        for key in ("rounds", "drafted_tokens", "acceptance_rate"):
            assert fast["stats"][key] == ref["stats"][key], key
    stop = str(ref["token_ids"][5])  # a token the run emits: both must end right after its first occurrence
    ref_stop = run_json(capsys, *base, "--stop-ids", stop)
    fast_stop = run_json(capsys, *base, "--stop-ids", stop, "--fast")
    assert fast_stop["token_ids"] == ref_stop["token_ids"] and ref_stop["token_ids"][-1] == int(stop)
    assert len(ref_stop["token_ids"]) <= 6 and fast_stop["stats"]["finish_reason"] == "eos"


@pytest.mark.parametrize(
    "extra, match",
    [(["--temperature", "0.7"], "greedily"), (["--proposer", "ngram"], "EAGLE-3"), (["--trace", "x"], "trace")],
)
def test_fast_path_refuses_what_it_cannot_do(capsys, target_dir, extra, match):
    code, out, err = run(capsys, "--target", str(target_dir), "--prompt-ids", PROMPT, "--fast", *extra)
    assert_one_line_error(code, out, err, match)


def test_kernel_choice_needs_the_fast_path(capsys, target_dir):
    code, out, err = run(capsys, "--target", str(target_dir), "--prompt-ids", PROMPT, "--no-batch-invariant")
    assert_one_line_error(code, out, err, "--fast")
