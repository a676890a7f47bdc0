"""`speculators train` (0.9.0) on the CPU, in speculators' own environment. Runs there, never in eaglescope's: it
imports speculators, torch and the standard library only.

    python train_runner.py SPEC.json OUT.json

SPEC: {"argv": [the flags of `speculators train`], "fault": null | "unshifted"}
OUT:  {"speculators_version", "seconds", "checkpoint": the last saved checkpoint directory, "error"}

The one change to speculators for the CPU is the device: its Trainer moves the model and every batch to
`get_local_rank()` (0, i.e. cuda:0, outside torchrun); here that name answers "cpu", and its step timer's
torch.accelerator.synchronize() (which raises without an accelerator) has nothing to wait for. Its autocast asks for
the accelerator's device type and falls back to "cuda", where autocast is off without CUDA: float32 stays float32.

fault "unshifted": speculators.train.cli's shift_batch, the function it hands the data loader for eagle3, replaced by
one that pairs every position's features with its own token, verifier state and loss mask (no shift) — the fault a
pipeline has when it drops or double-applies the shift.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from importlib.metadata import version
from pathlib import Path


def unshifted_batch(batch: dict) -> dict:
    """shift_batch's contract (the same keys, one sample), without the shift: (x_t, g_t, y_t, l_t)."""
    return dict(batch)


def last_checkpoint(save_path: Path) -> Path | None:
    epochs = [d for d in save_path.iterdir() if d.is_dir() and d.name.isdigit() and (d / "config.json").is_file()]
    return max(epochs, key=lambda d: int(d.name)) if epochs else None


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    out: dict = {"speculators_version": version("speculators"), "error": None, "checkpoint": None}
    t = time.perf_counter()
    try:
        import speculators.train.cli as cli
        import speculators.train.trainer as trainer
        import torch
        from speculators.train.config import TrainConfig

        # The device choice, and nothing else: the CPU instead of cuda:<local rank>, and no accelerator to wait for
        # (its step timer synchronizes the accelerator, which raises where there is none).
        trainer.get_local_rank = lambda: "cpu"
        if not torch.accelerator.is_available():
            torch.accelerator.synchronize = lambda *args, **kwargs: None
        if spec.get("fault") == "unshifted":
            cli.shift_batch = unshifted_batch
        elif spec.get("fault") is not None:
            raise ValueError(f"unknown fault {spec['fault']!r}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cli.main(TrainConfig.resolve(list(spec["argv"])))
        save_path = Path(spec["argv"][spec["argv"].index("--save-path") + 1])
        ckpt = last_checkpoint(save_path)
        out["checkpoint"] = None if ckpt is None else str(ckpt)
        if ckpt is None:
            out["error"] = f"no checkpoint under {save_path}"
    except BaseException as e:  # noqa: BLE001 - SystemExit included: speculators exits on bad arguments
        out["error"] = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        out["traceback"] = traceback.format_exc()[-6000:]
    out["seconds"] = time.perf_counter() - t
    Path(argv[2]).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
