"""Chat data: read JSONL conversations, render them with the target's own chat template, and
mark the tokens the assistant generates (the loss mask).

What is supervised (loss_mask == 1): every token the assistant *generates* when serving —
its content (reasoning included, as the template renders it) and the end-of-turn token that
stops generation (the draft must learn to predict it, or drafts run past the end of every
answer). Not supervised: system and user turns, the assistant header / generation prompt,
bos, and anything the template writes after the end-of-turn token (e.g. ChatML's trailing
"\\n"), because serving never generates those: it stops at the end-of-turn token.

Two ways to find those tokens:
  * the template has `{% generation %}` blocks: transformers' `return_assistant_tokens_mask`
    marks exactly what the template author put inside them;
  * otherwise, template-agnostic: for each assistant turn i, render messages[:i] with
    add_generation_prompt=True and messages[:i+1]; the text the turn adds beyond the
    generation prompt, cut after its last control (special) token — the end-of-turn — is the
    answer. It is located in the full rendering by character position; templates that
    re-render earlier turns once later turns follow (Qwen3 drops earlier <think> blocks) are
    handled by anchoring on the end-of-turn token instead. Characters map to tokens through
    the fast tokenizer's offsets; a token that straddles the boundary (byte-level BPE merges
    "Assistant: " + "Hello" into "ĠHello") is supervised, since it carries generated text.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import sha256_text

# Both ShareGPT "from" values and OpenAI "role" values, normalised.
ROLES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "assistant": "assistant",
}

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class RenderedChat:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the assistant generates the token (content + end-of-turn)
    text: str  # the full rendering; input_ids may be a truncated tokenization of it


def _content(value, where: str) -> str:
    if isinstance(value, str):
        return value
    # OpenAI content parts: [{"type": "text", "text": ...}, ...]
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise EagleScopeError(f"{where}: message content must be a string or a list of text parts, got {value!r:.60}.")


def parse_conversation(obj, where: str) -> list[dict]:
    """One JSON object (ShareGPT or OpenAI form) → [{"role", "content"}]; `where` prefixes errors."""
    if not isinstance(obj, dict):
        raise EagleScopeError(f"{where}: expected a JSON object with 'conversations' or 'messages'.")
    if "conversations" in obj:
        turns, role_key, content_key = obj["conversations"], "from", "value"
    elif "messages" in obj:
        turns, role_key, content_key = obj["messages"], "role", "content"
    else:
        raise EagleScopeError(f"{where}: expected a 'conversations' (ShareGPT) or 'messages' (OpenAI) list.")
    if not isinstance(turns, list):
        raise EagleScopeError(f"{where}: '{'conversations' if role_key == 'from' else 'messages'}' is not a list.")
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise EagleScopeError(f"{where}: message {j} needs '{role_key}' and '{content_key}' keys.")
        role = ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise EagleScopeError(f"{where}: message {j} has unknown role {turn[role_key]!r}.")
        out.append({"role": role, "content": _content(turn[content_key], where)})
    return out


def read_conversations(path: Path) -> Iterator[list[dict]]:
    """Yield normalised conversations from a JSONL file; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise EagleScopeError(f"{path}: no such data file.")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = raw[e.start]
                raise EagleScopeError(f"{where}: not UTF-8 text (byte {bad:#04x} at column {e.start + 1}).") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise EagleScopeError(f"{where}: invalid JSON ({e.msg}).") from None
            yield parse_conversation(obj, where)


def _template(tokenizer) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):  # named templates: serving uses "default"
        tpl = tpl.get("default")
    if not tpl:
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise EagleScopeError(f"{name} has no chat template; training data must be rendered as serving renders it.")
    return tpl


def chat_template_hash(tokenizer) -> str:
    """sha256 of the template text; equals target.base.sha256_text(chat_template_of(model_dir))."""
    return sha256_text(_template(tokenizer))


def _apply(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raise_exception(...) in templates, e.g. "roles must alternate"
        raise EagleScopeError(f"chat template failed on a conversation: {e}") from None


def _control_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return ids


def _common_prefix_len(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def assistant_char_spans(messages: list[dict], tokenizer, text: str) -> list[tuple[int, int]]:
    """[start, end) character spans of `text` (the full rendering) that the assistant generates."""
    control = _control_ids(tokenizer)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _apply(tokenizer, messages[:i], add_generation_prompt=True)
        local = _apply(tokenizer, messages[: i + 1], add_generation_prompt=False)
        a = _common_prefix_len(prompt, local)  # where the answer starts in the local rendering
        answer = local[a:]
        # Cut after the last control token: that is the end-of-turn token generation stops at.
        enc = tokenizer(answer, add_special_tokens=False, return_offsets_mapping=True)
        pairs = zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        ends = [(s, e) for t, (s, e) in pairs if t in control and e > s]
        eot = None
        if ends:
            eot = answer[ends[-1][0] : ends[-1][1]]
            answer = answer[: ends[-1][1]]
        if not text.startswith(local[:a]):
            raise EagleScopeError(
                f"chat template renders the conversation before assistant message {i} differently once later turns "
                "follow, so its answer cannot be located."
            )
        start = a
        if text.startswith(answer, start):
            end = start + len(answer)
        elif eot is not None and (pos := text.find(eot, start)) >= 0:
            end = pos + len(eot)  # earlier turn re-rendered (e.g. reasoning stripped): anchor on end-of-turn
        else:
            raise EagleScopeError(
                f"chat template re-renders assistant message {i} once later turns follow and writes no end-of-turn "
                "control token to anchor on, so its answer cannot be located."
            )
        if spans and start < spans[-1][1]:
            raise EagleScopeError(f"chat template produced overlapping assistant spans at turn {i}.")
        if end > start:
            spans.append((start, end))
    return spans


def mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a span (both lists sorted by position)."""
    mask = [0] * len(offsets)
    j = 0
    for t, (s, e) in enumerate(offsets):
        while j < len(spans) and s >= spans[j][1]:
            j += 1
        if j == len(spans):
            break
        if e > spans[j][0] and e > s:
            mask[t] = 1
    return mask


def rendered_messages(messages: list[dict]) -> list[dict] | None:
    """The messages `render` renders: without leading assistant turns (they answer no prompt, and there is no prefix
    to render a generation prompt from) and without what follows the last assistant turn; None when no assistant
    turn is left."""
    first = next((i for i, m in enumerate(messages) if m["role"] != "assistant"), len(messages))
    messages = messages[first:]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    return None if last is None else messages[: last + 1]


def render(messages: list[dict], tokenizer, max_length: int | None = None) -> RenderedChat | None:
    """Render with the tokenizer's chat template and build the assistant loss mask.

    Returns None (the caller counts it as skipped) when there is nothing to supervise: no
    assistant turn, or none left after truncation to max_length. Assistant turns before the
    first user/system message and messages after the last assistant turn are dropped.
    """
    template = _template(tokenizer)
    messages = rendered_messages(messages)
    if messages is None:
        return None
    if not getattr(tokenizer, "is_fast", False):
        raise EagleScopeError("loss masks need a fast (tokenizers-backed) tokenizer for character offsets.")
    text = _apply(tokenizer, messages, add_generation_prompt=False)
    if _GENERATION_BLOCK.search(template):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
        if not any(mask):
            raise EagleScopeError("chat template has {% generation %} blocks but they cover no assistant tokens.")
    else:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = mask_from_spans(enc["offset_mapping"], assistant_char_spans(messages, tokenizer, text))
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return None
    return RenderedChat(input_ids=ids, loss_mask=mask, text=text)


def render_all(
    conversations: Iterable[list[dict]], tokenizer, max_length: int | None = None
) -> tuple[list[RenderedChat], int]:
    """Render many conversations; returns (rendered, number skipped for having nothing to supervise)."""
    rendered, skipped = [], 0
    for conv in conversations:
        r = render(conv, tokenizer, max_length)
        if r is None:
            skipped += 1
        else:
            rendered.append(r)
    return rendered, skipped
