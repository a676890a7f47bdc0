"""Hooks that record canonical traces (docs/trace-format.md) inside vLLM 0.32 without changing what it computes.

Installed by plugin.py in the process that imports vLLM's model runner (the worker; the main process under
VLLM_ENABLE_V1_MULTIPROCESSING=0). They wrap, at run time, the methods where vLLM holds each canonical stage:

    GPUModelRunner.execute_model        an engine step begins: its scheduler output (finished requests, layout)
    GPUModelRunner._model_forward       the target's forward; with EAGLE-3 it returns (hidden, [aux per layer]):
                                        the states the model captured (EagleModelMixin._maybe_add_hidden_state, ids
                                        used as-is = HF output_hidden_states indices) → target.tap.<i>
    GPUModelRunner._sample              the rejection sampler's output, one row per request, -1 past the accepted
                                        tokens → verify.accepted / verify.bonus (round 0: the first token)
    SpecDecodeBaseProposer.propose      the hand-off: target_hidden_states as the runner concatenated the aux states
                                        (propose_draft_token_ids' torch.cat), token_indices_to_sample (each request's
                                        last accepted position) → target.aux (the request's whole block, when vLLM
                                        hands on every row the target processed), next.hidden_in; inside it:
        combine_hidden_states           fc (and any pre-fc norm) → draft.fc.out
        forward                         step 0 over the handed positions, then one row per request per step; its
                                        input_ids, positions, hidden_states in, (normed, pre-norm) out, the pre-norm
                                        output the next step's input → draft.step<k>.tokens / positions / embed_in /
                                        hidden_in / hidden_out
    SpecDecodeBaseProposer._sample_draft_tokens   the draft token of each step (target ids, after d2t); its
                                        log-prob from the draft's own compute_logits → draft.step<k>.topk
    GPUModelRunner.sample_tokens        the step's end: requests that ended in it are closed (after the drafter
                                        received their last round)

vLLM's semantics mapped onto the canonical stages (a chain of K = num_speculative_tokens):
  * vLLM hands the drafter every verified position of the round (prepare_inputs_padded: rejected ones too, as
    padding the causal mask keeps out of the sampled row) and samples at the last accepted one. The canonical
    next.hidden_in, draft.fc.out and draft.step0.* are the rows of the root and the accepted positions only:
    the handed rows up to and including token_indices_to_sample (the event's extra `vllm_rows` says how many vLLM
    handed in). With disable_padded_drafter_batch vLLM hands exactly those rows (prepare_inputs).
  * Step k >= 1 processes one row per request (the sampled row's pre-norm output and the token drafted by step
    k-1), as eaglescope's chain does.
  * verify.tokens are the tokens of the target's forward for the request (the root = its last token, then the
    scheduled drafts); parents a chain. A round's draft stages are kept until that round is verified, and
    dropped when the request ends first: the drafts vLLM makes after the last verify never reach a target.
  * Round 0 is the prefill; a prefill vLLM splits into chunks is recorded once it completes, the chunks joined.
  * A request whose prompt hit vLLM's prefix cache is not traced (the cached positions never ran, so round 0
    has no features for them): serve with prefix caching off to trace every request.

A request's trace is closed (written, atomically) at the end of the step in which the hooks see it finish — its
stop token, its max_tokens or the context, checked as vLLM's scheduler does — or when vLLM reports it finished or
aborted, or at exit: never left to atexit alone, since a worker may be torn down without running it. When vLLM's
engine step raises (execute_model or sample_tokens), every traced request in flight is closed as it stands, with
`complete: false` and the error in meta (`incomplete`), one note each, and a line in raised.txt for `eaglescope
capture`; the exception goes on to vLLM unchanged. Errors inside the hooks are reported as one line and drop that
request's trace; they never reach vLLM.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from eaglescope.capture import (
    ENV_DIR,
    ENV_LAYERS,
    ENV_MODE,
    ENV_REQUESTS,
    note,
    unsupported_line,
)
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
from eaglescope.capture.vllm_layers import LayerStates, record_prefill
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

PLACEHOLDER = -1  # vLLM's rejection sampler writes this past each request's accepted tokens


@dataclass
class _Prefill:
    """Round 0 and round 1's step 0, gathered over the chunks of a prefill."""

    taps: list[list[torch.Tensor]] = field(default_factory=list)  # per chunk, per captured layer
    tokens: int = 0
    nxt: list[torch.Tensor] = field(default_factory=list)  # per chunk: the rows vLLM handed the drafter
    step0: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    layers: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per chunk: target.layer.* (--layers)


class RequestTrace(TracedRequest):
    """One vLLM request's trace."""

    def __init__(self, cap: Capture, runner, req_id: str, slot: int) -> None:
        super().__init__(cap.staging, slot, req_id, cap.mode, cap.producer)
        self.cap = cap
        state = runner.requests[req_id]
        self.prompt = [int(t) for t in state.prompt_token_ids]
        self.sp = state.sampling_params
        self.max_model_len = int(runner.max_model_len)
        self.layers = [int(i) for i in cap.aux_layers(runner)]
        self.prefill: _Prefill | None = _Prefill()  # until round 1's step 0 is staged
        self.current: dict | None = None  # this step's target forward, until the sampler decides it
        self.aux_due: int | None = None  # the round verified in this step, whose target.aux the drafter receives
        self.round_taps: list[torch.Tensor] = []  # that round's taps, for a target.aux the hand-off cannot give
        self.rec.set_meta(**cap.meta(runner, self))

    @property
    def position(self) -> int:
        """Sequence position of the next target row (the root of the next round)."""
        return len(self.prompt) + len(self.emitted) - 1

    # -- commit ------------------------------------------------------------------------------------------
    def record_taps(self, rnd: int, taps: list[torch.Tensor]) -> None:
        """The states the target model captured (its list of aux hidden states). target.aux is recorded where the
        drafter receives their concatenation (Capture.begin_propose), after the runner's own torch.cat."""
        for layer, t in zip(self.layers, taps, strict=True):
            self.record(rnd, target_tap(layer), t)

    def settle_aux(self) -> None:
        """The verified round's target.aux when the drafter was not handed the whole block (vLLM without its padded
        drafter batch hands on the accepted rows only; near the context's end the drafter does not run): the taps
        side by side, low to high, as vLLM's runner concatenates them, marked as rebuilt by the capture."""
        if self.aux_due is not None and self.round_taps:
            self.record(self.aux_due, TARGET_AUX, torch.cat(self.round_taps, dim=-1), segments=len(self.round_taps),
                        rebuilt_from_taps=True)  # fmt: skip
        self.aux_due, self.round_taps = None, []

    def finished(self, new_tokens: list[int]) -> str | None:
        """Whether these newly emitted tokens end the request, checked as vLLM's scheduler does (check_stop),
        token by token; the reason, or None."""
        n_out = len(self.emitted) - len(new_tokens)
        max_tokens = self.sp.max_tokens if self.sp.max_tokens is not None else self.max_model_len
        for tok in new_tokens:
            n_out += 1
            if self.sp.eos_token_id is not None and tok == self.sp.eos_token_id:
                return "stop"
            if tok in (self.sp.stop_token_ids or ()):
                return "stop"
            if len(self.prompt) + n_out >= self.max_model_len or n_out >= max_tokens:
                return "length"
        return None


class Capture(EngineCapture):
    """Process-wide capture state: which requests are traced, and the current engine step's layout."""

    def __init__(self, staging: Path, limit: int, mode: str, version: str, layers: bool = False) -> None:
        super().__init__(staging, limit, mode, "vllm", version)
        self.layer_states = LayerStates() if layers else None  # capture --layers: every state of each prefill
        self.step: dict | None = None  # {"runner", "sched", "layout": {req: (batch index, first row, rows, kind)}}
        self.propose: dict | None = None
        self.rank_ok: bool | None = None  # decided at the first step, once vLLM's parallel state exists

    def abandon_step(self) -> None:
        self.propose = None

    def end_step(self) -> None:
        """The step's sampler and drafter have run: the requests that ended in it are closed."""
        for req_id, tr in list(self.traces.items()):
            tr.settle_aux()
            if tr.closing is not None:
                self.close(req_id, tr.closing)
        self.step = self.propose = None

    def raised(self, where: str, e: BaseException) -> None:
        """vLLM's engine step raised: every traced request in flight is closed as it stands, marked incomplete,
        and said in one line each (notes, and raised.txt for `eaglescope capture`'s exit status)."""
        what = f"vLLM's {where} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        for req_id in list(self.traces):
            tr = self.traces[req_id]
            line = f"request {req_id} (slot {tr.slot}): {what}; its trace stops after round {tr.round}"
            report_raised(self.staging, line)
            tr.settle_aux()
            self.close(req_id, "error", incomplete=what)
        self.step = self.propose = None

    def claim(self) -> int | None:
        """The first free request slot (claimed across every engine process by an atomic mkdir), or None."""
        if self.exhausted:
            return None
        slot = claim_slot(self.staging, self.limit)
        self.exhausted = slot is None
        return slot

    # -- what every trace's meta holds -------------------------------------------------------------------
    @staticmethod
    def aux_layers(runner) -> list[int]:
        holder = getattr(runner.model, "model", runner.model)
        return list(getattr(holder, "aux_hidden_state_layers", ()) or ())

    def meta(self, runner, tr: RequestTrace) -> dict:
        spec = runner.speculative_config
        K = int(spec.num_speculative_tokens)
        sp = tr.sp
        settings = {
            "chain": K,
            "tree": None,
            "temperature": float(sp.temperature),
            "top_k": None if sp.top_k in (None, 0, -1) else int(sp.top_k),
            "top_p": None if sp.top_p in (None, 1.0) else float(sp.top_p),
            "seed": sp.seed,
            "max_new_tokens": sp.max_tokens,
            "proposer": str(spec.method),
        }
        draft_cfg = spec.draft_model_config.hf_config if spec.draft_model_config is not None else None
        L = len(getattr(getattr(runner.model, "model", runner.model), "layers", ()) or ())
        return {
            "prompt_ids": tr.prompt,
            "taps": {"layers": tr.layers, "index_convention": "hf_output_hidden_states", "num_layers": L},
            "tap_convention": "hf_output_hidden_states",
            "settings": settings,
            "decoding": settings,  # docs/trace-format.md's name for the same settings
            "target": target_fingerprint(str(runner.model_config.model)),
            "draft": {
                "path": str(spec.model),
                "draft_vocab_size": getattr(draft_cfg, "draft_vocab_size", None),
            },
            "dtype": str(runner.model_config.dtype).removeprefix("torch."),
            "vllm": {
                "version": self.version,
                "request_id": tr.req_id,
                "model": str(runner.model_config.model),
                "method": str(spec.method),
                "num_speculative_tokens": K,
                "padded_drafter_batch": not bool(spec.disable_padded_drafter_batch),
                "capture_slot": tr.slot,
                "pid": os.getpid(),  # the process that ran the model (a worker, unless multiprocessing is off)
            },
        }

    def _first_rank(self) -> bool:
        """Whether this worker records: the first tensor-parallel rank (every rank holds the same tensors);
        pipeline parallelism splits the layers, so nothing is recorded there (said once)."""
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp_rank, pp_size = get_tp_group().rank_in_group, get_pp_group().world_size
        except Exception:  # noqa: BLE001 - no distributed state (a single process): this is the only rank
            return True
        if pp_size > 1:
            self.note_once("pp", "pipeline-parallel serving is not supported by eaglescope capture: nothing traced")
            return False
        return tp_rank == 0

    # -- the engine step --------------------------------------------------------------------------------
    def begin_step(self, runner, sched) -> None:
        if self.rank_ok is None:
            self.rank_ok = self._first_rank()
            if not self.rank_ok:
                self.exhausted = True  # another rank of this model records: nothing to do here (idle from now)
                return
        self.end_step()  # a step whose sample_tokens did not run to its end leaves no request unclosed
        for req_id in getattr(sched, "finished_req_ids", ()) or ():
            self.close(req_id, "finished (reported by the scheduler)")
        self.step = {"runner": runner, "sched": sched, "layout": {}, "target": False}
        self.propose = None
        self._begin_layers(runner, sched)

    def _begin_layers(self, runner, sched) -> None:
        """capture --layers: record this step's per-layer states if it may run a traced request's prefill (a new
        request, which may be claimed, or the next chunk of a traced one)."""
        states = self.layer_states
        if states is None:
            return
        why = states.install(runner.model)
        if why is not None:
            self.note_once("layers", f"--layers: {why}; no per-layer states are recorded")
            self.layer_states = None
            return
        new = not self.exhausted and bool(getattr(sched, "scheduled_new_reqs", None))
        states.begin(new or any(tr.round < 0 for tr in self.traces.values()))

    def on_target(self, runner, input_ids, positions, out) -> None:
        step = self.step
        if step is None or step["runner"] is not runner or step["target"]:
            return
        step["target"] = True
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple))):
            self.note_once("no-aux", "vLLM runs this model without EAGLE-3 auxiliary hidden states: nothing to trace")
            self.exhausted = True
            return
        aux = list(out[1])
        sched = step["sched"]
        req_ids = list(runner.input_batch.req_ids)
        row = 0
        for b, req_id in enumerate(req_ids):
            n = int(sched.num_scheduled_tokens.get(req_id, 0))
            first, row = row, row + n
            if n == 0:
                continue
            tr = self.traces.get(req_id)
            start = int(positions[first]) if positions is not None and positions.dim() == 1 else None
            if tr is None:
                if req_id in self.seen:
                    continue
                self.seen.add(req_id)
                if self.exhausted:
                    continue
                if start is None:
                    self.note_once("mrope", "the target's positions are not one per token (M-RoPE): nothing traced")
                    continue
                if start != 0:
                    self.note_once(
                        f"cache-{req_id}",
                        f"request {req_id} is not traced: its prompt started at position {start} (vLLM's prefix "
                        "cache had the rest); serve with prefix caching off to trace every request",
                    )
                    continue
                slot = self.claim()
                if slot is None:
                    continue
                tr = RequestTrace(self, runner, req_id, slot)
                self.traces[req_id] = tr
            taps = [_rows(a, first, first + n) for a in aux]
            if tr.round < 0:
                if start != tr.prefill.tokens:
                    self.drop(req_id, f"its prefill resumed at position {start}, not {tr.prefill.tokens} (preempted?)")
                    continue
                tr.prefill.taps.append(taps)
                if self.layer_states is not None:
                    tr.prefill.layers.append(self.layer_states.rows(first, first + n))
                tr.prefill.tokens += n
                kind = "prefill" if tr.prefill.tokens == len(tr.prompt) else "chunk"
                tr.current = None
            else:
                if start is not None and start != tr.position:
                    self.drop(req_id, f"its round began at position {start}, not {tr.position} (preempted?)")
                    continue
                kind = "decode"
                tr.current = {"tokens": _rows(input_ids, first, first + n).long(), "taps": taps}
            step["layout"][req_id] = (b, first, n, kind)
        if self.layer_states is not None:
            self.layer_states.begin(False)  # only this forward: not a dummy run before the next step

    def on_sampled(self, runner, sampled: torch.Tensor) -> None:
        step = self.step
        if step is None or step["runner"] is not runner or not step["layout"]:
            return
        rows = sampled.detach().to("cpu")
        for req_id, (b, _, n, kind) in list(step["layout"].items()):
            tr = self.traces.get(req_id)
            if tr is None or kind == "chunk":  # a chunk's sampled token is discarded by vLLM too
                continue
            valid = [int(t) for t in rows[b].tolist() if int(t) != PLACEHOLDER]
            if not valid:
                self.drop(req_id, "the sampler returned no token for it")
                continue
            if kind == "prefill":
                pre = tr.prefill
                taps = [torch.cat([c[j] for c in pre.taps]) for j in range(len(tr.layers))]
                tr.record_taps(0, taps)
                if pre.layers and (why := record_prefill(tr.rec, pre.layers)) is not None:
                    note(f"request {req_id}: {why}")
                tr.record(0, VERIFY_BONUS, torch.tensor(valid[:1], dtype=torch.long))
                tr.aux_due, tr.round_taps = 0, taps
                tr.round, tr.emitted = 0, valid[:1]  # tr.prefill stays: the drafter's step 0 of it is next
                new = valid[:1]
            else:
                cur, tr.current = tr.current, None
                tokens = cur["tokens"]
                a = len(valid) - 1
                if a > n - 1 or tokens[1 : a + 1].tolist() != valid[:a]:
                    self.drop(req_id, f"its accepted tokens {valid[:a]} are not its drafts {tokens[1:].tolist()}")
                    continue
                if tr.emitted and int(tokens[0]) != tr.emitted[-1]:
                    self.drop(req_id, f"its round's root {int(tokens[0])} is not its last token {tr.emitted[-1]}")
                    continue
                rnd = tr.round + 1
                tr.commit_staged()
                tr.record(rnd, VERIFY_TOKENS, tokens)
                tr.record(rnd, VERIFY_PARENTS, torch.arange(-1, n - 1, dtype=torch.long))
                tr.record_taps(rnd, cur["taps"])
                tr.record(rnd, VERIFY_ACCEPTED, torch.arange(1, a + 1, dtype=torch.long))
                tr.record(rnd, VERIFY_BONUS, torch.tensor(valid[-1:], dtype=torch.long))
                tr.round, tr.aux_due, tr.round_taps = rnd, rnd, cur["taps"]
                tr.emitted += valid
                new = valid
            tr.closing = tr.finished(new)  # closed at the step's end: the drafter still receives this round

    # -- the drafter ---------------------------------------------------------------------------------------
    def begin_propose(self, drafter, kw: dict) -> bool:
        step = self.step
        if step is None or not step["layout"]:
            return False
        cad = kw["common_attn_metadata"]
        qsl = [int(x) for x in cad.query_start_loc_cpu.tolist()]
        tis = kw.get("token_indices_to_sample")
        last = [q - 1 for q in qsl[1:]] if tis is None else [int(x) for x in tis.detach().to("cpu").tolist()]
        hidden = kw["target_hidden_states"]  # [rows handed in, nH]: the runner's concatenation of the aux states
        reqs = {}
        for req_id, (b, _, n, kind) in step["layout"].items():
            tr = self.traces.get(req_id)
            if tr is None or b + 1 >= len(qsl):
                continue
            lo, hi, handed = qsl[b], last[b] + 1, qsl[b + 1] - qsl[b]
            reqs[req_id] = {"b": b, "lo": lo, "hi": hi, "kind": kind, "vllm_rows": handed}
            seg = {"segments": len(tr.layers), "vllm_rows": handed}
            if kind == "decode":
                if tr.aux_due == tr.round and handed == n:
                    # the padded drafter batch hands on every verified row: that block is the round's target.aux as
                    # the drafter receives it (prepare_inputs without padding hands the accepted rows only: then
                    # settle_aux rebuilds it from the taps at the step's end)
                    tr.record(tr.round, TARGET_AUX, _rows(hidden, lo, lo + handed), **seg)
                    tr.aux_due, tr.round_taps = None, []
                tr.staged.append((tr.round, NEXT_HIDDEN_IN, _rows(hidden, lo, hi), seg))
            else:
                tr.prefill.nxt.append(_rows(hidden, lo, hi))
                if kind == "prefill" and tr.aux_due == 0:  # the prompt's last chunk: round 0 is verified
                    tr.record(0, TARGET_AUX, torch.cat(tr.prefill.nxt), segments=len(tr.layers))
                    tr.aux_due, tr.round_taps = None, []
        if not reqs:
            return False
        self.propose = {"drafter": drafter, "reqs": reqs, "step": 0}
        _hook_draft_model(drafter.model)
        return True

    def on_fc(self, out: torch.Tensor) -> None:
        p = self.propose
        if p is None:
            return
        for req_id, r in p["reqs"].items():
            self._step_rows(req_id, r, DRAFT_FC_OUT, _rows(out, r["lo"], r["hi"]))

    def _step_rows(self, req_id: str, r: dict, stage: str, t: torch.Tensor) -> None:
        """A step-0 row block of one request: staged for its next round, or gathered while its prefill runs."""
        tr = self.traces.get(req_id)
        if tr is None:
            return
        if r["kind"] == "decode":
            # step 0 reads the handed rows up to the sampled one (rows after it are vLLM's padding)
            rows = {"vllm_rows": r["vllm_rows"], "sampled_row": r["hi"] - 1 - r["lo"]}
            tr.staged.append((tr.round + 1, stage, t, rows))
            return
        pre = tr.prefill
        pre.step0.setdefault(stage, []).append(t)
        if r["kind"] == "prefill" and stage == draft_hidden_out(0):
            # the prefill's last chunk: round 0's features handed on and round 1's step 0, chunks joined
            total = sum(x.shape[0] for x in pre.nxt)
            tr.staged.append((0, NEXT_HIDDEN_IN, torch.cat(pre.nxt), {"segments": len(tr.layers), "vllm_rows": total}))
            for s in (DRAFT_FC_OUT, draft_tokens(0), draft_positions(0), draft_embed_in(0), draft_hidden_in(0),
                      draft_hidden_out(0)):  # fmt: skip
                if s in pre.step0:
                    tr.staged.append((1, s, torch.cat(pre.step0[s]), {"vllm_rows": total, "sampled_row": total - 1}))
            tr.prefill = None

    def on_draft_forward(self, model, kw: dict, out) -> None:
        p = self.propose
        if p is None:
            return
        k = p["step"]
        p["step"] = k + 1
        normed, prenorm = out if isinstance(out, tuple) else (out, out)
        input_ids, hidden_in, embeds = kw.get("input_ids"), kw.get("hidden_states"), kw.get("inputs_embeds")
        positions = kw.get("positions")
        if positions is not None and positions.dim() != 1:
            positions = None  # M-RoPE: not one position per row
        for req_id, r in p["reqs"].items():
            lo, hi = (r["lo"], r["hi"]) if k == 0 else (r["b"], r["b"] + 1)
            if k > 0 and r["kind"] == "chunk":
                continue  # a chunk's later steps draft from a position that is not the end: vLLM discards them
            if embeds is not None:
                e = _rows(embeds, lo, hi)
            else:
                with torch.inference_mode():  # the draft's own embedding of the same ids, as its forward does
                    e = model.embed_input_ids(input_ids[lo:hi]).detach().to("cpu", copy=True)
            blocks = [(draft_tokens(k), _rows(input_ids, lo, hi).long())] if input_ids is not None else []
            if positions is not None:
                blocks.append((draft_positions(k), _rows(positions, lo, hi).long()))
            blocks += [(draft_embed_in(k), e), (draft_hidden_in(k), _rows(hidden_in, lo, hi)),
                       (draft_hidden_out(k), _rows(prenorm, lo, hi))]  # fmt: skip
            for stage, t in blocks:
                if k == 0:
                    self._step_rows(req_id, r, stage, t)
                else:
                    tr = self.traces.get(req_id)
                    if tr is not None:
                        tr.staged.append((tr.round + 1, stage, t, {}))

    def on_draft_sample(self, drafter, hidden: torch.Tensor, ids: torch.Tensor) -> None:
        p = self.propose
        if p is None or p["step"] == 0:
            return
        k = p["step"] - 1
        for req_id, r in p["reqs"].items():
            if r["kind"] == "chunk":
                continue
            tr = self.traces.get(req_id)
            if tr is None:
                continue
            b = r["b"]
            with torch.inference_mode():
                logits = drafter.model.compute_logits(hidden[b : b + 1]).float()
                lp = torch.log_softmax(logits, dim=-1)
            tok = ids[b : b + 1].detach().to(lp.device).long().view(1, 1)
            value = {TOPK_IDS: tok.cpu(), TOPK_LOGPROBS: lp.gather(-1, tok).cpu()}
            tr.staged.append((tr.round + 1, draft_topk(k), value, {}))

    def end_propose(self) -> None:
        self.propose = None


_CAPTURE: Capture | None = None


def _capture() -> Capture | None:
    """The process's capture, or None once there is nothing left to do (the hooks then cost one check)."""
    cap = _CAPTURE
    return None if cap is None or cap.idle else cap


_begin_step = guarded(Capture.begin_step)
_on_target = guarded(Capture.on_target)
_on_sampled = guarded(Capture.on_sampled)
_begin_propose = guarded(Capture.begin_propose)
_on_fc = guarded(Capture.on_fc)
_on_draft_forward = guarded(Capture.on_draft_forward)
_on_draft_sample = guarded(Capture.on_draft_sample)
_end_step = guarded(Capture.end_step)
_raised = guarded(Capture.raised)


def _hook_draft_model(model) -> None:
    """Instance-level wrappers on the draft model (once): fc and the forward of each step."""
    if getattr(model, "_eaglescope_hooked", False):
        return
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "combine_hidden_states"):
        raise RuntimeError(
            f"the drafter's model is a {type(model).__name__}, not an EAGLE-3 module (run vLLM with enforce_eager)"
        )
    fc, fwd = model.combine_hidden_states, model.forward

    def combine_hidden_states(hidden_states, *a, **kw):
        out = fc(hidden_states, *a, **kw)
        if (cap := _capture()) is not None and cap.propose is not None:
            _on_fc(cap, out)
        return out

    def forward(*a, **kw):
        out = fwd(*a, **kw)
        if (cap := _capture()) is not None and cap.propose is not None:
            names = ("input_ids", "positions", "hidden_states", "inputs_embeds")
            _on_draft_forward(cap, model, {**dict(zip(names, a)), **kw}, out)
        return out

    model.combine_hidden_states = combine_hidden_states
    model.forward = forward
    model._eaglescope_hooked = True


# The wrappers: each reads what vLLM computed around the method it wraps and never changes its result.


def _execute_model_hook(orig):
    def run(self, scheduler_output, *a, **kw):
        if (cap := _capture()) is not None:
            _begin_step(cap, self, scheduler_output)
        try:
            return orig(self, scheduler_output, *a, **kw)
        except Exception as e:
            if (cap := _capture()) is not None:
                _raised(cap, "engine step (the target's forward, execute_model)", e)
            raise

    return run


def _sample_tokens_hook(orig):
    def run(self, *a, **kw):
        try:
            out = orig(self, *a, **kw)
        except Exception as e:
            if (cap := _capture()) is not None:
                _raised(cap, "engine step (its sampler or drafter, sample_tokens)", e)
            raise
        if (cap := _capture()) is not None and cap.step is not None and cap.step["runner"] is self:
            _end_step(cap)
        return out

    return run


def _model_forward_hook(orig):
    def run(self, *a, **kw):
        out = orig(self, *a, **kw)
        if (cap := _capture()) is not None and cap.step is not None:
            args = dict(zip(("input_ids", "positions"), a)) | kw
            _on_target(cap, self, args.get("input_ids"), args.get("positions"), out)
        return out

    return run


def _sample_hook(orig):
    def run(self, *a, **kw):
        out = orig(self, *a, **kw)
        if (cap := _capture()) is not None and cap.step is not None:
            _on_sampled(cap, self, out.sampled_token_ids)
        return out

    return run


def _propose_hook(orig):
    names = ("num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
             "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata")  # fmt: skip

    def run(self, *a, **kw):
        cap = _capture()
        active = cap is not None and bool(_begin_propose(cap, self, dict(zip(names, a)) | kw))
        try:
            return orig(self, *a, **kw)
        finally:
            if active:
                cap.end_propose()

    return run


def _sample_draft_hook(orig):
    def run(self, hidden_states, *a, **kw):
        out = orig(self, hidden_states, *a, **kw)
        if (cap := _capture()) is not None and cap.propose is not None:
            _on_draft_sample(cap, self, hidden_states, out[0])
        return out

    return run


def install(runner_module: ModuleType) -> None:
    """Wrap vLLM's model runner and drafter methods (class level, once per process)."""
    global _CAPTURE
    if _CAPTURE is not None:
        return
    import vllm
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    refused = unsupported_line(str(vllm.__version__))
    if refused is not None:  # plugin.register refuses first; this guards any other way in
        raise RuntimeError(refused)
    staging = Path(os.environ[ENV_DIR])
    limit = max(1, int(os.environ.get(ENV_REQUESTS, "1")))
    mode = os.environ.get(ENV_MODE, "full")
    _CAPTURE = Capture(staging, limit, mode, str(vllm.__version__), layers=os.environ.get(ENV_LAYERS) == "1")
    atexit.register(_CAPTURE.close_all, "exit")
    Runner = runner_module.GPUModelRunner

    _wrap(Runner, "execute_model", _execute_model_hook)
    _wrap(Runner, "sample_tokens", _sample_tokens_hook)
    _wrap(Runner, "_model_forward", _model_forward_hook)
    _wrap(Runner, "_sample", _sample_hook)
    _wrap(SpecDecodeBaseProposer, "propose", _propose_hook)
    _wrap(SpecDecodeBaseProposer, "_sample_draft_tokens", _sample_draft_hook)
