"""The `eaglescope` command line. Each subcommand is a plain function; errors become one stderr line."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings

from eaglescope.commands import BACKENDS, add_parsers
from eaglescope.errors import EagleScopeError


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="Hugging Face checkpoint directory of the target model")
    p.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="native Llama-family path or generic transformers path (auto: native when supported)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 (default: bf16 on GPU, fp32 on CPU)")


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


def cmd_generate(args) -> int:
    import torch

    from eaglescope.decode.vanilla import SamplingConfig, generate_vanilla
    from eaglescope.fast.run import generate_fast, why_not_fast
    from eaglescope.target import load_target, parse_device, parse_dtype

    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    sampling.validate()
    if args.max_new_tokens < 1:
        raise EagleScopeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.proposer != "ngram" and not args.draft:
        for flag, given in (("--chain", args.chain), ("--tree", args.tree)):
            if given is not None:
                raise EagleScopeError(f"{flag} shapes a speculative run: add --draft DIR (or --proposer ngram)")
        if args.proposer == "draft-lm":
            raise EagleScopeError("--proposer draft-lm needs --draft DIR (the draft language model)")
    if args.chain is not None or args.tree is not None:
        from eaglescope.decode.speculative import parse_tree_shape

        parse_tree_shape(args.chain, args.tree)  # a bad shape is refused before any model is loaded
    if args.trace:
        if not (args.draft or args.proposer == "ngram"):
            raise EagleScopeError("--trace records a speculative run: add --draft DIR (or --proposer ngram)")
        from eaglescope.outputs import check_destination
        from eaglescope.trace import trace_kind

        check_destination(args.trace, trace_kind("eaglescope"), inputs=[args.target, args.draft], flag="--trace")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    target = load_target(args.target, device=device, dtype=dtype, backend=args.backend)
    prompt_ids = prompt_ids_from_args(args, target.tokenizer)
    stop = None
    if args.stop_ids:
        extra = _parse_ids(args.stop_ids, "--stop-ids")
        outside = [i for i in extra if i >= target.vocab_size]
        if outside:
            raise EagleScopeError(
                f"--stop-ids {outside[0]} is outside the target vocabulary (size {target.vocab_size})"
            )
        stop = list(target.eos_token_ids) + extra
    if args.draft or args.proposer == "ngram":
        from eaglescope.decode.speculative import parse_tree_shape

        depth = parse_tree_shape(args.chain, args.tree)[0]
        if len(prompt_ids) + depth + 1 > target.max_positions:
            raise EagleScopeError(
                f"a round drafts {depth} tokens past the {len(prompt_ids)}-token prompt, beyond the target's context "
                f"of {target.max_positions}; use a shorter --chain/--tree depth or prompt"
            )
    if args.fast and args.reference:
        raise EagleScopeError("--fast and --reference choose opposite decoders; pass one")
    fast = args.fast
    if device.type == "cuda" and not args.fast and not args.reference:
        # On a GPU the static-shape decoder is the default wherever it can run (the same tokens, several times
        # faster); where it cannot, say why in one line and decode on the reference path.
        why = why_not_fast(args, target, sampling)
        fast = why is None
        if why is not None:
            print(f"eaglescope: generate: the reference decoder, because the fast one cannot: {why}", file=sys.stderr)
    if args.no_batch_invariant and not fast:
        raise EagleScopeError("--no-batch-invariant chooses the kernels of the fast decoder (a GPU, or --fast)")
    if fast:
        result = generate_fast(args, target, prompt_ids, sampling, stop)
    elif args.draft or args.proposer in ("ngram",):
        from eaglescope.decode.loop import run_speculative_from_args

        result = run_speculative_from_args(args, target, prompt_ids, sampling, stop)
    else:
        result = generate_vanilla(target, prompt_ids, args.max_new_tokens, sampling, stop)
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


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="decode with the target, optionally speculatively with a draft")
    _add_target_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn with the tokenizer's template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-ids", default=None, help="extra stop token ids, comma-separated")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft checkpoint (or draft LM for --proposer draft-lm)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--chain", type=int, default=None, metavar="K", help="chain of K draft tokens per round")
    shape.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL", help="EAGLE-2 dynamic tree")
    p.add_argument("--proposer", default="eagle3", choices=["eagle3", "ngram", "draft-lm"])
    p.add_argument(
        "--reference",
        action="store_true",
        help="the reference decoder even on a GPU (on a GPU the fast one is the default wherever it can run)",
    )
    p.add_argument(
        "--fast",
        action="store_true",
        help="static-shape decoders (one CUDA graph per step or EAGLE-3 round on a GPU, batch-invariant kernels so "
        "the output is vanilla greedy's exactly); greedy, native targets",
    )
    p.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="with --fast on a GPU: one-token steps on the fused decode kernels and verifies on cuBLAS instead of the "
        "batch-invariant kernels; faster on large targets (8B step 4.2 vs 6.7 ms), but bf16 near-ties may then flip "
        "between vanilla and speculative",
    )
    p.add_argument("--trace", default=None, help="record a trace of this run into DIR")
    p.add_argument("--trace-mode", default="full", choices=["full", "fingerprint"])
    p.set_defaults(func=cmd_generate)


class _Parser(argparse.ArgumentParser):
    """argparse with the product's error form: one `eaglescope: error:` line and exit 2 (not usage + error)."""

    def error(self, message: str):
        self.exit(
            2, f"eaglescope: error: {self.prog.removeprefix('eaglescope ')}: {message} (see {self.prog} --help)\n"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="eaglescope", description="Train, serve and debug EAGLE-3 draft models.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_parsers(sub)
    return parser


def _command(func):
    """A subcommand's function: cmd_generate itself, or "module:function" imported now (see commands.py)."""
    if callable(func):
        return func
    module, name = func.split(":")
    return getattr(importlib.import_module(module), name)


def _quiet_transformers() -> None:
    # Loading reports and progress bars from transformers would bury our one-line errors.
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = os.environ.get("EAGLESCOPE_DEBUG") == "1"
    if not debug:
        warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
        _quiet_transformers()
    # Warnings are held back while the command runs: after a success each becomes one `eaglescope: warning:`
    # line; after a failure they are dropped, so the error stays the single line on stderr.
    with warnings.catch_warnings(record=True) as caught:
        if not debug:
            warnings.simplefilter("always")
        try:
            rc = int(_command(args.func)(args) or 0)
        except EagleScopeError as e:
            print(f"eaglescope: error: {_one_line(e)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("eaglescope: interrupted", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 - a bug, but the user still gets one line and a way to see more
            if debug:
                raise
            print(
                f"eaglescope: internal error: {type(e).__name__}: {_one_line(e)} (set EAGLESCOPE_DEBUG=1 for a "
                "traceback)",
                file=sys.stderr,
            )
            return 3  # distinct from doctor's 1 (findings) and bad input's 2
    seen = set()
    for w in caught:
        text = _one_line(w.message)
        if text not in seen and _ours(w):
            seen.add(text)
            print(f"eaglescope: warning: {text}", file=sys.stderr)
    return rc


def _one_line(e: object) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _ours(w: warnings.WarningMessage) -> bool:
    """Warnings eaglescope raised for the user (libraries' deprecation chatter is not the user's business)."""
    return "eaglescope" in (w.filename or "") and not issubclass(w.category, DeprecationWarning)


if __name__ == "__main__":
    sys.exit(main())
