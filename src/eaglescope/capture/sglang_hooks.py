"""Hooks that record canonical traces (docs/trace-format.md) inside SGLang 0.5.23 without changing what it computes.

Installed by plugin.py in the process that imports `srt/speculative/eagle_worker_v2.py`: SGLang's scheduler process,
which it starts with multiprocessing's spawn and in which it loads its general plugins (`run_scheduler_process` →
`load_plugins`). They wrap, at run time, the methods where SGLang holds each canonical stage, and record the values
SGLang itself computed there, never a value of their own idea of what SGLang should have done:

    EAGLEWorkerV2.forward_batch_generation      a scheduler step begins: its batch (requests in row order, extend
                                                lengths); the first step also hooks the models below
    the target's model body (a forward hook)    the states it captured for the draft (`layers_to_capture`, HF
                                                output_hidden_states indices once SGLang applied its id rule: the
                                                input of decoder layer i) → target.tap.<i>
    EagleDraftWorker._draft_extend_for_prefill  the hand-off after the prefill: target_hidden_states (the logits
                                                processor's concatenation of the captured states) → target.aux,
                                                next.hidden_in of round 0, next_token_ids → verify.bonus of round 0;
                                                the draft's extend over the prompt inside it is round 1's step 0
    EAGLEWorkerV2.verify                        the tree sent to the target (EagleVerifyInput.draft_token, its
                                                retrieve_next_token / retrieve_next_sibling links) and eagle_sample's
                                                decision (accept_index, accept_lens, predict) → verify.tokens / parents
                                                / accepted / bonus; the target's hidden states of every verified node
                                                → target.aux (read before a tree's accepted path is moved to the front:
                                                eagle_worker_common._finalize_accept_tree_path, wrapped too)
    EagleDraftWorker._draft_extend_for_decode   the hand-off after verify: the draft extends over all verified rows;
                                                the row `select_index` picked is read from what the worker kept of the
                                                draft's output (its hidden state and logits, gathered at select_index
                                                in place), located among the extend's rows → next.hidden_in and step 0
    EagleDraftWorker.draft_forward              steps 1..K-1 (topk rows per request)
    eagle_worker_v2.select_top_k_tokens         each step's top-k as SGLang passes it on: its ids after the worker's
                                                hot-token map (SGLang's d2t) → draft.step<k>.topk ids
    the draft model (forward hooks: its body, its fc, its embed_tokens, its first decoder layer's input; its
    logits)                                     → draft.fc.out, draft.step<k>.tokens / positions / embed_in /
                                                hidden_in / hidden_out, and the log-probabilities of draft.step<k>.topk
    Req.update_finish_state                     the scheduler decided the request ended: its trace is written

SGLang's semantics mapped onto the canonical stages (K = speculative_num_steps, N = speculative_num_draft_tokens
verified nodes; a chain is speculative_eagle_topk 1 and N = K + 1):
  * SGLang hands the draft every verified row of the round (its rejected ones too, which the causal mask keeps out of
    the row it samples) and samples at `select_index`. That is where the seed incident's `accepted_indices` filter sat
    in SGLang's older worker (`eagle_worker.py` filtered `hidden_states[accepted_indices]` before its draft extend).
    The canonical next.hidden_in, draft.fc.out and draft.step0.* are the rows up to and including the one SGLang
    selected (the event's extra `sglang_rows` says how many SGLang handed in, `sampled_row` which one it selected): a
    worker that selects another row than the last accepted one shows here.
  * draft.step<k>.tokens are the ids the draft's forward received; hidden_in what its first decoder layer received
    (fc's output at step 0 when fc ran: a draft whose fc never ran shows its nH-wide input there); topk ids what
    SGLang's worker passed on as the step's proposal (target ids after its hot-token map), with their log-probabilities
    from the draft's own logits of that row, best first.
  * A tree's rows: step k >= 1 runs topk rows per request (SGLang's frontier, best first), verify.tokens are SGLang's
    N nodes in its node order, verify.parents read from its first-child / next-sibling links, verify.accepted its
    accept_index (root excluded). Row j of step k attends the prefix and the rows j of steps 1..k, not its
    ancestors (SGLang's draft KV is per top-k column): meta draft_tree_attention "column", which the replay follows.
  * A round's draft stages are kept until that round is verified, and dropped when the request ends first.
  * Requests whose prompt hit the radix cache, or that SGLang prefills in chunks, are not traced (said in a note):
    their features never ran as one block. Serve with disable_radix_cache to trace every request.
  * Overlap scheduling is refused with one note: nothing is traced.

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
    DRAFT_TREE_ATTENTION,
    NEXT_HIDDEN_IN,
    TARGET_AUX,
    TOPK_IDS,
    TOPK_LOGPROBS,
    TREE_COLUMN,
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


def _top_logprobs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, k]: the k largest log-probabilities of the draft's own logits per row, best first (the values SGLang's
    top-k of those logits ranks)."""
    with torch.inference_mode():
        lp = torch.log_softmax(logits.detach().float(), dim=-1)
        return lp.topk(min(k, lp.shape[-1]), dim=-1).values.cpu()


def tree_parents(first_child: list[int], next_sibling: list[int]) -> list[int] | None:
    """verify.parents of one request's N nodes from SGLang's links (retrieve_next_token: a node's first child,
    retrieve_next_sibling: its next sibling, -1 for none; local node indices, node 0 the root); None when a node other
    than the root is not reached from it."""
    n = len(first_child)
    parents = [-2] * n
    parents[0] = -1
    for node in range(n):
        child, seen = first_child[node], 0
        while 0 <= child < n and seen < n:
            parents[child] = node
            child, seen = next_sibling[child], seen + 1
    return None if -2 in parents else parents


class RequestTrace(TracedRequest):
    """One SGLang request's trace."""

    def __init__(self, cap: Capture, worker, req, slot: int) -> None:
        super().__init__(cap.staging, slot, str(req.rid), cap.mode, cap.producer)
        self.prompt = [int(t) for t in req.origin_input_ids]
        self.step0_logits: torch.Tensor | None = None  # [1, V]: the row step 0 sampled, until its top-k is read
        self.rec.set_meta(**cap.meta(worker, req, self))


class Capture(EngineCapture):
    """Process-wide capture state: which requests are traced, and what the current scheduler step is doing."""

    def __init__(self, staging: Path, limit: int, mode: str, version: str) -> None:
        super().__init__(staging, limit, mode, "sglang", version)
        self.hooked: set[int] = set()  # id() of the modules hooked
        self.layers: list[int] = []  # the target's layers_to_capture
        self.topk = 1  # speculative_eagle_topk
        self.taps: list[torch.Tensor] | None = None  # the last target forward's captured states, whole batch
        self.verified_aux: torch.Tensor | None = None  # the verify forward's hidden states in node order (a tree's)
        self.layout: dict[str, tuple[int, int, int]] = {}  # this step's traced requests: rid → (batch index, rows)
        self.handoff: dict[str, tuple[int, int]] = {}  # verified this step: rid → (b, first row of its block)
        self.draft: dict | None = None  # the draft forwards in progress: {"step", "kind", "reqs": {rid: (b, lo, hi)}}
        self.forward: dict = {}  # the draft forward in progress: its inputs and outputs
        self.step_logits: dict[int, torch.Tensor] = {}  # draft_forward's step k -> its logits, all rows

    def abandon_step(self) -> None:
        self.draft, self.forward, self.step_logits = None, {}, {}

    def raised(self, e: BaseException) -> None:
        what = f"SGLang's scheduler step raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        what = what.rstrip(": ")
        layer_in = self.forward.get("layer_in")
        if self.draft is not None and layer_in is not None:
            # the draft forward that raised: what its first decoder layer was handed (fc's input width when fc never
            # ran), as read at the layer's input
            what += (f" (in draft step {self.draft['step']}, whose decoder layer received features "
                     f"{int(layer_in.shape[-1])} wide)")  # fmt: skip
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
        K, topk, N = int(worker.speculative_num_steps), int(worker.topk), int(worker.speculative_num_draft_tokens)
        top_k = getattr(sp, "top_k", None)
        settings = {
            "chain": K if topk == 1 else None,
            "tree": None if topk == 1 else f"{K},{topk},{N}",  # DEPTH,TOPK,TOTAL as `generate --tree` takes it
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
            # SGLang's draft KV is laid out per top-k column: a tree step's row attends its column's earlier rows,
            # not its ancestors (cache_locs.py generate_draft_decode_kv_indices); a chain is the same either way
            DRAFT_TREE_ATTENTION: TREE_COLUMN,
            "sglang": {
                "version": self.version,
                "request_id": tr.req_id,
                "model": str(sargs.model_path),
                "speculative_algorithm": str(sargs.speculative_algorithm),
                "num_steps": K,
                "topk": topk,
                "num_draft_tokens": N,
                "capture_slot": tr.slot,
                "pid": os.getpid(),  # the scheduler process
            },
        }

    # -- the scheduler step ---------------------------------------------------------------------------------
    def begin_step(self, worker, batch) -> None:
        self.layout, self.handoff, self.taps, self.verified_aux = {}, {}, None, None
        self.draft, self.forward, self.step_logits = None, {}, {}
        if not self.hooked:
            if not worker.server_args.disable_overlap_schedule:
                self.note_once("shape", "SGLang serves with overlap scheduling: eaglescope capture traces SGLang "
                               "without overlap only (disable_overlap_schedule); nothing traced")  # fmt: skip
                self.exhausted = True
                return
            self.topk = int(worker.topk)
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
            reqs[rid] = (b, lo, hi)
        self.draft = {"step": 0, "kind": "prefill", "reqs": reqs} if reqs else None

    def on_tree_verified(self, logits_output) -> None:
        """A tree's verify forward, before SGLang moves each accepted path to the front of its block: its hidden
        states in node order (target.aux)."""
        if self.layout and logits_output.hidden_states is not None:
            self.verified_aux = logits_output.hidden_states

    def on_verified(self, worker, verify_input, result) -> None:
        N = int(worker.speculative_num_draft_tokens)
        tokens = verify_input.draft_token.detach().to("cpu").long()
        predict = result.next_token_ids.detach().to("cpu").long()  # a tree's accepted path is at its block's front
        accept_lens = result.accept_lens.detach().to("cpu").long()
        accept_index = result.accept_index.detach().to("cpu").long()  # [bs, K+1] node indices over the batch, -1 pad
        first_child = verify_input.retrieve_next_token.detach().to("cpu").long().view(-1, N)
        next_sibling = verify_input.retrieve_next_sibling.detach().to("cpu").long().view(-1, N)
        hidden = self.verified_aux if self.verified_aux is not None else result.logits_output.hidden_states
        for rid, (b, lo, hi) in list(self.layout.items()):
            tr = self.traces.get(rid)
            if tr is None:
                continue
            nodes, a = tokens[lo:hi], int(accept_lens[b]) - 1  # a drafts accepted, then the bonus
            path = [int(i) - lo for i in accept_index[b, : a + 1].tolist()]
            parents = tree_parents(first_child[b].tolist(), next_sibling[b].tolist())
            if int(nodes[0]) != tr.emitted[-1]:
                self.drop(rid, f"its round's root {int(nodes[0])} is not its last token {tr.emitted[-1]}")
                continue
            if parents is None or path[0] != 0 or any(not 0 < i < N for i in path[1:]):
                self.drop(rid, f"SGLang's tree links or accepted nodes {path} are not a tree path")
                continue
            if nodes[path[1:]].tolist() != predict[lo : lo + a].tolist():
                self.drop(rid, f"its accepted tokens {predict[lo : lo + a].tolist()} are not its drafts")
                continue
            rnd = tr.round + 1
            tr.commit_staged()
            tr.record(rnd, VERIFY_TOKENS, nodes.clone())
            tr.record(rnd, VERIFY_PARENTS, torch.tensor(parents, dtype=torch.long))
            for layer, t in zip(self.layers, self.taps or [], strict=True):
                tr.record(rnd, target_tap(layer), t[lo:hi])
            tr.record(rnd, TARGET_AUX, _rows(hidden, lo, hi), segments=len(self.layers), sglang_rows=N)
            tr.record(rnd, VERIFY_ACCEPTED, torch.tensor(path[1:], dtype=torch.long))
            tr.record(rnd, VERIFY_BONUS, predict[lo + a : lo + a + 1].clone())
            tr.round = rnd
            tr.emitted += predict[lo : lo + a + 1].tolist()
            self.handoff[rid] = (b, lo)

    def begin_decode_handoff(self) -> None:
        reqs = {rid: (b, lo, self.layout[rid][2]) for rid, (b, lo) in self.handoff.items() if rid in self.traces}
        self.draft = {"step": 0, "kind": "decode", "reqs": reqs} if reqs else None

    def on_decode_handoff(self, handed: torch.Tensor, batch_result) -> None:
        """The draft extend after verify returned: the worker kept, of its output, the rows at select_index (in
        place, on the output object the draft model returned). Which row that is, per request, is read by finding
        the kept hidden state and logits among the rows the extend computed; what the next round drafts from is
        then that row and the rows before it (next.hidden_in, step 0)."""
        d, out = self.draft, self.forward.get("draft_extend")
        if d is None or out is None:
            return
        kept_h, kept_l = out["output"].hidden_states, out["output"].next_token_logits
        all_h, all_l = out["hidden_out"], out["logits"]
        for rid, (b, lo, hi) in d["reqs"].items():
            tr = self.traces.get(rid)
            if tr is None:
                continue
            same = [r for r in range(lo, hi) if torch.equal(all_h[r], kept_h[b]) and torch.equal(all_l[r], kept_l[b])]
            if len(same) != 1:
                self.drop(rid, f"the row SGLang selected for the next round is {len(same)} of its verified rows")
                continue
            s = same[0] - lo  # select_index, within the request's block
            extra = {"sglang_rows": hi - lo, "sampled_row": s}
            tr.staged.append((tr.round, NEXT_HIDDEN_IN, _rows(handed, lo, lo + s + 1),
                              {"segments": len(self.layers), **extra}))  # fmt: skip
            self._stage_step(tr, 0, out["blocks"], lo, lo + s + 1, extra)
            tr.step0_logits = _cpu(kept_l[b : b + 1])

    def begin_draft_steps(self) -> None:
        t = self.topk
        reqs = {rid: (b, b * t, (b + 1) * t) for rid, (b, _, _) in self.layout.items() if rid in self.traces}
        self.draft = {"step": 1, "kind": "steps", "reqs": reqs} if reqs else None
        self.step_logits = {}

    # -- the draft model ----------------------------------------------------------------------------------
    def on_draft_body(self, args: tuple, kwargs: dict, out) -> None:
        """The draft's body ran: its inputs (ids, positions) and the feature it hands on."""
        names = ("input_ids", "positions", "forward_batch")
        kw = dict(zip(names, args)) | kwargs
        self.forward |= {"input_ids": kw["input_ids"], "positions": kw["positions"], "hidden_out": out[1][0],
                         "spec_hidden": kw["forward_batch"].spec_info.hidden_states}  # fmt: skip

    def on_draft_logits(self, worker, out) -> None:
        """The draft model's forward returned its logits: one step of the requests in `self.draft` is complete."""
        d, f = self.draft, self.forward
        self.forward = {}
        if d is None or "hidden_out" not in f:
            return
        k = d["step"]
        d["step"] = k + 1
        blocks = [(draft_tokens(k), f["input_ids"].long())]
        if f["positions"] is not None and f["positions"].dim() == 1:
            blocks.append((draft_positions(k), f["positions"].long()))
        if f.get("embeds") is not None:
            blocks.append((draft_embed_in(k), f["embeds"]))
        # what the draft's decoder layer received (fc's output once fc ran), else what its forward was handed
        blocks += [(draft_hidden_in(k), f.get("layer_in", f["spec_hidden"])), (draft_hidden_out(k), f["hidden_out"])]
        if k == 0 and f.get("fc") is not None:
            blocks.insert(0, (DRAFT_FC_OUT, f["fc"]))
        if d["kind"] == "decode":
            # which rows count is known once the worker selected its row (on_decode_handoff)
            self.forward["draft_extend"] = {"blocks": blocks, "output": out, "hidden_out": f["hidden_out"].detach(),
                                            "logits": out.next_token_logits.detach().clone()}  # fmt: skip
            return
        logits = out.next_token_logits
        for rid, (b, lo, hi) in d["reqs"].items():
            tr = self.traces.get(rid)
            if tr is None:
                continue
            if d["kind"] == "prefill":
                extra = {"sglang_rows": hi - lo, "sampled_row": hi - 1 - lo}
                self._stage_step(tr, 0, blocks, lo, hi, extra)
                tr.step0_logits = _cpu(logits[b : b + 1])  # SGLang's prefill extend keeps each request's last row
            else:
                self._stage_step(tr, k, blocks, lo, hi, {})
        if d["kind"] == "steps":
            self.step_logits[k] = logits.detach()

    def on_proposal(self, i: int, topk_index: torch.Tensor) -> None:
        """SGLang's worker passes on draft step i's top-k (select_top_k_tokens: ids after its hot-token map): step 0's
        one row per request (the extend's), step i >= 1's topk rows per request."""
        d = self.draft
        if d is None or d["kind"] != "steps":
            return
        ids = topk_index.detach().to("cpu").long()
        for rid, (b, lo, hi) in d["reqs"].items():
            tr = self.traces.get(rid)
            if tr is None:
                continue
            if i == 0:
                if tr.step0_logits is None:
                    continue
                row_ids, logits = ids[b : b + 1], tr.step0_logits
                tr.step0_logits = None
            else:
                if i not in self.step_logits:
                    continue
                row_ids, logits = ids[lo:hi], self.step_logits[i][lo:hi]
            value = {TOPK_IDS: row_ids.clone(), TOPK_LOGPROBS: _top_logprobs(logits, row_ids.shape[-1])}
            tr.staged.append((tr.round + 1, draft_topk(i), value, {}))

    @staticmethod
    def _stage_step(tr: RequestTrace, k: int, blocks: list, lo: int, hi: int, extra: dict) -> None:
        for stage, t in blocks:
            tr.staged.append((tr.round + 1, stage, _rows(t, lo, hi), extra))

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
        # the features the draft's (first) decoder layer receives: positions, embeds, hidden_states, ... (llama_eagle3:
        # layers[0]; kimi_k25_eagle3: midlayer)
        layer = inner.layers[0] if hasattr(inner, "layers") else getattr(inner, "midlayer", None)
        if layer is not None:
            layer.register_forward_pre_hook(
                lambda m, a, kw: self._keep("layer_in", a[2] if len(a) > 2 else kw.get("hidden_states")),
                with_kwargs=True,
            )
        # SGLang's model runner calls the draft model's forward method itself (no module call, so no module hooks):
        # its logits are read by an instance-level wrapper of that method
        forward = draft.forward

        def draft_forward(*a, **kw):
            out = forward(*a, **kw)
            _on_draft_logits(self, worker, out)
            return out

        draft.forward = draft_forward
        self.hooked |= {id(body), id(inner), id(draft)}

    def _keep(self, name: str, t: torch.Tensor | None) -> None:
        if self.draft is not None and t is not None and name not in self.forward:
            self.forward[name] = t.detach()


_CAPTURE: Capture | None = None


def _capture() -> Capture | None:
    cap = _CAPTURE
    return None if cap is None or cap.idle else cap


_begin_step = guarded(Capture.begin_step)
_on_target = guarded(Capture.on_target)
_on_prefill_handoff = guarded(Capture.on_prefill_handoff)
_on_tree_verified = guarded(Capture.on_tree_verified)
_on_verified = guarded(Capture.on_verified)
_begin_decode_handoff = guarded(Capture.begin_decode_handoff)
_on_decode_handoff = guarded(Capture.on_decode_handoff)
_begin_draft_steps = guarded(Capture.begin_draft_steps)
_on_proposal = guarded(Capture.on_proposal)
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
        out = orig(self, batch, target_hidden_states, next_token_ids, *a, **kw)
        if (cap := _capture()) is not None:
            cap.draft = None
        return out

    return run


def _finalize_tree_path_hook(orig):
    def run(*a, **kw):
        if (cap := _capture()) is not None and cap.layout and len(a) > 4:
            _on_tree_verified(cap, a[4])  # (batch, accept_index, accept_lens, predict, logits_output, bs)
        return orig(*a, **kw)

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
        active = (cap := _capture()) is not None and bool(cap.handoff)
        if active:
            _begin_decode_handoff(cap)
        handed = batch_result.logits_output.hidden_states  # the verified rows the draft extend is handed
        out = orig(self, batch, batch_result, *a, **kw)
        if active and (cap := _capture()) is not None:
            _on_decode_handoff(cap, handed, batch_result)
            cap.draft, cap.forward = None, {}
        return out

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


def _select_top_k_tokens_hook(orig):
    def run(i, topk_p, topk_index, *a, **kw):
        if (cap := _capture()) is not None and cap.draft is not None:
            _on_proposal(cap, int(i), topk_index)
        return orig(i, topk_p, topk_index, *a, **kw)

    return run


def _update_finish_state_hook(orig):
    def run(self, *a, **kw):
        out = orig(self, *a, **kw)
        if (cap := _capture()) is not None and str(self.rid) in cap.traces and self.finished():
            _close(cap, str(self.rid), _ended(self.finished_reason))
        return out

    return run


def install(worker_module: ModuleType) -> None:
    """Wrap SGLang's EAGLE worker and Req methods (class level, once per process), and the two module-level functions
    the worker calls by name (the tree's compaction, the step's top-k)."""
    global _CAPTURE
    if _CAPTURE is not None:
        return
    import sglang
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.speculative import eagle_worker_common

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
    _wrap(worker_module, "select_top_k_tokens", _select_top_k_tokens_hook)
    _wrap(eagle_worker_common, "_finalize_accept_tree_path", _finalize_tree_path_hook)
