"""One torchrun rank of `eaglescope`, for tests/test_train_ddp.py: `torchrun … tests/ddp_rank.py ARGS…`.

- `{rank}` in ARGS becomes this process's RANK, so the ranks of one job can be given different inputs or settings,
  as ranks on different machines are when one machine's copy or launch line differs.
- EAGLESCOPE_TEST_WATCH=DIR: each change this rank makes to the file system under DIR (a file opened for writing,
  mkdir, rename/replace, remove, rmtree) is appended to DIR.rank<RANK>.writes, one line each. These are Python's
  audit events: bytes that native code writes itself (safetensors, torch.save's zip writer) are not seen, but the
  staging directories they go into and the renames that put them in place are. A line repeating the one before
  (TensorBoard reopens its event file for each write) is written once.
"""

from __future__ import annotations

import os
import sys

from eaglescope.cli import main

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CHANGES = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.symlink", "os.truncate")


def watch(root: str, log_path: str) -> None:
    root = os.path.realpath(root) + os.sep
    log = open(log_path, "a")  # noqa: SIM115 - open for the life of the process, before the hook exists
    busy, last = False, ""

    def under(p) -> bool:
        if isinstance(p, int) or p is None:
            return False
        return (os.path.realpath(os.fsdecode(p)) + os.sep).startswith(root)

    def hook(event: str, args: tuple) -> None:
        nonlocal busy, last
        if busy:
            return
        busy = True
        try:
            if event == "open":
                path, mode, flags = args
                writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
                paths = [path] if writes else []
            elif event in CHANGES:
                paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
            else:
                paths = []
            hit = [os.fsdecode(p) for p in paths if under(p)]
            line = f"{event} {' '.join(hit)}\n"
            if hit and line != last:
                log.write(line)
                log.flush()
                last = line
        finally:
            busy = False

    sys.addaudithook(hook)


if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    if os.environ.get("EAGLESCOPE_TEST_WATCH"):
        root = os.environ["EAGLESCOPE_TEST_WATCH"].rstrip(os.sep)
        watch(root, f"{root}.rank{rank}.writes")
    sys.exit(main([a.replace("{rank}", rank) for a in sys.argv[1:]]))
