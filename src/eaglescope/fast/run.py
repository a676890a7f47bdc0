"""The static-shape backend as the backend chooser (eaglescope/backend.py) builds it: what it can run, and its runner.

Greedy only, native targets only, EAGLE-3 or no proposer: the fast path's acceptance is greedy and its modules are
eaglescope's own."""

from __future__ import annotations

from pathlib import Path

from eaglescope.decode.generation import DecodeSettings
from eaglescope.decode.loop import Runner
from eaglescope.errors import EagleScopeError
from eaglescope.fast import invariant
from eaglescope.fast.engine import FastEagle, FastTarget, FastVanilla
from eaglescope.fast.fused_decode import fused_decode_supported
from eaglescope.fast.fused_verify import fused_verify_supported
from eaglescope.models.draft import Eagle3Draft
from eaglescope.models.targets.base import Target
from eaglescope.models.targets.llama import NativeTarget, fuse_projections
from eaglescope.outputs import read_json


def why_not_fast(settings: DecodeSettings, target: Target) -> str | None:
    """None when the static-shape backend can run this decode, else why not (one clause)."""
    if not settings.sampling.greedy:
        return "it decodes greedily only (--temperature is set)"
    if not isinstance(target, NativeTarget):
        return "it needs a native target (llama, qwen2, qwen3, mistral), not the transformers backend"
    if settings.speculative and settings.proposer != "eagle3":
        return f"it runs EAGLE-3 drafts only, not --proposer {settings.proposer}"
    if settings.draft and "kv_lora_rank" in (read_json(Path(settings.draft) / "config.json") or {}):
        return "its slot caches hold Llama-attention drafts; this draft uses multi-head latent attention (MLA)"
    return None


def fast_runner(
    target: NativeTarget,
    draft: Eagle3Draft | None,
    shape: tuple[int, int, int] | None,
    max_len: int,
    batch_invariant: bool = True,
    recorder=None,
    trace_layers: bool = False,
    compile_round: bool = False,
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
    # vanilla's target runs the fused verify too, for its prompt alone: both methods of a paired bench prefill in
    # the same captured chunks (FastTarget.graph_prefill), so their starts differ by the draft's work only
    verify_rows = fused and fused_verify_supported(target.model, target.device) is None
    info = {"fast": True, "batch_invariant": exact, "fused_decode": fused, "fused_verify": verify_rows}
    common = dict(fuse=on_gpu, float32_logits=on_gpu, batch_invariant=exact, fused_decode=fused,
                  fused_verify=verify_rows)  # fmt: skip
    if draft is None:
        return FastVanilla(FastTarget(target.model, max_len + 1, **common), max_len), info
    depth, top_k, total = shape
    if draft.config.arch != "llama":
        raise EagleScopeError("the fast decoder runs Llama-attention drafts; MLA drafts decode on the reference one")
    if on_gpu:
        fuse_projections(draft)
    ft = FastTarget(target.model, max_len + total + depth + 3, taps=target.taps.layers, **common)
    fe = FastEagle(ft, draft, depth, top_k, total, max_len + 2, recorder=recorder, trace_layers=trace_layers,
                   compile=compile_round)  # fmt: skip
    info["tuning"] = ft.tuning.path  # a tuning file's launch settings (fast/tuning.py), or None: the built-ins
    return fe, info
