"""The one rule for everything a command writes: nothing a user owns is destroyed.

1. Check first: before any work, `check_destination` decides whether `out` may receive this command's output.
   It may if it does not exist, is an empty directory, or is recognisably *this command's own kind* of output
   (a prepared directory for prepare, a trained draft for train, an export for export, a trace for replay, a
   doctor report for `--html`). It may never be a target or any directory holding other things, a plain file
   where a directory goes, an input of the command, a directory holding an input, or the current directory.
2. Build beside: the new output is written into a hidden sibling (`.NAME.eaglescope-tmp-PID` for one-shot
   outputs, `.NAME.eaglescope-partial` for resumable ones), on the same filesystem.
3. Swap when complete: `swap_in` exchanges the sibling with `out` in one atomic step (renameat2 with
   RENAME_EXCHANGE on Linux), so at every instant `out` is either the old output or the new one, whatever
   kills the process; the old one is then deleted. Where the exchange is unavailable two renames are used and
   `recover` puts the old output back if a crash fell between them.

`--overwrite` therefore means "replace my previous output once the new one is complete", never "delete first".
This module uses only the standard library: it is imported before torch, and the trace recorder uses it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fnmatch
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eaglescope.errors import EagleScopeError
from eaglescope.jsonfile import read_object_or_none as read_json  # optional JSON files: None when unreadable

log = logging.getLogger(__name__)

TMP_TAG = ".eaglescope-tmp-"
PARTIAL_TAG = ".eaglescope-partial"
OLD_TAG = ".eaglescope-old-"
PARTIAL_MARKER = ".eaglescope-partial.json"  # inside a resumable staging directory while it is ours


@dataclass(frozen=True)
class OutputKind:
    """What one command writes. `recognise(path)` says whether an existing path is such an output;
    `entries` are the names (fnmatch patterns) such an output may hold, so a directory the user has put other
    things into is not one any more. `replace_flag` names the flag that allows replacing one (None: replaced
    without asking, for cheap outputs such as an export or a report)."""

    name: str
    is_dir: bool
    recognise: Callable[[Path], bool]
    entries: tuple[str, ...] = ()
    replace_flag: str | None = None
    resumable: bool = False
    extra_ok: tuple[str, ...] = field(default=())  # hidden names of our own that may sit inside (staging)

    def only_known_entries(self, path: Path) -> list[str]:
        """Names in `path` that such an output does not write (empty list: nothing foreign)."""
        foreign = []
        for p in path.iterdir():
            if any(fnmatch.fnmatchcase(p.name, pat) for pat in (*self.entries, *self.extra_ok)):
                continue
            foreign.append(p.name)
        return sorted(foreign)


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def _resolved(p: Path | str) -> Path:
    return Path(os.path.abspath(os.path.expanduser(str(p)))).resolve()


def _listing(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_destination(
    out: Path | str,
    kind: OutputKind,
    inputs: Iterable[Path | str | None] = (),
    replace: bool = False,
    flag: str = "--out",
) -> Path:
    """Refuse (EagleScopeError) unless `out` may receive a new `kind` output; → the absolute path.

    Never touches the filesystem beyond reading it. `replace` is the user's --overwrite (ignored for kinds
    replaced without asking). Call it before any long work, so a refusal costs nothing."""
    raw = Path(out)
    if Path(os.path.abspath(os.path.expanduser(str(raw)))).is_symlink():
        raise EagleScopeError(f"{flag} {raw} is a symbolic link; name the real location for the {kind.name}.")
    path = _resolved(raw)
    cwd = _resolved(os.getcwd())
    if _is_within(cwd, path):
        what = "the current directory" if path == cwd else "a directory holding the current directory"
        raise EagleScopeError(f"{flag} {raw} is {what}; name a new or empty directory for the {kind.name}.")
    for i in inputs:
        if i is None:
            continue
        ip = _resolved(i)
        if ip == path:
            raise EagleScopeError(f"{flag} {raw} is one of this command's inputs; write the {kind.name} elsewhere.")
        if _is_within(ip, path):
            raise EagleScopeError(
                f"{flag} {raw} holds this command's input {i}; replacing it would delete that input. Write the "
                f"{kind.name} into a new directory."
            )
        if ip.is_dir() and _is_within(path, ip):
            raise EagleScopeError(
                f"{flag} {raw} is inside this command's input {i}, which would then hold files it did not have; "
                f"write the {kind.name} beside it instead."
            )
    recover(path)
    blocker = next((a for a in path.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise EagleScopeError(f"{flag} {raw}: {blocker} is a file, not a directory.")
    if path.exists():
        if not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            raise EagleScopeError(f"{flag} {raw} is read-only; it is left as it is. Name a writable destination.")
        if kind.is_dir and not path.is_dir():
            raise EagleScopeError(f"{flag} {raw} is a file, not a directory; it is left as it is.")
        if not kind.is_dir and path.is_dir():
            raise EagleScopeError(f"{flag} {raw} is a directory; name a file for the {kind.name}.")
        if kind.is_dir and not any(path.iterdir()):
            pass  # an empty directory holds nothing to lose
        elif kind.recognise(path):
            if kind.is_dir:
                foreign = kind.only_known_entries(path)
                if foreign:
                    raise EagleScopeError(
                        f"{flag} {raw} holds a {kind.name} and also other files ({_listing(foreign)}); it is not "
                        f"replaced. Move those files out or choose another directory."
                    )
            if kind.replace_flag is not None and not replace:
                raise EagleScopeError(
                    f"{flag} {raw} already holds a {kind.name}; pass {kind.replace_flag} to replace it (the old "
                    "one stays until the new one is complete), or choose another directory."
                )
        else:
            what = "directory that is not" if kind.is_dir else "file that is not"
            held = f" (it holds {_listing(sorted(p.name for p in path.iterdir()))})" if kind.is_dir else ""
            raise EagleScopeError(
                f"{flag} {raw} is a {what} a {kind.name}{held}; it is left as it is. Name a new or empty "
                f"{'directory' if kind.is_dir else 'file'}."
            )
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise EagleScopeError(f"{flag} {raw}: cannot write in {parent} (permission denied).")
    return path


# -- staging and the swap -------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> None:
    """Remove our own leftovers beside `out` from processes that died (temp builds, old outputs being deleted)."""
    parent = out.parent
    if not parent.is_dir():
        return
    for p in parent.glob(f".{out.name}{TMP_TAG}*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            _remove(p)
    partial = parent / f".{out.name}{PARTIAL_TAG}"
    if partial.is_dir() and not (partial / PARTIAL_MARKER).is_file():
        _remove(partial)  # an old output exchanged out of the way, whose deletion was interrupted


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def recover(out: Path) -> None:
    """After a crash between the two renames of the fallback swap: put the old output back."""
    if out.exists() or not out.parent.is_dir():
        return
    olds = sorted(out.parent.glob(f".{out.name}{OLD_TAG}*"))
    if olds:
        os.rename(olds[-1], out)
        log.info("%s was restored from an interrupted replacement", out)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_EXCHANGE = _renameat2()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False when this system or filesystem cannot."""
    if _EXCHANGE is None:
        return False
    if _EXCHANGE(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_in(new: Path, out: Path) -> None:
    """Make the complete `new` (a sibling of `out`) become `out`; the previous `out`, if any, is deleted."""
    new, out = Path(new), Path(out)
    if not (out.exists() or out.is_symlink()):
        os.rename(new, out)
    elif _exchange(new, out):
        _remove(new)  # now the old output
    else:
        old = out.with_name(f".{out.name}{OLD_TAG}{os.getpid()}")
        _remove(old)
        os.rename(out, old)
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(old, out)
            raise
        _remove(old)
    # The marker goes only once the output stands at `out`: a staging directory without one is an old output
    # whose deletion was interrupted, which clean_stale removes.
    if out.is_dir():
        (out / PARTIAL_MARKER).unlink(missing_ok=True)


def _io_error(e: OSError, out: Path) -> EagleScopeError:
    return EagleScopeError(f"cannot write {out}: {e.strerror or e}.")


@contextlib.contextmanager
def staged_dir(out: Path | str) -> Iterator[Path]:
    """A fresh hidden sibling of `out` to build into; swapped in when the block ends normally, removed when it
    raises (Ctrl-C included). Run check_destination first."""
    out = _resolved(out)
    clean_stale(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}{TMP_TAG}{os.getpid()}")
        _remove(tmp)
        tmp.mkdir()
    except OSError as e:
        raise _io_error(e, out) from None
    try:
        yield tmp
        swap_in(tmp, out)
    except BaseException:
        _remove(tmp)
        raise


def write_file(out: Path | str, data: str | bytes) -> Path:
    """Write a whole file beside `out`, then rename it over `out` (atomic). Run check_destination first."""
    out = _resolved(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}{TMP_TAG}", suffix=f"-{os.getpid()}", dir=out.parent)
    except OSError as e:
        raise _io_error(e, out) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


# -- resumable staging (prepare, train) -----------------------------------------------------------------------
def partial_dir(out: Path | str) -> Path:
    """Where a resumable command builds `out` until it is complete."""
    out = _resolved(out)
    return out.with_name(f".{out.name}{PARTIAL_TAG}")


def has_partial(out: Path | str) -> bool:
    return (partial_dir(out) / PARTIAL_MARKER).is_file()


def open_partial(out: Path | str, command: str, fresh: bool) -> Path:
    """The resumable staging directory for `out`: kept as it is (to resume) unless `fresh`, which starts it
    over. Run check_destination first."""
    out = _resolved(out)
    clean_stale(out)
    part = partial_dir(out)
    try:
        if fresh and part.exists():
            _remove(part)
        if not (part / PARTIAL_MARKER).is_file():
            _remove(part)
            part.mkdir(parents=True)
            (part / PARTIAL_MARKER).write_text(json.dumps({"command": command, "out": str(out)}) + "\n")
    except OSError as e:
        raise _io_error(e, out) from None
    return part


def dir_kind(
    name: str,
    markers: Sequence[str],
    entries: Sequence[str],
    replace_flag: str | None = None,
    resumable: bool = False,
    check: Callable[[Path], bool] | None = None,
) -> OutputKind:
    """A directory output recognised by any of its marker files (and `check`, when given)."""

    def recognise(path: Path) -> bool:
        if not any((path / m).is_file() for m in markers):
            return False
        return check(path) if check is not None else True

    return OutputKind(
        name,
        True,
        recognise,
        tuple(entries),
        replace_flag,
        resumable,
        extra_ok=(PARTIAL_MARKER, f".*{TMP_TAG}*", "*.tmp"),
    )


__all__ = [
    "OutputKind",
    "check_destination",
    "staged_dir",
    "write_file",
    "swap_in",
    "recover",
    "clean_stale",
    "partial_dir",
    "has_partial",
    "open_partial",
    "dir_kind",
    "read_json",
]
