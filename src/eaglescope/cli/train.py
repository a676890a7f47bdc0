"""`eaglescope train` (the training loop: eaglescope.train.loop); under torchrun only rank 0 reports."""

from __future__ import annotations

import os
import sys

from eaglescope.config import TrainConfig
from eaglescope.train.loop import train
from eaglescope.train.metrics import format_report
from eaglescope.train.speed import format_speed


def cmd_train(args) -> int:
    fields = set(TrainConfig.__dataclass_fields__)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    from eaglescope.train.stream import is_buffer, train_stream

    if is_buffer(cfg.data):  # a feature buffer engines fill while this trains (docs/engine-features.md)
        res = train_stream(cfg)
        print(f"{res.out}: {res.steps} steps; {res.metrics.get('split', 'held-out')} {format_report(res.metrics)}")
        return 0
    res = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{res.out}: {res.steps} steps; {res.metrics.get('split', 'held-out')} {format_report(res.metrics)}")
        tb = cfg.log_dir or str(res.out / "tb")
        print(f"TensorBoard logs: {tb} (view with: tensorboard --logdir {tb})")
        print(f"eaglescope train: {format_speed(res.metrics['speed'])}", file=sys.stderr)
    return 0
