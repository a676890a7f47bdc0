"""Builders for the bad-input suite (test_bad_input.py): one set of good artifacts, damaged copies of them, and
the bookkeeping that proves a failed command left the user's files alone.

    shared = build_shared(root)     # target (tokenizer + chat template), data.jsonl, prepared dir, draft, export, trace
    before = snapshot([path, ...])  # every file's sha256 and every path, recursively
    ...
    assert snapshot([path, ...]) == before, describe_diff(before, after)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from models import make_checkpoint
from safetensors.torch import load_file, save_file
from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir

NOBODY = 65534
MAX_LEN = 64
DRAFT_VOCAB = 64
PROMPT = "1,2,3"

QA = [
    ("Hello there, how are you today?", "I am fine, thank you."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Two plus two?", "Think step by step: two plus two is four."),
    ("def add(a, b):", "    return a + b"),
]


def conversations(n: int = 12) -> list[dict]:
    """n conversations, alternating the OpenAI and ShareGPT forms; every one has an assistant turn."""
    rows = []
    for i in range(n):
        q, a = QA[i % len(QA)]
        if i % 2:
            rows.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
        else:
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@dataclass
class Shared:
    root: Path
    target: Path  # tiny 8-layer Llama, LLAMA3 tokenizer and chat template, vocab = tokenizer length
    data: Path  # data.jsonl (12 conversations)
    prep: Path  # prepared with --hidden-states (taps 2,4,5), 3 shards
    draft: Path  # trained 2 steps on prep
    export: Path  # the draft exported for vllm
    trace: Path  # `generate --draft draft --chain 3 --trace`


def build_shared(root: Path) -> Shared:
    """The good artifacts every case starts from (about 5 s of CPU)."""
    from eaglescope.cli import main
    from eaglescope.data.prepare import PrepareConfig, prepare
    from eaglescope.export import export_draft
    from eaglescope.models.draft import load_draft
    from eaglescope.train.loop import TrainConfig, train

    root.mkdir(parents=True, exist_ok=True)
    tok_dir = make_tokenizer_dir(root / "tokenizer-src", LLAMA3, vocab_size=300)
    tok = load(tok_dir)
    target = make_checkpoint(
        "llama", root / "target", vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    tok.save_pretrained(target)
    shutil.rmtree(root / "tokenizer-src")
    data = write_jsonl(root / "data.jsonl", conversations())
    prep = root / "prep"
    prepare(
        PrepareConfig(
            target=str(target), data=str(data), out=str(prep), max_length=MAX_LEN, draft_vocab_size=DRAFT_VOCAB,
            shard_samples=4, batch_size=4, hidden_states=True, device="cpu", dtype="float32",
        ),
        progress=False,
    )  # fmt: skip
    draft = root / "draft"
    train(
        TrainConfig(
            target=str(target), data=str(prep), out=str(draft), max_steps=2, batch_size=2, eval_fraction=0.25,
            max_length=MAX_LEN, device="cpu", dtype="float32",
        ),
        progress=False,
    )  # fmt: skip
    export = root / "export"
    export_draft(load_draft(draft), "vllm", export)
    trace = root / "trace"
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--prompt-ids", PROMPT, "--chain", "3"]
    argv += ["--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32", "--trace", str(trace)]
    rc = main(argv)
    assert rc == 0 and (trace / "manifest.json").is_file(), "could not record the shared trace"
    return Shared(root, target, data, prep, draft, export, trace)


# -- snapshots ---------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def snapshot(paths) -> dict[str, str]:
    """{path: what it is} for every path in `paths` and everything below them: a file's sha256, 'dir', a link's
    target, or 'absent' for a guarded path that does not exist (it must not appear either)."""
    snap: dict[str, str] = {}

    def visit(p: Path) -> None:
        key = str(p)
        if p.is_symlink():
            snap[key] = "link:" + os.readlink(p)
        elif p.is_dir():
            snap[key] = "dir"
            for child in sorted(p.iterdir()):
                visit(child)
        elif p.is_file():
            snap[key] = "file:" + _sha256(p)
        elif p.exists():
            snap[key] = "other"
        else:
            snap[key] = "absent"

    for p in paths:
        visit(Path(p))
    return snap


def describe_diff(before: dict[str, str], after: dict[str, str], most: int = 6) -> str:
    added = sorted(k for k in after if k not in before)
    removed = sorted(k for k in before if k not in after)
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    parts = []
    for what, keys in (("added", added), ("removed", removed), ("changed", changed)):
        if keys:
            shown = ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")
            parts.append(f"{what}: {shown}")
    return "; ".join(parts) or "identical"


def restore(dst: Path, pristine: Path) -> None:
    """Put `dst` back as `pristine` (after a case that damaged a shared artifact, so later cases stay valid)."""
    make_writable(dst)
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    elif dst.exists() or dst.is_symlink():
        dst.unlink()
    shutil.copytree(pristine, dst, symlinks=True)


# -- read-only paths and an ordinary user --------------------------------------------------------------------
def make_readonly(path: Path) -> None:
    for p in sorted(Path(path).rglob("*"), reverse=True):
        if p.is_dir():
            p.chmod(0o555)
        elif p.is_file():
            p.chmod(0o444)
    Path(path).chmod(0o555 if Path(path).is_dir() else 0o444)


def make_writable(path: Path) -> None:
    path = Path(path)
    if not path.exists():
        return
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode | stat.S_IWUSR | (stat.S_IXUSR if p.is_dir() else 0))


def chown_tree(path: Path, uid: int, gid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.lchown(p, uid, gid)


@contextlib.contextmanager
def ordinary_user():
    """Run the block as an unprivileged user (real and effective ids), so file permissions bind as they do for a
    user; root keeps its saved id and comes back afterwards. A no-op when not running as root."""
    if os.geteuid() != 0:
        yield
        return
    groups = os.getgroups()
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, 0)
    os.setresuid(NOBODY, NOBODY, 0)
    try:
        yield
    finally:
        os.setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)
        os.setgroups(groups)


# -- damaged copies --------------------------------------------------------------------------------------------
def copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    return dst


def edit_json(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    obj = fn(obj) or obj
    path.write_text(json.dumps(obj, indent=2) + "\n")


def flip_bytes(path: Path, offset: int = -5, count: int = 1) -> None:
    b = bytearray(path.read_bytes())
    for i in range(count):
        b[offset + i] ^= 0xFF
    path.write_bytes(bytes(b))


def truncate(path: Path, keep: float = 0.5) -> None:
    b = path.read_bytes()
    path.write_bytes(b[: int(len(b) * keep)])


def corrupt_safetensors_header(path: Path) -> None:
    """Garbage in the JSON header of a safetensors file (its first bytes after the 8-byte length)."""
    b = bytearray(path.read_bytes())
    b[8:24] = b"\xff\xfe{not json at all"[:16]
    path.write_bytes(bytes(b))


def set_weight(model_dir: Path, fn, file: str = "model.safetensors") -> None:
    """Rewrite one safetensors file of `model_dir` with fn(state_dict) applied."""
    path = model_dir / file
    sd = load_file(str(path))
    fn(sd)
    save_file(sd, str(path), metadata={"format": "pt"})


def nan_weight(model_dir: Path, key: str | None = None, file: str = "model.safetensors") -> None:
    def poison(sd):
        k = key or next(k for k in sorted(sd) if sd[k].is_floating_point() and sd[k].dim() == 2)
        sd[k] = sd[k].clone()
        sd[k].view(-1)[0] = float("nan")

    set_weight(model_dir, poison, file)


def other_target(dst: Path, **overrides) -> Path:
    """A tiny Llama unlike the shared one (no tokenizer)."""
    return make_checkpoint("llama", dst, seed=3, **overrides)


def target_with_tokenizer_of(dst: Path, shared_target: Path, **overrides) -> Path:
    """A checkpoint built with `overrides` that carries the shared target's tokenizer files."""
    make_checkpoint("llama", dst, seed=4, **overrides)
    for f in shared_target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, dst / f.name)
    return dst


def drop_chat_template(model_dir: Path) -> None:
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file():
        edit_json(cfg, lambda c: c.pop("chat_template", None) and None)


def drop_tokenizer(model_dir: Path) -> None:
    for f in list(model_dir.iterdir()):
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()


def pickle_only(model_dir: Path, whole_module: bool) -> None:
    """Replace model.safetensors by a pytorch_model.bin written with torch.save: the state dict, or the whole
    nn.Module (which only an unsafe unpickling can load)."""
    sd = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    if whole_module:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        model.load_state_dict(sd, strict=False)
        torch.save(model, model_dir / "pytorch_model.bin")
    else:
        torch.save(sd, model_dir / "pytorch_model.bin")


def shard_index_outside(model_dir: Path, outside: Path) -> None:
    """Move the weights to `outside` (a sibling of the checkpoint) and point model.safetensors.index.json at it."""
    src = model_dir / "model.safetensors"
    sd = load_file(str(src))
    src.rename(outside)
    rel = os.path.relpath(outside, model_dir)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())}}
    index["weight_map"] = {k: rel for k in sd}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def big_draft(root: Path, hidden: int = 1024, vocab: int = 32000, layers: int = 8) -> Path:
    """A draft of ~200 MB for a target that exists only as its config.json: big enough that writing it takes a
    while (the kill tests signal while it is being written)."""
    from drafts import make_draft

    from eaglescope.models.draft import save_draft

    cfg_dir = root / "big-target-config"
    cfg_dir.mkdir(parents=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 8,
        "num_key_value_heads": 8, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    }  # fmt: skip
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    model, contract = make_draft(cfg_dir, draft_vocab_size=vocab)
    return save_draft(model, contract, root / "big-draft")


def shard_in_two(model_dir: Path) -> tuple[Path, Path]:
    """Split model.safetensors into two shards and an index, as save_pretrained does for big models."""
    sd = load_file(str(model_dir / "model.safetensors"))
    keys = sorted(sd)
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2 :])
    weight_map = {}
    for name, part in zip(names, halves):
        save_file({k: sd[k] for k in part}, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (model_dir / "model.safetensors").unlink()
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}) + "\n")
    return model_dir / names[0], model_dir / names[1]
