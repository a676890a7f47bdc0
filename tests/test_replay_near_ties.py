"""A clean bf16 run traced in fingerprint mode is healthy, also when its draft's candidates are near-tied.

A random draft over a random target puts one or two tokens on top of almost every frontier row, so at each tree
step several candidates share an id and their scores differ by less than bf16 rounds: the static-shape decoder in
bf16 and doctor's float32 replay break those ties differently. The replay must expand the nodes the traced run
expanded (each one's parent and token, which the trace shows exactly even when fingerprinted), not its own
near-equal choice; before it did, every one of three such runs was called DIVERGENCE_UNEXPLAINED at a
`draft.step<k>.tokens` (the 8B-shaped GPU test found it first). The target is saved in bf16 and loaded through the
normal loading code; generate and doctor run as the CLI runs them."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from drafts import save_random_draft

from eaglescope.cli import main
from eaglescope.detective.replay import distinct_assignment

NEW_TOKENS = 48
VOCAB = 2048


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("near-ties")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # the GPU tests' 8B-shaped init, at this width
                p.normal_(0.0, 0.15 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.save_pretrained(root / "target")
    return root, root / "target", save_random_draft(root / "target", root / "draft", 512)


def test_a_clean_bf16_fingerprint_tree_trace_is_healthy(capsys, pair):
    root, target, draft = pair
    prompt = ",".join(str((i * 7919 + 13) % (VOCAB - 10) + 10) for i in range(64))
    trace = root / "trace"
    capsys.readouterr()
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt-ids", prompt, "--device", "cpu",
                 "--dtype", "bfloat16", "--max-new-tokens", str(NEW_TOKENS), "--trace", str(trace),
                 "--trace-mode", "fingerprint", "--json"]) == 0  # fmt: skip
    capsys.readouterr()
    rc = main(["doctor", "--target", str(target), "--draft", str(draft), "--trace", str(trace), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert (rc, report["healthy"]) == (0, True), report["findings"][:1]


def test_distinct_assignment_moves_an_earlier_row_to_make_room():
    inf = float("inf")
    # row 0 takes column 0 first (its cheapest pair), but row 1 can only take column 0: row 0 must move to column 1
    cost = torch.tensor([[0.0, 0.2], [0.1, inf]])
    assert distinct_assignment(cost) == [1, 0]
    # cheapest pairs first when every row has room
    assert distinct_assignment(torch.tensor([[0.3, 0.1], [0.2, 0.9]])) == [1, 0]
    # two rows, one allowed column: none exists
    assert distinct_assignment(torch.tensor([[0.0, inf], [0.0, inf]])) is None
