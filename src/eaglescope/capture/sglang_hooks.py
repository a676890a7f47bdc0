"""Hooks that record canonical traces (docs/trace-format.md) inside SGLang 0.5.23 without changing what it computes.

Installed by plugin.py in the process that imports `srt/speculative/eagle_worker_v2.py`: SGLang's scheduler process,
which it starts with multiprocessing's spawn and in which it loads its general plugins (`run_scheduler_process` →
`load_plugins`). They wrap, at run time, the methods where SGLang holds each canonical stage:

    EAGLEWorkerV2.forward_batch_generation      a scheduler step begins: its batch (requests in row order, extend
                                                lengths); the first step also hooks the models below
    the target's model body (a forward hook)    the states it captured for the draft (`layers_to_capture`, HF
                                                output_hidden_states indices once SGLang applied its id rule: the
                                                input of decoder layer i) → target.tap.<i>
    EagleDraftWorker._draft_extend_for_prefill  the hand-off after the prefill: target_hidden_states (the logits
                                                processor's concatenation of the captured states) → target.aux,
                                                next.hidden_in of round 0, next_token_ids → verify.bonus of round 0;
                                                the draft's extend over the prompt inside it is round 1's step 0
    EAGLEWorkerV2.verify                        the chain sent to the target (EagleVerifyInput.draft_token) and
                                                eagle_sample's decision (accept_lens, bonus included; predict) →
                                                verify.tokens / parents / accepted / bonus; the target's hidden states
                                                of every verified row → target.aux
    EagleDraftWorker._draft_extend_for_decode   the hand-off after verify (next.hidden_in) and the next round's step 0:
                                                the draft extends over all K+1 verified rows and `select_index` (each
                                                request's last accepted row) is what the next round drafts from
    EagleDraftWorker.draft_forward              steps 1..K-1, one row per request
    the draft model (forward hooks: its body, its fc, its embed_tokens, its logits)
                                                → draft.fc.out, draft.step<k>.tokens / positions / embed_in /
                                                hidden_in / hidden_out / topk
    Req.update_finish_state                     the scheduler decided the request ended: its trace is written

SGLang's semantics mapped onto the canonical stages (a chain: speculative_eagle_topk 1, K = speculative_num_steps,
K + 1 = speculative_num_draft_tokens verified rows):
  * SGLang hands the draft every verified row of the round (its rejected ones too, which the causal mask keeps out of
    the row it samples) and samples at the last accepted one. That is where the seed incident's `accepted_indices`
    filter sat in SGLang's older worker (`eagle_worker.py` filtered `hidden_states[accepted_indices]` before its
    draft extend); `eagle_worker_v2.py` keeps every row and selects with `select_index` instead. The canonical
    next.hidden_in, draft.fc.out and draft.step0.* are the root's and the accepted rows only: the rows up to and
    including the selected one (the event's extra `sglang_rows` says how many SGLang handed in, `sampled_row` which
    one it sampled).
  * Step k >= 1 runs one row per request: the selected row's output and the token drafted by step k-1.
  * draft.step<k>.topk holds the token SGLang proposed (a target id, after `hot_token_id`, SGLang's d2t) and its
    log-probability under the draft's own logits.
  * A round's draft stages are kept until that round is verified, and dropped when the request ends first.
  * Requests whose prompt hit the radix cache, or that SGLang prefills in chunks, are not traced (said in a note):
    their features never ran as one block. Serve with disable_radix_cache to trace every request.
  * Trees (topk > 1) and overlap scheduling are refused with one note: nothing is traced.

A request's trace is closed (written, atomically) when SGLang's scheduler decides it ended (Req.update_finish_state),
or at exit. When SGLang's step raises, every traced request in flight is closed as it stands, `complete: false`, with
a line in raised.txt; the exception goes on to SGLang unchanged. Errors inside the hooks are reported as one line and
drop the traces in flight; they never reach SGLang.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from types import ModuleType

import torch

from eaglescope.capture import ENV_DIR, ENV_MODE, ENV_REQUESTS, unsupported_line
from eaglescope.capture.slots import (
    EngineCapture,
    TracedRequest,
    claim_slot,
    guarded,
    report_raised,
    target_fingerprint,
)
from eaglescope.capture.slots import rows as _rows
from eaglescope.capture.slots import wrap as _wrap
from eaglescope.trace import (
    DRAFT_FC_OUT,
    NEXT_HIDDEN_IN,
    TARGET_AUX,
    TOPK_IDS,
    TOPK_LOGPROBS,
    VERIFY_ACCEPTED,
    VERIFY_BONUS,
    VERIFY_PARENTS,
    VERIFY_TOKENS,
    draft_embed_in,
    draft_hidden_in,
    draft_hidden_out,
    draft_positions,
    draft_tokens,
    draft_topk,
    target_tap,
)

# SGLang's finish reasons (srt/managers/schedule_batch.py) → the capture's: its own stop, its length, or why not
STOPS = ("FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISHED_MATCHED_REGEX")


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _ended(reason) -> str:
    name = type(reason).__name__
    return "length" if name == "FINISH_LENGTH" else "stop" if name in STOPS else name


class RequestTrace(TracedRequest):
    """One SGLang request's trace."""

    def __init__(self, cap: Capture, worker, req, slot: int) -> None:
        super().__init__(cap.staging, slot, str(req.rid), cap.mode, cap.producer)
        self.prompt = [int(t) for t in req.origin_input_ids]
        self.rec.set_meta(**cap.meta(worker, req, self))


class Capture(EngineCapture):
    """Process-wide capture state: which requests are traced, and what the current scheduler step is doing."""

    def __init__(self, staging: Path, limit: int, mode: str, version: str) -> None:
        super().__init__(staging, limit, mode, "sglang", version)
        self.hooked: set[int] = set()  # id() of the modules hooked
        self.layers: list[int] = []  # the target's layers_to_capture
        self.taps: list[torch.Tensor] | None = None  # the last target forward's captured states, whole batch
        self.layout: dict[str, tuple[int, int, int]] = {}  # this step's traced requests: rid → (batch index, rows)
        self.handoff: dict[str, tuple[int, int, int]] = {}  # verified this step: rid → (b, first row, selected + 1)
        self.draft: dict | None = None  # the draft forwards in progress: {"step", "reqs": {rid: (b, lo, hi)}}
        self.forward: dict = {}  # the draft forward in progress: its inputs and outputs

    def abandon_step(self) -> None:
        self.draft, self.forward = None, {}

    def raised(self, e: BaseException) -> None:
        what = f"SGLang's scheduler step raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        what = what.rstrip(": ")
        for rid in list(self.traces):
            tr = self.traces[rid]
            line = f"request {rid} (slot {tr.slot}): {what}; its trace stops after round {tr.round}"
            report_raised(self.staging, line)
            self.close(rid, "error", incomplete=what)
        self.abandon_step()

    # -- what every trace's meta holds -------------------------------------------------------------------
    def meta(self, worker, req, tr: RequestTrace) -> dict:
        sargs = worker.server_args
        sp = req.sampling_params
        K = int(worker.speculative_num_steps)
        top_k = getattr(sp, "top_k", None)
        settings = {
            "chain": K,
            "tree": None,
            "temperature": float(sp.temperature),
            "top_k": None if top_k is None or top_k < 1 or top_k >= 1 << 30 else int(top_k),
            "top_p": None if getattr(sp, "top_p", 1.0) in (None, 1.0) else float(sp.top_p),
            "seed": getattr(sp, "sampling_seed", None),
            "max_new_tokens": sp.max_new_tokens,
            "proposer": "eagle3",
        }
        target_cfg = worker.target_worker.model_runner.model_config.hf_config
        draft_cfg = worker.draft_worker.draft_runner.model_config.hf_config
        return {
            "prompt_ids": tr.prompt,
            "taps": {
                "layers": list(self.layers),
                "index_convention": "hf_output_hidden_states",
                "num_layers": int(target_cfg.num_hidden_layers),
            },  # fmt: skip
            "tap_convention": "hf_output_hidden_states",
            "settings": settings,
            "decoding": settings,
            "target": target_fingerprint(str(sargs.model_path)),
            "draft": {
                "path": str(sargs.speculative_draft_model_path),
                "draft_vocab_size": getattr(draft_cfg, "draft_vocab_size", None),
            },  # fmt: skip
            "dtype": str(worker.target_worker.model_runner.model_config.dtype).removeprefix("torch."),
            "sglang": {
                "version": self.version,
                "request_id": tr.req_id,
                "model": str(sargs.model_path),
                "speculative_algorithm": str(sargs.speculative_algorithm),
                "num_steps": K,
                "topk": int(worker.topk),
                "num_draft_tokens": int(worker.speculative_num_draft_tokens),
                "capture_slot": tr.slot,
                "pid": os.getpid(),  # the scheduler process
            },
        }

    # -- the scheduler step ---------------------------------------------------------------------------------
    def begin_step(self, worker, batch) -> None:
        self.layout, self.handoff, self.taps, self.draft, self.forward = {}, {}, None, None, {}
        if not self.hooked:
            if int(worker.topk) != 1 or not worker.server_args.disable_overlap_schedule:
                self.note_once("shape", "SGLang serves a tree (speculative_eagle_topk > 1) or with overlap scheduling: "
                               "eaglescope capture traces chains without overlap only; nothing traced")  # fmt: skip
                self.exhausted = True
                return
            self._hook_models(worker)
        N = int(worker.speculative_num_draft_tokens)
        extend = batch.forward_mode.is_extend()
        row = 0
        for b, req in enumerate(batch.reqs):
            rid = str(req.rid)
            if extend:
                n, prefix = int(batch.extend_lens[b]), int(batch.prefix_lens[b])
                first, row = row, row + n
                if rid in self.seen:
                    if rid in self.traces:  # a traced request prefilled again (retracted?): its rounds do not join
                        self.drop(rid, "SGLang prefilled it again (retracted or chunked)")
                    continue
                self.seen.add(rid)
                if self.exhausted:
                    continue
                if prefix != 0 or n != len(req.origin_input_ids):
                    why = (f"request {rid} is not traced: its prompt ran from position {prefix} over {n} of "
                           f"{len(req.origin_input_ids)} tokens (radix cache or chunked prefill; serve with "
                           "disable_radix_cache and a chunk size above the prompts)")  # fmt: skip
                    self.note_once(f"prefix-{rid}", why)
                    continue
                slot = claim_slot(self.staging, self.limit)
                if slot is None:
                    self.exhausted = True
                    continue
                self.traces[rid] = RequestTrace(self, worker, req, slot)
                self.layout[rid] = (b, first, first + n)
            elif rid in self.traces:
                self.layout[rid] = (b, b * N, (b + 1) * N)

    def on_target(self, out) -> None:
        """The target's model body returned (hidden, captured states): a list of [T, H], or one packed [T, nH]."""
        if not self.layout or not (isinstance(out, tuple) and len(out) == 2):
            return
        aux = out[1]
        if isinstance(aux, torch.Tensor):
            aux = list(aux.chunk(len(self.layers), dim=-1))
        self.taps = [_cpu(a) for a in aux]

    def on_prefill_handoff(self, target_hidden: torch.Tensor, next_token_ids: torch.Tensor) -> None:
        firsts = next_token_ids.detach().to("cpu").long()
        reqs = {}
        for rid, (b, lo, hi) in self.layout.items():
            tr = self.traces.get(rid)
            if tr is None or tr.round >= 0:
                continue
            if self.taps is None:
                self.drop(rid, "the target captured no states for the draft")
                continue
            for layer, t in zip(self.layers, self.taps, strict=True):
                tr.record(0, target_tap(layer), t[lo:hi])
            aux = _rows(target_hidden, lo, hi)
            seg = {"segments": len(self.layers), "sglang_rows": hi - lo}
            tr.record(0, TARGET_AUX, aux, segments=len(self.layers))
            tr.record(0, VERIFY_BONUS, firsts[b : b + 1].clone())
            tr.round, tr.emitted = 0, [int(firsts[b])]
            tr.staged.append((0, NEXT_HIDDEN_IN, aux, seg))
            reqs[rid] = (b, lo, hi, hi - lo)
        self.draft = {"step": 0, "reqs": reqs} if reqs else None

    def on_verified(self, worker, verify_input, result) -> None:
        N = int(worker.speculative_num_draft_tokens)
        tokens = verify_input.draft_token.detach().to("cpu").long()
        predict = result.next_token_ids.detach().to("cpu").long()
        accept_lens = result.accept_lens.detach().to("cpu").long()
        hidden = result.logits_output.hidden_states
        for rid, (b, lo, hi) in list(self.layout.items()):
            tr = self.traces.get(rid)
            if tr is None:
                continue
            chain, a = tokens[lo:hi], int(accept_lens[b]) - 1  # a drafts accepted, then the bonus
            if int(chain[0]) != tr.emitted[-1]:
                self.drop(rid, f"its round's root {int(chain[0])} is not its last token {tr.emitted[-1]}")
                continue
            if chain[1 : a + 1].tolist() != predict[lo : lo + a].tolist():
                self.drop(rid, f"its accepted tokens {predict[lo : lo + a].tolist()} are not its drafts")
                continue
            rnd = tr.round + 1
            tr.commit_staged()
            tr.record(rnd, VERIFY_TOKENS, chain.clone())
            tr.record(rnd, VERIFY_PARENTS, torch.arange(-1, N - 1, dtype=torch.long))
            for layer, t in zip(self.layers, self.taps or [], strict=True):
                tr.record(rnd, target_tap(layer), t[lo:hi])
            tr.record(rnd, TARGET_AUX, _rows(hidden, lo, hi), segments=len(self.layers), sglang_rows=N)
            tr.record(rnd, VERIFY_ACCEPTED, torch.arange(1, a + 1, dtype=torch.long))
            tr.record(rnd, VERIFY_BONUS, predict[lo + a : lo + a + 1].clone())
            tr.round = rnd
            tr.emitted += predict[lo : lo + a + 1].tolist()
            self.handoff[rid] = (b, lo, lo + a + 1)

    def on_decode_handoff(self, result) -> None:
        hidden = result.logits_output.hidden_states
        reqs = {}
        for rid, (b, lo, hi) in self.handoff.items():
            tr = self.traces.get(rid)
            if tr is None:
                continue
            seg = {"segments": len(self.layers), "sglang_rows": self.layout[rid][2] - lo}
            tr.staged.append((tr.round, NEXT_HIDDEN_IN, _rows(hidden, lo, hi), seg))
            reqs[rid] = (b, lo, hi, self.layout[rid][2] - lo)
        self.draft = {"step": 0, "reqs": reqs} if reqs else None

    def begin_draft_steps(self) -> None:
        reqs = {rid: (b, b, b + 1, 1) for rid, (b, _, _) in self.layout.items() if rid in self.traces}
        self.draft = {"step": 1, "reqs": reqs} if reqs else None

    # -- the draft model ----------------------------------------------------------------------------------
    def on_draft_body(self, args: tuple, kwargs: dict, out) -> None:
        """The draft's body ran: its inputs (ids, positions, spec_info.hidden_states) and the feature it hands on."""
        names = ("input_ids", "positions", "forward_batch")
        kw = dict(zip(names, args)) | kwargs
        fb = kw["forward_batch"]
        self.forward |= {"input_ids": kw["input_ids"], "positions": kw["positions"],
                         "hidden_in": fb.spec_info.hidden_states, "hidden_out": out[1][0]}  # fmt: skip

    def on_draft_logits(self, worker, out) -> None:
        """The draft model's forward returned its logits: one step of the requests in `self.draft` is complete."""
        d, f = self.draft, self.forward
        self.forward = {}
        if d is None or "hidden_out" not in f:
            return
        k = d["step"]
        d["step"] = k + 1
        logits = out.next_token_logits
        hot = getattr(worker.draft_worker, "hot_token_id", None)
        total = int(f["input_ids"].shape[0])
        for rid, (b, lo, hi, handed) in d["reqs"].items():
            tr = self.traces.get(rid)
            if tr is None:
                continue
            blocks = [(draft_tokens(k), _rows(f["input_ids"], lo, hi).long())]
            if f["positions"] is not None and f["positions"].dim() == 1:
                blocks.append((draft_positions(k), _rows(f["positions"], lo, hi).long()))
            if f.get("embeds") is not None:
                blocks.append((draft_embed_in(k), _rows(f["embeds"], lo, hi)))
            hidden_in = f["fc"] if k == 0 and f.get("fc") is not None else f["hidden_in"]
            blocks += [(draft_hidden_in(k), _rows(hidden_in, lo, hi)),
                       (draft_hidden_out(k), _rows(f["hidden_out"], lo, hi))]  # fmt: skip
            if k == 0 and f.get("fc") is not None:
                blocks.insert(0, (DRAFT_FC_OUT, _rows(f["fc"], lo, hi)))
            # the row SGLang samples: all rows' logits (a decode extend), or one per request (a prefill's, a step's)
            row = hi - 1 if logits.shape[0] == total else b
            with torch.inference_mode():
                lp = torch.log_softmax(logits[row : row + 1].float(), dim=-1)
            draft_id = lp.argmax(dim=-1, keepdim=True)
            proposed = draft_id if hot is None else hot.to(draft_id.device)[draft_id]
            topk = {TOPK_IDS: proposed.cpu().long(), TOPK_LOGPROBS: lp.gather(-1, draft_id).cpu()}
            extra = {"sglang_rows": handed, "sampled_row": hi - 1 - lo} if k == 0 else {}
            for stage, t in blocks:
                tr.staged.append((tr.round + 1, stage, t, extra))
            tr.staged.append((tr.round + 1, draft_topk(k), topk, {}))

    def _hook_models(self, worker) -> None:
        target = worker.target_worker.model_runner.model
        body = target.model
        self.layers = [int(i) for i in getattr(body, "layers_to_capture", ()) or ()]
        body.register_forward_hook(lambda m, a, out: _on_target(self, out))
        draft = worker.draft_worker.draft_runner.model
        inner = draft.model
        inner.register_forward_hook(lambda m, a, kw, out: _on_draft_body(self, a, kw, out), with_kwargs=True)
        inner.fc.register_forward_hook(lambda m, a, out: self._keep("fc", out[0] if isinstance(out, tuple) else out))
        inner.embed_tokens.register_forward_hook(lambda m, a, out: self._keep("embeds", out))
        # SGLang's model runner calls the draft model's forward method itself (no module call, so no module hooks):
        # its logits are read by an instance-level wrapper of that method
        forward = draft.forward

        def draft_forward(*a, **kw):
            out = forward(*a, **kw)
            _on_draft_logits(self, worker, out)
            return out

        draft.forward = draft_forward
        self.hooked |= {id(body), id(inner), id(draft)}

    def _keep(self, name: str, t: torch.Tensor) -> None:
        if self.draft is not None and name not in self.forward:
            self.forward[name] = t.detach()


_CAPTURE: Capture | None = None


def _capture() -> Capture | None:
    cap = _CAPTURE
    return None if cap is None or cap.idle else cap


_begin_step = guarded(Capture.begin_step)
_on_target = guarded(Capture.on_target)
_on_prefill_handoff = guarded(Capture.on_prefill_handoff)
_on_verified = guarded(Capture.on_verified)
_on_decode_handoff = guarded(Capture.on_decode_handoff)
_begin_draft_steps = guarded(Capture.begin_draft_steps)
_on_draft_body = guarded(Capture.on_draft_body)
_on_draft_logits = guarded(Capture.on_draft_logits)
_raised = guarded(Capture.raised)
_close = guarded(Capture.close)


# The wrappers: each reads what SGLang computed around the method it wraps and never changes its result.
def _forward_batch_generation_hook(orig):
    def run(self, batch, *a, **kw):
        if (cap := _capture()) is not None:
            _begin_step(cap, self, batch)
        try:
            return orig(self, batch, *a, **kw)
        except Exception as e:
            if (cap := _capture()) is not None:
                _raised(cap, e)
            raise
        finally:
            if (cap := _capture()) is not None:
                cap.draft = None

    return run


def _extend_for_prefill_hook(orig):
    def run(self, batch, target_hidden_states, next_token_ids, *a, **kw):
        if (cap := _capture()) is not None and cap.layout:
            _on_prefill_handoff(cap, target_hidden_states, next_token_ids)
        try:
            return orig(self, batch, target_hidden_states, next_token_ids, *a, **kw)
        finally:
            if (cap := _capture()) is not None:
                cap.draft = None

    return run


def _verify_hook(orig):
    def run(self, batch, *a, **kw):
        verify_input = batch.spec_info
        out = orig(self, batch, *a, **kw)
        if (cap := _capture()) is not None and cap.layout:
            _on_verified(cap, self, verify_input, out)
        return out

    return run


def _extend_for_decode_hook(orig):
    def run(self, batch, batch_result, *a, **kw):
        if (cap := _capture()) is not None and cap.handoff:
            _on_decode_handoff(cap, batch_result)
        try:
            return orig(self, batch, batch_result, *a, **kw)
        finally:
            if (cap := _capture()) is not None:
                cap.draft = None

    return run


def _draft_forward_hook(orig):
    def run(self, forward_batch, *a, **kw):
        if (cap := _capture()) is not None and cap.layout:
            _begin_draft_steps(cap)
        try:
            return orig(self, forward_batch, *a, **kw)
        finally:
            if (cap := _capture()) is not None:
                cap.draft = None

    return run


def _update_finish_state_hook(orig):
    def run(self, *a, **kw):
        out = orig(self, *a, **kw)
        if (cap := _capture()) is not None and str(self.rid) in cap.traces and self.finished():
            _close(cap, str(self.rid), _ended(self.finished_reason))
        return out

    return run


def install(worker_module: ModuleType) -> None:
    """Wrap SGLang's EAGLE worker and Req methods (class level, once per process)."""
    global _CAPTURE
    if _CAPTURE is not None:
        return
    import sglang
    from sglang.srt.managers.schedule_batch import Req

    refused = unsupported_line(str(sglang.__version__), "sglang")
    if refused is not None:  # plugin.py refuses first; this guards any other way in
        raise RuntimeError(refused)
    staging = Path(os.environ[ENV_DIR])
    limit = max(1, int(os.environ.get(ENV_REQUESTS, "1")))
    _CAPTURE = Capture(staging, limit, os.environ.get(ENV_MODE, "full"), str(sglang.__version__))
    atexit.register(_CAPTURE.close_all, "exit")
    Worker, DraftWorker = worker_module.EAGLEWorkerV2, worker_module.EagleDraftWorker
    _wrap(Worker, "forward_batch_generation", _forward_batch_generation_hook)
    _wrap(Worker, "verify", _verify_hook)
    _wrap(DraftWorker, "_draft_extend_for_prefill", _extend_for_prefill_hook)
    _wrap(DraftWorker, "_draft_extend_for_decode", _extend_for_decode_hook)
    _wrap(DraftWorker, "draft_forward", _draft_forward_hook)
    _wrap(Req, "update_finish_state", _update_finish_state_hook)
