"""The one output rule (eaglescope.outputs): what may be replaced, and that a kill at any instant of a replacement
leaves either the old output or the new one at the destination, never neither and never a mixture."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eaglescope import outputs as O
from eaglescope.errors import EagleScopeError

KIND = O.dir_kind("widget", markers=["widget.json"], entries=["widget.json", "data.bin"], replace_flag="--overwrite")


def widget(path: Path, text: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "widget.json").write_text(text)
    (path / "data.bin").write_bytes(text.encode() * 3)
    return path


def state(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_missing_empty_and_own_kind_are_accepted(tmp_path):
    assert O.check_destination(tmp_path / "new", KIND) == (tmp_path / "new").resolve()
    (tmp_path / "empty").mkdir()
    O.check_destination(tmp_path / "empty", KIND)
    old = widget(tmp_path / "old", "v1")
    with pytest.raises(EagleScopeError, match="--overwrite"):
        O.check_destination(old, KIND)
    O.check_destination(old, KIND, replace=True)


@pytest.mark.parametrize(
    "case, match",
    [
        ("file", "is a file"),
        ("foreign", "not a widget"),
        ("own_plus_foreign", "also other files"),
        ("input", "one of this command's inputs"),
        ("parent_of_input", "holds this command's input"),
        ("cwd", "current directory"),
        ("parent_of_cwd", "holding the current directory"),
        ("symlink", "symbolic link"),
    ],
)
def test_refusals_touch_nothing(tmp_path, monkeypatch, case, match):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    inputs: list[Path] = []
    if case == "file":
        out = home / "notes.txt"
    elif case == "foreign":
        out = home
    elif case == "own_plus_foreign":
        out = widget(tmp_path / "w", "v1")
        (out / "notes.txt").write_text("mine")
    elif case in ("input", "parent_of_input"):
        src = widget(home / "src", "input")
        inputs = [src]
        out = src if case == "input" else home
    elif case in ("cwd", "parent_of_cwd"):
        (home / "sub").mkdir()
        monkeypatch.chdir(home / "sub")
        out = Path(".") if case == "cwd" else home
    else:
        out = tmp_path / "link"
        out.symlink_to(widget(tmp_path / "real", "v1"), target_is_directory=True)
    before = state(tmp_path)
    with pytest.raises(EagleScopeError, match=match):
        O.check_destination(out, KIND, inputs=inputs, replace=True)
    assert state(tmp_path) == before


@pytest.mark.parametrize("exchange", [True, False])
def test_staged_dir_swaps_in_only_when_complete(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(O, "_EXCHANGE", None)  # the two-rename fallback
    out = widget(tmp_path / "w", "v1")
    with pytest.raises(RuntimeError):
        with O.staged_dir(out) as tmp:
            widget(tmp, "v2")
            raise RuntimeError("crash while building")
    assert state(out) == state(widget(tmp_path / "ref1", "v1"))
    with pytest.raises(KeyboardInterrupt):
        with O.staged_dir(out) as tmp:
            widget(tmp, "v2")
            raise KeyboardInterrupt
    with O.staged_dir(out) as tmp:
        widget(tmp, "v2")
    assert (out / "widget.json").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref1", "w"]  # no staging or old copy left beside it


def test_write_file_replaces_atomically(tmp_path):
    f = tmp_path / "r.html"
    O.write_file(f, "one")
    O.write_file(f, b"two")
    assert f.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["r.html"]


_KILL = """
import os, signal, sys
from pathlib import Path
from eaglescope import outputs as O
mode, out = sys.argv[1], Path(sys.argv[2])
if mode == "fallback":
    O._EXCHANGE = None
    real = os.rename
    calls = []
    def rename(a, b):
        calls.append(a)
        if len(calls) == 2:  # between moving the old output aside and moving the new one in
            os.kill(os.getpid(), signal.SIGKILL)
        real(a, b)
    O.os.rename = rename
else:
    real_exchange, real_remove, swapped = O._exchange, O._remove, []
    def exchange(a, b):
        swapped.append(real_exchange(a, b))
        return swapped[-1]
    def remove(p):  # after the exchange, before the old output is deleted
        if swapped:
            os.kill(os.getpid(), signal.SIGKILL)
        real_remove(p)
    O._exchange, O._remove = exchange, remove
with O.staged_dir(out) as tmp:
    (tmp / "widget.json").write_text("v2")
    (tmp / "data.bin").write_bytes(b"new")
"""


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_sigkill_inside_the_swap_loses_nothing(tmp_path, mode):
    if mode == "exchange" and O._EXCHANGE is None:
        pytest.skip("renameat2 is not available here")
    out = widget(tmp_path / "w", "v1")
    old = state(out)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILL), mode, str(out)], timeout=120)
    assert r.returncode == -9
    # the next command finds either the old output or the new one at `out`, and cleans up beside it
    O.check_destination(out, KIND, replace=True)
    O.clean_stale(out.resolve())
    now = state(out)
    assert now in (old, {"data.bin": b"new", "widget.json": b"v2"}), now
    if mode == "exchange":
        assert now["widget.json"] == b"v2"
    else:
        assert now == old  # restored by recover()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def test_resumable_staging_survives_and_is_cleaned_only_when_ours(tmp_path):
    out = tmp_path / "w"
    part = O.open_partial(out, "test", fresh=False)
    (part / "half.bin").write_bytes(b"half")
    assert O.has_partial(out)
    assert (O.open_partial(out, "test", fresh=False) / "half.bin").read_bytes() == b"half"  # resumed
    assert not (O.open_partial(out, "test", fresh=True) / "half.bin").exists()  # started over
    widget(part, "v1")
    O.swap_in(part, out)
    assert (out / "widget.json").read_text() == "v1" and not (out / O.PARTIAL_MARKER).exists()
    assert not O.has_partial(out)


def test_cli_parser_imports_no_torch():
    # `eaglescope --help` and flag errors answer at once: building the parser must not import torch
    code = "import sys; from eaglescope.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
