import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers_fixtures import CUSTOM, LLAMA3, LLAMA3_GENERATION, QWEN3, STYLES, load, make_tokenizer_dir

from eaglescope.data.chat import chat_template_hash, read_conversations, render, render_all
from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import chat_template_of, sha256_text

SYSTEM = "You are a helpful assistant."
Q1, Q2 = "What is the capital of France?", "Thank you. Two plus two?"
A1 = "<think>\nThe capital of France\n</think>\n\nThe capital of France is Paris."
A2 = "<think>two plus two</think>Four."
CONV = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": Q1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": Q2},
    {"role": "assistant", "content": A2},
]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {name: load(make_tokenizer_dir(root, style)) for name, style in STYLES.items()}


def runs(ids, mask):
    """Contiguous supervised token runs."""
    out, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def supervised_and_not(tok, r):
    sup = [tok.decode(run) for run in runs(r.input_ids, r.loss_mask)]
    unsup = [tok.decode(run) for run in runs(r.input_ids, [1 - m for m in r.loss_mask])]
    return sup, unsup


def test_llama3_supervises_content_and_eot_only(toks):
    tok = toks["llama3"]
    r = render(CONV, tok)
    sup, unsup = supervised_and_not(tok, r)
    assert sup == [A1 + "<|eot_id|>", A2 + "<|eot_id|>"]
    assert unsup == [
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{Q1}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        f"<|start_header_id|>user<|end_header_id|>\n\n{Q2}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    ]
    assert tok.decode(r.input_ids) == r.text


def test_qwen3_supervises_reasoning_of_last_turn_and_im_end_not_trailing_newline(toks):
    tok = toks["qwen3"]
    r = render(CONV, tok)
    sup, unsup = supervised_and_not(tok, r)
    # The earlier turn is re-rendered without its reasoning once a later user turn follows: the
    # mask follows the final rendering (located via <|im_end|>), not the prefix rendering.
    assert "The capital of France\n</think>" not in r.text
    assert sup == ["The capital of France is Paris.<|im_end|>", "<think>\ntwo plus two\n</think>\n\nFour.<|im_end|>"]
    assert unsup == [
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n",
        f"\n<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n",
        "\n",  # ChatML writes "\n" after <|im_end|>; serving stops at <|im_end|>, so it is never generated
    ]


def test_custom_template_supervises_answer_and_its_eos(toks):
    tok = toks["custom"]
    r = render(CONV, tok)
    sup, unsup = supervised_and_not(tok, r)
    assert sup == [A1 + "</s>", A2 + "</s>"]
    assert unsup == [f"{SYSTEM}\n\n### User: {Q1}\n### Assistant: ", f"\n### User: {Q2}\n### Assistant: ", "\n"]


def test_token_straddling_prompt_and_answer_is_supervised(toks):
    # The generation prompt ends in "Assistant: " but byte-level BPE merges that space with the
    # answer's first word ("ĠThe"): the straddling token carries generated text, so it is supervised.
    tok = toks["custom"]
    conv = [{"role": "user", "content": Q1}, {"role": "assistant", "content": "The capital is Paris."}]
    r = render(conv, tok)
    sup, unsup = supervised_and_not(tok, r)
    assert sup == [" The capital is Paris.</s>"]
    assert unsup == [f"### User: {Q1}\n### Assistant:", "\n"]
    prompt = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("### Assistant: ")
    enc = tok(r.text, add_special_tokens=False, return_offsets_mapping=True)
    start, end = enc["offset_mapping"][r.loss_mask.index(1)]
    assert start == len(prompt) - 1 and end > len(prompt)


def test_generation_blocks_agree_with_template_agnostic_mask(toks):
    # Same rendering, two methods: transformers' {% generation %} mask and the prefix/offset one.
    a, b = render(CONV, toks["llama3"]), render(CONV, toks["llama3_generation"])
    assert a.text == b.text
    assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask


@pytest.mark.parametrize("name", ["llama3", "qwen3", "llama3_generation"])
def test_context_before_last_answer_is_exactly_the_serving_prompt(toks, name):
    tok = toks[name]
    r = render(CONV, tok)
    first_of_last = len(r.loss_mask) - r.loss_mask[::-1].index(1) - len(runs(r.input_ids, r.loss_mask)[-1])
    serving = tok(
        tok.apply_chat_template(CONV[:-1], tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert r.input_ids[:first_of_last] == serving["input_ids"]


@pytest.mark.parametrize("name", sorted(STYLES))
def test_control_and_user_tokens_never_supervised(toks, name):
    tok = toks[name]
    r = render(CONV, tok)
    eot = tok.convert_tokens_to_ids(tok.eos_token)
    supervised = {t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if m}
    unsupervised_control = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert supervised & unsupervised_control == {eot}
    # exactly one supervised end-of-turn per assistant turn
    assert sum(1 for t, m in zip(r.input_ids, r.loss_mask, strict=True) if m and t == eot) == 2


def test_sharegpt_and_openai_forms_render_identically(tmp_path, toks):
    share = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                               "value": m["content"]} for m in CONV]}  # fmt: skip
    openai = {"messages": CONV}
    parts = {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CONV]}
    (tmp_path / "s.jsonl").write_text(json.dumps(share) + "\n\n")
    (tmp_path / "o.jsonl").write_text(json.dumps(openai) + "\n" + json.dumps(parts) + "\n")
    s, o = list(read_conversations(tmp_path / "s.jsonl")), list(read_conversations(tmp_path / "o.jsonl"))
    assert s == [CONV] and o == [CONV, CONV]
    for tok in toks.values():
        assert render(s[0], tok) == render(o[0], tok)


@pytest.mark.parametrize(
    "bad, reason",
    [
        ('{"messages": [{"role": "user", "content": "hi"}', "invalid JSON"),
        ('{"messages": [{"role": "user"}]}', "needs 'role' and 'content'"),
        ('{"conversations": [{"from": "tool", "value": "x"}]}', "unknown role 'tool'"),
        ('{"text": "hello"}', "'conversations'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "content must be"),
    ],
)
def test_broken_line_is_one_line_error_with_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "d.jsonl"
    good = json.dumps({"messages": CONV[:3]})
    path.write_text(good + "\n\n" + bad + "\n" + good + "\n")
    it = read_conversations(path)
    assert next(it) == CONV[:3]  # lines before the broken one are usable
    with pytest.raises(EagleScopeError) as e:
        next(it)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and reason in msg and "\n" not in msg


def test_conversations_without_answers_are_skipped_and_counted(toks):
    tok = toks["llama3"]
    no_answer = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]
    assert render(no_answer, tok) is None
    assert render([], tok) is None
    rendered, skipped = render_all([CONV, no_answer, CONV[:3]], tok)
    assert skipped == 1 and [r.text for r in rendered] == [render(CONV, tok).text, render(CONV[:3], tok).text]


def test_leading_assistant_and_trailing_user_turns_are_dropped(toks):
    tok = toks["qwen3"]
    padded = [{"role": "assistant", "content": "Hello there"}] + CONV + [{"role": "user", "content": "bye"}]
    assert render(padded, tok) == render(CONV, tok)


def test_truncation_keeps_prefix_and_skips_when_no_answer_left(toks):
    tok = toks["llama3"]
    full = render(CONV, tok)
    first = full.loss_mask.index(1)
    cut = render(CONV, tok, max_length=first + 3)
    assert cut.input_ids == full.input_ids[: first + 3] and cut.loss_mask == full.loss_mask[: first + 3]
    assert render(CONV, tok, max_length=first) is None


def test_missing_chat_template_is_an_error(tmp_path, toks):
    d = make_tokenizer_dir(tmp_path, LLAMA3)
    (d / "chat_template.jinja").unlink()
    tok = load(d)
    with pytest.raises(EagleScopeError, match="no chat template"):
        render(CONV, tok)
    with pytest.raises(EagleScopeError, match="no chat template"):
        chat_template_hash(tok)


def test_template_exception_is_an_eaglescope_error(tmp_path):
    d = make_tokenizer_dir(tmp_path, CUSTOM)
    tok = load(d)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(EagleScopeError, match="roles must alternate"):
        render(CONV, tok)


def test_chat_template_hash_matches_fingerprint_of_the_directory(tmp_path, toks):
    for style in (LLAMA3, QWEN3, CUSTOM):
        d = make_tokenizer_dir(tmp_path, style)
        assert chat_template_hash(load(d)) == sha256_text(chat_template_of(d))
    assert len({chat_template_hash(t) for t in toks.values()}) == len(toks)
    assert LLAMA3_GENERATION.template != LLAMA3.template


def test_re_rendered_turn_without_end_token_is_a_loud_error(toks):
    tok = toks["custom"]
    saved = tok.chat_template
    # Earlier answers are replaced by a placeholder and no control token ends a turn: nothing to anchor on.
    tok.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}A: [earlier answer]\n"
        "{%- elif m['role'] == 'assistant' %}A: {{ m['content'] }}\n{%- else %}U: {{ m['content'] }}\n{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}A: {%- endif %}"
    )
    try:
        with pytest.raises(EagleScopeError, match="assistant message 1 once"):
            render(CONV[1:] + [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok"}], tok)
        assert render(CONV[1:3], tok) is not None  # one answer: nothing re-rendered, fine
    finally:
        tok.chat_template = saved


FRAGMENTS = ["Paris", " is", " the", " capital", ".", "\n", " ", "def add(a, b):", "\n    return a + b", "2+2=4", "é"]
text_st = st.lists(st.sampled_from(FRAGMENTS + ["<think>", "</think>"]), min_size=1, max_size=6).map("".join)


@st.composite
def conversations(draw):
    conv = [{"role": "system", "content": draw(text_st)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        conv += [{"role": "user", "content": draw(text_st)}, {"role": "assistant", "content": draw(text_st)}]
    return conv


def qwen3_expected(conv):
    answers = [m["content"] for m in conv if m["role"] == "assistant"]
    out = []
    for k, c in enumerate(answers):
        reasoning = ""
        if "</think>" in c:
            reasoning = c.split("</think>")[0].split("<think>")[-1].strip("\n")
            c = c.split("</think>")[-1].lstrip("\n")
        last = k == len(answers) - 1
        out.append((f"<think>\n{reasoning}\n</think>\n\n" if last else "") + c + "<|im_end|>")
    return out


def matches_with_straddle(got: list[str], want: list[str], prompt_tail: str) -> bool:
    """got == want, except a supervised run may start with the end of the generation prompt when the
    tokenizer merged it into the answer's first token (see test_token_straddling_prompt_and_answer...)."""
    return len(got) == len(want) and all(
        g.endswith(w) and prompt_tail.endswith(g[: len(g) - len(w)]) for g, w in zip(got, want, strict=True)
    )


@settings(max_examples=60, deadline=None)
@given(conv=conversations())
def test_random_conversations_supervise_exactly_the_answers(toks, conv):
    answers = [m["content"] for m in conv if m["role"] == "assistant"]
    llama, gen = render(conv, toks["llama3"]), render(conv, toks["llama3_generation"])
    assert supervised_and_not(toks["llama3"], llama)[0] == [a.strip() + "<|eot_id|>" for a in answers]
    assert llama.input_ids == gen.input_ids and llama.loss_mask == gen.loss_mask
    qwen = supervised_and_not(toks["qwen3"], render(conv, toks["qwen3"]))[0]
    assert matches_with_straddle(qwen, qwen3_expected(conv), "<|im_start|>assistant\n")
    custom = supervised_and_not(toks["custom"], render(conv, toks["custom"]))[0]
    assert matches_with_straddle(custom, [a + "</s>" for a in answers], "### Assistant: ")
