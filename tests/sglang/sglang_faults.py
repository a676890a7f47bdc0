"""Wiring faults made inside SGLang 0.5.23's own code, for tests/sglang/test_sglang_code_faults.py.

Made as tests/vllm/vllm_faults.py makes vLLM's: the SGLang environment (.venv-sglang) is never written.
`private_sglang(root, package)` makes ROOT/sglang, a tree of real directories whose files are symbolic links to the
installed package's files, except the few files a fault patches (real files holding the patched text, their stale
bytecode left out) and one file of this project's, `sglang/_eaglescope_fault.py`, which reads the switch. The served
processes put ROOT first on their PYTHONPATH, so `import sglang` finds the copy.

Each fault is one or more exact replacements of whole statements (the original text must occur exactly once in its
file), kept behind a switch read each time the statement runs:

    if __import__("sglang._eaglescope_fault", fromlist=["on"]).on("<fault>"):
        <the faulty statement>
    else:
        <SGLang's statement, unchanged>

SGLang runs its model in a scheduler process it spawns per engine, so an environment variable set between requests
would not reach it: the switch is the content of a file (named by EAGLESCOPE_SGLANG_FAULT_FILE), which the runner
rewrites between requests, so that one SGLang engine serves every fault in turn. Faults in code that runs while the
engine loads (the target's capture ids, the draft's d2t) are read once, at load: they get an engine of their own.
A run with the variable unset, or the file naming no fault, is SGLang as installed.
"""

from __future__ import annotations

import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "vllm"))
from vllm_faults import sha256, switched  # noqa: E402 - the same statement switch as vLLM's faults

SWITCH_FILE = "EAGLESCOPE_SGLANG_FAULT_FILE"
SWITCH_MODULE = "_eaglescope_fault"

WORKER = "srt/speculative/eagle_worker_v2.py"
COMMON = "srt/speculative/eagle_worker_common.py"
AUX = "srt/layers/aux_hidden_states.py"
LLAMA = "srt/models/llama.py"
LLAMA_EAGLE3 = "srt/models/llama_eagle3.py"

# sglang/_eaglescope_fault.py in the private copy: whether a fault is switched on (read each time a patched statement
# runs, in whichever SGLang process runs it)
SWITCH_SOURCE = f'''"""eaglescope's switch for the faults patched into this private copy of SGLang (tests/sglang)."""
import os


def on(fault: str) -> bool:
    path = os.environ.get("{SWITCH_FILE}")
    if not path:
        return False
    try:
        with open(path) as f:
            return f.read().strip() == fault
    except OSError:
        return False
'''


@dataclass(frozen=True)
class Patch:
    """In SGLang's file `path` (relative to the package), the statement(s) `old` as `new` computes them."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Fault:
    """A wiring mistake made in SGLang's code: its patches, what it does, and whether it acts while the engine loads
    (then it needs an engine of its own)."""

    what: str
    patches: tuple[Patch, ...]
    at_load: bool = False


def _p(path: str, old: str, new: str) -> Patch:
    return Patch(path, textwrap.dedent(old), textwrap.dedent(new))


_SELECT = """\
select_index = (
    torch.arange(
        0,
        len(batch.seq_lens) * self.speculative_num_draft_tokens,
        self.speculative_num_draft_tokens,
        device=self.device,
    )
    + batch_result.accept_lens
    - 1
)
"""
_CAPTURE_IDS = """\
# we plus 1 here because in sglang, for the ith layer, it takes the output
# of the (i-1)th layer as aux hidden state
self.model.layers_to_capture = [val + 1 for val in layer_ids]
"""
_STEP_POSITIONS = """\
draft_input.positions = (
    prepared_positions
    if prepared_positions is not None
    else batch.seq_lens.repeat_interleave(topk, dim=0)
)
"""
_HOT_FIRST = """\
maybe_detect_nan(topk_p, "draft_forward: NaN in initial topk_p from spec_info")

if self.hot_token_id is not None:
    topk_index = self.hot_token_id[topk_index]
"""
_HOT_LOOP = """\
maybe_detect_oob(
    topk_index,
    0,
    logits_output.next_token_logits.shape[-1],
    f"draft_forward step {i}: topk_index OOB vs vocab_size={logits_output.next_token_logits.shape[-1]}",
)
if self.hot_token_id is not None:
    topk_index = self.hot_token_id[topk_index]
"""
_D2T_LOAD = """\
if "d2t" in name:
    # d2t stores diffs between draft id and target id
    self.hot_token_id = loaded_weight + torch.arange(loaded_weight.shape[0])
    continue
"""


def _without_last_lines(text: str, n: int) -> str:
    return "".join(text.splitlines(keepends=True)[:-n])


# fault → how it is made. The order is the order the patches are applied in (a later patch of the same file must
# still find its statement once).
FAULTS: dict[str, Fault] = {
    "select-last-row": Fault(
        "the worker selects each request's last verified row (rejected or not) to start the next round from "
        "(the seed's hand-off fault in eagle_worker_v2's form)",
        (_p(WORKER, _SELECT, _SELECT.replace("batch_result.accept_lens\n", "self.speculative_num_draft_tokens\n")),),
    ),
    "select-one-early": Fault(
        "the worker selects the row before each request's last accepted one (the root's own when nothing was accepted)",
        (
            _p(
                WORKER,
                _SELECT,
                _SELECT.replace("batch_result.accept_lens\n    - 1\n", "(batch_result.accept_lens - 2).clamp(min=0)\n"),
            ),
        ),
    ),
    "concat-order": Fault(
        "the logits processor concatenates the captured states high to low for the draft",
        (
            _p(
                AUX,
                "return torch.cat(aux_hidden_states, dim=-1)\n",
                "return torch.cat(aux_hidden_states[::-1], dim=-1)\n",
            ),
        ),
    ),
    "positions-offset": Fault(
        "RoPE positions of draft steps k >= 1 one too high (prepare_for_draft)",
        (
            _p(
                COMMON,
                _STEP_POSITIONS,
                _STEP_POSITIONS.replace("repeat_interleave(topk, dim=0)\n", "repeat_interleave(topk, dim=0) + 1\n"),
            ),
        ),
    ),
    "d2t-worker": Fault(
        "the worker does not map the draft's top-k through hot_token_id (draft ids fed and verified as target ids)",
        (
            _p(WORKER, _HOT_FIRST, _without_last_lines(_HOT_FIRST, 3)),
            _p(WORKER, _HOT_LOOP, _without_last_lines(_HOT_LOOP, 2)),
        ),
    ),
    "feedback-postnorm": Fault(
        "draft steps k >= 2 receive the previous step's normed output (the draft's final norm applied to its hand-off "
        "in draft_forward)",
        (
            _p(
                WORKER,
                "hidden_states = logits_output.hidden_states\n",
                "hidden_states = self.draft_runner.model.model.norm(logits_output.hidden_states)\n",
            ),
        ),
    ),
    "norm-output-assumed": Fault(
        "each draft step hands on its normed output, as if the draft had EAGLE 3.1's norm_output (llama_eagle3.py)",
        (
            _p(
                LLAMA_EAGLE3,
                "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux\n",
                "aux = hidden_states_to_logits\n",
            ),
        ),
    ),
    "hidden-norm-skipped": Fault(
        "the draft layer reads its features without hidden_norm (llama_eagle3.py)",
        (
            _p(
                LLAMA_EAGLE3,
                """\
                residual = hidden_states
                hidden_states = self.hidden_norm(hidden_states)
                """,
                "residual = hidden_states\n",
            ),
        ),
    ),
    "fc-skipped": Fault(
        "the draft model does not apply fc: its layer receives the target's nH-wide features (llama_eagle3.py)",
        (_p(LLAMA_EAGLE3, "hidden_states = self.fc(hidden_states)\n", "pass\n"),),
    ),
    "tap-capture": Fault(
        "the target captures the layer ids as written, without SGLang's +1 (llama.py set_eagle3_layers_to_capture): "
        "each aux state one layer early",
        (_p(LLAMA, _CAPTURE_IDS, "self.model.layers_to_capture = [val for val in layer_ids]\n"),),
        at_load=True,
    ),
    "d2t-load": Fault(
        "the draft's d2t is skipped at load (llama_eagle3.py load_weights): no hot_token_id, draft ids used as target "
        "ids",
        (_p(LLAMA_EAGLE3, _D2T_LOAD, 'if "d2t" in name:\n    continue\n'),),
        at_load=True,
    ),
}
# The fault that makes SGLang's scheduler raise: SGLang then ends its whole process tree, so it is served last.
CRASH = "fc-skipped"


def condition(fault: str) -> str:
    return f'__import__("sglang.{SWITCH_MODULE}", fromlist=["on"]).on("{fault}")'


def private_sglang(root: Path, package: Path, faults: dict[str, Fault] | None = None) -> dict[str, str]:
    """ROOT/sglang: the installed SGLang `package` as links, the files `faults` patch (default FAULTS) as real ones, and
    the switch module → {relative path: sha256 of the installed original} (for the caller to check the installed files
    are unchanged)."""
    out = root / "sglang"
    files: dict[str, list[tuple[str, Patch]]] = {}
    for name, fault in (FAULTS if faults is None else faults).items():
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
            text = switched(text, patch.old, patch.new, name, condition(name))
        dst = out / rel
        dst.unlink()
        dst.write_text(text)
        stem = Path(rel).stem
        for pyc in (out / Path(rel).parent / "__pycache__").glob(f"{stem}.*.pyc"):
            pyc.unlink()  # the installed bytecode is of the unpatched source
    (out / f"{SWITCH_MODULE}.py").write_text(SWITCH_SOURCE)
    return originals
