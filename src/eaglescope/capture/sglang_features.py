"""The capture plugin's features hooks inside SGLang 0.5.23 (`eaglescope prepare --engine sglang`): each prefill's tap
states and final state, as SGLang itself computes them for its EAGLE-3 drafts, without a draft being served.

SGLang hands a draft only the concatenation of its captured states and never the final state beside them; its
capture-only mode (`--enable-return-aux-hidden-states`, server_args `enable_return_aux_hidden_states` with
`speculative_algorithm` EAGLE3 naming the capture convention and `return_aux_hidden_state_layer_ids` the ids) returns
the captured states *in place of* the final state. So the target's aux capture is switched on the way SGLang switches
it on (the worker starts SGLang in that mode) and these hooks read both, per request, where SGLang holds them:

    model_runner.configure_aux_hidden_state_capture   SGLang configured the target's capture
        (model_runner_components/attention_backend_setup.py, called by ModelRunner.init_attention_backends before any
        graph is captured): the model's `layers_to_capture` after its own id rule (llama.py: id i → i + 1;
        deepseek_v2.py: + 1 only when the first id is 1), HF output_hidden_states indices (the state entering layer
        i), are read back into FEATURES_READY (with the prefill attention backend SGLang resolved and whether the
        target's attention is latent), and a forward hook is put on the model body
    the target's model body (forward hook)   returns (final state after the final norm, the captured states: a list
        of [T, H] or one packed [T, nH]) for every token of the forward: copied at once
    ModelRunner.forward                      an extend (prefill) forward: its batch's request ids, each request's
        first position and token count (ForwardBatch.rids, extend_prefix_lens_cpu, extend_seq_lens_cpu) and token
        ids; after it, one file per eaglescope request: FEATURES_DIR/<rid>.<first position>.safetensors with
        taps [n, n_taps, H], final [n, H], token_ids [n]

A prefill split in chunks gives one file per chunk (the worker joins them and checks they cover the prompt once,
features/contract.py check_prefill_chunks). Only requests whose id starts with FEATURES_REQUEST_PREFIX are written,
on tensor-parallel rank 0 (the states are whole there after SGLang's all-reduce). The hooks only read: what SGLang
computes is unchanged, and an error inside them is one note (the request then has no file) that never reaches SGLang.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save_file

from eaglescope.capture import ENV_DIR, FEATURES_DIR, FEATURES_READY, FEATURES_REQUEST_PREFIX, unsupported_line
from eaglescope.capture.slots import EngineCapture, guarded
from eaglescope.capture.slots import wrap as _wrap


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _body(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that captures (`layers_to_capture`: LlamaModel, DeepseekV2Model, a language model inside a
    multimodal one)."""
    return next((m for m in model.modules() if hasattr(m, "layers_to_capture")), None)


def _prefill_backend() -> str | None:
    """The prefill attention backend the target runs, as SGLang resolves it for its model runner
    (model_runner_components/attention_backend_setup.py resolve_attention_backend_strs: runtime_context's
    `attention_backends()`, after SGLang's platform fallbacks: an intel_amx becomes torch_native on a CPU without AMX);
    the ServerArgs, in either process, keep the one asked."""
    try:
        from sglang.srt.runtime_context import attention_backends

        return str(attention_backends()[0])
    except Exception:  # noqa: BLE001 - not known here: the check that reads it is then not made
        return None


class Features(EngineCapture):
    """Process-wide state: the target's body once hooked, and the prefill forward in progress."""

    def __init__(self, staging: Path, version: str) -> None:
        super().__init__(staging, 0, "full", "sglang", version)
        self.body: torch.nn.Module | None = None
        self.step: list[tuple[str, int, int, int]] | None = None  # this forward's requests: (rid, lo, hi, first pos)
        self.out: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # the body's (final, taps), whole batch

    def abandon_step(self) -> None:
        self.step, self.out = None, None

    def on_configured(self, model: torch.nn.Module) -> None:
        """SGLang configured its target's capture: read back what it captures, hook the body (the target only: a
        draft's runner, where one is served too, has no `layers_to_capture`)."""
        body = _body(model)
        if body is None or self.body is not None:
            return
        self.body = body
        body.register_forward_hook(lambda m, a, out: _on_body(self, out))
        config = getattr(model, "config", None)
        ready = {
            "layers_to_capture": [int(i) for i in getattr(body, "layers_to_capture", ()) or ()],
            "capture_aux_hidden_states": bool(getattr(model, "capture_aux_hidden_states", False)),
            "architecture": type(model).__name__,
            "num_layers": int(getattr(config, "num_hidden_layers", len(getattr(body, "layers", ())))),
            # DeepSeek-V2/V3, Kimi-K2: attention through a compressed latent (kv_lora_rank), which not every backend
            # computes right (features/sglang_engine.py)
            "latent_attention": bool(getattr(config, "kv_lora_rank", None)),
            "attention_backend": _prefill_backend(),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "pid": os.getpid(),
        }
        tmp = self.staging / f"{FEATURES_READY}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(ready))
        os.replace(tmp, self.staging / FEATURES_READY)

    def begin(self, forward_batch) -> None:
        self.step, self.out = None, None
        rids, lens, firsts = forward_batch.rids, forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu
        if not rids or lens is None or firsts is None:
            return
        step, row = [], 0
        for rid, n, first in zip(rids, lens, firsts, strict=True):
            if str(rid).startswith(FEATURES_REQUEST_PREFIX):
                step.append((str(rid), row, row + int(n), int(first)))
            row += int(n)
        self.step = step or None

    def on_body(self, out) -> None:
        if self.step is None:
            return
        if not (isinstance(out, tuple) and len(out) == 2):
            # no captured states: SGLang was not started in its capture mode (ready.json says so); the final alone
            self.out = (_cpu(out if isinstance(out, torch.Tensor) else out[0]), [])
            return
        final, aux = out
        n = len(getattr(self.body, "layers_to_capture", ()) or ())
        if isinstance(aux, torch.Tensor):  # packed [T, nH] (deepseek_v2.py's AuxHiddenStatePacker)
            aux = list(aux.chunk(n, dim=-1)) if n else []
        self.out = (_cpu(final), [_cpu(a) for a in aux])

    def write(self, forward_batch) -> None:
        step, out = self.step, self.out
        self.step, self.out = None, None
        if step is None:
            return
        if out is None:
            for rid, *_ in step:
                self.note_once(f"none-{rid}", f"request {rid}: the target's body ran without eaglescope's hook")
            return
        final, taps = out
        ids = forward_batch.input_ids.detach().to("cpu").long()
        folder = self.staging / FEATURES_DIR
        folder.mkdir(exist_ok=True)
        for rid, lo, hi, first in step:
            tensors = {
                "taps": torch.stack([t[lo:hi] for t in taps], dim=1) if taps else final[lo:hi, None][:, :0],
                "final": final[lo:hi].contiguous(),
                "token_ids": ids[lo:hi].contiguous(),
            }
            path = folder / f"{rid}.{first}.safetensors"
            tmp = folder / f".{rid}.{first}.tmp"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
            os.replace(tmp, path)


_FEATURES: Features | None = None

_on_configured = guarded(Features.on_configured)
_begin = guarded(Features.begin)
_on_body = guarded(Features.on_body)
_write = guarded(Features.write)


def _rank0() -> bool:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank) == 0
    except Exception:  # noqa: BLE001 - no parallel context: one process
        return True


def _configure_hook(orig):
    def run(*a, **kw):
        out = orig(*a, **kw)
        model = kw.get("model", a[0] if a else None)
        if _FEATURES is not None and model is not None:
            _on_configured(_FEATURES, model)
        return out

    return run


def _forward_hook(orig):
    def run(self, forward_batch, *a, **kw):
        cap = _FEATURES
        active = cap is not None and cap.body is not None and forward_batch.forward_mode.is_extend() and _rank0()
        if active:
            _begin(cap, forward_batch)
        try:
            return orig(self, forward_batch, *a, **kw)
        finally:
            if active:
                _write(cap, forward_batch)

    return run


def install(model_runner_module: ModuleType) -> None:
    """Wrap SGLang's capture configuration (module level, where ModelRunner calls it by name) and ModelRunner.forward,
    once per process."""
    global _FEATURES
    if _FEATURES is not None:
        return
    import sglang

    refused = unsupported_line(str(sglang.__version__), "sglang")
    if refused is not None:  # plugin.py refuses first; this guards any other way in
        raise RuntimeError(refused)
    _FEATURES = Features(Path(os.environ[ENV_DIR]), str(sglang.__version__))
    _wrap(model_runner_module, "configure_aux_hidden_state_capture", _configure_hook)
    _wrap(model_runner_module.ModelRunner, "forward", _forward_hook)
