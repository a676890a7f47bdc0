"""Every subcommand's flags, and which function (a `cmd_*` in this package) runs each.

Standard library only: `eaglescope --help` and a bad flag answer before torch is imported. A command's
function is named as "module:function" and imported when it runs. The flags of `prepare` and `train` take their
defaults from the config dataclasses (eaglescope.config), so each default is stated once.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from eaglescope.config import DEFAULT_DEPTH, PrepareConfig, TrainConfig
from eaglescope.taps import SERVING_ENGINES

BACKENDS = ("auto", "native", "hf")
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")
DEVICE_HELP = "cpu, cuda, cuda:1 … (default: cuda if available)"
DTYPE_HELP = "float32 | bfloat16 | float16 (default: bf16 on GPU, fp32 on CPU)"
COMPILE_HELP = (
    "on the fast decoder: torch.compile the draft side of each EAGLE-3 round (the draft layer, a tree level, the "
    "rerank, the acceptance): a one-off compilation per tree budget for shorter rounds; pays on long or many decodes"
)


def _from(config: type, p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, name: str, **kw) -> None:
    """A flag for dataclass field `name`, its default taken from the field (booleans become store_true)."""
    field = next(f for f in fields(config) if f.name == name)
    flag = "--" + name.replace("_", "-")
    if field.default is MISSING:
        p.add_argument(flag, required=True, **kw)
    elif field.default is False:
        p.add_argument(flag, action="store_true", **kw)
    else:
        if field.default is not None and "type" not in kw:
            kw["type"] = type(field.default)
        p.add_argument(flag, default=field.default, **kw)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="Hugging Face checkpoint directory of the target model")
    p.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="native Llama-family path or generic transformers path (auto: native when supported)",
    )
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)


def add_generate(sub) -> None:
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
    p.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    p.add_argument("--trace", default=None, help="record a trace of this run into DIR")
    p.add_argument("--trace-mode", default="full", choices=["full", "fingerprint"])
    p.add_argument(
        "--trace-layers",
        action="store_true",
        help="with --trace: also record fingerprints of every layer's hidden state of the prefill (target.layer.*), "
        "so that doctor can check the taps without the target's layers",
    )
    p.set_defaults(func="eaglescope.cli.generate:cmd_generate")


def add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="render chat data, build the draft vocabulary, optionally store tap features")
    f = lambda name, **kw: _from(PrepareConfig, p, name, **kw)  # noqa: E731
    f("target", help="Hugging Face checkpoint directory of the target model")
    f("data", help="JSONL of conversations (ShareGPT or OpenAI form)")
    f("out", help="output directory (a new one, or a preparation this command wrote)")
    f("taps", help="tap indices '2,4,5' (HF hidden-state indices) or 'default'")
    f("max_length", help="truncate samples to this many tokens (default %(default)s)")
    f("draft_vocab_size", type=int, help="default min(32000, target vocab)")
    f("regenerate", help="replace assistant turns by the target's greedy answers")
    f("regen_max_new_tokens", help="default %(default)s")
    f("hidden_states", help="store the target's tap features in shards")
    f("batch_size", help="samples per target forward (default %(default)s)")
    f("shard_samples", help="conversations per shard, the unit of resume (default %(default)s)")
    f("device", help=DEVICE_HELP)
    f("dtype", help=DTYPE_HELP)
    f("backend", choices=BACKENDS)
    f("limit", type=int, help="use only the first N conversations")
    f("overwrite", help="replace an earlier preparation at OUT, once the new one is complete")
    f("engine", choices=["vllm", "sglang"], help="the serving engine computes the features (implies --hidden-states; "
      "docs/engine-features.md)")  # fmt: skip
    f("engine_python", help="the engine environment's python (default $EAGLESCOPE_VLLM_PYTHON or "
      "$EAGLESCOPE_SGLANG_PYTHON, else python)")  # fmt: skip
    f("engine_args", help="JSON object of the engine's own arguments, e.g. '{\"tensor_parallel_size\": 8}'")
    f("engine_url", help="with --engine vllm: a running vLLM server that extracts hidden states "
      "(http://HOST:PORT), instead of starting one (docs/engine-features.md)")  # fmt: skip
    f("engine_log", help="with --engine-url: the server's log, from which the layer ids it captures are checked")
    p.add_argument(
        "--buffer",
        default=None,
        help="with --engine: stream the features into this bounded buffer, which "
        "`train --data BUFFER` consumes while they are made (instead of --out's prepared directory)",
    )
    p.add_argument(
        "--buffer-shards",
        type=int,
        default=4,
        help="unconsumed shards the buffer holds before the engine waits (default %(default)s)",
    )
    p.add_argument("--producer", default="0/1", help="I/N: this is producer I of N filling --buffer (default 0/1)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="with --buffer: held-out share of the samples")
    p.set_defaults(func="eaglescope.cli.prepare:cmd_prepare")


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train an EAGLE-3 draft with training-time test (also under torchrun)")
    f = lambda name, group=p, **kw: _from(TrainConfig, group, name, **kw)  # noqa: E731
    f("target", help="Hugging Face checkpoint directory of the target model")
    f("data", help="a directory written by `eaglescope prepare`")
    f("out", help="output directory: becomes the draft checkpoint when training completes")
    f("ttt_length", help="TTT unroll steps; 1 = no TTT, EAGLE-2 style (default %(default)s)")
    f("taps", help="tap indices '2,4,5' (online mode; stored hidden states fix them)")
    f("draft_vocab_size", type=int, help="default: the prepared vocabulary")
    length = p.add_mutually_exclusive_group()
    f("max_steps", group=length, type=int, help="optimizer steps")
    f("epochs", group=length, type=float, help="passes over the training split (default 1)")
    f("max_seconds", type=float, help="seconds for the optimizer steps: the schedule is fitted to the steps that fit")
    f("batch_size", help="samples per process per micro-batch (default %(default)s)")
    f("grad_accum", help="micro-batches per optimizer step (default %(default)s)")
    f("lr", help="peak learning rate (default %(default)s)")
    warm = p.add_mutually_exclusive_group()
    f("warmup_steps", group=warm, type=int)
    f("warmup_ratio", group=warm, help="fraction of the steps (default %(default)s)")
    f("weight_decay", help="default %(default)s")
    f("clip", help="gradient-norm clip, 0 = off (default %(default)s)")
    f("max_length", help="truncate samples to this many tokens (default %(default)s)")
    f("eval_every", help="evaluate every N steps, 0 = at the end only")
    f("eval_fraction", help="held-out share of the samples (default %(default)s)")
    f("save_every", help="checkpoint every N steps, 0 = at the end only")
    f("resume", help="continue an interrupted (or finished) run for OUT")
    f("overwrite", help="replace the draft at OUT once the new one is complete")
    f("seed")
    f("device", help=DEVICE_HELP)
    f("dtype", help="target dtype and GPU autocast: float32 | bfloat16 (default)")
    f("log_dir", help="TensorBoard directory (default OUT/tb)")
    f("backend", choices=BACKENDS)
    f("draft_arch", choices=["llama", "mla"], help="draft layer: Llama attention, or MLA (DeepSeek-V2/V3 targets)")
    f("norm_before_fc", help="EAGLE 3.1: one RMSNorm over the concatenated target features before fc")
    f("fc_norm", help="EAGLE 3.1: one RMSNorm per tap segment before fc")
    f("norm_output", help="EAGLE 3.1: the next draft step receives the post-norm output")
    f("compile", help="fuse the step's elementwise work with torch.compile (pays on long GPU runs)")
    f("pack", help="pack each micro-batch's samples into rows as documents (attention kept within each) instead of "
      "padding each to the longest")  # fmt: skip
    p.set_defaults(func="eaglescope.cli.train:cmd_train")


def add_inspect_export(sub) -> None:
    p = sub.add_parser("inspect", help="what a draft checkpoint was trained on and what each engine will capture")
    p.add_argument("draft_dir", metavar="DRAFT_DIR", help="EAGLE-3 draft checkpoint directory")
    p.add_argument("--target", default=None, help="target checkpoint: infers taps for checkpoints without a contract")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func="eaglescope.cli.export:cmd_inspect")

    p = sub.add_parser("export", help="write a draft checkpoint in SGLang's or vLLM's layer-id convention")
    p.add_argument("--draft", required=True, help="EAGLE-3 draft checkpoint directory")
    p.add_argument("--to", required=True, choices=SERVING_ENGINES, help="engine whose convention to write")
    p.add_argument(
        "--out", required=True, help="new output directory (an earlier export there is replaced once this is complete)"
    )
    p.add_argument("--target", default=None, help="target checkpoint (fingerprint check, embedding, layer count)")
    p.add_argument("--with-embedding", action="store_true", help="save the target's embedding (needs --target)")
    p.add_argument("--dtype", default=None, choices=WEIGHT_DTYPES, help="weight dtype (default: the source's)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func="eaglescope.cli.export:cmd_export")


def add_replay(sub) -> None:
    p = sub.add_parser("replay", help="recompute the golden trace for a recorded trace's prompt and decisions")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--trace", required=True, help="the recorded trace directory")
    p.add_argument("--out", required=True, help="where to write the golden trace (new, or an earlier replay)")
    p.add_argument("--trace-mode", default="full", choices=["full", "fingerprint"])
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", help="default float32")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.set_defaults(func="eaglescope.cli.replay:cmd_replay")


DOCTOR_MODES = """\
MODES of --trace (the report's `replay` line and --json's context.replay say which ran and what it cannot name):
  full replay        the target's layers are on disk and run: every stage is recomputed, the capture
                     (target.aux) included. Names every trace cause, tap causes (TAP_*) included.
  draft-side replay  the target's layers are absent (--target may hold only config.json, the tokenizer and
                     the embedding/lm_head tensors) or --replay draft-side: the draft runs on the trace's own
                     target.aux, tokens and verify decisions, the embedding read tensor by tensor from the
                     shards. Names every draft-side cause exactly as a full replay (fc, feedback, stale
                     features, positions, vocabulary / lm_head map, embedding, EAGLE 3.1 norms, the draft's
                     final norm); cannot name causes in the capture itself (TAP_OFF_BY_ONE, TAP_WRONG_LAYER,
                     TAP_ORDER, TAP_EMBEDDING, TAP_NORMED, EAGLE-2 wiring's FC_SKIPPED): it says they need the
                     target's layers or per-layer fingerprints in the trace. Needs target.aux in full.
                     --data's teacher-forced checks need the target's layers and are skipped.
  fingerprints only  beside a draft-side replay, when the trace records every layer's state of the prefill
                     (target.layer.<i>: generate --trace-layers, capture --layers): the taps are matched
                     against those states with no target forward (the report's `taps` line). Names
                     TAP_OFF_BY_ONE, TAP_WRONG_LAYER, TAP_ORDER, TAP_EMBEDDING, the final normed state
                     (EAGLE-2 wiring's FC_SKIPPED), and TAP_NORMED when target.layer.<i>.normed is recorded.
See docs/doctor.md.
"""


def add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="name the cause of low acceptance: static checks, trace vs golden replay, served vs predicted α_k",
        description="Exit status: 0 healthy, 1 findings, 2 bad input.",
        epilog=DOCTOR_MODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="target checkpoint directory (or a copy without its layers)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft checkpoint directory (optional with --training-data)")
    p.add_argument("--data", default=None, help="held-out data: a JSONL of conversations or a prepared directory")
    p.add_argument("--trace", default=None, help="a trace directory recorded by the serving engine")
    p.add_argument("--engine-log", default=None, help="an SGLang or vLLM server log with acceptance lines")
    p.add_argument(
        "--metrics-url",
        default=None,
        help="a running vLLM or SGLang server (http://HOST:PORT): its /metrics counters as the served acceptance",
    )
    p.add_argument(
        "--engine",
        action="append",
        choices=["sglang", "vllm", "sglang-legacy"],
        default=None,
        help="engine whose tap convention to check, repeatable (default: the log's engine, else sglang and vllm)",
    )
    p.add_argument("--html", default=None, help="write a self-contained HTML report here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--prompts", type=int, default=8, help="prompts from --data served by eaglescope's decoder")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per served prompt")
    p.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="chain depth for served and predicted α_k")
    p.add_argument("--eval-samples", type=int, default=32, help="samples of --data for teacher-forced α_k")
    p.add_argument(
        "--replay",
        default="auto",
        choices=["auto", "full", "draft-side"],
        help="golden replay of --trace: full (the target's layers run), draft-side (the draft runs on the trace's own "
        "target.aux; the target needs only config.json and its embedding), auto (full when every layer's tensors are "
        "on disk; default). See MODES below",
    )
    p.add_argument(
        "--training-data",
        default=None,
        help="check the draft's training data against the target's own states for the same tokens instead of the "
        "draft: speculators' hs_<i>.safetensors (vLLM extract_hidden_states), SpecForge's *.ckpt samples or an "
        "eaglescope prepared directory. Names DATA_TAP_MISMATCH, DATA_SHIFT, DATA_FINAL_NORM, DATA_UNMATCHED",
    )
    p.add_argument("--training-samples", type=int, default=8, help="samples of --training-data read")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument(
        "--measure-wiring",
        action="store_true",
        help="measure which features the draft was trained on (taps, order, final norm, token pairing, TTT) from its "
        "teacher-forced acceptance under each, against what the engine feeds it; needs --data (the target runs here) "
        "or --layer-states",
    )
    p.add_argument(
        "--layer-states",
        default=None,
        help="for --measure-wiring: a directory of per-layer states the engine recorded (*.safetensors with token_ids "
        "[T] and hidden_states [T, L+1, H]); the target then needs only config.json, embedding, final norm, lm_head",
    )
    p.add_argument("--wiring-tokens", type=int, default=256, help="tokens the wiring is measured on (default 256)")
    p.set_defaults(func="eaglescope.cli.doctor:cmd_doctor")


CAPTURE_DESCRIPTION = """\
Record canonical traces (docs/trace-format.md) inside an unmodified vLLM or SGLang, for `eaglescope doctor --trace`.

COMMAND is your own command (python serve.py, vllm serve ..., python -m sglang.launch_server ..., a benchmark), run
unchanged with an environment switch set. eaglescope's plugin for the engine (a `vllm.general_plugins` or
`sglang.srt.plugins` entry point: install eaglescope into the engine's environment, e.g. `pip install --no-deps -e .`;
scripts/vllm_env.sh and scripts/sglang_env.sh do) then wraps the engine's methods in the process that runs the model
(vLLM's worker, SGLang's scheduler) and traces the first N requests it starts, one trace per request, each written
complete when its request finishes. With --requests 1 (default) TRACE is that trace; with N > 1 it is a
directory of request-<k>/ traces and capture.json. TRACE may be a new or empty directory or an earlier capture,
nothing else. Supported: vLLM 0.32.0 with EAGLE-3 (a chain of num_speculative_tokens), and SGLang 0.5.23 with
EAGLE3 as a chain (speculative_eagle_topk 1, overlap scheduling off); any other version is refused in one line and
nothing is written. Serve with prefix caching (SGLang: the radix cache) off to trace requests whose prompts
share a prefix (a cached prefix never runs, so it has no features to record). --layers: vLLM only.

Exit status: the command's own; 2 when nothing could be captured; 1 (if the command exited 0) when the engine
step raised while traced requests were in flight: their traces stop there, marked incomplete.
example: eaglescope capture --engine vllm --out ./trace -- python serve.py
"""


def add_capture(sub) -> None:
    p = sub.add_parser(
        "capture",
        help="record traces inside an unmodified vLLM or SGLang while your own command runs (for doctor --trace)",
        description=CAPTURE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="eaglescope capture --engine vllm|sglang --out TRACE [--mode full|fingerprint] [--requests N] [--layers] "
        "-- COMMAND ...",
    )
    p.add_argument("--engine", required=True, choices=["vllm", "sglang"], help="the serving engine COMMAND runs")
    p.add_argument("--out", required=True, help="where the trace goes (new, empty, or an earlier capture)")
    p.add_argument(
        "--mode",
        default="full",
        choices=["full", "fingerprint"],
        help="full tensors, or compact fingerprints of float tensors for large models (default %(default)s)",
    )
    p.add_argument("--requests", type=int, default=1, help="trace the first N requests (default %(default)s)")
    p.add_argument(
        "--layers",
        action="store_true",
        help="also record fingerprints of every layer's hidden state of each prefill (target.layer.*), so that doctor "
        "can check the taps without the target's layers",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run")
    p.set_defaults(func="eaglescope.cli.capture:cmd_capture")


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="end to end on the embedded default (CPU, minutes, nothing downloaded)")
    p.add_argument(
        "--workdir", default=None, help="artifact cache (default: $EAGLESCOPE_HOME/demo or ~/.cache/eaglescope/demo)"
    )
    p.add_argument("--fast", action="store_true", help="a smaller, quicker run")
    p.add_argument(
        "--scenario",
        default="default",
        choices=["default", "seed"],
        help="default: the healthy pipeline; seed: taps [0, 3, L-2] and a TTT-1 draft, which doctor names NO_TTT",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pretrain-steps", type=int, default=None, help="target pretraining steps (default 600; 200 fast)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="cap pretraining at this many seconds, its schedule shortened to fit (default: no cap, every step "
        "runs; 0 = no cap)",
    )
    p.set_defaults(func="eaglescope.cli.demo:cmd_demo")


def add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure speculative decoding on your target, draft and prompts: τ, α_k, tok/s, speedup, η",
        description="Exit status: 0 when every method's output equals vanilla greedy's, 1 otherwise, 2 bad input.",
    )
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft checkpoint directory (for chain=K and tree=...)")
    p.add_argument(
        "--prompts",
        required=True,
        help="a .jsonl of {prompt} / {prompt_ids} / conversations, or a text file with one prompt a line",
    )
    p.add_argument(
        "--method",
        action="append",
        default=None,
        help="vanilla | chain=K | tree=DEPTH,TOPK,TOTAL | ngram=K, repeatable "
        "(default: vanilla, chain=4, tree=6,4,24, ngram=4)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (no stop tokens)")
    p.add_argument("--chat", action="store_true", help="wrap text prompts as user turns with the chat template")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--html", default=None, help="write a self-contained HTML report with a plot here")
    p.add_argument("--reference", action="store_true", help="use the reference backend even on a GPU")
    p.add_argument(
        "--no-batch-invariant", action="store_true", help="on a GPU: the fused decode kernels (see generate --fast)"
    )
    p.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.set_defaults(func="eaglescope.cli.bench:cmd_bench")


WATCH_DESCRIPTION = """\
Watch a running vLLM or SGLang server's acceptance against what the draft should give. Every --interval seconds
it reads the server's /metrics, takes the counts served over the last --window polls, and judges them by doctor's
serving rule; --sustain low windows in a row raise the alert. Exit status: 0 the run ended in band, 1 alert,
2 bad input (or a server that never answered). See docs/watch.md for the --json lines."""


def add_watch(sub) -> None:
    p = sub.add_parser(
        "watch",
        help="a serving engine's live acceptance (its /metrics) against what the draft should give",
        description=WATCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", required=True, help="the server, http://HOST:PORT (its /metrics is read)")
    p.add_argument("--draft", required=True, help="the EAGLE-3 draft checkpoint the server should be serving")
    p.add_argument("--expect", default=None, help="expected acceptance: a doctor --json report or a JSON {alpha}")
    p.add_argument("--target", default=None, help="with --data: predict the expectation on this traffic")
    p.add_argument("--data", default=None, help="with --target: text like the served traffic (JSONL or prepared)")
    p.add_argument("--eval-samples", type=int, default=32, help="samples of --data for the prediction")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between polls (default 10)")
    p.add_argument("--window", type=int, default=6, help="polls per sliding window (default 6)")
    p.add_argument("--sustain", type=int, default=3, help="low windows in a row that raise the alert (default 3)")
    p.add_argument("--min-rounds", type=int, default=40, help="verify rounds a window needs to be judged")
    p.add_argument("--max-polls", type=int, default=None, help="stop after this many polls")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--give-up-after", type=float, default=600.0,
                   help="fail when the server has not answered for this many seconds (default 600)")  # fmt: skip
    p.add_argument("--keep-watching", action="store_true", help="go on after an alert (exit 1 at the end)")
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        help="the served chain depth K where the metrics do not say it (SGLang before its first decode log)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per poll instead of the table")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.set_defaults(func="eaglescope.cli.watch:cmd_watch")


def add_parsers(sub) -> None:
    for add in (
        add_generate,
        add_replay,
        add_prepare,
        add_inspect_export,
        add_train,
        add_doctor,
        add_capture,
        add_demo,
        add_bench,
        add_watch,
    ):
        add(sub)


__all__ = ["add_parsers", "BACKENDS", "WEIGHT_DTYPES"]
