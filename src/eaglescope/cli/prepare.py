"""`eaglescope prepare` (the pipeline: eaglescope.data.prepare)."""

from __future__ import annotations

from eaglescope.config import PrepareConfig
from eaglescope.data.prepare import prepare


def cmd_prepare(args) -> int:
    fields = set(PrepareConfig.__dataclass_fields__)
    cfg = PrepareConfig(**{k: v for k, v in vars(args).items() if k in fields})
    if getattr(args, "buffer", None):  # stream the engine's features into a buffer `train` consumes
        from eaglescope.features.produce import produce

        s = produce(cfg, args.buffer, args.buffer_shards, args.producer, args.eval_fraction)
        print(f"{args.buffer}: {s['samples']} samples, {s['tokens']} tokens produced ({s.get('tokens_per_s', 0):.0f} "
              f"tokens/s, {s['blocked_seconds']:.1f} s blocked by a full buffer)")  # fmt: skip
        return 0
    m = prepare(cfg)
    parts = [
        f"{m['num_samples']} samples",
        f"{m['num_tokens']} tokens ({m['num_supervised_tokens']} supervised)",
        f"{m['skipped']} skipped",
        f"{m['truncated']} truncated to {m['max_length']}",
        f"draft vocab {m['draft_vocab_size']}",
    ]
    if m["hidden_states"]:
        parts.append(f"{len(m['shards'])} hidden-state shards")
    print(f"{cfg.out}: " + ", ".join(parts))
    return 0
