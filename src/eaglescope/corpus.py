"""A code corpus every Python install carries: its own standard library sources.

Deterministic: files are listed in sorted order, the list is hashed, and the split into train and
held-out is by a hash of each file's relative path, so two machines with the same Python agree.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from eaglescope.errors import EagleScopeError

SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass
class Corpus:
    root: Path
    train: list[Path]
    heldout: list[Path]
    sha256: str  # of the sorted relative file list and sizes

    def read(self, files: list[Path], max_bytes: int | None = None) -> list[str]:
        texts, total = [], 0
        for f in files:
            try:
                t = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            texts.append(t)
            total += len(t)
            if max_bytes is not None and total >= max_bytes:
                break
        return texts


def stdlib_corpus(
    heldout_fraction: float = 0.05, root: Path | None = None, include_site_packages: bool = False
) -> Corpus:
    """Python sources under the stdlib (or `root`), split by file into train and held-out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise EagleScopeError(f"no Python sources found at {root}")
    skip = SKIP_PARTS - ({"site-packages", "dist-packages"} if include_site_packages else set())
    files = sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & skip))
    if not files:
        raise EagleScopeError(f"no .py files under {root}")
    listing = hashlib.sha256()
    train, heldout = [], []
    for f in files:
        rel = f.relative_to(root).as_posix()
        listing.update(f"{rel}\t{f.stat().st_size}\n".encode())
        # A file's side of the split depends on its path alone, never on what else is installed.
        bucket = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2**64
        (heldout if bucket < heldout_fraction else train).append(f)
    return Corpus(root, train, heldout, listing.hexdigest())


def code_prefixes(files: list[Path], tok, n: int, seed: int, length: int, chunk_chars: int = 1500) -> list[list[int]]:
    """`n` code prefixes of `length` tokens from random places in `files` (deterministic for a seed)."""
    rng = random.Random(seed)
    texts = [t for t in (f.read_text(encoding="utf-8", errors="ignore") for f in files) if len(t) > chunk_chars + 500]
    if not texts:
        raise EagleScopeError(f"no source file is longer than {chunk_chars + 500} characters")
    out: list[list[int]] = []
    while len(out) < n:
        text = rng.choice(texts)
        start = rng.randrange(0, len(text) - chunk_chars)
        ids = tok.encode(text[start : start + chunk_chars])[1:]  # drop a partial first token
        if len(ids) >= length:
            out.append(ids[:length])
    return out


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, chat_template: str | None = None):
    """Byte-level BPE trained with `tokenizers`, saved as a transformers fast tokenizer in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast  # seconds to import: only when a tokenizer is trained

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


# A "chat" template for code completion: the user turn is a code prefix, the assistant turn its
# continuation, with nothing in between, so rendering a conversation is plain language modelling and
# the loss mask covers exactly the continuation (plus the end-of-text token).
COMPLETION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)
