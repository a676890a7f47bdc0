"""What a diagnosis compares: precision and tolerances, one observation against one reference (Cmp), the
draft's head, and the evidence at hand (the trace, its golden replay, the models)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eaglescope import trace as T
from eaglescope.detective.replay import comparable_rows, replay_hs, replay_rows, row_norms
from eaglescope.models.draft import LoadedDraft
from eaglescope.models.targets.base import Target
from eaglescope.models.targets.layer_states import input_norm


@dataclass(frozen=True)
class Precision:
    """How far a correct engine's values may lie from the replay's: `rel`, the relative error of a hidden state;
    `nats`, the absolute error of a log-prob (relative error is meaningless for log-probs near 0; candidates this
    close may also swap ranks)."""

    rel: float
    nats: float


# By the coarsest float the traced run or the replay computed in. A 32-bit engine against the 32-bit replay differs
# by summation order only (~1e-6; TF32 matmuls ~1e-3). bf16 engines against a float32 replay land around 1e-2 on a
# trained model's activations and up to 0.05 on the test suite's random 8-layer target (tests/engines), and their
# draft log-probs within ~0.1-0.25 nats (logits of a few units, 8-bit mantissas). Wiring mistakes land at 0.3 and
# above, RoPE position mistakes at 0.05-0.1 on the rows they move: a 16-bit trace cannot show those.
PRECISION_32 = Precision(rel=0.02, nats=0.05)
PRECISION_16 = Precision(rel=0.08, nats=0.3)
# Stages the replay copies from the trace (it follows the trace's decisions): never evidence.
FORCED = {T.VERIFY_TOKENS, T.VERIFY_PARENTS, T.VERIFY_ACCEPTED, T.VERIFY_BONUS}
# A fingerprint's error is a Johnson-Lindenstrauss estimate: ||(a-b) P||² / ||a-b||² is χ²(d)/d for d projected
# dimensions (P's entries are N(0, 1/16)). A row is called different only when its estimate exceeds what a row at
# the tolerance reads at this many standard deviations (one clean row in ~10^4 reads above it).
FP_Z = 3.7


def fp_slack(dof: int) -> float:
    """How far above the true error a χ²(dof) projection estimate reads at FP_Z (Wilson-Hilferty's quantile)."""
    c = 2.0 / (9.0 * max(dof, 1))
    return math.sqrt(max(1.0 - c + FP_Z * math.sqrt(c), 1.0) ** 3)


@torch.no_grad()
def on_model(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`fn` (a model's module) over evidence `x`. The evidence (trace and replay tensors, read from disk) stays on
    the host, where every comparison is made; the models live on --device: `x` goes to `like`'s (a weight's) device
    and dtype for the call, and the result comes back as host float32."""
    return fn(x.to(like)).float().cpu()


# -- comparing one observation with one reference ------------------------------------------------------------------
@dataclass
class Cmp:
    """How an observation compares with a reference: `score` is the worst error over its tolerance (≤ 1: the
    same; None: shapes differ), `err` the headline error (relative L2; nats for log-probs; the share of
    unexplained ids for top-k ids), `bad_rows` the rows beyond tolerance and `row_err` every row's error."""

    score: float | None
    err: float | None
    bad_rows: list[int] = field(default_factory=list)
    row_err: list[float] = field(default_factory=list)

    @property
    def match(self) -> bool:
        return self.score is not None and self.score <= 1.0


NO_SHAPE = Cmp(None, None)


def precision_of(*dtypes: torch.dtype | str | None) -> Precision:
    """The precision of values computed in these dtypes (the coarsest decides; None and non-float dtypes are ignored).
    A trace's log-probs are float32 even from a bf16 engine: its precision is that of its coarsest tensor."""
    names = [str(d).removeprefix("torch.") for d in dtypes if d is not None]
    coarse = any(n in ("bfloat16", "float16", "half") or n.startswith("float8") for n in names)
    return PRECISION_16 if coarse else PRECISION_32


def compare_rows(obs, ref: torch.Tensor, tol: float, absolute: bool = False) -> Cmp:
    """`obs` (tensor or fingerprint) against the reference tensor `ref`, row by row. Relative errors by default;
    `absolute`: absolute differences (log-probs, in nats: a full row's max |diff|, a fingerprint's its L2 norm over
    the row's K values, bounded by K^½ times the max). Row norms are exact even in a fingerprint; the rest is the
    projections' estimate, compared with the tolerance widened by `fp_slack`."""
    if tuple(obs.shape) != tuple(ref.shape):
        return NO_SHAPE
    a, b = comparable_rows(obs, ref), comparable_rows(ref, obs)
    if a.shape[0] == 0 or a.numel() == 0:
        return Cmp(0.0, 0.0)
    fp = isinstance(obs, T.Fingerprint)
    dof = a.shape[1]
    row_tol = tol * (fp_slack(dof) if fp else 1.0)
    d = a - b
    if absolute:
        width = ref.shape[-1] if ref.dim() else 1
        row_err = d.norm(dim=-1) if fp else d.abs().max(dim=-1).values
        row_tol = row_tol * (math.sqrt(width) if fp else 1.0)
        err = float(row_err.max())
        bad = row_err > row_tol
        score = err / row_tol
    else:
        bn, an = row_norms(ref), row_norms(obs)
        # the denominator is the reference row's exact norm (a fingerprint keeps it): only ||a - b|| is estimated
        row_err = T._rel(d, bn[:, None], dim=-1)
        err = float(T._rel(d, bn))
        ratio_dev = (T._ratio(an, bn) - 1.0).abs()
        bad = (row_err > row_tol) | (ratio_dev > tol)
        all_tol = tol * (fp_slack(dof * a.shape[0]) if fp else 1.0)
        score = max(err / all_tol, float(row_err.max()) / row_tol, float(ratio_dev.max()) / tol)
    return Cmp(score, err, [int(i) for i in torch.nonzero(bad).flatten().tolist()], [float(x) for x in row_err])


@dataclass
class Head:
    """One way of turning a draft step's rows into top-k target ids: log-probs over the draft vocabulary [n, Vd]
    and the map from draft ids to target ids."""

    lp: torch.Tensor
    to_target: Callable[[torch.Tensor], torch.Tensor]
    nats: float  # the log-prob tolerance (Precision.nats)

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        vals, ids = self.lp.topk(min(k, self.lp.shape[-1]), dim=-1)
        return self.to_target(ids), vals

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """The draft id this head maps to each target id (-1 where none does)."""
        table = self.to_target(torch.arange(self.lp.shape[-1])).long()
        hi = int(max(int(table.max()), int(target_ids.max()))) + 1
        inverse = torch.full((hi,), -1, dtype=torch.long)
        mapped = torch.nonzero(table >= 0).flatten().flip(0)  # draft ids the map places (a fitted map may leave some)
        inverse[table[mapped]] = mapped  # written last to first: the first id wins on collisions
        t = target_ids.long()
        return torch.where(t >= 0, inverse[t.clamp_min(0)], torch.full_like(t, -1))

    def compare(self, obs: dict, only: str | None = None) -> Cmp:
        """The trace's top-k parts (`ids` [n, K] in full, `logprobs` [n, K] tensor or fingerprint) against this head
        (`only`: score that part alone). Ids may differ only between candidates this head scores within `nats` (a
        precision tie); log-probs are compared with the head's values of the ids the trace chose."""
        ids, vals = obs.get(T.TOPK_IDS), obs.get(T.TOPK_LOGPROBS)
        shape = tuple((ids if ids is not None else vals).shape)
        if len(shape) != 2 or shape[0] != self.lp.shape[0]:
            return NO_SHAPE
        mine, mine_vals = self.topk(shape[1])
        if tuple(mine.shape) != shape:
            return NO_SHAPE
        scores, errs, bad = [], [], set()
        chosen = None
        if ids is not None:
            ids = ids.long()
            obs_d = self.draft_ids(ids)
            diff = ids != mine
            ok = ~diff
            if bool(diff.any()):
                my_d = self.draft_ids(mine)
                valid = obs_d >= 0
                gap = (self.lp.gather(-1, obs_d.clamp_min(0)) - self.lp.gather(-1, my_d.clamp_min(0))).abs()
                ok = ok | (valid & (gap <= self.nats))
                ok = ok & ~_repeats(ids)
            share = float((~ok).double().mean())
            if only in (None, T.TOPK_IDS):
                scores.append(0.0 if share == 0 else 1.0 + share)
                errs.append(share)
                bad |= {int(r) for r in torch.nonzero(~ok.all(dim=-1)).flatten().tolist()}
            if bool((obs_d >= 0).all()):
                chosen = self.lp.gather(-1, obs_d)
        if vals is not None and only in (None, T.TOPK_LOGPROBS):
            c = compare_rows(vals, chosen if chosen is not None else mine_vals, self.nats, absolute=True)
            if c.score is None:
                return NO_SHAPE
            scores.append(c.score)
            errs.append(c.err)
            bad |= set(c.bad_rows)
        if not scores:
            return NO_SHAPE
        return Cmp(max(scores), max(errs), sorted(bad))


def _repeats(ids: torch.Tensor) -> torch.Tensor:
    """[n, K] bool: an id that occurs earlier in its row (top-k ids are distinct: a repeat is never a tie)."""
    eq = ids[:, :, None] == ids[:, None, :]
    return torch.tril(eq, diagonal=-1).any(-1)


def golden_value(golden: T.Trace, stage: str, rnd: int, part: str | None = None):
    """A replay's value of `stage` in round `rnd` (None if it has none), a tree step's rows put in the trace's order:
    replay row j holds the node the trace keeps in row replay.step<k>.trace_rows[j]."""
    try:
        v = golden.get(stage, rnd, part=part) if part else golden.get(stage, rnd)
    except KeyError:
        return None
    step = T.parse_stage(stage)[1] if stage.startswith("draft.step") else None
    if not step or not isinstance(v, torch.Tensor):
        return v
    try:
        rows = golden.get(replay_rows(step), rnd).long()
    except KeyError:
        return v
    if rows.numel() != v.shape[0] or not torch.equal(rows.sort().values, torch.arange(rows.numel())):
        return v
    out = torch.empty_like(v)
    out[rows] = v
    return out


# -- the evidence at hand -------------------------------------------------------------------------------------------
class Evidence:
    """Access to the trace, the replay and the models at one (round, stage)."""

    def __init__(self, target: Target, loaded: LoadedDraft, trace: T.Trace, golden: T.Trace, tol: float | None):
        self.target, self.loaded, self.trace, self.golden, self.fixed_tol = target, loaded, trace, golden, tol
        self.draft = loaded.model
        self.taps = loaded.contract.taps
        self.H = target.hidden_size
        self._trace_keys = {(e.stage, e.round, e.part) for e in trace.events}
        floats = {e.dtype for e in trace.events if e.dtype.startswith(("float", "bfloat"))}
        self.precision = precision_of(*floats, trace.meta.get("dtype"), target.dtype)
        self.tried: dict[str, float | None] = {}  # every hypothesis tested ("CODE: name" → its score), for the report

    def has(self, stage: str, rnd: int) -> bool:
        return any((stage, rnd, p) in self._trace_keys for p in (None, T.TOPK_IDS, T.TOPK_LOGPROBS))

    def g(self, stage: str, rnd: int, part: str | None = None):
        """The golden value, its rows in the trace's order (tree steps are paired by content)."""
        return golden_value(self.golden, stage, rnd, part)

    def t(self, stage: str, rnd: int, part: str | None = None):
        try:
            return self.trace.get(stage, rnd, part=part) if part else self.trace.get(stage, rnd)
        except KeyError:
            return None

    def topk_obs(self, stage: str, rnd: int) -> dict:
        return {p: v for p in (T.TOPK_IDS, T.TOPK_LOGPROBS) if (v := self.t(stage, rnd, p)) is not None}

    def compare(self, observed, reference: torch.Tensor) -> Cmp:
        return compare_rows(observed, reference.detach().float().cpu(), self.tol(observed))

    def tol(self, observed) -> float:
        """The relative tolerance for `observed`: the caller's, else the trace's precision."""
        return self.fixed_tol if self.fixed_tol is not None else self.precision.rel

    def best(self, candidates: dict[str, torch.Tensor], observed) -> tuple[str | None, dict[str, float | None]]:
        """Name of the candidate the observation matches (lowest score among matches) and every candidate's score."""
        scores, hits = {}, []
        for name, cand in candidates.items():
            c = self.compare(observed, cand)
            scores[name] = c.score
            if c.match:
                hits.append((c.score, name))
        return (min(hits)[1] if hits else None), scores

    # -- the draft's head ---------------------------------------------------------------------------------------
    def head_rows(self, step: int, rnd: int, n: int, source: T.Trace | None = None) -> torch.Tensor | None:
        """The golden (or `source` replay's) pre-norm outputs of step `step` behind the trace's n top-k rows."""
        h = golden_value(source if source is not None else self.golden, T.draft_hidden_out(step), rnd)
        if h is None:
            return None
        if step == 0 and h.shape[0] != n:
            h = h[-n:]  # only the last row (the root's) proposes; an engine may record every row's top-k
        return h if h.shape[0] == n else None

    @torch.no_grad()
    def head(self, h: torch.Tensor, variant: str | None = None, to_target=None) -> Head:
        """The draft's head over pre-norm outputs `h` [n, H], or with one head mistake (`variant`)."""
        d = self.draft
        x = h.to(d.fc.weight)
        if variant == "final norm skipped":
            y = d.lm_head(x)
            y = y * d.config.logit_scale if d.config.logit_scale != 1.0 else y
        elif variant == "logit_scale not applied":
            y = d.lm_head(x if d.config.norm_output else d.norm(x))
        else:
            y = d.logits(x)
        lp = torch.log_softmax(y.float(), dim=-1).cpu()
        return Head(lp, to_target or (lambda i: d.to_target_ids(i.to(d.d2t.device)).cpu()), self.precision.nats)

    @torch.no_grad()
    def normed(self, i: int, hs: torch.Tensor) -> torch.Tensor | None:
        """Layer i's input RMSNorm applied to hidden state i: what a 'normed tap' captures."""
        norm = input_norm(self.target, i)
        if norm is None:
            return None
        return on_model(norm, hs, norm.weight)

    def hidden_states(self, rnd: int) -> dict[int, torch.Tensor]:
        out = {}
        for i in range(self.target.num_layers):
            h = self.g(replay_hs(i), rnd)
            if h is not None:
                out[i] = h.float()
        return out
