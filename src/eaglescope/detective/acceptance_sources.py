"""Where α_k comes from (docs/doctor.md): an engine's log, a trace, training's metrics file, the teacher-forced draft
on --data (every position, or the rounds a greedy server would start), and eaglescope's own decoder."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.config import DEFAULT_DEPTH
from eaglescope.data.chat import read_conversations, render
from eaglescope.data.shards import PreparedData
from eaglescope.decode.loop import generate_speculative
from eaglescope.decode.speculative import Eagle3Proposer
from eaglescope.decode.stats import SpecStats, alpha_from_unconditional, predicted_accept_length
from eaglescope.detective.acceptance import Acceptance, alpha_of, as_float, round_counts
from eaglescope.errors import EagleScopeError
from eaglescope.jsonfile import read_object_or_none
from eaglescope.train.metrics import Batch, hit_counts, step_hits
from eaglescope.train.ttt import draft_vocab_ids, teacher_of, ttt_unroll

# Training's acc_k file, written next to the draft's weights.
TRAINING_METRICS = "training_metrics.json"


# -- sources -------------------------------------------------------------------------------------------------
def from_engine(e) -> Acceptance:
    """An EngineAcceptance (engine_logs) as an Acceptance, with per-position counts where the engine gives them
    (vLLM: drafts and accepted tokens per position), so thinly reached positions weigh as little as they should."""
    counts = e.position_counts()
    if counts is None:
        return Acceptance(e.source, list(e.alpha or []), e.accept_length, rounds=None)
    reached, accepted = counts
    return Acceptance(e.source, alpha_of(reached, accepted), e.accept_length, None, reached, accepted, None,
                      int(round(e.drafts)) if e.drafts else None)  # fmt: skip


def from_trace(trace) -> Acceptance | None:
    """What a trace's verify decisions say was served: τ and conditional α_k over its rounds (None without any).

    Like an engine's numbers this is what the engine served; a short trace's deep positions are thin evidence
    (its counts say how thin), which is why doctor uses it only for NO_TTT, a cause the contract's TTT length must
    corroborate."""
    acc, depths = [], []
    for rnd in trace.rounds():
        if rnd == 0 or (T.VERIFY_PARENTS, rnd) not in trace or (T.VERIFY_ACCEPTED, rnd) not in trace:
            continue
        parents = [int(p) for p in trace.get(T.VERIFY_PARENTS, rnd).flatten().tolist()]
        depth = [0] * len(parents)
        for i, p in enumerate(parents):  # parents precede children
            depth[i] = depth[p] + 1 if p >= 0 else 0
        acc.append(int(trace.get(T.VERIFY_ACCEPTED, rnd).numel()))
        depths.append(max(depth, default=0))
    if not acc:
        return None
    engine = str(trace.producer).split("-", 1)[0].split(" ", 1)[0] or "engine"
    stats = SpecStats()
    for a, d in zip(acc, depths, strict=True):
        stats.record_round(None, a, max_depth=d)
    reached, accepted = round_counts(acc, depths, max(depths))
    return Acceptance.from_groups(f"{engine} trace", [(reached, accepted)], len(acc), stats.accept_length)


def _find_acc(obj) -> dict | None:
    """The dict holding acc_k in a training metrics file: top level, a known section, or a history's last."""
    if isinstance(obj, dict):
        if isinstance(obj.get("acc"), list):
            return obj
        for key in ("final", "eval", "held_out", "heldout", "valid", "validation", "metrics", "train"):
            if key in obj and (found := _find_acc(obj[key])) is not None:
                return found
        for key in ("history", "evals", "log"):
            if isinstance(obj.get(key), list) and obj[key]:
                return _find_acc(obj[key][-1])
    if isinstance(obj, list) and obj:
        return _find_acc(obj[-1])
    return None


def read_training_metrics(draft_dir: Path | str) -> Acceptance | None:
    """acc_k / α_k (and their counts, when training wrote them) from the draft directory's training_metrics.json;
    None when absent or unreadable."""
    path = Path(draft_dir) / TRAINING_METRICS
    if not path.is_file():
        return None
    found = _find_acc(read_object_or_none(path))
    if found is None:
        return None
    acc = [as_float(x) for x in found["acc"]]
    # acc_k is unconditional; prefer the conditional α training measured, else estimate it from acc alone.
    given = found.get("alpha")
    alpha = [as_float(x) for x in given] if isinstance(given, list) else alpha_from_unconditional(acc)
    reached = found.get("reached") if isinstance(found.get("reached"), list) else None
    accepted = found.get("accepted") if isinstance(found.get("accepted"), list) and reached is not None else None
    tau = predicted_accept_length([x for x in alpha if not math.isnan(x)])
    return Acceptance("training", alpha, tau, acc, reached, accepted, None, reached[0] if reached else None)


# -- data ----------------------------------------------------------------------------------------------------
def load_samples(data: Path | str, tokenizer, limit: int, max_length: int = 1024) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) pairs from a prepared directory or a JSONL of conversations (rendered with the
    target's own template, as serving renders them)."""
    data = Path(data)
    out: list[tuple[list[int], list[int]]] = []
    if data.is_dir():
        pd = PreparedData.open(data, verify=False)
        for i in range(min(limit, len(pd))):
            s = pd.sample(i)
            out.append((s["input_ids"][:max_length].tolist(), s["loss_mask"][:max_length].tolist()))
    elif data.is_file():
        if tokenizer is None:
            raise EagleScopeError("--data is a JSONL of conversations but the target has no tokenizer to render it")
        for conv in read_conversations(data):
            r = render(conv, tokenizer, max_length)
            if r is not None:
                out.append((r.input_ids, r.loss_mask))
            if len(out) >= limit:
                break
    else:
        raise EagleScopeError(f"--data {str(data)!r} is neither a prepared directory nor a JSONL file")
    out = [(ids, mask) for ids, mask in out if any(mask)]
    if not out:
        raise EagleScopeError(f"--data {str(data)!r} holds no sample with supervised (assistant) tokens")
    return out


def prompt_of(ids: list[int], mask: list[int]) -> list[int] | None:
    """The prompt of a rendered sample: everything before the first supervised token."""
    first = next((i for i, m in enumerate(mask) if m), None)
    return ids[:first] if first else None


@torch.inference_mode()
def teacher_hits(target, draft, ids: list[int], mask: list[int], depth: int) -> tuple[torch.Tensor, torch.Tensor, int,
                                                                                      int]:  # fmt: skip
    """One sample through the target and a `depth`-step TTT unroll: (hits [T, K], supervised [T, K], supervised
    tokens that are the target's own greedy choice, supervised tokens). Row t, step k: the draft's step-k argmax
    at position t equals the target's next token at t+k+1 (train.metrics.step_hits' alignment)."""
    dev = draft.fc.weight.device
    x = torch.tensor([ids], device=target.device)
    out = target.hidden_states(x)
    batch = Batch(
        input_ids=x.to(dev),
        loss_mask=torch.tensor([mask], device=dev),
        valid=torch.ones_like(x, device=dev),
        aux=out.aux.to(device=dev, dtype=draft.fc.weight.dtype),
        teacher=teacher_of(draft_vocab_ids(draft), out.logits.to(device=dev, dtype=torch.float32)),
    )
    unrolled = ttt_unroll(draft, batch.input_ids, batch.aux, depth)
    hits, sup = step_hits(draft, unrolled.logits, batch)
    greedy = batch.teacher.argmax[0, :-1]
    m = batch.loss_mask[0, 1:].bool()
    agree = int((greedy == batch.input_ids[0, 1:])[m].sum())
    return hits[0].cpu(), sup[0].cpu(), agree, int(m.sum())


def chain_at(hits: torch.Tensor, sup: torch.Tensor, row: int) -> int | None:
    """Tokens a greedy chain rooted at teacher-forced `row` accepts: its leading hits. None when the chain runs out
    of supervised text before its first miss (the text cannot say how far it would have gone)."""
    K = hits.shape[1]
    if row < 0 or row >= hits.shape[0]:
        return None
    for k in range(K):
        if not bool(sup[row, k]):
            return None
        if not bool(hits[row, k]):
            return k
    return K


def simulate_rounds(hits: torch.Tensor, sup: torch.Tensor, mask: list[int]) -> list[int]:
    """Greedy chain serving on a sample's own text: each supervised span is an answer whose first token the
    target emits after prefill (committed n = span start + 1, so the first root is row n - 2); every round then
    commits its accepted tokens and the bonus. Returns the accepted length of each round until the text runs out."""
    out: list[int] = []
    i = 0
    while i < len(mask):
        if not mask[i]:
            i += 1
            continue
        start = i
        while i < len(mask) and mask[i]:
            i += 1
        row = start - 1
        while row < i - 1:
            a = chain_at(hits, sup, row)
            if a is None:
                break
            out.append(a)
            row += a + 1
    return out


@dataclass
class DataPrediction:
    predicted: Acceptance  # teacher-forced on --data, every supervised position (acc_k, α_k)
    rounds: Acceptance  # serving simulated on --data's text (what a correct engine gets on it)
    agreement: float | None  # share of supervised tokens that are the target's own greedy choice
    prompt_lengths: list[int] = field(default_factory=list)


@torch.inference_mode()
def predict_on_data(target, draft, samples, depth: int = DEFAULT_DEPTH) -> DataPrediction:
    """Teacher-forced acc_k and α_k of a `depth`-step TTT unroll over the samples, and greedy chain serving
    simulated on the same text (both with their counts per sample)."""
    groups, rounds, hits_k, sup_k = [], [], [0] * depth, [0] * depth
    agree = total = 0
    for ids, mask in samples:
        hits, sup, a, n = teacher_hits(target, draft, ids, mask, depth)
        c = hit_counts(hits, sup)
        groups.append((c["reached"], c["accepted"]))
        hits_k = [x + y for x, y in zip(hits_k, c["hits"], strict=True)]
        sup_k = [x + y for x, y in zip(sup_k, c["supervised"], strict=True)]
        rounds.append(simulate_rounds(hits, sup, mask))
        agree, total = agree + a, total + n
    acc = alpha_of(sup_k, hits_k)
    positions = sum(g[0][0] for g in groups)
    predicted = Acceptance.from_groups("teacher-forced on data", groups, positions, acc=acc)
    simulated = Acceptance.from_rounds("rounds simulated on data", rounds, depth)
    prompts = [len(p) for p in (prompt_of(i, m) for i, m in samples) if p]
    return DataPrediction(predicted, simulated, agree / total if total else None, prompts)


@dataclass
class Served:
    acceptance: Acceptance  # what the decoder served, over the rounds `expected` could score too
    expected: Acceptance  # the teacher-forced draft at those very rounds
    agree: float  # share of those rounds where the two accepted the same number of tokens


@torch.inference_mode()
def serve_with_decoder(target, draft, prompts, max_new_tokens: int, depth: int = DEFAULT_DEPTH) -> Served:
    """eaglescope's own greedy chain decoder over the prompts, and the teacher-forced draft at each served round's
    root in the served text: the same positions. A round whose chain runs past the output is left out of both."""
    served_rounds: list[list[int]] = []
    expected_rounds: list[list[int]] = []
    for p in prompts:
        max_len = len(p) + max_new_tokens + 1
        proposer = Eagle3Proposer(draft, depth, 1, depth + 1, max_len)
        res = generate_speculative(target, proposer, p, max_new_tokens)
        seq = list(p) + list(res.token_ids)
        if not res.stats.rounds or len(seq) < len(p) + 2:
            continue
        mask = [0] * len(p) + [1] * (len(seq) - len(p))
        hits, sup, _, _ = teacher_hits(target, draft, seq, mask, depth)
        n = len(p) + 1  # committed after prefill: the prompt and the target's first token
        s, e = [], []
        for a in res.stats.accepted:
            x = chain_at(hits, sup, n - 2)  # step 0 at row t predicts token t + 2: the round's first draft token
            if x is not None:
                s.append(a)
                e.append(x)
            n += a + 1
        served_rounds.append(s)
        expected_rounds.append(e)
    pairs = [(a, b) for s, e in zip(served_rounds, expected_rounds, strict=True) for a, b in zip(s, e, strict=True)]
    if not pairs:
        raise EagleScopeError("the decoder ran no speculative round (every prompt ended at once): use longer outputs")
    return Served(
        Acceptance.from_rounds("eaglescope decoder", served_rounds, depth),
        Acceptance.from_rounds("teacher-forced at the served rounds", expected_rounds, depth),
        sum(a == b for a, b in pairs) / len(pairs),
    )
