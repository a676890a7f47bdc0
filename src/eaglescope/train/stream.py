"""`eaglescope train --data BUF` where BUF is a feature buffer (features/buffer.py) that engines fill while this trains:
online training fed by a running engine, with nothing held beyond the buffer's bound.

The loop takes the oldest complete shard, trains on it in batches of --batch-size (TTT unroll and loss as train/
loop.py: the same ttt_unroll, ttt_loss and evaluate), then saves the training state and only then records the shard
consumed and deletes it: a restart (--resume) continues from the last recorded shard with the state that trained on
it. It ends after --max-steps, or when every producer has finished and the buffer is empty. One process (torchrun
ranks consuming one buffer are not supported yet: docs/distributed.md).

Throughput is reported for both sides, so the bottleneck shows: the consumer's tokens/s over its busy time (waiting
for shards excluded), the producers' tokens/s over theirs (waiting on a full buffer excluded), and the seconds each
side waited for the other; on stderr at the end and in OUT/training_metrics.json under "stream".
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from eaglescope.config import TrainConfig
from eaglescope.errors import EagleScopeError
from eaglescope.features.buffer import FeatureBuffer
from eaglescope.models.draft import DraftConfig, DraftContract, Eagle3Draft
from eaglescope.models.targets import parse_device
from eaglescope.models.targets.head import load_target_head
from eaglescope.models.targets.loading import read_config
from eaglescope.outputs import check_destination, open_partial, swap_in
from eaglescope.taps import TapContract
from eaglescope.train.loop import TRAINED, TrainResult, collate, lr_factor, make_batch, save_checkpoint
from eaglescope.train.metrics import evaluate
from eaglescope.train.ttt import LOSS_MASK_SHIFT, draft_vocab_ids, ttt_loss, ttt_unroll

log = logging.getLogger(__name__)

STATE = "training_state/stream_state.pt"  # under the directory a trained draft may hold (loop.TRAINED)


def is_buffer(path: str | Path) -> bool:
    return (Path(path) / "buffer.json").is_file()


def _draft(cfg: TrainConfig, header: dict, buf: FeatureBuffer, head, taps: TapContract) -> Eagle3Draft:
    torch.manual_seed(cfg.seed)
    d2t, t2d = buf.vocab()
    dcfg = DraftConfig.for_target(read_config(Path(cfg.target)), taps, int(d2t.numel()), arch=cfg.draft_arch,
                                  norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm,
                                  norm_output=cfg.norm_output)  # fmt: skip
    draft = Eagle3Draft(dcfg)
    draft.set_vocab_map(d2t, t2d)
    draft.load_target_embedding(head.embedding.detach().float().cpu())
    return draft


def train_stream(cfg: TrainConfig, progress: bool = False) -> TrainResult:
    cfg.validate()
    buf = FeatureBuffer(cfg.data)
    header = buf.header()
    device = parse_device(cfg.device)
    if device.type != "cpu" and cfg.dtype not in ("auto", "float32"):
        raise EagleScopeError("train from a feature buffer runs in float32 for now; pass --dtype float32.")
    if cfg.pack:
        raise EagleScopeError("train --pack reads prepared data; a feature buffer's batches are padded: drop --pack.")
    out = Path(cfg.out)
    check_destination(out, TRAINED, inputs=[cfg.target, cfg.data], replace=cfg.overwrite or cfg.resume)
    head = load_target_head(cfg.target, device, torch.float32)
    for key in ("num_layers", "hidden_size", "vocab_size", "tokenizer_sha256"):
        if header["target"].get(key) != getattr(head.fingerprint, key):
            raise EagleScopeError(f"{cfg.data} holds features of a target with {key}={header['target'].get(key)!r}; "
                                  f"this target has {getattr(head.fingerprint, key)!r}.")  # fmt: skip
    taps = TapContract.from_dict(header["taps"])
    if cfg.taps is not None and TapContract.parse(cfg.taps, taps.num_layers) != taps:
        raise EagleScopeError(f"--taps {cfg.taps} conflicts with the buffer's taps {list(taps.layers)}")
    draft = _draft(cfg, header, buf, head, taps).to(device).train()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step = 0
    # built beside OUT and swapped in when complete; an interrupted run's state stays there for --resume
    work = open_partial(out, "train", fresh=not cfg.resume)
    if cfg.resume and (work / STATE).is_file():
        saved = torch.load(work / STATE, map_location="cpu", weights_only=True)
        draft.load_state_dict(saved["model"], strict=False)
        opt.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
    # the schedule's length: --max-steps, else what the buffer's training samples give for --epochs 1
    per_step = cfg.batch_size * cfg.grad_accum
    total = cfg.max_steps or max(1, math.ceil(header["num_train_samples"] / per_step))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total)
    vocab_ids = draft_vocab_ids(draft)
    max_length = min(cfg.max_length, head.max_positions)
    side = {"tokens": 0, "samples": 0, "shards": 0, "busy_seconds": 0.0, "waited_seconds": 0.0}
    history = []
    while step < total:
        t_wait = time.perf_counter()
        got = buf.next_shard()
        side["waited_seconds"] += time.perf_counter() - t_wait
        if got is None:
            break  # every producer finished and the buffer is empty
        seq, samples = got
        t_busy = time.perf_counter()
        for i in range(0, len(samples), cfg.batch_size):
            if step >= total:
                break
            raw = collate(samples[i : i + cfg.batch_size], max_length)
            batch = make_batch(head, raw, device, torch.float32, vocab_ids)
            for group in opt.param_groups:
                group["lr"] = cfg.lr * lr_factor(step, warmup, total)
            unrolled = ttt_unroll(draft, batch.input_ids, batch.aux, cfg.ttt_length)
            res = ttt_loss(draft, unrolled, batch.teacher, batch.loss_mask, batch.valid, per_sample=True)
            if not bool(torch.isfinite(res.loss)):
                raise EagleScopeError(f"loss became non-finite at step {step + 1} (shard {seq} of {cfg.data})")
            res.loss.backward()
            if cfg.clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            side["tokens"] += int(batch.valid.sum())
            history.append({"step": step, "loss": float(res.loss.detach()), "acc": list(res.step_acc), "shard": seq})
        side["busy_seconds"] += time.perf_counter() - t_busy
        side["samples"] += len(samples)
        side["shards"] += 1
        # the state that trained on this shard first, then the record: a restart never trains on a shard twice or
        # skips one
        (work / STATE).parent.mkdir(exist_ok=True)
        torch.save({"model": {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"},
                    "optimizer": opt.state_dict(), "step": step}, work / STATE)  # fmt: skip
        buf.mark_consumed(seq, len(samples), sum(len(s["input_ids"]) for s in samples))
    evals = buf.eval_samples()
    batches = (make_batch(head, collate(evals[i : i + cfg.batch_size], max_length), device, torch.float32, vocab_ids)
               for i in range(0, len(evals), cfg.batch_size))  # fmt: skip
    metrics = evaluate(draft, batches, cfg.ttt_length) if evals else {}
    metrics |= {"split": "held-out", "num_samples": len(evals), "step": step, "ttt_length": cfg.ttt_length}
    metrics["stream"] = throughput(side, buf)
    training = {"data_chat_template_sha256": header["chat_template_sha256"], "data_hidden_states": True,
                "data_engine": header["engine"]}  # fmt: skip
    source = f"feature buffer token frequencies, {header['num_samples']} samples"
    contract = DraftContract(taps=taps, target=head.fingerprint, ttt_length=cfg.ttt_length,
                             loss_mask_shift=LOSS_MASK_SHIFT, draft_vocab_source=source,
                             extra={"training": training})  # fmt: skip
    save_checkpoint(work, draft, contract, metrics)
    swap_in(work, check_destination(out, TRAINED, inputs=[cfg.target, cfg.data], replace=True))
    s = metrics["stream"]
    c = s["consumer"]
    log.info(f"stream: consumer {c['tokens_per_s']:.0f} tokens/s ({c['waited_seconds']:.1f} s waiting for shards), "
             f"producers {s['producers_tokens_per_s']:.0f} tokens/s ({s['producers_blocked_seconds']:.1f} s blocked "
             f"by a full buffer); bottleneck: {s['bottleneck']}")  # fmt: skip
    return TrainResult(out, step, metrics, history)


def throughput(side: dict, buf: FeatureBuffer) -> dict:
    consumer = dict(side, tokens_per_s=side["tokens"] / max(1e-9, side["busy_seconds"]))
    producers = buf.producers()
    p_tokens = sum(p.get("tokens", 0) for p in producers.values())
    # the engines' time computing the shards (their start-up and their waits on a full buffer excluded), summed: N
    # producers side by side make N times one's rate
    p_rate = sum(p.get("tokens", 0) / max(1e-9, p.get("engine_seconds", 0.0)) for p in producers.values())
    blocked = sum(p.get("blocked_seconds", 0.0) for p in producers.values())
    bottleneck = "producers (the engine)" if p_rate < consumer["tokens_per_s"] else "consumer (training)"
    return {"consumer": consumer, "producers": producers, "producers_tokens_per_s": p_rate,
            "producers_tokens": p_tokens,
            "producers_blocked_seconds": blocked, "bottleneck": bottleneck,
            "peak_waiting_shards": max((p.get("peak_waiting", 0) for p in producers.values()), default=0),
            "peak_bytes": max((p.get("peak_bytes", 0) for p in producers.values()), default=0),
            "capacity": int(buf.header()["capacity"])}  # fmt: skip
