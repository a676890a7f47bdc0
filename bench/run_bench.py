"""The H200 benchmark protocol of bench/README.md, end to end in one script.

    corpus (installed Python sources, sorted, hashed, split by file) → BPE tokenizer → Llama target trained
    from scratch, saved as a checkpoint → target's own greedy continuations (batched) → conversations →
    `eaglescope prepare` → `eaglescope train`: EAGLE-3 draft (TTT 7) + ablation (TTT 1), each held to its
    budget by --max-seconds; small draft LM (same budget) → decode the same held-out prompts with every method
    (the eaglescope rows through `eaglescope bench`'s Bench: backend.Decoder, what `generate` runs) →
    8B-shaped roofline.

    PYTHONPATH=src python3 bench/run_bench.py --out bench/results            # GPU, < 10 minutes
    PYTHONPATH=src python3 bench/run_bench.py --smoke --out /tmp/bench       # CPU, tiny, a minute or two
    ... --part roofline [--replay-from results.json]                         # only the 8B section
    ... --pair-with DIR    # then DIR's (an earlier version's) 8B section replaying this run: η paired

Every stage has a wall-clock budget (cosine schedules fitted to the time), so the run fits its limit on any
machine; the JSON records what each stage actually did. Nothing here is hard-coded: every number in
the table comes from this run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from eaglescope.bench import Bench, Method, parse_method
from eaglescope.config import PrepareConfig, TrainConfig
from eaglescope.corpus import COMPLETION_TEMPLATE, code_prefixes, stdlib_corpus, train_tokenizer
from eaglescope.data.prepare import prepare
from eaglescope.decode.stats import SpecStats
from eaglescope.decode.tree import top_k_rows
from eaglescope.fast import FastEagle, FastTarget, FastVanilla, fused_decode
from eaglescope.fast import invariant as inv_kernels
from eaglescope.fast.engine import _graph, use_batch_invariant, use_matmul_attention
from eaglescope.fast.fused_decode import available, fused_decode_supported
from eaglescope.fast.fused_draft import DRAFT_K_SPLITS, FusedDraftStep, fused_draft_supported, log_softmax_top_k
from eaglescope.fast.fused_verify import blas_library
from eaglescope.fast.layers import compile_layers, use_gemv_reductions
from eaglescope.fast.tuning import tuning_for
from eaglescope.models.draft import DraftConfig, Eagle3Draft
from eaglescope.models.targets import load_target
from eaglescope.models.targets.llama import LlamaArgs, LlamaModel, NativeTarget, RopeSpec, fuse_projections
from eaglescope.pretrain import PretrainConfig, init_weights, save_target
from eaglescope.taps import TapContract
from eaglescope.train.loop import train

T0 = time.perf_counter()


def say(msg: str) -> None:  # progress on stderr: stdout is the run's table (and the 8B section's kernel tables)
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- configuration ------------------------------------------------------------------------------------
def sizes(smoke: bool) -> dict:
    if smoke:
        return dict(
            vocab=512, d=32, layers=8, heads=4, kv=2, ffn=96, seq=64, batch=8, lr=3e-3,
            t_target=10, t_draft=8, t_abl=4, t_lm=4, lm_d=32, lm_layers=2, lm_heads=2, lm_ffn=96,
            n_seq=32, prefix=24, cont=24, regen_batch=32, d_batch=8, prompts=4, new=32, tune_prompts=2,
            text_mb=2, tok_mb=1,
            trees=[(4, 2, 8), (3, 3, 8)], chain=4, official=(7, 10, 60),
        )  # fmt: skip
    return dict(
        vocab=16384, d=1024, layers=16, heads=16, kv=4, ffn=2816, seq=512, batch=32, lr=1.5e-3,
        t_target=135, t_draft=70, t_abl=45, t_lm=70, lm_d=512, lm_layers=4, lm_heads=8, lm_ffn=1408,
        n_seq=6144, prefix=64, cont=192, regen_batch=1024, d_batch=32, prompts=32, new=256, tune_prompts=6,
        text_mb=160, tok_mb=24,
        trees=[(6, 4, 24), (8, 4, 32), (8, 8, 48), (10, 6, 64)], chain=6, official=(7, 10, 60),
    )  # fmt: skip


# -- data -------------------------------------------------------------------------------------------
def build_corpus(cfg: dict, work: Path, device):
    root = Path(sysconfig.get_paths()["purelib"])
    corpus = stdlib_corpus(heldout_fraction=0.02, root=root, include_site_packages=True)
    if len(corpus.train) < 50:  # a bare interpreter: fall back to the standard library alone
        corpus = stdlib_corpus(heldout_fraction=0.05)
    files = list(corpus.train)
    random.Random(0).shuffle(files)  # capped reads must not be one alphabetical corner of the tree
    texts = corpus.read(files, max_bytes=cfg["text_mb"] * 1_000_000)
    sample, n = [], 0
    for t in texts:
        sample.append(t)
        n += len(t)
        if n > cfg["tok_mb"] * 1_000_000:
            break
    tok = train_tokenizer(sample, cfg["vocab"], work / "tokenizer", COMPLETION_TEMPLATE)
    ids = []
    for enc in tok.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(tok.eos_token_id)
    train_ids = torch.tensor(ids, dtype=torch.long)
    say(
        f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out files under {corpus.root} "
        f"(sha256 {corpus.sha256[:12]}); {train_ids.numel():,} training tokens, vocab {len(tok)}"
    )
    return corpus, tok, train_ids


def prefixes(files, tok, n: int, seed: int, length: int) -> list[list[int]]:
    return code_prefixes(files, tok, n, seed, length, chunk_chars=2500)


# -- training ---------------------------------------------------------------------------------------
def lm_args(vocab, d, layers, heads, kv, ffn, max_pos=1024) -> PretrainConfig:
    return PretrainConfig(
        vocab_size=vocab,
        hidden_size=d,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        intermediate_size=ffn,
        max_position_embeddings=max_pos,
    )


def timed_cosine(elapsed: float, budget: float, lr: float, warm: float = 0.05) -> float:
    f = elapsed / budget
    if f < warm:
        return lr * max(f / warm, 0.02)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (f - warm) / (1 - warm)))))


def train_lm(pc: PretrainConfig, tokens: torch.Tensor, budget: float, batch: int, seq: int, lr: float, device):
    """nanoGPT-style loop whose cosine schedule runs on wall-clock time, so it ends inside `budget`."""
    torch.manual_seed(0)
    model = LlamaModel(pc.args())
    init_weights(model, pc.num_layers, 0)
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    t0, step, seen = time.perf_counter(), 0, 0
    pos = torch.arange(seq, device=device)[None]
    while True:
        el = time.perf_counter() - t0
        if el >= budget:
            break
        for gr in opt.param_groups:
            gr["lr"] = timed_cosine(el, budget, lr)
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        b = tokens[starts[:, None] + torch.arange(seq + 1)[None]].to(device, non_blocking=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(b[:, :-1], pos.expand(batch, seq), None)[0]
        loss = F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += batch * seq
    loss_v = float(loss.detach())
    secs = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    return model.eval(), {"steps": step, "tokens": seen, "seconds": secs, "train_loss": loss_v, "parameters": params}


@torch.inference_mode()
def regenerate(model: LlamaModel, prompts: torch.Tensor, new: int, batch: int, device) -> torch.Tensor:
    """The target's own greedy continuations of `prompts` [n, P], `batch` rows at a time (decode/vanilla.py's batched
    loop on a slot cache)."""
    from eaglescope.decode.vanilla import greedy_rows

    return torch.cat(
        [greedy_rows(model, prompts[i : i + batch].to(device), new).cpu() for i in range(0, len(prompts), batch)]
    )


def write_conversations(path: Path, tok, data: torch.Tensor, prefix: int) -> dict:
    """The held-in prefixes and the target's own continuations as conversations, the continuation the assistant turn
    (what `eaglescope prepare` trains on), each cut at its first end of text as `prepare --regenerate` cuts it."""
    eos, cut = tok.eos_token_id, 0
    pres = tok.batch_decode(data[:, :prefix].tolist(), skip_special_tokens=False)
    conts = []
    for row in data[:, prefix:].tolist():
        if eos in row:
            row, cut = row[: row.index(eos)], cut + 1
        conts.append(row)
    conts = tok.batch_decode(conts, skip_special_tokens=False)
    with path.open("w") as f:
        for user, answer in zip(pres, conts):
            turns = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return {"conversations": len(pres), "cut_at_end_of_text": cut}


PREPARE_KEYS = ("num_samples", "num_tokens", "num_supervised_tokens", "skipped", "truncated", "draft_vocab_size")


def prepare_worker(spec_path: str) -> int:
    """`--prepare-worker SPEC`: `eaglescope prepare` on the conversations (chat template, assistant-only loss mask,
    draft vocabulary; no stored hidden states: the drafts train online). On the CPU, in its own process, so that its
    per-conversation host work overlaps the draft LM's training on the GPU."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    t0 = time.perf_counter()
    m = prepare(PrepareConfig(target=spec["target"], data=spec["data"], out=spec["out"], device="cpu",
                              overwrite=True), progress=False)  # fmt: skip
    write_json(Path(spec["result"]), {k: m[k] for k in PREPARE_KEYS} | {"seconds": round(time.perf_counter() - t0, 1)})
    return 0


class Preparation:
    """The prepare worker (prepare_worker), started before the draft LM trains and waited for after it."""

    def __init__(self, tgt_dir: Path, jsonl: Path, out: Path, work: Path) -> None:
        self.t0, self.log, self.result = time.perf_counter(), work / "prepare.log", work / "prepare-result.json"
        self.result.unlink(missing_ok=True)
        spec = work / "prepare.spec.json"
        write_json(spec, {"target": str(tgt_dir), "data": str(jsonl), "out": str(out), "result": str(self.result)})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--prepare-worker", str(spec)]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait(self) -> dict:
        rc = self.proc.wait()
        if rc != 0 or not self.result.is_file():
            raise RuntimeError(f"eaglescope prepare failed (exit {rc}): {self.log.read_text()[-2000:]}")
        waited = round(time.perf_counter() - self.t0, 1)
        return json.loads(self.result.read_text()) | {"start_to_done_seconds": waited}


def train_draft(tgt_dir: Path, prep: Path, out: Path, ttt: int, budget: float, cfg, device) -> dict:
    """An EAGLE-3 draft trained by `eaglescope train` (eaglescope.train.loop.train, online), its optimizer steps
    held to `budget` seconds by --max-seconds (the cosine schedule fitted to the steps that fit)."""
    t0, times = time.perf_counter(), []
    res = train(
        TrainConfig(
            target=str(tgt_dir), data=str(prep), out=str(out), ttt_length=ttt, max_steps=10**6, max_seconds=budget,
            batch_size=cfg["d_batch"], lr=cfg["d_lr"], warmup_steps=10, clip=0.5, seed=1, device=str(device),
            overwrite=True,
        ),
        progress=False,
        on_step=lambda step, logs: times.append(time.perf_counter()),
    )  # fmt: skip
    last, m = res.history[-1], res.metrics
    first_step = times[1] - times[0] if len(times) > 1 else 0.0  # about one step: the loop starts before it
    return {
        "ttt_length": ttt,
        "steps": res.steps,
        "steps_seconds": round(times[-1] - times[0] + first_step, 2),
        "seconds": round(time.perf_counter() - t0, 1),  # with loading, the held-out evaluation and saving
        "samples": res.steps * cfg["d_batch"],
        "loss": round(last["loss"], 4),
        "acc": [round(a, 4) for a in last["acc"]],
        "heldout_acc": [round(a, 4) for a in m["acc"]],
        "heldout_predicted_accept_length": round(m["predicted_accept_length"], 3),
    }


# -- evaluation -------------------------------------------------------------------------------------
def alpha_of(stats: SpecStats) -> list[float]:
    return [round(float(x), 4) for x in stats.alpha if x is not None and not math.isnan(float(x))]


def eval_method(bench: Bench, m: Method, prompts, new, ref) -> dict:
    """Every prompt through `eaglescope bench`'s Bench.run (the backend `generate` uses: backend.Decoder, the static
    one on a GPU), after one untimed warm-up (graph capture); tokens, seconds, τ/α, matches with `ref`
    (vanilla's outputs)."""
    t = time.perf_counter()
    bench.run(m, prompts[0], min(new, 32))
    warm_up = time.perf_counter() - t
    st, tok, secs, match, outputs = SpecStats(), 0, 0.0, 0, []
    for i, p in enumerate(prompts):
        r = bench.run(m, p, new)
        secs += r.seconds
        tok += len(r.token_ids)
        outputs.append(r.token_ids)
        if m.kind != "vanilla" and r.stats is not None:
            st.merge(r.stats)
        match += int(ref is not None and r.token_ids == ref[i])
    runner = bench.static_runner(m.name)
    return {
        "tokens": tok, "seconds": secs, "stats": None if m.kind == "vanilla" else st, "match": match,
        "per_round": list(st.accepted), "graph": getattr(runner, "use_graph", None), "outputs": outputs,
        "compiled": bool(getattr(runner, "compiled", False)), "warm_up_seconds": round(warm_up, 1),
    }  # fmt: skip


@torch.inference_mode()
def flip_margins(target_f32, prompts, ref, outputs, device) -> list[dict]:
    """Where a speculative output first leaves vanilla greedy: the float32 logit gap there between vanilla's token
    and the speculative one, and float32's own top-2 margin. Gaps near zero = a bf16 near-tie flipped."""
    flips = []
    for p, r, o in zip(prompts, ref, outputs):
        i = next((j for j, (a, b) in enumerate(zip(r, o)) if a != b), None)
        if i is None:
            continue
        ids = torch.tensor(p + r[:i], device=device)[None]
        logits = target_f32(ids, torch.arange(ids.shape[1], device=device)[None], None)[0][0, -1].float()
        top2 = logits.topk(2).values
        flips.append({
            "position": i,
            "gap_vanilla_minus_spec": round(float(logits[r[i]] - logits[o[i]]), 5),
            "fp32_top2_margin": round(float(top2[0] - top2[1]), 5),
            "fp32_argmax_is_vanilla": int(logits.argmax()) == r[i],
        })  # fmt: skip
    return flips


def exactness_fp32(tgt_dir: Path, draft_dir: Path, shapes, prompts, new, max_len, device) -> dict:
    """The same decoders in float32 (TF32 off), through Bench as every row: does speculative decoding reproduce
    vanilla greedy exactly when the arithmetic is not the bf16 noise source? (Untimed; the table's speeds are the
    bf16 runs.) The target is loaded in float32 and runs without the batch-invariant kernels
    (`--no-batch-invariant`)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        t32 = load_target(tgt_dir, device=device, dtype=torch.float32)
        b32 = Bench(t32, str(draft_dir), True, max_len, batch_invariant=False)
        ref = eval_method(b32, parse_method("vanilla"), prompts, new, None)["outputs"]
        out = {}
        for shape in shapes:
            r = eval_method(b32, tree_method(shape), prompts, new, ref)
            out[str(tuple(shape))] = {"match_vanilla_fraction": round(r["match"] / len(prompts), 4),
                                      "accept_length": round(float(r["stats"].accept_length), 4)}  # fmt: skip
        return {"float32_vanilla": ref, "methods": out}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


class ForwardCounter:
    """Counts a transformers model's forward calls and their query lengths (for τ of HF's speculative modes)."""

    def __init__(self, model) -> None:
        self.lengths: list[int] = []
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    @classmethod
    def on(cls, model) -> ForwardCounter:
        """The model's counter, registered once (a second hook would count every forward twice)."""
        if getattr(model, "_forward_counter", None) is None:
            model._forward_counter = cls(model)
        return model._forward_counter

    def _hook(self, module, args, kwargs) -> None:
        x = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else (args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        self.lengths.append(int(x.shape[1]) if x is not None else 0)


HF_METHODS = ("vanilla", "assisted", "lookup")
ASSISTANT_STATE = ("num_assistant_tokens", "assistant_confidence_threshold")
COVERAGE_KEYS = ("match", "match_hf_vanilla", "prompts", "rounds", "round_tokens")
TIMED_KEYS = (*COVERAGE_KEYS, "tokens", "seconds")
MERGE_S = 15.0  # of --time-limit, kept after the transformers' end for stopping workers, merging and writing
GRACE_S = 5.0  # a worker still running this long after the end is killed (its finished prompts count)
FIRST_PROMPT_S = 45.0  # a process's first prompt starts only with this much left (no slowest prompt to go by)
POLL_S = 0.1


class HFModels:
    """transformers' target and draft LM in one process, and the assistant's draft-length state as loaded.

    transformers' assisted generation carries its draft-length schedule (and confidence threshold) from one call to
    the next in the assistant's generation_config; `reset` restores the state as loaded, so each prompt runs as the
    first call of a fresh process would, whatever ran before it in this process."""

    def __init__(self, job: dict, device: torch.device) -> None:
        # SDPA's cuDNN backend builds an execution plan for every new key length it meets, so a process's first
        # 256-token prompt ran ~4x slower than its later ones (73 vs ~18 ms per token on the H200 machine): the
        # flash backend has no per-shape plans, so every prompt is timed and covered in the same steady state
        torch.backends.cuda.enable_cudnn_sdp(False)
        dtype = getattr(torch, job["dtype"])
        self.target = load_hf(Path(job["target"]), device, dtype)
        self.draft_lm = load_hf(Path(job["draft_lm"]), device, dtype)
        kwargs = ({}, {"assistant_model": self.draft_lm}, {"prompt_lookup_num_tokens": 10})
        self.methods = dict(zip(HF_METHODS, kwargs))
        gc = self.draft_lm.generation_config
        self.fresh = {k: getattr(gc, k, None) for k in ASSISTANT_STATE}

    def to(self, device: torch.device) -> None:
        self.target.to(device)
        self.draft_lm.to(device)

    def reset(self) -> None:
        for k, v in self.fresh.items():
            setattr(self.draft_lm.generation_config, k, v)


def eval_hf_methods(hfm: HFModels, prompt: list[int], new: int, ref: list[int], warmup: bool) -> dict[str, dict]:
    """Every transformers method on one prompt: tokens, seconds, matches and target forwards per method.

    τ for HF's speculative modes = tokens per target forward (HF does not report acceptance): a round is one
    target forward; a forward over exactly the prompt is a plain prefill and counts neither as a round nor
    for its one token."""
    target = hfm.target
    counter = ForwardCounter.on(target)
    x = torch.tensor([prompt], device=target.device)
    for kw in hfm.methods.values() if warmup else ():
        target.generate(x, max_new_tokens=8, do_sample=False, **kw)
    res, outs = {}, {}
    for name, kw in hfm.methods.items():
        hfm.reset()
        counter.lengths.clear()
        sync()
        t0 = time.perf_counter()
        y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, **kw)
        sync()
        seconds = time.perf_counter() - t0
        out = y[0, len(prompt) :].tolist()
        prefill = int(bool(counter.lengths) and counter.lengths[0] == len(prompt))
        res[name] = {"tokens": len(out), "seconds": seconds, "match": int(out == ref), "prompts": 1,
                     "rounds": len(counter.lengths) - prefill, "round_tokens": len(out) - prefill}  # fmt: skip
        outs[name] = out
    for name, out in outs.items():  # against transformers' own greedy output (same kernels)
        res[name]["match_hf_vanilla"] = int(out == outs["vanilla"])
    return res


def claim_prompt(claims: Path, n: int) -> int | None:
    """The lowest prompt index no process has claimed yet (claimed by creating its file: atomic), or None."""
    for i in range(n):
        try:
            os.close(os.open(claims / f"{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return i
        except FileExistsError:
            continue
    return None


def fits(end: float, slowest: float) -> bool:
    """Whether another prompt may start: the slowest one so far (before the first, FIRST_PROMPT_S) ends by `end`."""
    return time.time() + (slowest + 5 if slowest else FIRST_PROMPT_S) <= end


def add_counts(total: dict, res: dict, keys: tuple[str, ...]) -> None:
    for name, r in res.items():
        t = total.setdefault(name, dict.fromkeys(keys, 0))
        for k in keys:
            t[k] += r[k]


def load_models(job: dict, device: torch.device) -> tuple[HFModels, dict]:
    """The models, and this process's counts (JSON: what a worker reports), which start with the load's seconds."""
    t0 = time.perf_counter()
    hfm = HFModels(job, device)
    return hfm, {"load_seconds": round(time.perf_counter() - t0, 1), "slowest": 0.0, "timed": {}, "coverage": {}}


def run_prompts(hfm: HFModels, job: dict, claims: Path, end: float, state: dict, save, timed: int = 0) -> None:
    """Claims prompts one at a time (a free process takes the next, so slow prompts leave no process idle) and runs
    every method on each, while the slowest prompt so far still fits before `end` (wall clock, shared between
    processes). Counts go to state["coverage"]; with `timed` > 0, at most that many prompts, whose tokens and
    seconds go to state["timed"] too."""
    for _ in range(timed or len(job["prompts"])):
        if not fits(end, state["slowest"]):
            return
        i = claim_prompt(claims, len(job["prompts"]))
        if i is None:
            return
        t0 = time.perf_counter()
        res = eval_hf_methods(hfm, job["prompts"][i], job["new"], job["ref"][i], warmup=not state["slowest"])
        state["slowest"] = max(state["slowest"], time.perf_counter() - t0)
        add_counts(state["coverage"], res, COVERAGE_KEYS)
        if timed:
            add_counts(state["timed"], res, TIMED_KEYS)
        save()  # after every prompt, so a process stopped at the end still counts what it finished


def wait_for(path: Path, parent: int, until: float = math.inf) -> bool:
    """Polls for `path`, another process's signal; False once the parent is gone or `until` (wall clock) passed."""
    while not path.exists():
        if os.getppid() != parent or time.time() > until:
            return False
        time.sleep(POLL_S)
    return True


def hf_worker(spec_path: str) -> int:
    """`--hf-worker SPEC`: loads transformers and both models on the CPU, then waits for spec["go"] without touching
    the GPU (the 8B section is being timed meanwhile). The worker with spec["timed"] > 0 then times that many
    prompts alone on the GPU and signals spec["timed_done"]; the others wait for that signal before their first
    GPU work. Then all claim the remaining prompts (run_prompts); counts go to spec["out"] after every prompt."""
    spec = json.loads(Path(spec_path).read_text())
    os.nice(10)  # the loads overlap the 8B section: its host work comes first
    torch.set_num_threads(1)  # many workers share the host's cores; transformers' host work is single-threaded
    hfm, state = load_models(spec["job"], torch.device("cpu"))
    out, go, timed_done = Path(spec["out"]), Path(spec["go"]), Path(spec["timed_done"])
    save = lambda: write_json(out, state)  # noqa: E731
    save()
    if not wait_for(go, spec["parent"]):
        return 1
    end, device, claims = json.loads(go.read_text())["end"], torch.device(spec["device"]), Path(spec["claims"])
    if spec["timed"]:
        try:
            hfm.to(device)
            run_prompts(hfm, spec["job"], claims, end, state, save, timed=spec["timed"])
        finally:
            timed_done.touch()  # also when timing failed: the others wait for it
    elif wait_for(timed_done, spec["parent"], end):
        hfm.to(device)
    else:
        return 0  # the end came first (or the parent is gone): nothing left to cover
    run_prompts(hfm, spec["job"], claims, end, state, save)
    return 0


def fresh_dir(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


class HFWorkers:
    """The transformers rows' worker processes (hf_worker), started before the 8B section so that their imports
    and model loads (~40 s) overlap it; worker 0 times the first `timed` prompts alone, then all cover the rest."""

    def __init__(self, job: dict, n: int, timed: int, device: torch.device, work: Path) -> None:
        d = fresh_dir(work / "hf")
        claims = fresh_dir(d / "claims")
        self.go, self.timed_done = d / "go.json", d / "timed-done"
        if not timed:  # --hf-timed 0: no tokens/s, nothing for the coverage workers to wait for
            self.timed_done.touch()
        self.outs = [d / f"worker-{j}.json" for j in range(min(n, len(job["prompts"])))]
        self.procs: list[subprocess.Popen] = []
        for j, out in enumerate(self.outs):
            spec = {
                "job": job,
                "device": str(device),
                "timed": 0 if j else timed,
                "claims": str(claims),
                "out": str(out),
                "go": str(self.go),
                "timed_done": str(self.timed_done),
                "parent": os.getpid(),
            }
            spec_path = d / f"worker-{j}.spec.json"
            write_json(spec_path, spec)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", str(spec_path)]
            with open(d / f"worker-{j}.log", "w") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        say(f"transformers: {len(self.procs)} worker processes loading on the CPU (logs in {d})")

    def run(self, end: float) -> tuple[list[dict], dict]:
        """Lets them go and waits until all are done or `end` + GRACE_S has passed (the rest are killed): their
        counts, and the stage record."""
        write_json(self.go, {"end": end})
        while any(p.poll() is None for p in self.procs) and time.time() < end + GRACE_S:
            if self.procs[0].poll() is not None:
                self.timed_done.touch()  # a timed worker that died must not hold the others back
            time.sleep(POLL_S)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        states = [json.loads(o.read_text()) if o.exists() else None for o in self.outs]
        stage = {
            "workers": {"started": len(self.procs), "finished": sum(p.returncode == 0 for p in self.procs),
                        "returncodes": [p.returncode for p in self.procs]},
            "per_worker": [s and process_record(s) for s in states],
        }  # fmt: skip
        return [s for s in states if s], stage


def hf_in_process(job: dict, device: torch.device, work: Path, end: float) -> tuple[list[dict], dict]:
    """Without workers (--hf-workers 0): every prompt in this process, all of them timed, until `end`."""
    hfm, state = load_models(job, device)
    claims = fresh_dir(work / "hf" / "claims")
    run_prompts(hfm, job, claims, end, state, lambda: None, timed=len(job["prompts"]))
    return [state], {"workers": {"started": 0, "finished": 0}, "per_worker": [process_record(state)]}


def process_record(state: dict) -> dict:
    """What one process did, for the stage record (the work folder with the workers' files stays on the machine)."""
    return {"load_seconds": state["load_seconds"], "prompts": state["coverage"].get("vanilla", {}).get("prompts", 0),
            "slowest_prompt_seconds": round(state["slowest"], 1)}  # fmt: skip


def merge_hf(states: list[dict]) -> dict[str, dict]:
    """Per method: tokens/s from the timed prompts only (processes sharing one GPU slow each other), τ and matches
    over every covered prompt (outputs and forward counts do not depend on timing); a timed prompt counts once."""
    hfr = {}
    for name in HF_METHODS:
        cov = [s["coverage"].get(name, {}) for s in states]
        timed = [s["timed"].get(name, {}) for s in states]
        r = {k: sum(c.get(k, 0) for c in cov) for k in COVERAGE_KEYS}
        r["tokens"], r["seconds"] = (sum(t.get(k, 0) for t in timed) for k in ("tokens", "seconds"))
        r["timed_prompts"] = sum(t.get("prompts", 0) for t in timed)
        # vanilla: one token per forward by construction
        r["tau"] = r["round_tokens"] / r["rounds"] if r["rounds"] and name != "vanilla" else None
        hfr[name] = r
    return hfr


def row(method, r, base_fast, base_hf, n_prompts, note=""):
    tps = r["tokens"] / r["seconds"] if r["seconds"] else None  # None: no prompt was timed
    st = r.get("stats")
    tau = st.accept_length if st is not None else r.get("tau")
    sp = tps / base_fast if (base_fast and tps is not None) else None
    return {
        "method": method,
        "accept_length": None if tau is None else round(float(tau), 4),
        "alpha": alpha_of(st) if st is not None else None,
        "tokens_per_second": None if tps is None else round(tps, 2),
        "speedup_vs_vanilla": None if sp is None else round(sp, 4),
        "speedup_vs_transformers": round(tps / base_hf, 4) if (base_hf and tps is not None) else None,
        "eta": round(sp / tau, 4) if (sp is not None and tau) else None,
        "match_vanilla_fraction": round(r["match"] / max(1, r.get("prompts", n_prompts)), 4),
        "prompts": r.get("prompts", n_prompts),
        "timed_prompts": r.get("timed_prompts", r.get("prompts", n_prompts)),
        "note": note,
    }


@dataclass
class EagleResults:
    """The eaglescope measurements behind the table, kept for the transformers step that comes after the 8B section."""

    vanilla: dict
    base: float  # eaglescope vanilla tokens/s
    runs: dict[str, tuple[dict, tuple]]  # method: (results, tree shape)
    vendor: list[tuple[str, dict, float]]  # the cuBLAS + SDPA rows: (method, results, their own vanilla tokens/s)
    kern: str
    n: int


def table_rows(ev: EagleResults, hfr: dict[str, dict] | None) -> list[dict]:
    """The table's rows; without transformers' results (None) the eaglescope rows alone, with no "vs transformers"."""
    hv = hfr["vanilla"] if hfr else None
    base_hf = hv["tokens"] / hv["seconds"] if hv and hv["seconds"] else None
    hf: dict[str, list[dict]] = {k: [] for k in HF_METHODS}
    tau_note = "τ = tokens per target forward (counted by a hook; HF reports no acceptance)"
    names = {"vanilla": ("transformers vanilla generate", ""),
             "assisted": ("transformers assisted (draft LM)", tau_note),
             "lookup": ("transformers prompt lookup (10)", tau_note)}  # fmt: skip
    for key, r in (hfr or {}).items():
        # eaglescope's and transformers' vanilla differ at bf16 near-ties; this compares like with like
        like = {"match_transformers_vanilla_fraction": round(r["match_hf_vanilla"] / max(1, r["prompts"]), 4)}
        name, note = names[key]
        hf[key] = [row(name, r, ev.base, base_hf, ev.n, note) | like]
    rows = [row(f"eaglescope vanilla (CUDA graph{ev.kern})", ev.vanilla, ev.base, base_hf, ev.n), *hf["vanilla"]]
    rows += [row(f"{k} {tuple(sh)}", r, ev.base, base_hf, ev.n) for k, (r, sh) in ev.runs.items()]
    same = "speedup vs eaglescope vanilla on the same kernels"
    rows += [row(name, r, base_d, base_hf, ev.n, same) for name, r, base_d in ev.vendor]
    return rows + hf["assisted"] + hf["lookup"]


def to_infer(m, dtype):
    """Cast for inference but keep RoPE frequencies (every inv_freq buffer) in float32, as load_native / load_draft
    do."""
    keep = {n: b.float().clone() for n, b in m.named_buffers() if n.endswith("inv_freq")}  # before any rounding
    m = m.to(dtype).eval()
    for n, b in m.named_buffers():
        if n in keep:
            b.data = keep[n].to(b.device)
    return m


def hf_dir_for(model: LlamaModel, pc: PretrainConfig, out: Path, tok_dir: Path, tok) -> Path:
    pc.eos_token_id, pc.pad_token_id = tok.eos_token_id, tok.pad_token_id
    return save_target(model.float().cpu(), pc, out, tok_dir)


def load_hf(path: Path, device, dtype):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    m.generation_config.eos_token_id = None  # fixed-length outputs, comparable token for token
    m.generation_config.do_sample = False
    return m


# -- 8B roofline --------------------------------------------------------------------------------------
LLAMA_8B_DIMS = dict(vocab=128256, d=4096, ffn=14336, layers=32, heads=32, kv=8, hd=128)
SMOKE_DIMS = dict(vocab=512, d=64, ffn=128, layers=8, heads=2, kv=1, hd=32)  # hd 32: the tensor-core tiles


def random_target(dims: dict, device, dtype) -> LlamaModel:
    """A Llama of `dims` (Llama-3.1 RoPE) with random weights, q/k/v and gate/up fused, built without a float32
    copy (8B in float32 would be 32 GB)."""
    a = LlamaArgs(
        "llama", dims["vocab"], dims["d"], dims["ffn"], dims["layers"], dims["heads"], dims["kv"], dims["hd"], 1e-5,
        8192, RopeSpec(500000.0),
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaModel(a)
    model = model.to_empty(device=device).to(dtype)
    model.register_buffer("inv_freq", a.rope.inv_freq(a.head_dim, a.max_position_embeddings).to(device), False)
    with torch.no_grad():
        for p in model.parameters():  # random, never zeros: zeros can run faster than real data
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return fuse_projections(model)


def event_ms(fn, reps: int = 20) -> float:
    if not torch.cuda.is_available():
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(t)
    fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


@torch.inference_mode()
def graphed_ms(fn, device, reps: int) -> float:
    """Median ms of `fn` captured as one CUDA graph (launch overhead excluded as a real decoder runs it); on the CPU,
    of a few plain calls."""
    if device.type != "cuda":
        return event_ms(fn, reps=min(reps, 5))
    graph = _graph(fn)
    ms = event_ms(graph.replay, reps=reps)
    del graph
    return ms


def _profile_step(fn, reps: int = 3, rows: int = 25) -> str:
    """Top `rows` kernels of `fn` by GPU time (the step run without its graph, so each kernel is visible)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync()
    avg = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        try:
            return avg.table(sort_by=key, row_limit=rows, max_name_column_width=70)
        except (AttributeError, KeyError, RuntimeError):
            continue
    return avg.table(row_limit=rows)


def kernels(fn) -> dict:
    """CUDA kernels `fn` launches (outside a graph) and their summed device time, ms."""
    if not torch.cuda.is_available():
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return {"count": len(ev), "device_ms": round(sum(e.device_time_total for e in ev) / 1e3, 4)}


@torch.inference_mode()
def round_pieces(fe: FastEagle, profile: bool = False) -> dict:
    """propose / verify / accept + commit of a FastEagle, each alone: ms as a graph, and kernels (their count and
    summed device time: the graph's ms less that is launches and gaps); `profile`: also each piece's kernels by
    time (`kernel_table`, one run)."""
    state = fe.propose()
    fe.proposer.state.committed.sub_(
        fe.proposer.state.count
    )  # propose advanced the draft's length: undo, so each replay sees the same state
    fe.verify(state)
    fe.accept(state)

    def propose():
        fe._draft_tree()
        fe.proposer.state.committed.sub_(fe.proposer.state.count)

    def verify():
        fe.verify(state)

    def accept_commit():
        fe.accept(state)
        saved = fe.proposer.state.count.clone()
        fe.commit(state)
        fe.t_len.sub_(state.accepted + 1)
        fe.proposer.state.count.copy_(saved)

    out = {}
    for name, fn in (("propose", propose), ("verify", verify), ("accept_commit", accept_commit)):
        out[name] = {"ms": round(graphed_ms(fn, fe.device, 100), 4), **kernels(fn)}
        if profile and fe.device.type == "cuda":
            out[name]["kernel_table"] = _profile_step(fn, reps=1, rows=45)
    return out


def copy_bandwidth_gbs(n: int, device, dtype) -> float:
    """Device-to-device copy of n elements, bytes read + written per second (the roofline's ceiling)."""
    src = torch.randn(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    ms = event_ms(lambda: dst.copy_(src))
    return round(2 * src.numel() * src.element_size() / ms / 1e6, 1)


def verify_ms(ft: FastTarget, ctx: int, vocab: int, sizes=(1, 8, 16, 24, 32, 64, 128)) -> dict[int, float]:
    """ms of one target forward over T chain tokens after `ctx` cached ones, each T captured as its own graph."""
    times, dev, S = {}, ft.device, ft.size
    for T in sizes:
        toks = torch.randint(0, vocab, (T,), device=dev)
        slots = ctx + torch.arange(T, device=dev)
        mask = torch.arange(S, device=dev)[None, :] <= slots[:, None]

        def f(toks=toks, slots=slots, mask=mask):
            ft.run(toks, slots, mask, slots)

        times[T] = graphed_ms(f, dev, reps=30)
    return times


def prefill_ms(ft: FastTarget, prompt: list[int]) -> dict[str, float]:
    """ms of the prompt's prefill, eager launches included as a decode's start pays them: as FastTarget.prefill runs it
    ("default": the fused verify's captured chunks where graph_prefill, else the modules), on the modules ("modules",
    compiled where the target's layers are; where "default" is not them) and, where the fused verify takes that many
    rows, on its kernels launched eagerly ("fused_verify"). With the replay's start (replay_start_ms) it splits the
    speculative start into the target's prefill and the rest (the draft's catch-up over the prompt, host reads)."""
    ids = torch.tensor(prompt, device=ft.device)
    out = {"default": round(event_ms(lambda: ft.prefill(ids), reps=10), 3)}
    if ft.graph_prefill:  # "default" is then the graphed chunks: the modules as well
        ft.graph_prefill = False
        out["modules"] = round(event_ms(lambda: ft.prefill(ids), reps=10), 3)
        ft.graph_prefill = True
    if ft.fused_rows is not None and ft.fused_rows.supports_rows(len(prompt)):
        slots = torch.arange(len(prompt), device=ft.device)
        mask = torch.arange(ft.size, device=ft.device)[None, :] <= slots[:, None]
        with torch.inference_mode():
            out["fused_verify"] = round(event_ms(lambda: ft.fused_rows(ids, slots, mask, slots), reps=10), 3)
    return out


@dataclass
class _Roofline:
    """What every stage of the roofline shares: the 8B-shaped target, its sizes, and the results filled in place."""

    model: LlamaModel
    device: torch.device
    dtype: torch.dtype
    res: dict
    left: object  # () -> seconds left of the budget
    checkpoint: object  # () -> None: write what was measured so far
    prompt: list[int]
    taps: tuple[int, ...]
    prompt_len: int = 64
    ctx_new: int = 256

    @property
    def a(self):
        return self.model.args

    @property
    def base_ctx(self) -> int:
        return self.prompt_len + 128

    @property
    def S(self) -> int:  # cache slots: the prompt, the new tokens and room for a round
        return self.prompt_len + self.ctx_new + 160

    @property
    def wbytes(self) -> int:
        return sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if "embed_tokens" not in n)

    @property
    def kv_bytes(self) -> int:
        a = self.a
        return 2 * a.num_layers * a.num_kv_heads * self.base_ctx * a.head_dim * 2


def roofline(
    smoke: bool,
    replay: dict | None,
    device,
    compile_target: bool,
    budget_s: float = 560.0,
    res: dict | None = None,
    checkpoint=lambda: None,
    variant_names: tuple[str, ...] = ("eager", "compiled", "reductions"),
) -> dict:
    """8B-shaped decode against the copy bandwidth, verify costs, a draft step, and the replayed-acceptance run.

    Decode is measured in up to three variants (all with fused q/k/v and gate/up, one CUDA graph per step):
    eager modules, compiled layers, compiled layers with matrix-vector products as reductions. The fastest
    one then serves every later measurement; all three are reported. A matmul-only stack of the same fused
    weights (no norms, attention, RoPE) gives the ceiling the kernels around the products are held to."""
    t_start = time.perf_counter()
    # the same random weights and prompt whatever ran before (the 197M part, or nothing with --part roofline), so
    # two runs replaying one acceptance build the same trees
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dims = SMOKE_DIMS if smoke else LLAMA_8B_DIMS
    model = random_target(dims, device, dtype)
    a = model.args
    # filled in place and checkpointed after each stage, so a crash or time-out keeps what was measured
    res = {} if res is None else res
    res.update({"shape": dims, "dtype": str(dtype), "fused_projections": True})
    res["gpu_state_start"] = gpu_state(device)
    res["copy_bandwidth_gbs"] = copy_bandwidth_gbs((1 << 30) if not smoke else (1 << 20), device, dtype)
    rf = _Roofline(
        model, device, dtype, res, lambda: budget_s - (time.perf_counter() - t_start), checkpoint,
        prompt=[], taps=TapContract.default(a.num_layers).layers,
    )  # fmt: skip
    res["weight_bytes"] = rf.wbytes
    _matmul_ceiling(rf)
    rf.prompt = torch.randint(0, a.vocab_size, (rf.prompt_len,)).tolist()
    ft, van, compiled, mm_attn = _fastest_decode(rf, _decode_variants(rf, compile_target, variant_names))
    r = van.generate(rf.prompt, rf.ctx_new)
    res["decode_tokens_per_second_end_to_end"] = round(rf.ctx_new / r.seconds, 2)
    res["prefill_ms"] = prefill_ms(ft, rf.prompt)
    say(f"roofline prefill of {rf.prompt_len} tokens (ms): {res['prefill_ms']}")

    # verify cost: T tokens (a chain) at the same context, each shape captured in its own graph
    times = verify_ms(ft, rf.base_ctx, a.vocab_size)
    res["verify_ms"] = {str(k): round(v, 4) for k, v in times.items()}
    res["verify_cost_ratio"] = {str(T): round(ms_T / times[1], 4) for T, ms_T in times.items()}
    checkpoint()
    say(f"roofline verify: {res['verify_cost_ratio']}")

    draft = _draft_8b(rf, compiled, mm_attn)
    shape = tuple(replay["shape"]) if replay else (7, 10, 60)
    res["replay_shape"] = list(shape)
    _draft_step(rf, draft, K=shape[1])
    # end-to-end replay of the acceptance lengths measured on the trained target
    if replay and replay.get("per_round"):
        pr = replay["per_round"][: REPLAYED_ROUNDS_SMOKE if smoke else REPLAYED_ROUNDS]
        _replayed_acceptance(rf, ft, van, draft, shape, pr, compiled)
        # the same rounds on the default's alternatives, where time is left: the products on the libraries where
        # the default runs fast.stream_mm, the composed tree pieces (a level's inputs, the tree's start and finalize
        # not in one launch), then the draft layer on its modules
        fused = fused_draft_supported(draft) is None and ft.fused_rows is not None
        res["replay_draft_layer"] = "fused" if fused else "modules"
        for key, option in (("replay_library_products", {"stream": False}),
                            ("replay_composed_pieces", {"one_launch": False}),
                            ("replay_modules_draft", {"fused_draft": False})):  # fmt: skip
            if key == "replay_library_products" and fused and not ft.fused_rows.stream:
                res[key] = "the default ran the libraries' products"
            elif fused and rf.left() > (45 if key == "replay_library_products" else 120):  # its compile is cached
                try:  # an alternative that fails must not cost the measurements after it
                    _replayed_acceptance(rf, ft, van, draft, shape, pr, compiled, **option)
                except Exception as e:
                    res[key] = f"failed: {type(e).__name__}: {str(e)[:500]}"
            else:
                res[key] = "the default ran the modules" if not fused else f"skipped: {rf.left():.0f} s"
    if device.type == "cuda" and rf.left() > 60:
        try:
            checkpoint()
            van.pos.fill_(rf.base_ctx)  # the step writes out[i] and cache slot pos: keep both inside their buffers
            van.i.fill_(1)
            res["decode_profile"] = _profile_step(van._step)
        except Exception as e:
            res["decode_profile"] = f"profiler failed: {type(e).__name__}: {e}"
    res["gpu_state_end"] = gpu_state(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _matmul_ceiling(rf: _Roofline) -> None:
    """The ceiling: the same fused products back to back, nothing else."""
    res, device, dtype = rf.res, rf.device, rf.dtype
    mats = [m.weight for n, m in rf.model.named_modules() if isinstance(m, torch.nn.Linear)]
    ins = {w.shape[1]: torch.randn(1, w.shape[1], device=device, dtype=dtype) for w in mats}

    def stack():
        for w in mats:
            F.linear(ins[w.shape[1]], w)

    res["matmul_stack_ms"] = round(graphed_ms(stack, device, reps=30), 4)
    res["matmul_stack_fraction_of_copy"] = round(
        rf.wbytes / res["matmul_stack_ms"] / 1e6 / res["copy_bandwidth_gbs"], 4
    )
    say(f"roofline: copy {res['copy_bandwidth_gbs']} GB/s, matmul-only stack {res['matmul_stack_ms']} ms")


def _decode_variant(
    rf: _Roofline, name: str, compiled: bool, gemv: bool, mm_attn: bool, fused: bool | str
) -> tuple[dict, FastTarget, FastVanilla]:
    model, prompt, base_ctx = rf.model, rf.prompt, rf.base_ctx
    t_c = time.perf_counter()
    torch._dynamo.reset()
    torch._inductor.config.coordinate_descent_tuning = gemv
    # layers only: they are the compiled region (an eager lm_head as a reduction would materialise V×H)
    use_gemv_reductions(model.model.layers, gemv)
    use_matmul_attention(model, mm_attn)
    ft = FastTarget(
        model, rf.S, taps=rf.taps, compile=compiled, fused_decode=bool(fused), fused_verify=fused == "verify"
    )
    if not compiled:  # undo an earlier variant's regional compilation
        for layer in model.model.layers:
            layer._compiled_call_impl = None
    van = FastVanilla(ft, rf.ctx_new)
    van.generate(prompt, 16)
    cap = time.perf_counter() - t_c
    van.pos.fill_(base_ctx)
    van.i.fill_(1)
    step = event_ms(lambda: van.graph.replay() if van.graph is not None else van._step(), reps=50)
    gbs = (rf.wbytes + rf.kv_bytes) / step / 1e6
    v = {
        "variant": name,
        "step_ms": round(step, 4),
        "tokens_per_second": round(1e3 / step, 2),
        "bandwidth_gbs": round(gbs, 1),
        "fraction_of_copy": round(gbs / rf.res["copy_bandwidth_gbs"], 4),
        "compile_and_capture_seconds": round(cap, 1),
    }
    say(f"roofline decode: {v}")
    return v, ft, van


def _decode_variants(rf: _Roofline, compile_target: bool, variant_names: tuple[str, ...]) -> list[tuple]:
    """(name, compiled, gemv, mm_attn, fused) of each decode variant to measure, in the order asked for."""
    variants = [("eager", "fused, eager, CUDA graph", False, False, False, False)]
    if compile_target:
        variants += [
            ("compiled", "fused, compiled layers, CUDA graph", True, False, False, False),
            ("reductions", "fused, compiled layers, products as reductions, CUDA graph", True, True, False, False),
            (
                "attention",
                "fused, compiled layers, products as reductions, attention as products, CUDA graph",
                True,
                True,
                True,
                False,
            ),
        ]
    if fused_decode_supported(rf.model, rf.device) is None:
        # one-token steps on fast/fused_decode.py's kernels; verifies on compiled layers (attention as products)
        variants.append(("fused_kernels", "one-token steps in five kernels per layer, CUDA graph", compile_target,
                         False, True, True))  # fmt: skip
        # and verifies of 2..64 tokens in the same layout on tensor cores (fast/fused_verify.py)
        variants.append(("fused_verify", "one-token steps and verifies on the fused kernels, CUDA graph",
                         compile_target, False, True, "verify"))  # fmt: skip
    # in the order asked for: when time runs short, the later ones are skipped
    variants = sorted((v for v in variants if v[0] in variant_names), key=lambda v: variant_names.index(v[0]))
    return [v[1:] for v in variants]


def _fastest_decode(rf: _Roofline, variants: list[tuple]) -> tuple[FastTarget, FastVanilla, bool, bool]:
    """Measure each variant (res["decode_variants"]); → the fastest one's (target, vanilla decoder, compiled,
    attention as products), which serves every later measurement."""
    res = rf.res
    measured, best, last = [], None, None
    for name, compiled, gemv, mm_attn, fused in variants:
        if measured and rf.left() < 200:
            say(f"roofline: skipping variant {name!r} ({rf.left():.0f} s left)")
            continue
        try:
            v, ft, van = _decode_variant(rf, name, compiled, gemv, mm_attn, fused)
            last = (name, ft, van)
        except Exception as e:  # report it and go on with the variants that work
            v = {"variant": name, "error": f"{type(e).__name__}: {e}"[:500]}
            say(f"roofline: variant {name!r} failed: {v['error']}")
        measured.append(v)
        res["decode_variants"] = measured
        rf.checkpoint()
        if "step_ms" in v and (best is None or v["step_ms"] < best[0]["step_ms"]):
            best = (v, compiled, gemv, mm_attn, fused)
    res["decode_variants"] = measured
    bv, compiled, gemv, mm_attn, fused = best
    if last is not None and last[0] == bv["variant"]:
        ft, van = last[1], last[2]
    else:  # rebuild the fastest variant (its numbers stay the ones measured above)
        _, ft, van = _decode_variant(rf, bv["variant"], compiled, gemv, mm_attn, fused)
    res["decode_variant"] = bv["variant"]
    res["compiled"] = compiled
    res["decode_step_ms"] = bv["step_ms"]
    res["decode_tokens_per_second"] = bv["tokens_per_second"]
    res["decode_bandwidth_gbs"] = bv["bandwidth_gbs"]
    res["decode_fraction_of_copy"] = bv["fraction_of_copy"]
    return ft, van, compiled, mm_attn


def random_draft(target: LlamaModel, dtype: torch.dtype) -> Eagle3Draft:
    """An EAGLE-3 draft shaped for `target` (draft vocabulary 32,000 or the target's if smaller) with random
    weights and the target's embedding, its projections fused, in `dtype` on the target's device."""
    a = target.args
    dc = DraftConfig(
        hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size,
        draft_vocab_size=min(32000, a.vocab_size), target_hidden_size=a.hidden_size, num_aux=3,
        max_position_embeddings=8192, rope=a.rope,
    )  # fmt: skip
    embed = target.model.embed_tokens.weight
    draft = Eagle3Draft(dc).to(embed.device)
    with torch.no_grad():
        for n_, p in draft.named_parameters():
            if p.dim() > 1 and n_ != "embed_tokens.weight":
                p.normal_(0, 0.02)
    draft.load_target_embedding(embed.float())
    return fuse_projections(to_infer(draft, dtype))


REPLAY_LOGIT_STD = 20.0  # the roofline draft's logit spread (see _draft_8b)
REPLAYED_ROUNDS, REPLAYED_ROUNDS_SMOKE = 400, 40  # the source's first rounds the replay cycles through


def _draft_8b(rf: _Roofline, compiled: bool, mm_attn: bool) -> Eagle3Draft:
    """An 8B-sized EAGLE-3 draft with random weights, fused and (with --compile) its layer compiled."""
    draft = random_draft(rf.model, rf.dtype)
    # A random head spreads its logits thinly (std ~1.3 at 8B), so every child scores about -6 and the tree's best
    # nodes by cumulative score stop at depth 3: a replayed acceptance of 4-6 was cut to 3 (41 of 70 rounds on an
    # H100, bench/results/HISTORY.md). A trained draft is confident. Logits ~20 wide give the top child ~0.98, so the
    # trees reach the shape's depth. The products and kernels are the same; only the values change.
    with torch.no_grad():
        draft.lm_head.weight.normal_(0, REPLAY_LOGIT_STD / math.sqrt(draft.config.hidden_size))
    # autotuning every kernel of the draft layer and the tree builder costs minutes; it paid only for the products
    torch._inductor.config.coordinate_descent_tuning = False
    if mm_attn:
        use_matmul_attention(draft)
    if compiled:
        compile_layers([draft.midlayer])
    return draft


def fused_draft_level(draft: Eagle3Draft, dcache, K: int, ctx: int, k_splits: dict[str, int] | None = None):
    """One tree level of K frontier rows at context `ctx` as fast/draft_pieces.py FusedPieces.tree_level runs it (its
    RoPE compiled, the layer on fast/fused_draft.py's kernels, the head, the children), on random inputs: (the
    FusedDraftStep, whose k_splits may be changed between calls, and the level as a function)."""
    c, device = draft.config, dcache.k.device
    dtype = draft.fc.weight.dtype
    emb = torch.randn(K, c.hidden_size, device=device, dtype=dtype)
    hid = torch.randn(K, c.hidden_size, device=device, dtype=dtype)
    pos = torch.full((1, K), ctx, device=device)
    slots = ctx + torch.arange(K, device=device)
    mask = torch.arange(dcache.size, device=device)[None, :] <= slots[:, None]
    fused = FusedDraftStep(draft, dcache, rows=K, k_splits=k_splits)  # as FastEagle builds it
    rotary = torch.compile(draft.midlayer.rotary) if device.type == "cuda" else draft.midlayer.rotary

    def level():
        cos, sin = rotary(pos, dtype)
        normed = fused(emb, hid, cos[0, 0], sin[0, 0], slots, mask)[1]
        fused.children(draft.head(normed), K)

    return fused, level


def _draft_step(rf: _Roofline, draft: Eagle3Draft, K: int) -> None:
    """One tree level of K frontier rows: res["draft_step_ms"] (and its profile on a GPU)."""
    from eaglescope.fast import SlotCache

    device, dtype, dc, S, base_ctx = rf.device, rf.dtype, draft.config, rf.S, rf.base_ctx
    dcache = SlotCache(1, 1, dc.num_kv_heads, S, dc.head_dim, dtype, device)
    emb = torch.randn(1, K, dc.hidden_size, device=device, dtype=dtype)
    hid = torch.randn(1, K, dc.hidden_size, device=device, dtype=dtype)
    dpos = torch.full((1, K), base_ctx, device=device)
    dslots = base_ctx + torch.arange(K, device=device)
    dmask = (torch.arange(S, device=device)[None, :] <= dslots[:, None])[None, None]

    def dstep():  # one tree level: K frontier rows through the layer, lm_head, log-softmax, top-k (as the round's)
        o = draft.step(emb, hid, dpos, dcache, dslots, dmask)
        top_k_rows(torch.log_softmax(draft.logits(o).float(), -1), K)

    rf.res["draft_step_ms"] = round(graphed_ms(dstep, device, reps=50), 4)
    lp = torch.randn(K, dc.draft_vocab_size, device=device)  # a level's top-k alone: torch's and the round's
    rf.res["draft_topk_us"] = {
        "torch.topk": round(1e3 * graphed_ms(lambda: lp.topk(K, -1), device, reps=50), 2),
        "top_k_rows": round(1e3 * graphed_ms(lambda: top_k_rows(lp, K), device, reps=50), 2),
    }
    if available(device):  # the fused draft's children from bf16 logits: log-softmax and top-k in one launch
        logits = torch.randn(K, dc.draft_vocab_size, device=device, dtype=dtype)
        rf.res["draft_topk_us"]["log_softmax + top_k_rows"] = round(
            1e3 * graphed_ms(lambda: top_k_rows(torch.log_softmax(logits.float(), -1), K), device, reps=50), 2
        )
        rf.res["draft_topk_us"]["log_softmax_top_k"] = round(
            1e3 * graphed_ms(lambda: log_softmax_top_k(logits, K), device, reps=50), 2
        )
        for chunk in (8192, 32768):  # fewer, wider programs a row (32768: one a row, 842fe7c's kernel's launch)
            rf.res["draft_topk_us"][f"log_softmax_top_k_chunk_{chunk}"] = round(
                1e3 * graphed_ms(lambda chunk=chunk: log_softmax_top_k(logits, K, chunk=chunk), device, reps=50), 2
            )
    if fused_draft_supported(draft) is None:  # the same level with the layer on fast/fused_draft.py's kernels
        fused, fstep = fused_draft_level(draft, dcache, K, base_ctx, tuning_for(device).draft_k_splits)
        rf.res["draft_step_ms_fused"] = round(graphed_ms(fstep, device, reps=50), 4)
        fused.k_splits = {"o": 2, "down": 2}  # o and down as partials the next norm sums (no split-K reduce kernels)
        try:
            rf.res["draft_step_ms_fused_k_split_2"] = round(graphed_ms(fstep, device, reps=50), 4)
        except Exception as e:  # bmm's out_dtype and kin: recorded, not fatal
            rf.res["draft_step_ms_fused_k_split_2"] = f"{type(e).__name__}: {str(e)[:200]}"
        fused.k_splits = {**DRAFT_K_SPLITS, **(tuning_for(device).draft_k_splits or {})}
        if device.type == "cuda" and rf.left() > 150:
            try:
                rf.res["draft_step_fused_profile"] = _profile_step(fstep)
            except Exception as e:
                rf.res["draft_step_fused_profile"] = f"profiler failed: {type(e).__name__}: {e}"
    if device.type == "cuda":  # the same level with its products through cuBLASLt (as fast/fused_verify.py's down)
        with blas_library("cublaslt"):
            rf.res["draft_step_ms_cublaslt"] = round(graphed_ms(dstep, device, reps=50), 4)
    if device.type == "cuda" and rf.left() > 150:  # where the step's time goes (~0.2 ms would be its weights at 85%)
        try:
            rf.res["draft_step_profile"] = _profile_step(dstep)
        except Exception as e:
            rf.res["draft_step_profile"] = f"profiler failed: {type(e).__name__}: {e}"
    lt, fd = rf.res.get("draft_step_ms_cublaslt"), rf.res.get("draft_step_ms_fused")
    say(f"roofline draft step: {rf.res['draft_step_ms']} ms (cuBLASLt {lt}, fused {fd}) ({rf.left():.0f} s left)")


def _replayed_acceptance(rf: _Roofline, ft, van, draft, shape, pr: list, compiled: bool,
                         fused_draft: bool | None = None, one_launch: bool = True,
                         stream: bool = True) -> None:  # fmt: skip
    """The fast round at 8B with the acceptance lengths `pr` measured on the trained target: τ, tok/s, η (in
    res["replay_*"]; with fused_draft=False, the draft layer on its modules whatever FastEagle's default, in
    res["replay_modules_draft"]; with one_launch=False, the fused layer's rounds taking a level's inputs, the
    tree's start and its finalize from the composed Eagle3Proposer pieces, not FusedDraftStep's kernels, in
    res["replay_composed_pieces"]; with stream=False, the verify's and draft level's products on the libraries where
    the default runs fast.stream_mm, in res["replay_library_products"])."""
    res = rf.res
    if fused_draft is False:
        res = rf.res["replay_modules_draft"] = {}
    elif not one_launch:
        res = rf.res["replay_composed_pieces"] = {}
    elif not stream:
        res = rf.res["replay_library_products"] = {}
    verify_stream = ft.fused_rows.stream if ft.fused_rows is not None else {}
    try:
        _replay_round(rf, res, ft, van, draft, shape, pr, compiled, fused_draft, one_launch, stream)
    finally:  # the target's verify is shared with the runs after this one
        if ft.fused_rows is not None:
            ft.fused_rows.stream = verify_stream


def _replay_round(rf: _Roofline, res: dict, ft, van, draft, shape, pr: list, compiled: bool,
                  fused_draft: bool | None, one_launch: bool, stream: bool) -> None:  # fmt: skip
    prompt, ctx_new = rf.prompt, rf.ctx_new
    t_c = time.perf_counter()
    rf.checkpoint()
    # compiling the 8B round as one graph took 36 s (bench-all-20261129T150034.json); piece by piece (a tree level
    # compiled once for every depth) the 197M rows' rounds took 11-23 s each (bench-all-20261204T174136.json)
    compile_round = compiled and rf.left() > 45
    if compiled and not compile_round:  # the round then runs eager kernels in its graph: a slower round, lower η
        say(f"roofline replay: {rf.left():.0f} s left, too few to compile the round; it runs uncompiled")
    fe = FastEagle(ft, draft, *shape, max_len=rf.prompt_len + ctx_new + 2, replay=True, compile=compile_round,
                   fused_draft=fused_draft)  # fmt: skip
    if fe.fused_layer is not None:
        fe.set_one_launch(one_launch)
        if not stream:
            fe.fused_layer.stream = {}
    if not stream and ft.fused_rows is not None:
        ft.fused_rows.stream = {}
    fe.generate(prompt, 32, replay=pr)
    res["replay_compile_and_capture_seconds"] = round(time.perf_counter() - t_c, 1)
    res["replay_round_compiled"] = fe.compiled
    sync()
    rr = fe.generate(prompt, ctx_new, replay=pr)
    sync()
    tau = len(rr.tokens) / len(rr.accepted)
    tps = len(rr.tokens) / rr.seconds
    sync()
    vv = van.generate(prompt, ctx_new)
    sync()
    vtps = ctx_new / vv.seconds
    res["replay_rounds"] = len(rr.accepted)
    res["replay_round_ms"] = round(rr.seconds / len(rr.accepted) * 1e3, 4)
    res["replay_tau"] = round(tau, 4)
    res["replay_tokens_per_second"] = round(tps, 2)
    res["replay_vanilla_tokens_per_second"] = round(vtps, 2)
    res["replay_speedup"] = round(tps / vtps, 4)
    res["replay_eta"] = round(tps / vtps / tau, 4)
    # each round accepts the forced depth where its tree has a node that deep, else its deepest (accept_greedy):
    # the rounds where the random draft's tree fell short, which make the replayed τ lower than its source's
    res["replay_accepted"] = list(rr.accepted)
    res["replay_rounds_short"] = sum(a < pr[i % len(pr)] for i, a in enumerate(rr.accepted))
    which = " (modules draft)" if fused_draft is False else " (composed pieces)" if not one_launch else ""
    which = which or ("" if stream else " (library products)")
    say(f"roofline replay{which}: τ {tau:.2f}, {tps:.1f} vs {vtps:.1f} tok/s, round {res['replay_round_ms']} ms")
    # η above is end to end: each run's start (the target's prefill; for EAGLE-3 also the draft's catch-up over the
    # prompt) is spread over ~74 rounds but over 256 vanilla tokens. The starts alone (a one-token generate is the
    # start and nothing else; the median of five, before any profiler has run: its hooks stay on the launches), and η
    # with them taken out of both: what the round itself costs against a step
    start_e = statistics.median(fe.generate(prompt, 1, replay=pr).seconds for _ in range(5))
    start_v = statistics.median(van.generate(prompt, 1).seconds for _ in range(5))
    if rf.device.type == "cuda" and rf.left() > 90:  # where the round's time goes: each operation alone
        fe.generate(prompt, ctx_new, replay=pr)  # the pieces are timed at the state the whole run ends in
        try:
            res["replay_round_pieces"] = round_pieces(fe, profile=rf.left() > 150)
        except Exception as e:
            res["replay_round_pieces"] = f"profiler failed: {type(e).__name__}: {e}"
    res["replay_start_ms"] = round(start_e * 1e3, 3)
    res["replay_vanilla_start_ms"] = round(start_v * 1e3, 3)
    res["replay_round_ms_after_start"] = round((rr.seconds - start_e) / len(rr.accepted) * 1e3, 4)
    res["replay_eta_after_start"] = round(
        (vv.seconds - start_v) / ctx_new / ((rr.seconds - start_e) / len(rr.accepted)), 4
    )


# -- main -------------------------------------------------------------------------------------------
def fmt_table(rows: list[dict]) -> str:
    head = (
        "| method | τ | α_1..α_k | tokens/s | speedup vs eaglescope vanilla | vs transformers | η | matches vanilla |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        al = "-" if not r["alpha"] else " ".join(f"{x:.2f}" for x in r["alpha"])
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        lines.append(
            f"| {r['method']} | {f(r['accept_length'])} | {al} | {f(r['tokens_per_second'], 1)} | "
            f"{f(r['speedup_vs_vanilla'])}x | {f(r['speedup_vs_transformers'])}x | {f(r['eta'])} | "
            f"{r['match_vanilla_fraction']:.2f} ({r['prompts']}"
            + (f"; {r['timed_prompts']} timed" if r.get("timed_prompts", r["prompts"]) != r["prompts"] else "")
            + ") |"
        )
    return "\n".join(lines)


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _config(args) -> dict:
    """The run's sizes and budgets (sizes()) with the command line's changes."""
    cfg = sizes(args.smoke)
    cfg["hf_workers"], cfg["hf_timed"], cfg["hf_reserve_s"] = args.hf_workers, args.hf_timed, args.hf_reserve_s
    cfg["vendor_rows"] = not args.no_vendor_rows
    cfg["d_lr"] = 3e-3 if args.smoke else 8e-4
    cfg["batch_invariant"] = not args.no_batch_invariant
    cfg["compile_rounds"] = args.compile  # the 197M rows as `eaglescope bench --compile` runs them
    cfg["float32_pass"] = args.float32_pass
    cfg["pdl"] = args.pdl  # the fused kernels' programmatic dependent launch (fast/fused_decode.py PDL)
    for k in ("t_target", "t_draft", "t_abl", "t_lm"):
        cfg[k] *= args.scale
    if args.n_seq:
        cfg["n_seq"] = args.n_seq
    return cfg


# what nvidia-smi reports of the GPU's state (clocks in MHz, power in W, temperature in C): the same code's η has
# differed by ~0.01 between machines (bench/results/HISTORY.md, "Results (2026-12-06 midday)"), and a clock or power
# cap is the first thing to rule out; read only, the clocks are left as they are
GPU_STATE_FIELDS = ("pstate", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw",
                    "power.limit", "temperature.gpu", "clocks_event_reasons.active")  # fmt: skip


def gpu_state(device) -> dict:
    """GPU_STATE_FIELDS of the device now, from nvidia-smi; {"unavailable": why} where it cannot say."""
    if device.type != "cuda":
        return {"unavailable": "not a GPU"}
    index = device.index if device.index is not None else torch.cuda.current_device()
    fields = ",".join(GPU_STATE_FIELDS)
    query = ["nvidia-smi", f"--id={index}", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"unavailable": f"{type(e).__name__}: {e}"}
    values = [v.strip() for v in done.stdout.strip().split(",")]
    if done.returncode != 0 or len(values) != len(GPU_STATE_FIELDS):
        return {"unavailable": (done.stderr or done.stdout).strip()[:200] or f"nvidia-smi exit {done.returncode}"}
    return dict(zip(GPU_STATE_FIELDS, values, strict=True))


def _run_meta(device, smoke: bool) -> dict:
    """When, where and on what versions the run ran."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        # the device copy of the tree has no .git: the caller passes the commit in the environment
        "commit": os.environ.get("EAGLESCOPE_COMMIT") or (commit if len(commit) == 40 else "unknown"),
        "smoke": smoke,
        "tuning": tuning_for(device).describe(),  # the fast path's launch settings (fast/tuning.py)
    }
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    return meta


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--work", default="/tmp/eaglescope-bench")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--part", choices=["all", "train", "roofline"], default="all")
    ap.add_argument("--replay-from", default=None, help="results JSON whose per-round acceptance to replay at 8B")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the 8B target step, and every EAGLE-3 row's round as `eaglescope bench --compile` does",
    )
    ap.add_argument("--time-limit", type=float, default=590.0, help="seconds the whole run may take")
    ap.add_argument(
        "--variants", default="eager,compiled,reductions,attention,fused_kernels", help="8B decode variants to measure"
    )
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every training budget")
    ap.add_argument("--n-seq", type=int, default=None, help="regenerated training sequences")
    ap.add_argument("--no-batch-invariant", action="store_true", help="197M rows on cuBLAS + SDPA kernels only")
    ap.add_argument("--float32-pass", action="store_true", help="also decode the trees in float32 (exactness check)")
    ap.add_argument("--hf-workers", type=int, default=0, help="processes for the transformers rows (0: this one)")
    ap.add_argument("--hf-timed", type=int, default=1, help="prompts the first worker times alone on the GPU")
    ap.add_argument("--hf-reserve-s", type=float, default=150.0, help="seconds the 8B section leaves to transformers")
    ap.add_argument("--no-vendor-rows", action="store_true", help="skip the cuBLAS + SDPA comparison rows")
    ap.add_argument("--pdl", action="store_true", help="launch the fused kernels with PDL (an A/B of it)")
    ap.add_argument(
        "--pair-with",
        default=None,
        metavar="DIR",
        help="then run DIR's 8B section (an earlier version's src/ and bench/) replaying this run's acceptance, "
        "and print the two side by side (bench/pair_rooflines.py)",
    )
    ap.add_argument("--pair-time-limit", type=float, default=110.0, help="seconds the --pair-with run may take")
    ap.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prepare-worker", default=None, help=argparse.SUPPRESS)
    return ap


def main() -> int:
    args = _parser().parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker)
    if args.prepare_worker:
        return prepare_worker(args.prepare_worker)
    if args.pair_with and not (Path(args.pair_with) / "bench" / "run_bench.py").is_file():
        why = "has no bench/run_bench.py (it holds an earlier version's src/ and bench/)"
        print(f"run_bench: --pair-with {args.pair_with} {why}", file=sys.stderr)
        return 2
    if args.part in ("all", "train"):
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:  # eaglescope train writes its scalars with it
            print("run_bench: eaglescope train needs tensorboard (pip install 'tensorboard>=2.14')", file=sys.stderr)
            return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = _config(args)
    fused_decode.PDL = cfg["pdl"]
    out_dir, work = Path(args.out), Path(args.work)
    out_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    meta = _run_meta(device, args.smoke)
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    result_path = out_dir / f"bench-{'smoke-' if args.smoke else ''}{args.part}-{stamp}.json"
    result: dict = {**meta, "config": cfg, "rows": [], "roofline": None, "stages": {}}
    torch.backends.cuda.matmul.allow_tf32 = True
    # the transformers rows end by the limit, less the time to stop their workers and write the results
    end = time.time() + args.time_limit - MERGE_S - (time.perf_counter() - T0)
    if args.part in ("all", "train"):
        ev, job = run_train_eval(cfg, work, device, result, result_path)
        # started now, so their imports and loads overlap the 8B section (they wait for go before any GPU work)
        workers = HFWorkers(job, cfg["hf_workers"], cfg["hf_timed"], device, work) if cfg["hf_workers"] else None
        if args.part == "train":
            run_transformers(ev, job, workers, end, device, work, result, result_path)
    if args.part in ("all", "roofline"):
        reserve = cfg["hf_reserve_s"] if args.part == "all" else 0.0
        replay = result.get("replay")
        if args.replay_from:
            replay = json.loads(Path(args.replay_from).read_text()).get("replay")
        say("roofline: 8B-shaped random-weight target and draft")
        try:
            result["roofline"] = {}
            roofline(
                args.smoke,
                replay,
                device,
                args.compile,
                budget_s=args.time_limit - reserve - (time.perf_counter() - T0),
                res=result["roofline"],
                checkpoint=lambda: write_json(result_path, result),
                variant_names=tuple(args.variants.split(",")),
            )
        except Exception as e:  # keep what the run already measured, and say what broke
            result["roofline"]["error"] = repr(e)[:2000]
        profiles = ("decode_profile", "draft_step_profile")
        say(json.dumps({k: v for k, v in result["roofline"].items() if k not in profiles}))
        for k in profiles:
            print(result["roofline"].get(k, ""), flush=True)
    if args.part == "all":
        run_transformers(ev, job, workers, end, device, work, result, result_path)
    result["seconds"] = round(time.perf_counter() - T0, 1)
    write_json(result_path, result)
    say(f"wrote {result_path}")
    if args.pair_with:
        return run_paired(args, result_path, out_dir / "before", work / "before")
    return 0


def run_paired(args: argparse.Namespace, after: Path, out: Path, work: Path) -> int:
    """An earlier version's 8B section, in its own process on its own code, replaying `after`'s acceptance round
    for round, then both side by side: on one card in one call, so their η pair (bench/README.md)."""
    import pair_rooflines

    before_dir = Path(args.pair_with).resolve()
    cmd = [sys.executable, str(before_dir / "bench" / "run_bench.py"), "--part", "roofline",
           "--replay-from", str(after.resolve()), "--variants", args.variants,
           "--time-limit", str(args.pair_time_limit), "--out", str(out), "--work", str(work)]  # fmt: skip
    if args.compile:
        cmd.append("--compile")
    if args.smoke:
        cmd.append("--smoke")
    env = os.environ | {"PYTHONPATH": str(before_dir / "src"),
                        "EAGLESCOPE_COMMIT": os.environ.get("EAGLESCOPE_BEFORE_COMMIT", "unknown")}  # fmt: skip
    say(f"paired: {before_dir}'s 8B section replaying {after.name}")
    # its stdout (the 8B section's kernel tables) joins the progress on stderr: stdout keeps this run's tables
    try:
        proc = subprocess.run(cmd, cwd=before_dir, env=env, stdout=sys.stderr, timeout=args.pair_time_limit + 30)
        ended = f"exited {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc, ended = None, "was stopped at its limit"
    found = sorted(out.glob("bench-*roofline-*.json"))
    if proc is None or proc.returncode != 0 or not found:
        say(f"paired: the run at {before_dir} {ended} and wrote {len(found)} results")
        return 1
    return pair_rooflines.main([str(after), str(found[-1]), "--out", str(after.with_name(f"paired-{after.stem}.md"))])


@dataclass
class _Trained:
    """What the training half of run_train_eval hands the evaluation: the corpus, the target, the drafts."""

    corpus: object
    tok: object
    target: LlamaModel  # float32, on the device
    tgt_dir: Path
    lm: LlamaModel
    lpc: PretrainConfig
    draft_dir: Path
    abl_dir: Path


def _train_stage(cfg: dict, work: Path, device, result: dict, result_path: Path) -> _Trained:
    """Corpus → target → its own continuations → the product's prepare and train (EAGLE-3 and the TTT-1 ablation),
    and the draft LM; each stage's record in result["stages"]."""
    st = result["stages"]
    corpus, tok, train_ids = build_corpus(cfg, work, device)
    st["corpus"] = {
        "root": str(corpus.root),
        "sha256": corpus.sha256,
        "train_files": len(corpus.train),
        "heldout_files": len(corpus.heldout),
        "train_tokens": train_ids.numel(),
        "seconds": round(time.perf_counter() - T0, 1),
    }
    pc = lm_args(len(tok), cfg["d"], cfg["layers"], cfg["heads"], cfg["kv"], cfg["ffn"])
    target, st["target"] = train_lm(pc, train_ids, cfg["t_target"], cfg["batch"], cfg["seq"], cfg["lr"], device)
    say(f"target: {json.dumps(st['target'])}")
    # the target as a checkpoint with its tokenizer and the completion chat template (as the demo saves it)
    t0 = time.perf_counter()
    tgt_dir = hf_dir_for(target, pc, work / "target", work / "tokenizer", tok)
    target = target.to(device)  # save_target moved it to the CPU
    st["save_target_seconds"] = round(time.perf_counter() - t0, 1)
    # the target's own continuations of training-file prefixes
    t0 = time.perf_counter()
    pre = torch.tensor(prefixes(corpus.train, tok, cfg["n_seq"], 1, cfg["prefix"]))
    import copy

    infer_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    data = regenerate(to_infer(copy.deepcopy(target), infer_dtype), pre, cfg["cont"], cfg["regen_batch"], device)
    st["regenerate"] = {"sequences": data.shape[0], "length": data.shape[1], "seconds": time.perf_counter() - t0}
    say(f"regenerate: {st['regenerate']}")
    # --- the product: prepare, then train (eaglescope prepare / eaglescope train) ----------------------------
    jsonl = work / "conversations.jsonl"
    st["conversations"] = write_conversations(jsonl, tok, data, cfg["prefix"])
    preparation = Preparation(tgt_dir, jsonl, work / "prepared", work)  # on the CPU while the draft LM trains
    lpc = lm_args(len(tok), cfg["lm_d"], cfg["lm_layers"], cfg["lm_heads"], cfg["lm_heads"] // 2, cfg["lm_ffn"])
    lm, st["draft_lm"] = train_lm(lpc, train_ids, cfg["t_lm"], cfg["batch"], cfg["seq"], cfg["lr"] * 2, device)
    say(f"draft LM: {st['draft_lm']}")
    st["prepare"] = preparation.wait()
    say(f"prepare: {st['conversations']} → {st['prepare']}")
    draft_dir, abl_dir = work / "eagle3", work / "ablation-ttt1"
    st["eagle3"] = train_draft(tgt_dir, work / "prepared", draft_dir, 7, cfg["t_draft"], cfg, device)
    say(f"eagle3 draft (eaglescope train): {st['eagle3']}")
    st["ablation"] = train_draft(tgt_dir, work / "prepared", abl_dir, 1, cfg["t_abl"], cfg, device)
    say(f"ablation (TTT 1, eaglescope train): {st['ablation']}")
    write_json(result_path, result)
    return _Trained(corpus, tok, target, tgt_dir, lm, lpc, draft_dir, abl_dir)


def _exactness(cfg, st, target_f32, prod, runs, ref, prompts, trees, paths, device) -> tuple[dict, list]:
    """Flips against vanilla (with their float32 logit margins), and the kernels without batch invariance for
    comparison (`generate --no-batch-invariant`); → (st["exactness"], the comparison rows). `trees`: the official
    and the tuned tree methods; `paths`: the target's and the draft's directories."""
    (official, best), (tgt_dir, draft_dir) = trees, paths
    new, n = cfg["new"], len(prompts)
    max_len = cfg["prefix"] + new
    invariant = st["kernels"].startswith("batch-invariant")
    ex = {"kernels": st["kernels"], "bf16_flips": {}}
    for k, (r, sh) in runs.items():
        ex["bf16_flips"][f"{k} {tuple(sh)}"] = flip_margins(target_f32, prompts, ref, r["outputs"], device)
    default_rows = []
    if invariant and cfg["vendor_rows"]:
        # the same model as `generate --no-batch-invariant` runs it (fused decode and verify kernels where the
        # target allows): what invariance costs in speed, and what it buys in exactness
        use_batch_invariant(prod.model, enable=False)
        other = Bench(prod, str(draft_dir), True, max_len, batch_invariant=False)
        vd = eval_method(other, parse_method("vanilla"), prompts, new, None)
        ref_d, vd["match"] = vd["outputs"], n
        base_d = vd["tokens"] / vd["seconds"]
        kern = "--no-batch-invariant kernels"
        default_rows.append((f"eaglescope vanilla, {kern}", vd, base_d))
        for m, name in ((official, "official"), (best, "tuned")):
            r = eval_method(other, m, prompts, new, ref_d)
            default_rows.append((f"eagle3 tree {name} {m.shape}, {kern}", r, base_d))
            ex["bf16_flips"][f"{kern}: eagle3 tree {name} {m.shape}"] = flip_margins(
                target_f32, prompts, ref_d, r["outputs"], device
            )
        ex["default_vanilla_equals_invariant_vanilla"] = round(sum(a == b for a, b in zip(ref_d, ref)) / n, 4)
        say(
            f"{kern}: vanilla {base_d:.1f} tok/s; "
            + ", ".join(
                f"{k}: {r['tokens'] / r['seconds']:.1f} tok/s, match {r['match']}" for k, r, _ in default_rows[1:]
            )
        )
    if cfg["float32_pass"]:
        fp = exactness_fp32(tgt_dir, draft_dir, [official.shape, best.shape], prompts, new, max_len, device)
        ex["float32"] = fp["methods"]
        ex["float32_vanilla_equals_bf16_vanilla"] = round(
            sum(a == b for a, b in zip(fp["float32_vanilla"], ref)) / n, 4
        )
        say(f"exactness float32: {ex['float32']}, fp32 vanilla == bf16 {ex['float32_vanilla_equals_bf16_vanilla']}")

    return ex, default_rows


def run_train_eval(cfg: dict, work: Path, device, result: dict, result_path: Path) -> tuple[EagleResults, dict]:
    """Corpus → target → the product's prepare and train → every eaglescope method through the product's bench on
    the held-out prompts → exactness; the rows so far go into `result`. Returns the eaglescope results and the
    transformers job (HF checkpoints, prompts, vanilla outputs)."""
    st = result["stages"]
    tr = _train_stage(cfg, work, device, result, result_path)
    corpus, tok, target, tgt_dir = tr.corpus, tr.tok, tr.target, tr.tgt_dir
    lm, lpc, draft_dir, abl_dir = tr.lm, tr.lpc, tr.draft_dir, tr.abl_dir
    # --- evaluation: every eaglescope row through eaglescope bench's Bench (backend.Decoder) ---------------
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompts = prefixes(corpus.heldout, tok, cfg["prompts"], 2, cfg["prefix"])
    tune = prefixes(corpus.heldout, tok, cfg["tune_prompts"], 3, cfg["prefix"])
    new = cfg["new"]
    lm_dir = hf_dir_for(lm, lpc, work / "draft_lm", work / "tokenizer", tok)
    target_f32 = target.eval()  # the trained weights in float32: the flips' logit margins
    prod = load_target(tgt_dir, device=device, dtype=dtype)
    if not isinstance(prod, NativeTarget):
        raise RuntimeError(f"{tgt_dir} did not load as a native target: the static-shape backend cannot run it")
    max_len = cfg["prefix"] + new
    # on a GPU the target then runs on the batch-invariant kernels (the static backend's default), as `generate` runs it
    invariant = device.type == "cuda" and cfg["batch_invariant"] and inv_kernels.supports(prod.model.args.head_dim,
                                                                                          device)  # fmt: skip
    compile_rounds = cfg["compile_rounds"] and device.type == "cuda"
    eagle = Bench(prod, str(draft_dir), True, max_len, cfg["batch_invariant"], compile_rounds)
    abl = Bench(prod, str(abl_dir), True, max_len, cfg["batch_invariant"], compile_rounds)
    st["kernels"] = "batch-invariant (fast/invariant.py)" if invariant else "cuBLAS + SDPA"
    st["load_seconds"] = round(time.perf_counter() - t0, 1)
    vr = eval_method(eagle, parse_method("vanilla"), prompts, new, None)
    ref = vr["outputs"]
    vr["match"] = len(prompts)
    base_fast = vr["tokens"] / vr["seconds"]
    lm_head = getattr(prod.model.lm_head, "original", prod.model.lm_head)
    st["float32_logits"] = {"mixed_precision_mm": getattr(lm_head, "mm_out_dtype", None)}
    say(f"eaglescope vanilla ({st['kernels']}): {base_fast:.1f} tok/s, graph {vr['graph']}")
    runs: dict[str, tuple[dict, tuple]] = {}
    chain, official = parse_method(f"chain={cfg['chain']}"), tree_method(cfg["official"])
    runs["eagle3 chain"] = (eval_method(eagle, chain, prompts, new, ref), chain.shape)
    say(f"eagle3 chain {chain.shape}: τ {runs['eagle3 chain'][0]['stats'].accept_length:.2f}")
    runs["eagle3 tree official"] = (eval_method(eagle, official, prompts, new, ref), official.shape)
    # tune the tree on separate held-out prompts by tokens/s, on plain rounds: compiling four more tree budgets
    # (~20-30 s each on an H200, bench/results/round-cost-20261204T173054.json) does not fit the ten minutes
    tuner = Bench(prod, str(draft_dir), True, max_len, cfg["batch_invariant"]) if compile_rounds else eagle
    best, best_tps, tuning = None, -1.0, {}
    for shape in cfg["trees"]:
        m = tree_method(shape)
        r = eval_method(tuner, m, tune, new, None)
        tps = r["tokens"] / r["seconds"]
        tuning[str(tuple(shape))] = {"tokens_per_second": round(tps, 1), "tau": round(r["stats"].accept_length, 3)}
        if tps > best_tps:
            best, best_tps = m, tps
    st["tree_tuning"] = tuning
    say(f"tuning: {tuning} → {best.shape}")
    runs["eagle3 tree tuned"] = (eval_method(eagle, best, prompts, new, ref), best.shape)
    runs["ablation TTT-1 tree tuned"] = (eval_method(abl, best, prompts, new, ref), best.shape)
    runs["ablation TTT-1 chain"] = (eval_method(abl, chain, prompts, new, ref), chain.shape)
    for k, (r, sh) in runs.items():
        tps = r["tokens"] / r["seconds"]
        say(
            f"{k} {sh}: τ {r['stats'].accept_length:.2f}, {tps:.1f} tok/s, match {r['match']}, graph {r['graph']}, "
            f"compiled {r['compiled']} (warm-up {r['warm_up_seconds']} s)"
        )
    st["rounds_compiled"] = {f"{k} {tuple(sh)}": [r["compiled"], r["warm_up_seconds"]] for k, (r, sh) in runs.items()}
    n = len(prompts)
    st["decode_seconds"] = round(time.perf_counter() - t0, 1)
    # --- exactness: flips against vanilla, and the kernels without batch invariance for comparison -------------
    t0 = time.perf_counter()
    del eagle, abl, tuner  # their decoders ran the invariant modules, which _exactness may swap out
    trees, paths = (official, best), (tgt_dir, draft_dir)
    ex, default_rows = _exactness(cfg, st, target_f32, prod, runs, ref, prompts, trees, paths, device)
    ex["seconds"] = round(time.perf_counter() - t0, 1)
    st["exactness"] = ex
    del target_f32, target
    kern = ", batch-invariant kernels" if invariant else ""
    ev = EagleResults(vr, base_fast, runs, default_rows, kern, n)
    tuned = runs["eagle3 tree tuned"]
    result["rows"] = table_rows(ev, None)  # written now, so a crash later keeps them; rebuilt with transformers'
    result["replay"] = {"shape": list(tuned[1]), "per_round": tuned[0]["per_round"]}
    result["prompts"] = {"count": n, "prefix_tokens": cfg["prefix"], "new_tokens": new, "greedy": True}
    write_json(result_path, result)
    job = {"target": str(tgt_dir), "draft_lm": str(lm_dir), "dtype": str(dtype).removeprefix("torch."),
           "prompts": prompts, "ref": ref, "new": new}  # fmt: skip
    return ev, job


def tree_method(shape) -> Method:
    return parse_method("tree=" + ",".join(str(x) for x in shape))


def run_transformers(
    ev: EagleResults,
    job: dict,
    workers: HFWorkers | None,
    end: float,
    device,
    work: Path,
    result: dict,
    result_path: Path,
) -> None:
    """The transformers rows until `end` (wall clock): in the worker processes, or in this one without them; then
    the table, every row with its speedup against transformers' vanilla generate."""
    say(f"transformers: go, {end - time.time():.0f} s to the end")
    t0 = time.perf_counter()
    states, stage = workers.run(end) if workers else hf_in_process(job, device, work, end)
    hfr = merge_hf(states)
    stage |= {
        "go_to_done_seconds": round(time.perf_counter() - t0, 1),
        "prompts": {k: r["prompts"] for k, r in hfr.items()},
        "timed_prompts": hfr["vanilla"]["timed_prompts"],
        "timed_seconds": {k: round(r["seconds"], 2) for k, r in hfr.items()},
    }
    result["stages"]["transformers"] = stage
    say(f"transformers: {json.dumps(stage)}")
    for k, r in hfr.items():
        say(f"transformers {k}: {r}")
    result["rows"] = table_rows(ev, hfr)
    print(fmt_table(result["rows"]), flush=True)
    write_json(result_path, result)


if __name__ == "__main__":
    sys.exit(main())
