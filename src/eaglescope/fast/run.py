"""`eaglescope generate --fast`: the static-shape decoders behind the command line.

Greedy only, native targets only, EAGLE-3 or no proposer: the fast path's acceptance is greedy and its modules
are eaglescope's own. Anything else gets one clear error instead of a silent fallback."""

from __future__ import annotations

import contextlib
from pathlib import Path

from eaglescope.decode.generation import GenerationResult, SamplingConfig, begin_generation
from eaglescope.decode.loop import Runner, decode, open_trace, trace_meta
from eaglescope.decode.speculative import build_proposer, parse_tree_shape
from eaglescope.draft import Eagle3Draft
from eaglescope.errors import EagleScopeError
from eaglescope.fast import invariant
from eaglescope.fast.engine import FastEagle, FastTarget, FastVanilla
from eaglescope.fast.fused_decode import fused_decode_supported
from eaglescope.fast.fused_verify import fused_verify_supported
from eaglescope.outputs import read_json
from eaglescope.target.base import Target
from eaglescope.target.llama import NativeTarget, fuse_projections


def why_not_fast(args, target: Target, sampling: SamplingConfig) -> str | None:
    """None when the static-shape backend can run this `generate`, else why not (one clause)."""
    if not sampling.greedy:
        return "it decodes greedily only (--temperature is set)"
    if not isinstance(target, NativeTarget):
        return "it needs a native target (llama, qwen2, qwen3, mistral), not the transformers backend"
    if args.proposer != "eagle3":
        return f"it runs EAGLE-3 drafts only, not --proposer {args.proposer}"
    if args.draft and "kv_lora_rank" in (read_json(Path(args.draft) / "config.json") or {}):
        return "its slot caches hold Llama-attention drafts; this draft uses multi-head latent attention (MLA)"
    return None


def check_fast_args(args, target: Target, sampling: SamplingConfig) -> None:
    why = why_not_fast(args, target, sampling)
    if why is not None:
        raise EagleScopeError(f"--fast cannot run this: {why}")


def fast_runner(
    target: NativeTarget,
    draft: Eagle3Draft | None,
    shape: tuple[int, int, int] | None,
    max_len: int,
    batch_invariant: bool = True,
    recorder=None,
    trace_layers: bool = False,
) -> tuple[Runner, dict]:
    """The static-shape backend for `target` (with `draft` and tree `shape`, or vanilla), sized for prompt + new
    tokens <= max_len → (runner, what it runs on). On a GPU the target runs on the batch-invariant kernels, so the
    speculative output is vanilla's exactly; without them, one-token steps on the fused decode kernels where the
    target allows (not Qwen3's q/k norms)."""
    on_gpu = target.device.type == "cuda"
    exact = on_gpu and batch_invariant and invariant.supports(target.model.args.head_dim, target.device)
    if on_gpu:
        fuse_projections(target.model)
    fused = on_gpu and not exact and fused_decode_supported(target.model, target.device) is None
    info = {"fast": True, "batch_invariant": exact, "fused_decode": fused}
    common = dict(fuse=on_gpu, float32_logits=on_gpu, batch_invariant=exact, fused_decode=fused)
    if draft is None:
        return FastVanilla(FastTarget(target.model, max_len + 1, **common), max_len), info
    depth, top_k, total = shape
    if draft.config.arch != "llama":
        raise EagleScopeError("the fast decoder runs Llama-attention drafts; MLA drafts decode on the reference one")
    if on_gpu:
        fuse_projections(draft)
    verify_rows = fused and fused_verify_supported(target.model, target.device) is None
    ft = FastTarget(
        target.model, max_len + total + depth + 3, taps=target.taps.layers, fused_verify=verify_rows, **common
    )
    return FastEagle(ft, draft, depth, top_k, total, max_len + 2, recorder=recorder, trace_layers=trace_layers), info


def generate_fast(args, target: Target, prompt_ids: list[int], sampling: SamplingConfig, stop_ids) -> GenerationResult:
    check_fast_args(args, target, sampling)
    _, budget, stop, _ = begin_generation(target, prompt_ids, args.max_new_tokens, sampling, stop_ids)
    recorder = draft = shape = None
    if args.draft is not None:
        if len(prompt_ids) < 2:
            raise EagleScopeError("--fast with a draft needs a prompt of at least 2 tokens")
        shape = parse_tree_shape(args.chain, args.tree)
        proposer = build_proposer(args, target, sampling, len(prompt_ids) + budget + 2)  # loads, checks, sets taps
        draft = proposer.draft
        recorder = open_trace(args)
        if recorder is not None:
            trace_meta(recorder, args, target, prompt_ids, sampling)
    invariant_kernels = not getattr(args, "no_batch_invariant", False)
    layers = bool(getattr(args, "trace_layers", False))
    runner, info = fast_runner(target, draft, shape, len(prompt_ids) + budget, invariant_kernels, recorder, layers)
    if draft is None:
        runner.chunk = 16 if stop else budget  # a stop token is looked for every 16 steps, not every step
    with recorder if recorder is not None else contextlib.nullcontext():  # written when complete, else dropped
        result = decode(runner, prompt_ids, budget, args.max_new_tokens, stop, target.device)
    if draft is None:
        result.stats = None
    result.extra = info
    return result
