"""An eaglescope draft converted by vLLM's `speculators` library (0.9.0) with the command `eaglescope export` prints:
the converted checkpoint keeps the trained taps, the vocabulary map and the embedding, and speculators' own EAGLE-3
forward computes eaglescope's logits at every TTT step.

speculators lives in its own environment (scripts/speculators_env.sh: it pins transformers and datasets versions
that .venv and .venv-vllm do not have). This module runs in eaglescope's and drives speculators through subprocesses:
the `speculators` command itself and tests/speculators_runner.py. Without that environment every test here is
skipped with one reason, which fails the run (tests/suite_rules.py).

The draft is random (the forward's equality needs no training) for the tiny 8-layer Llama of tests/models.py, with
non-default taps [0, 3, 6] (a plain `speculators convert` would silently give [2, 4, 5]) and a reduced vocabulary
(48 of 96 target ids, so d2t/t2d matter).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglescope.cli import main
from eaglescope.export import load_target_embedding
from eaglescope.models.draft import load_draft, save_draft
from eaglescope.taps import TapContract
from eaglescope.train.ttt import shift_left, ttt_unroll

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().parent / "speculators_runner.py"
TAPS = (0, 3, 6)
L = 8  # tests/models.py TINY
DRAFT_VOCAB = 48
T = 128  # speculators' default flex attention builds its masks in blocks of 128 positions
TTT_STEPS = 3
TIMEOUT_S = 300


def speculators_env() -> tuple[Path | None, str]:
    """(the environment's bin directory, "") or (None, why it is unavailable)."""
    venv = Path(os.environ.get("EAGLESCOPE_SPECULATORS_VENV") or ROOT / ".eaglescope" / "venv-speculators")
    if not venv.is_absolute():
        venv = ROOT / venv
    error = venv / ".eaglescope-speculators-error"
    if error.is_file():  # scripts/speculators_env.sh's last failure, in its own words
        return None, error.read_text().strip().splitlines()[-1]
    if not (venv / ".eaglescope-speculators-complete").is_file() or not (venv / "bin" / "speculators").is_file():
        return None, f"no complete environment at {venv} (bash scripts/speculators_env.sh builds it)"
    return venv / "bin", ""


_BIN, _WHY = speculators_env()
if _BIN is None:
    # The whole module at collection: one skip, one line in pytest's -ra summary.
    pytest.skip(f"speculators unavailable: {_WHY}", allow_module_level=True)


@pytest.fixture(scope="module")
def spec_bin() -> Path:
    assert _BIN is not None  # the module skipped itself otherwise (which fails the run: tests/suite_rules.py)
    return _BIN


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{tail}"
    return proc


def export(draft: Path, target: Path, out: Path, *extra: str) -> dict:
    rc, text, err = cli(
        ["export", "--draft", str(draft), "--to", "vllm", "--out", str(out), "--target", str(target), "--json", *extra]
    )
    assert rc == 0, err
    return json.loads(text)


def converted_config(report: dict) -> dict:
    out = Path(report["speculators"]["argv"][report["speculators"]["argv"].index("--output-path") + 1])
    return json.loads((out / "config.json").read_text()) | {"_dir": str(out)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, spec_bin: Path) -> dict:
    """The draft, its two exports (with and without the target's embedding), each converted by speculators: the
    first with the printed command exactly (only `speculators` resolved to the environment's), the second plainly
    (no --algorithm-kwargs), as a user who skips eaglescope's advice would."""
    root = tmp_path_factory.mktemp("speculators")
    target = make_checkpoint("llama", root / "target")
    model, contract = make_draft(target, taps=TapContract(TAPS, L), draft_vocab_size=DRAFT_VOCAB)
    draft = save_draft(model, contract, root / "draft")
    printed = export(draft, target, root / "export", "--with-embedding")
    argv = shlex.split(printed["speculators"]["command"])
    assert argv == printed["speculators"]["argv"] and argv[:2] == ["speculators", "convert"]
    run([str(spec_bin / "speculators"), *argv[1:]])
    bare = export(draft, target, root / "export-bare")
    plain = bare["speculators"]["argv"][: bare["speculators"]["argv"].index("--algorithm-kwargs")]
    run([str(spec_bin / "speculators"), *plain[1:]])
    return {"root": root, "target": target, "draft": draft, "printed": printed, "bare": bare}


def test_the_printed_command_is_ready_only_with_the_embedding(converted):
    assert converted["printed"]["speculators"]["ready"] and converted["printed"]["speculators"]["problems"] == []
    assert not converted["bare"]["speculators"]["ready"]
    assert "--with-embedding" in converted["bare"]["speculators"]["problems"][0]


def test_the_converted_checkpoint_keeps_taps_map_and_embedding(converted):
    cfg = converted_config(converted["printed"])
    assert cfg["speculators_model_type"] == "eagle3" and cfg["speculators_version"] == "0.9.0"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(TAPS)
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["transformer_layer_config"]["vocab_size"] == 96
    assert cfg["norm_before_residual"] is False
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(converted["target"].resolve())
    weights = load_file(str(Path(cfg["_dir"]) / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in weights and not any(k.startswith("midlayer.") for k in weights)
    draft = load_draft(converted["draft"]).model
    assert torch.equal(weights["d2t"], draft.d2t) and torch.equal(weights["t2d"], draft.t2d)
    assert torch.equal(weights["embed_tokens.weight"], load_target_embedding(converted["target"]))


def test_a_plain_convert_silently_loses_the_taps_and_the_embedding(converted):
    """The two facts the printed command exists for: speculators convert ignores eagle_config's ids (the converted
    draft then captures the default [2, L//2, L-3]) and writes no embedding unless the export has one."""
    exported = json.loads((Path(converted["bare"]["out"]) / "config.json").read_text())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(TAPS)  # the ids were there
    cfg = converted_config(converted["bare"])
    assert cfg["eagle_aux_hidden_state_layer_ids"] is None
    with safe_open(str(Path(cfg["_dir"]) / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in set(f.keys())  # noqa: SIM118 - safe_open is not a mapping


def test_speculators_forward_equals_eaglescopes_at_every_ttt_step(converted, spec_bin: Path):
    root = converted["root"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (1, T), generator=g)
    aux = torch.randn(1, T, len(TAPS) * 64, generator=g)
    # speculators pairs each position's features with the *next* token and advances positions itself per step;
    # eaglescope's TTT pairs position t with token t+1 (docs/field.md §3): the same alignment once ids are shifted.
    inputs = {
        "aux": aux,
        "input_ids": shift_left(ids, 1).contiguous(),
        "position_ids": torch.arange(T)[None],
        "ttt_steps": torch.tensor(TTT_STEPS),
    }
    save_file(inputs, str(root / "inputs.safetensors"))
    proc = run(
        [
            str(spec_bin / "python"),
            str(RUNNER),
            converted_config(converted["printed"])["_dir"],
            str(root / "inputs.safetensors"),
            str(root / "out.safetensors"),
        ]
    )
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["target_layer_ids"] == list(TAPS) and info["speculators_version"] == "0.9.0"
    theirs = load_file(str(root / "out.safetensors"))
    emb = load_target_embedding(converted["target"])
    assert torch.equal(theirs["embed_tokens"], emb)
    loaded = load_draft(converted["draft"])
    loaded.model.load_target_embedding(emb)  # what eaglescope drafts with: the target's embedding
    with torch.no_grad():
        ours = ttt_unroll(loaded.model, ids, aux, TTT_STEPS).logits
    for k in range(TTT_STEPS):
        got, want = theirs[f"step{k}"], ours[k]
        assert got.shape == want.shape == (1, T, DRAFT_VOCAB)
        err = (got - want).abs().max().item()
        sys.stderr.write(
            f"step {k}: max |speculators - eaglescope| = {err:.2e} (logits up to {want.abs().max():.2f})\n"
        )
        assert err < 1e-5, (k, err)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_eaglescope_reads_the_converted_checkpoint_back_as_the_draft_it_was(converted):
    """`speculators convert`'s output is speculators' format (what vLLM serves natively): eaglescope reads it as written
    and gets back the draft it exported, taps and every tensor."""
    back = load_draft(converted_config(converted["printed"])["_dir"], L)
    draft = load_draft(converted["draft"])
    assert back.format == "speculators" and back.contract.taps == draft.contract.taps
    ours = draft.model.state_dict()
    for k, v in back.model.state_dict().items():
        if k != "embed_tokens.weight":  # the converted checkpoint carries the target's; the draft saved none
            assert torch.equal(v, ours[k]), k
