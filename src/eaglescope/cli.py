"""The `eaglescope` command line. Each subcommand is a plain function; errors become one stderr line."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from eaglescope.commands import BACKENDS, add_parsers
from eaglescope.errors import EagleScopeError
from eaglescope.log import configure as configure_logging


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
    p.add_argument(
        "--trace-layers",
        action="store_true",
        help="with --trace: also record fingerprints of every layer's hidden state of the prefill (target.layer.*), "
        "so that doctor can check the taps without the target's layers",
    )
    p.set_defaults(func="eaglescope.generate:cmd_generate")


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
    """A subcommand's function, named "module:function" and imported now (see commands.py)."""
    module, name = func.split(":")
    return getattr(importlib.import_module(module), name)


def _quiet_transformers() -> None:
    # Loading reports and progress bars from transformers would bury our one-line errors.
    try:
        from transformers.utils import logging as hf_logging  # after parsing: --help and flag errors stay instant

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = os.environ.get("EAGLESCOPE_DEBUG") == "1"
    configure_logging(debug)
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
