"""Tiny tokenizers with real chat templates, for tests.

Each builder trains a byte-level BPE on a few sentences (so decode(encode(text)) == text and
tokens can straddle template boundaries like real ones do), wraps it as a
`PreTrainedTokenizerFast`, saves it with `save_pretrained` and returns the directory, so tests
load it back through the same `AutoTokenizer.from_pretrained` path a real checkpoint takes.

    from tokenizers_fixtures import make_tokenizer_dir, LLAMA3, load
    tok = load(make_tokenizer_dir(tmp_path, LLAMA3))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

CORPUS = [
    "Hello there, how are you today?",
    "I am fine, thank you. What is the capital of France?",
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "Think step by step: two plus two is four.",
    "You are a helpful assistant that answers briefly.",
    "System User Assistant user assistant system ### : \n\n",
    "### Assistant: The answer is Paris. The end. The capital. Four.",
]

SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class ChatStyle:
    name: str
    template: str
    special: tuple[str, ...]  # added with special=True (control tokens)
    plain_added: tuple[str, ...]  # added with special=False (like Qwen3's <think>)
    bos: str | None
    eos: str


# Llama-3 style: every turn is header + content + <|eot_id|>; bos written by the template.
LLAMA3 = ChatStyle(
    name="llama3",
    template=(
        "{{- bos_token }}"
        "{%- for m in messages %}"
        "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
    special=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    plain_added=(),
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
)

# ChatML / Qwen3 style: reasoning is split off `content` at </think>; assistant turns after the
# last user message show it in a <think> block, earlier ones are re-rendered without it. So a
# prefix of the conversation renders an earlier turn differently from the full conversation.
QWEN3 = ChatStyle(
    name="qwen3",
    template=(
        "{%- set ns = namespace(last_user=-1) %}"
        "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
        "{%- endfor %}"
        "{%- for m in messages %}"
        "{%- if m['role'] == 'assistant' %}"
        "{%- set content = m['content'] %}{%- set reasoning = '' %}"
        "{%- if '</think>' in content %}"
        "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
        "{%- endif %}"
        "{%- if loop.index0 > ns.last_user %}"
        "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- else %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    special=("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
    plain_added=("<think>", "</think>"),
    bos=None,
    eos="<|im_end|>",
)

# An odd plain-text template: markdown headers, a space after the colon (so the first answer
# token merges with the header's space under byte-level BPE) and </s> as end of turn.
CUSTOM = ChatStyle(
    name="custom",
    template=(
        "{%- for m in messages %}"
        "{%- if m['role'] == 'system' %}{{- m['content'] + '\\n\\n' }}"
        "{%- elif m['role'] == 'user' %}{{- '### User: ' + m['content'] + '\\n' }}"
        "{%- else %}{{- '### Assistant: ' + m['content'] + eos_token + '\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '### Assistant: ' }}{%- endif %}"
    ),
    special=("<s>", "</s>"),
    plain_added=(),
    bos="<s>",
    eos="</s>",
)

# Llama-3 style with {% generation %} blocks, for transformers' own assistant mask.
LLAMA3_GENERATION = ChatStyle(
    name="llama3_generation",
    template=(
        "{{- bos_token }}"
        "{%- for m in messages %}"
        "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
        "{%- if m['role'] == 'assistant' %}"
        "{%- generation %}{{- m['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
        "{%- else %}{{- m['content'] | trim + '<|eot_id|>' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
    special=LLAMA3.special,
    plain_added=(),
    bos=LLAMA3.bos,
    eos=LLAMA3.eos,
)

STYLES = {s.name: s for s in (LLAMA3, QWEN3, CUSTOM, LLAMA3_GENERATION)}


def make_tokenizer_dir(root: Path, style: ChatStyle, vocab_size: int = 600) -> Path:
    """Train a byte-level BPE, attach `style`'s template and tokens, save_pretrained under root/style.name."""
    tok = Tokenizer(models.BPE())
    # Llama-3 / Qwen2 style split: runs of newlines stay one piece whatever follows them, so the
    # text before an answer tokenizes the same alone (serving prompt) as with the answer after it.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(style.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=style.bos, eos_token=style.eos)
    fast.add_tokens(list(style.plain_added), special_tokens=False)
    fast.chat_template = style.template
    out = root / style.name
    fast.save_pretrained(out)
    return out


def load(path: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(path)
