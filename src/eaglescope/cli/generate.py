"""`eaglescope generate`: decode a prompt with the target, speculatively with a draft when one is given; on a GPU
the static-shape backend is the default wherever it can run, elsewhere the reference one (backend.py chooses)."""

from __future__ import annotations

import json
import sys

import torch

from eaglescope.backend import FAST, Decoder
from eaglescope.decode.generation import DecodeSettings, SamplingConfig, stop_ids_for
from eaglescope.errors import EagleScopeError
from eaglescope.models.targets import load_target, parse_device, parse_dtype
from eaglescope.outputs import check_destination
from eaglescope.trace import trace_kind


def _parse_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise EagleScopeError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise EagleScopeError(f"{flag} must be token ids >= 0, got {text!r}")
    return ids


def prompt_ids_from_args(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        if args.chat:
            raise EagleScopeError("--chat applies to --prompt text, not to --prompt-ids")
        return _parse_ids(args.prompt_ids)
    if tokenizer is None:
        raise EagleScopeError("the target directory has no tokenizer; pass --prompt-ids instead of --prompt")
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise EagleScopeError("--chat needs a chat template, and the target's tokenizer has none")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(args.prompt, add_special_tokens=True)


def settings_from_args(args, sampling: SamplingConfig) -> DecodeSettings:
    """The typed settings of `generate`'s flags (nothing below the command layer reads argparse)."""
    if args.fast and args.reference:
        raise EagleScopeError("--fast and --reference choose opposite decoders; pass one")
    decoder = "fast" if args.fast else "reference" if args.reference else "auto"
    return DecodeSettings(
        args.max_new_tokens,
        sampling,
        draft=args.draft,
        proposer=args.proposer,
        chain=args.chain,
        tree=args.tree,
        decoder=decoder,
        batch_invariant=not args.no_batch_invariant,
        compile=args.compile,
        backend=args.backend,
        trace=args.trace,
        trace_mode=args.trace_mode,
        trace_layers=bool(getattr(args, "trace_layers", False)),
        target_dir=args.target,
    )


def cmd_generate(args) -> int:
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    settings = settings_from_args(args, SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed))
    settings.validate()  # every flag check: a bad one is refused before any model is loaded
    if settings.trace:
        check_destination(args.trace, trace_kind("eaglescope"), inputs=[args.target, args.draft], flag="--trace")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    target = load_target(args.target, device=device, dtype=dtype, backend=args.backend)
    prompt_ids = prompt_ids_from_args(args, target.tokenizer)
    stop = stop_ids_for(target, _parse_ids(args.stop_ids, "--stop-ids")) if args.stop_ids else None
    decoder = Decoder(target, settings, len(prompt_ids) + settings.room(target, prompt_ids))
    settings.check_backend(decoder.backend == FAST)
    result = decoder.run(prompt_ids, stop)
    text = target.tokenizer.decode(result.token_ids, skip_special_tokens=False) if target.tokenizer else None
    stats = {
        "new_tokens": len(result.token_ids),
        "seconds": round(result.seconds, 6),
        "tokens_per_second": round(result.tokens_per_second, 3),
        "finish_reason": result.finish_reason,
    }
    if result.stats is not None:
        stats.update(result.stats.to_dict())
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "token_ids": result.token_ids, "text": text, "stats": stats}))
    else:
        print(text if text is not None else " ".join(map(str, result.token_ids)))
        extra = "".join(f", {k}={v}" for k, v in stats.items() if k in ("accept_length", "rounds"))
        print(
            f"[{stats['new_tokens']} tokens in {stats['seconds']:.3f}s, {stats['tokens_per_second']:.1f} tok/s{extra}]",
            file=sys.stderr,
        )
    return 0


__all__ = ["cmd_generate", "prompt_ids_from_args"]
