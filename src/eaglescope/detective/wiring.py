"""What a draft was trained on, measured: its teacher-forced acceptance under candidate input wirings.

A draft trained by another tool carries labels (a config's layer ids, maybe a TTT length), not a record of what its
training data held. The one thing that cannot lie is how well it predicts the target when it is fed one wiring or
another: fed what it was trained on, it agrees with the target; fed anything else, much less. So, from the target's
hidden states of every layer for a few hundred tokens (a target forward here, or states the engine recorded: nothing
else of the target is needed but its embedding, final norm and lm_head), doctor scores the draft teacher-forced
(acc_0..acc_k, TTT unrolled by train/ttt.py's own ttt_unroll) under:

    tap sets     any layer per segment (coordinate search from the served wiring; radius-limited on deep targets)
    order        every permutation of the best set
    embedding    hs[0] in a segment or not
    final state  the last layer's output before the final norm (vLLM's extraction) or after it (SGLang's capture)
    shift        row t (paired with token t+1) reads the features of position t-1, t or t+1

and reports the wiring the draft was trained for (the best) against the one the engine feeds it (the served config
read by the engine's convention: taps.py), with the acceptance of each, and the α_k profile under the best wiring:
step 1 fine and later steps collapsing is NO_TTT, low everywhere UNDERTRAINED, served much worse than best a wiring
mismatch. When the best is not clearly better than the runner-up, the trained wiring is called unexplained, not
guessed.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eaglescope.detective.acceptance import Acceptance
from eaglescope.detective.behaviour import LOW_ALPHA1, diagnose_behaviour
from eaglescope.detective.findings import Finding
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import Eagle3Draft
from eaglescope.taps import TapContract, default_tap_layers, engine_capture
from eaglescope.train.metrics import Batch, hit_counts, step_hits
from eaglescope.train.ttt import Teacher, draft_vocab_ids, ttt_unroll

RAW_FINAL = "final"  # the last layer's output before the final norm (vLLM's extract_hidden_states, id L)
NORMED_FINAL = "final.normed"  # after the final norm: what lm_head reads (SGLang's capture of the last state)
Source = int | str
SHIFTS = (-1, 1)  # tried beside 0 (EAGLE's: features of position t with token t+1)
# Two wirings are told apart when, on the positions both score, the hits only one of them gets differ by more than
# Z_SEPARATE standard deviations (a paired sign test) AND acc_0 differs by MIN_GAP: hundreds of positions, adjacent
# layers that look alike, and a tie must not be called a cause.
Z_SEPARATE = 2.5
MIN_GAP = 0.03
SWEEPS = 3
FINAL_NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")


# -- a wiring ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wiring:
    segments: tuple[Source, ...]  # what each fc segment reads, in concatenation order: hs[i], RAW_FINAL, NORMED_FINAL
    shift: int = 0  # row t (paired with token t+1) reads the features of position t + shift

    def contract(self, num_layers: int) -> TapContract | None:
        """The tap contract these segments are, when they are one (layer taps, low to high, distinct)."""
        segs = self.segments
        if all(isinstance(s, int) for s in segs) and list(segs) == sorted(set(segs)):
            try:
                return TapContract(tuple(segs), num_layers)
            except EagleScopeError:
                return None
        return None

    def describe(self, num_layers: int) -> str:
        c = self.contract(num_layers)
        if c is not None:
            text = f"taps {list(c.layers)}"
            ids = engine_ids(c)
            if ids:
                text += f" ({ids})"
        else:
            text = "segments [" + ", ".join(source_name(s) for s in self.segments) + "]"
        if self.shift:
            text += f", features of position t paired with token {pairing(self.shift)}"
        return text

    def to_dict(self, num_layers: int) -> dict:
        c = self.contract(num_layers)
        return {
            "segments": [s if isinstance(s, int) else s for s in self.segments],
            "shift": self.shift,
            "paired_token": pairing(self.shift),
            "taps": list(c.layers) if c else None,
            "engine_ids": {e: _ids(c, e) for e in ("vllm", "sglang-legacy")} if c else None,
            "text": self.describe(num_layers),
        }


def source_name(s: Source) -> str:
    if s == RAW_FINAL:
        return "final state before norm"
    if s == NORMED_FINAL:
        return "final normed state"
    return "embedding hs[0]" if s == 0 else f"hs[{s}]"


def pairing(shift: int) -> str:
    """The token that features of position t are paired with: t+1 is EAGLE's (what engines feed)."""
    k = 1 - shift
    return "t" if k == 0 else f"t{k:+d}"


def _ids(c: TapContract, engine: str) -> list[int] | None:
    try:
        return c.to_engine_ids(engine)
    except EagleScopeError:
        return None


def engine_ids(c: TapContract) -> str:
    """How the taps are written in the two id conventions (vLLM: ids as inputs; SGLang/SpecForge: ids as outputs)."""
    as_in, as_out = _ids(c, "vllm"), _ids(c, "sglang-legacy")
    parts = []
    if as_in is not None:
        parts.append(f"ids-as-inputs {as_in}")
    if as_out is not None:
        parts.append(f"ids-as-outputs {as_out}")
    return "; ".join(parts)


# -- the target's states -----------------------------------------------------------------------------------------
@dataclass
class LayerRecord:
    """Every hidden state of the target over a few samples (right padded), and its greedy choice at each position."""

    input_ids: torch.Tensor  # [B, T] int64
    valid: torch.Tensor  # [B, T] bool: a real token
    supervised: torch.Tensor  # [B, T] bool: a position whose next tokens count
    states: dict[Source, torch.Tensor]  # [B, T, H] each: hs[0..L-1], RAW_FINAL and NORMED_FINAL where known
    teacher_argmax: torch.Tensor  # [B, T] the target's argmax at each position (over its whole vocabulary)
    num_layers: int
    source: str

    @property
    def positions(self) -> int:
        return int(self.valid.sum())


def _pad(rows: list[torch.Tensor], fill=0) -> torch.Tensor:
    T = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), T, *rows[0].shape[1:]), fill, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def _take(samples: list[tuple[list[int], list[int]]], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    out, n = [], 0
    for ids, mask in samples:
        if n >= max_tokens:
            break
        ids, mask = ids[: max_tokens - n], mask[: max_tokens - n]
        if len(ids) >= 4:
            out.append((ids, mask))
            n += len(ids)
    if not out:
        raise EagleScopeError("the wiring search needs at least one sample of 4 or more tokens")
    return out


def _final_norm_module(target) -> torch.nn.Module | None:
    body = getattr(getattr(target, "model", None), "model", None)
    norm = getattr(body, "norm", None)
    return norm if isinstance(norm, torch.nn.Module) else None


@torch.inference_mode()
def record_from_target(target, samples: list[tuple[list[int], list[int]]], max_tokens: int = 256) -> LayerRecord:
    """A target forward in this process over the first `max_tokens` tokens of `samples` ((input_ids, loss_mask)
    pairs), every layer tapped; the state before the final norm read by a hook on that norm."""
    samples = _take(samples, max_tokens)
    L, H = target.num_layers, target.hidden_size
    before = target.taps
    norm = _final_norm_module(target)
    raw: list[torch.Tensor] = []
    hook = norm.register_forward_pre_hook(lambda m, a: raw.append(a[0].detach())) if norm is not None else None
    per: dict[Source, list[torch.Tensor]] = {}
    argmax, ids_rows, masks = [], [], []
    target.set_taps(TapContract(tuple(range(L)), L))
    try:
        for ids, mask in samples:
            x = torch.tensor([ids], device=target.device)
            raw.clear()
            out = target.hidden_states(x)
            aux = out.aux[0].float().cpu()  # [T, L·H]
            for i in range(L):
                per.setdefault(i, []).append(aux[:, i * H : (i + 1) * H])
            per.setdefault(NORMED_FINAL, []).append(out.final_hidden[0].float().cpu())
            if raw:
                per.setdefault(RAW_FINAL, []).append(raw[-1].reshape(-1, H)[: len(ids)].float().cpu())
            argmax.append(out.logits[0].argmax(-1).cpu())
            ids_rows.append(torch.tensor(ids))
            masks.append(torch.tensor(mask, dtype=torch.bool))
    finally:
        target.set_taps(before)
        if hook is not None:
            hook.remove()
    states = {s: _pad(v) for s, v in per.items() if len(v) == len(samples)}
    valid = _pad([torch.ones(len(i), dtype=torch.bool) for i in ids_rows], False)
    return LayerRecord(_pad(ids_rows), valid, valid.clone(), states, _pad(argmax), L, "a target forward in process")


# -- recorded by the engine ----------------------------------------------------------------------------------------
def save_layer_states(path: Path | str, token_ids: torch.Tensor, hidden_states: torch.Tensor) -> None:
    """One request's states in the layout `--layer-states` reads (vLLM's extract_hidden_states layout, as
    speculators' data generation writes it): token_ids [T], hidden_states [T, L+1, H] = hs[0..L-1] and the last
    layer's output before the final norm."""
    from safetensors.torch import save_file

    save_file({"token_ids": token_ids.contiguous(), "hidden_states": hidden_states.contiguous()}, str(path))


@dataclass
class TargetHeadParts:
    """What the search needs of a target whose layers are not loaded: its embedding, final norm and lm_head."""

    embedding: torch.Tensor  # [V, H]
    final_norm: torch.Tensor | None  # [H]
    lm_head: torch.Tensor  # [V, H]
    eps: float


def load_head_parts(target_dir: Path | str) -> TargetHeadParts:
    from eaglescope.models.targets.head import EMBEDDING_NAMES, HEAD_NAMES, read_fingerprint
    from eaglescope.models.targets.loading import check_finite, load_tensors

    text, fp, _ = read_fingerprint(target_dir)
    found = load_tensors(
        Path(target_dir), {"embedding": EMBEDDING_NAMES, "lm_head": HEAD_NAMES, "norm": FINAL_NORM_NAMES}
    )
    if "embedding" not in found:
        raise EagleScopeError(f"{target_dir} has no embed_tokens.weight")
    check_finite(found, Path(target_dir))
    head = found.get("lm_head", found["embedding"])
    return TargetHeadParts(found["embedding"], found.get("norm"), head, float(text.get("rms_norm_eps", 1e-6)))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def _head_argmax(head: torch.Tensor, normed: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """argmax of lm_head(normed) a few rows at a time: a 163,840-token vocabulary never exists whole in float32."""
    out = torch.empty(normed.shape[0], dtype=torch.long)
    for a in range(0, normed.shape[0], rows):
        out[a : a + rows] = (normed[a : a + rows].to(head.dtype) @ head.T).argmax(-1)
    return out


def state_files(directory: Path | str) -> list[Path]:
    """The per-layer state files of `--layer-states`, refused at once when there are none."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise EagleScopeError(f"--layer-states {directory} holds no *.safetensors files of per-layer states")
    return files


def record_from_files(
    directory: Path | str, parts: TargetHeadParts, num_layers: int, max_tokens: int = 256
) -> LayerRecord:
    """Per-layer states the engine recorded (`save_layer_states`' layout, one *.safetensors per request), the first
    `max_tokens` tokens; the target's greedy choice from its final norm and lm_head."""
    files = state_files(directory)
    L = num_layers
    ids_rows, per, n = [], {}, 0
    for f in files:
        if n >= max_tokens:
            break
        try:
            with safe_open(str(f), "pt") as h:
                keys = set(h.keys())
                tok_key = "token_ids" if "token_ids" in keys else "input_ids"
                if tok_key not in keys or "hidden_states" not in keys:
                    raise EagleScopeError(f"{f} lacks token_ids or hidden_states (vLLM's extract_hidden_states layout)")
                ids, hs = h.get_tensor(tok_key).long().reshape(-1), h.get_tensor("hidden_states")
        except (SafetensorError, OSError) as e:
            raise EagleScopeError(f"cannot read {f} ({e})") from None
        if hs.dim() != 3 or hs.shape[0] != ids.shape[0] or hs.shape[1] != L + 1:
            raise EagleScopeError(
                f"{f}: hidden_states has shape {list(hs.shape)}; expected [T={ids.shape[0]}, {L + 1}, H]: "
                f"hs[0..{L - 1}] and the last layer's output, every layer of this {L}-layer target"
            )
        keep = min(ids.shape[0], max_tokens - n)
        if keep < 4:
            continue
        ids, hs = ids[:keep], hs[:keep].float()
        ids_rows.append(ids)
        # the file's index i is vLLM's aux id i; the tap contract says which hidden state that is (id L: the last
        # layer's output, before the final norm, which no tap contract names)
        for i, hf in enumerate(engine_capture(list(range(L)), "vllm", L)):
            per.setdefault(hf, []).append(hs[:, i])
        per.setdefault(RAW_FINAL, []).append(hs[:, L])
        n += keep
    if not ids_rows:
        raise EagleScopeError(f"--layer-states {directory} holds no request of 4 or more tokens")
    states = {s: _pad(v) for s, v in per.items()}
    if RAW_FINAL not in states or parts.final_norm is None:
        raise EagleScopeError(
            "the target's greedy choices need the last layer's output (hidden_states index L) and the target's final "
            "norm (model.norm.weight): record every layer and keep the final norm in the target directory"
        )
    raw = states[RAW_FINAL]
    normed = _rms_norm(raw, parts.final_norm, parts.eps)
    states[NORMED_FINAL] = normed
    B, T, H = raw.shape
    argmax = _head_argmax(parts.lm_head, normed.reshape(B * T, H)).reshape(B, T)
    valid = _pad([torch.ones(len(i), dtype=torch.bool) for i in ids_rows], False)
    return LayerRecord(_pad(ids_rows), valid, valid.clone(), states, argmax, L, f"recorded by the engine: {directory}")


# -- scoring -----------------------------------------------------------------------------------------------------
class SegmentProjections:
    """fc is linear in each segment: fc(cat(x_0, .., x_{n-1})) = Σ_j W_j x_j with W_j = fc.weight[:, jH:(j+1)H]. So
    each source's projection through each segment's block is computed once (on first use) and a candidate wiring is
    a sum of n of them: scoring hundreds of wirings costs hundreds of draft steps, not hundreds of fc products over
    n·H-wide features. EAGLE 3.1 keeps that: fc_norm is one RMSNorm per segment (W_j norm_j(x_j)), and
    norm_before_fc's one RMSNorm over the whole concatenation divides the sum by one number per row, computed from
    each source's sum of squares (also kept once)."""

    def __init__(self, draft: Eagle3Draft, record: LayerRecord) -> None:
        self.draft, self.record = draft, record
        c = draft.config
        self.H, self.n = c.target_hidden_size, c.num_aux
        self.cache: dict[tuple[int, Source], torch.Tensor] = {}
        self.squares: dict[Source, torch.Tensor] = {}

    @torch.inference_mode()
    def get(self, j: int, s: Source) -> torch.Tensor:
        key = (j, s)
        if key not in self.cache:
            d, x = self.draft, self.record.states[s]
            w = d.fc.weight[:, j * self.H : (j + 1) * self.H]
            x = x.to(w.device, w.dtype)
            if d.fc_norm is not None:
                x = d.fc_norm[j](x)
            if d.input_norm is not None:
                x = x * d.input_norm.weight[j * self.H : (j + 1) * self.H]
            self.cache[key] = (x @ w.T).float()  # [B, T, H_draft]
        return self.cache[key]

    def square(self, s: Source) -> torch.Tensor:
        if s not in self.squares:
            self.squares[s] = self.record.states[s].float().pow(2).sum(-1, keepdim=True)
        return self.squares[s]

    def features(self, wiring: Wiring) -> torch.Tensor:
        """draft.project(cat(segments)) [B, T, H], from the cached per-segment projections."""
        out = sum(self.get(j, s) for j, s in enumerate(wiring.segments))
        norm = self.draft.input_norm
        if norm is not None:
            ms = sum(self.square(s) for s in wiring.segments) / (self.n * self.H)
            out = out * torch.rsqrt(ms.to(out.device) + norm.eps)
        return out.to(self.draft.fc.weight.dtype)


@dataclass
class Score:
    wiring: Wiring
    steps: int
    hits: torch.Tensor  # [B, T, K] bool, in the record's row coordinates
    supervised: torch.Tensor  # [B, T, K] bool
    loglik: float  # mean log-probability of the target's choice at step 0 (a tie-break finer than acc_0)

    def acc(self) -> list[float]:
        n = self.supervised.sum((0, 1)).tolist()
        h = (self.hits & self.supervised).sum((0, 1)).tolist()
        return [a / b if b else math.nan for a, b in zip(h, n, strict=True)]

    @property
    def acc0(self) -> float:
        return self.acc()[0]

    def key(self) -> tuple[float, float]:
        a = self.acc0
        return (-1.0 if math.isnan(a) else a, self.loglik)

    def acceptance(self, source: str) -> Acceptance:
        """acc_k and conditional α_k (per sample counts, as predict_on_data keeps them)."""
        groups = []
        for b in range(self.hits.shape[0]):
            c = hit_counts(self.hits[b], self.supervised[b])
            groups.append((c["reached"], c["accepted"]))
        positions = int(self.supervised[..., 0].sum())
        return Acceptance.from_groups(source, groups, positions, acc=self.acc())

    def summary(self, num_layers: int) -> dict:
        a = self.acceptance("teacher-forced")
        return {
            "wiring": self.wiring.to_dict(num_layers),
            "acc": [None if math.isnan(x) else round(x, 4) for x in self.acc()],
            "alpha": [None if math.isnan(x) else round(x, 4) for x in a.alpha],
            "tau": a.accept_length,
            "positions": int(self.supervised[..., 0].sum()),
            "loglik": round(self.loglik, 4),
        }


@torch.inference_mode()
def score(draft: Eagle3Draft, proj: SegmentProjections, wiring: Wiring, steps: int) -> Score:
    """Teacher-forced hits of `steps` TTT steps (train/ttt.py's unroll) with step 0 fed `wiring`."""
    rec = proj.record
    feats = proj.features(wiring)
    d = wiring.shift
    B, T = rec.input_ids.shape
    a, b = max(0, -d), T - max(0, d)  # rows whose features exist at t + shift
    dev = draft.fc.weight.device
    ids = rec.input_ids[:, a:b].to(dev)
    valid = (rec.valid[:, a:b] & rec.valid[:, a + d : b + d]).to(dev)
    sup = rec.supervised[:, a:b].to(dev) & valid
    teacher = Teacher(torch.empty(0), rec.teacher_argmax[:, a:b].to(dev))
    unrolled = ttt_unroll(draft, ids, None, steps, projected=feats[:, a + d : b + d].to(dev))
    batch = Batch(ids, sup, valid, feats, teacher)
    hits, supk = step_hits(draft, unrolled.logits, batch)
    full_h = torch.zeros(B, T, steps, dtype=torch.bool)
    full_s = torch.zeros(B, T, steps, dtype=torch.bool)
    full_h[:, a:b], full_s[:, a:b] = hits.cpu(), supk.cpu()
    return Score(wiring, steps, full_h, full_s, _loglik(draft, unrolled.logits[0], teacher.argmax, supk[..., 0]))


def _loglik(draft: Eagle3Draft, logits: torch.Tensor, teacher_argmax: torch.Tensor, sup: torch.Tensor) -> float:
    """Mean log-probability the draft gives the target's next choice at step 0, where that choice is in its
    vocabulary (row t predicts the target's argmax at t+1)."""
    vocab_ids = draft_vocab_ids(draft)
    to_draft = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=logits.device)
    to_draft[vocab_ids] = torch.arange(vocab_ids.numel(), device=logits.device)
    nxt = torch.zeros_like(teacher_argmax)
    nxt[:, :-1] = teacher_argmax[:, 1:]
    idx = to_draft[nxt]
    keep = sup & (idx >= 0)
    if not bool(keep.any()):
        return -math.inf
    lp = torch.log_softmax(logits.float(), -1).gather(-1, idx.clamp_min(0)[..., None])[..., 0]
    return float(lp[keep].mean())


def separated(better: Score, worse: Score) -> dict:
    """Whether `better` beats `worse` at step 0 beyond chance, on the positions both score (a paired sign test)."""
    both = better.supervised[..., 0] & worse.supervised[..., 0]
    hb, hw = better.hits[..., 0] & both, worse.hits[..., 0] & both
    only_b, only_w = int((hb & ~hw).sum()), int((hw & ~hb).sum())
    n = int(both.sum())
    gap = (only_b - only_w) / n if n else 0.0
    z = (only_b - only_w) / math.sqrt(only_b + only_w) if only_b + only_w else 0.0
    return {"positions": n, "only_better": only_b, "only_worse": only_w, "gap": gap, "z": z,
            "separated": z > Z_SEPARATE and gap >= MIN_GAP}  # fmt: skip


# -- the search --------------------------------------------------------------------------------------------------
@dataclass
class WiringSearch:
    served: Score
    best: Score
    runner_up: Score | None
    declared: Score | None  # the draft's own contract, when it is not what is served
    scored: dict[Wiring, Score]  # every wiring scored at step 0
    num_layers: int
    record_source: str
    notes: list[str] = field(default_factory=list)


class Searcher:
    def __init__(self, draft: Eagle3Draft, record: LayerRecord, radius: int | None = None) -> None:
        self.draft, self.record = draft, record
        self.proj = SegmentProjections(draft, record)
        self.L = record.num_layers
        self.radius = radius
        self.scored: dict[Wiring, Score] = {}
        self.extra = [s for s in (RAW_FINAL, NORMED_FINAL) if s in record.states]

    def screen(self, w: Wiring) -> Score:
        if w not in self.scored:
            self.scored[w] = score(self.draft, self.proj, w, 1)
        return self.scored[w]

    def best_of(self, ws) -> Score:
        return max((self.screen(w) for w in ws), key=Score.key)

    def sources_near(self, s: Source, anchors: set[int]) -> list[Source]:
        """Candidates for one segment: every layer of a shallow target; of a deep one, the layers within `radius` of
        the segment's current source and of what the served and declared wirings put there, and the embedding."""
        L, r = self.L, self.radius
        if r is None or L <= 2 * r + 4:
            layers = set(range(L))
        else:
            around = anchors | ({s} if isinstance(s, int) else {L - 1})
            layers = {i for a in around for i in range(a - r, a + r + 1) if 0 <= i < L} | {0}
        return [*sorted(layers), *self.extra]

    def run(self, served: Wiring, declared: Wiring | None, also: tuple[Wiring, ...] = ()) -> Score:
        """Coordinate search on acc_0 from the served wiring: one segment at a time over its candidates, then every
        order of the best set, then the shifts; repeated until nothing improves. `also`: more starting points."""
        L, n = self.L, len(served.segments)
        start = [served, *([declared] if declared else []), *also]
        if n == 3 and L >= 7:
            start.append(Wiring(default_tap_layers(L)))
        start += [Wiring(p, served.shift) for p in itertools.permutations(served.segments)]
        best = self.best_of(start)
        anchors = [{w.segments[j] for w in start[:2] if isinstance(w.segments[j], int)} for j in range(n)]
        for _ in range(SWEEPS):
            before = best.wiring
            for j in range(n):
                segs, d = best.wiring.segments, best.wiring.shift
                near = self.sources_near(segs[j], anchors[j])
                best = max(best, self.best_of(Wiring((*segs[:j], x, *segs[j + 1 :]), d) for x in near), key=Score.key)
            segs, d = best.wiring.segments, best.wiring.shift
            best = max(best, self.best_of(Wiring(p, d) for p in itertools.permutations(segs)), key=Score.key)
            best = max(best, self.best_of(Wiring(best.wiring.segments, x) for x in (0, *SHIFTS)), key=Score.key)
            if best.wiring == before:
                break
        return best


def search_wiring(
    draft: Eagle3Draft,
    record: LayerRecord,
    served: Wiring,
    declared: Wiring | None = None,
    steps: int = 5,
    radius: int | None = 3,
    also: tuple[Wiring, ...] = (),
) -> WiringSearch:
    """The best wiring for `draft` on `record` (screened at step 0), and `steps`-deep TTT profiles of the best, the
    served, the runner-up and the declared wiring. `also`: other wirings to score (other engines' readings)."""
    if draft.config.num_aux != len(served.segments):
        raise EagleScopeError(
            f"the draft's fc reads {draft.config.num_aux} segments, the served wiring names {len(served.segments)}"
        )
    s = Searcher(draft, record, radius)
    best = s.run(served, declared if declared != served else None, also)
    others = sorted((x for w, x in s.scored.items() if w != best.wiring), key=Score.key, reverse=True)
    runner = others[0].wiring if others else None

    def deep(w: Wiring | None) -> Score | None:
        return None if w is None else score(draft, s.proj, w, steps)

    return WiringSearch(
        served=deep(served),
        best=deep(best.wiring),
        runner_up=deep(runner),
        declared=deep(declared) if declared is not None and declared != served else None,
        scored=s.scored,
        num_layers=record.num_layers,
        record_source=record.source,
    )


# -- findings ----------------------------------------------------------------------------------------------------
def difference(trained: Wiring, served: Wiring) -> list[str]:
    """What differs between two wirings, in the finding codes' terms (one code per kind of difference)."""
    kinds: list[str] = []
    if trained.shift != served.shift:
        kinds.append("SHIFT_OFF_BY_ONE")
    t, s = trained.segments, served.segments
    if t == s:
        return kinds
    if sorted(map(str, t)) == sorted(map(str, s)):
        return [*kinds, "TAP_ORDER"]
    steps = set()
    for a, b in zip(t, s, strict=True):
        if a == b:
            continue
        if {a, b} == {RAW_FINAL, NORMED_FINAL}:
            kinds.append("TAP_NORMED")
        elif isinstance(a, int) and isinstance(b, int) and 0 in (a, b):
            kinds.append("TAP_EMBEDDING")
        elif isinstance(a, int) and isinstance(b, int) and abs(a - b) == 1:
            steps.add(a - b)
        else:
            kinds.append("TRAINED_WIRING_MISMATCH")
    if steps:
        kinds.append("TAP_OFF_BY_ONE" if len(steps) == 1 else "TRAINED_WIRING_MISMATCH")
    return list(dict.fromkeys(kinds))


def code_of(kinds: list[str]) -> str:
    """One kind of difference keeps its own code; several are TRAINED_WIRING_MISMATCH."""
    return kinds[0] if len(kinds) == 1 else "TRAINED_WIRING_MISMATCH"


def _fix(trained: Wiring, L: int) -> str:
    c = trained.contract(L)
    if trained.shift:
        return (
            "the draft was trained on features paired with the wrong token (the training data's shift): retrain "
            "with features of position t paired with token t+1 (speculators' shift_batch, EAGLE's alignment)"
        )
    if c is not None:
        ids = {e: _ids(c, e) for e in ("vllm", "sglang-legacy")}
        return (
            f"serve the taps it was trained on: eagle_aux_hidden_state_layer_ids {ids['vllm']} for vLLM, "
            f"{ids['sglang-legacy']} for SGLang's Llama-family targets (eaglescope export writes each engine's ids), "
            "or retrain on the served taps"
        )
    return "retrain the draft on the features the engine feeds it (no engine can be made to feed these)"


def plausible(ws: WiringSearch) -> list[Score]:
    """The best wiring and every scored wiring within chance of it: what the draft may have been trained on."""
    best = ws.scored[ws.best.wiring]
    near = [x for w, x in ws.scored.items() if w != best.wiring and not separated(best, x)["separated"]]
    return [best, *sorted(near, key=Score.key, reverse=True)]


def established(ws: WiringSearch) -> tuple[list[str], list[dict]]:
    """The kinds of difference from the served wiring that every plausible wiring shares (a cause is named only when
    whatever the draft was trained on, within chance, implies it), and the plausible wirings with their own kinds.
    A draft trained unshifted on taps [2, 4, 5] may score as well on [2, 4, 6] unshifted: the pairing is established
    either way, which taps is not."""
    served, L = ws.served.wiring, ws.num_layers
    cands = [{"text": x.wiring.describe(L), "acc_0": x.acc0, "differences": difference(x.wiring, served)}
             for x in plausible(ws)]  # fmt: skip
    common = [k for k in cands[0]["differences"] if all(k in c["differences"] for c in cands[1:])]
    return common, cands


def findings_of(ws: WiringSearch) -> tuple[list[Finding], dict]:
    """Findings and context["wiring"] from a search."""
    L = ws.num_layers
    best, served, runner = ws.best, ws.served, ws.runner_up
    ctx = {
        "mode": ws.record_source,
        "wirings_scored": len(ws.scored),
        "served": served.summary(L),
        "trained_for": best.summary(L),
        "runner_up": runner.summary(L) if runner else None,
        "declared": ws.declared.summary(L) if ws.declared else None,
        "served_vs_best": separated(best, served),
        "best_vs_runner_up": separated(best, runner) if runner else None,
        "verdict": None,
    }
    line = (
        f"trained for {best.wiring.describe(L)}: acc_0 {best.acc0:.2f}; "
        f"served {served.wiring.describe(L)}: acc_0 {served.acc0:.2f}"
    )
    ctx["line"] = line
    findings: list[Finding] = []
    evidence = {k: ctx[k] for k in ("served", "trained_for", "runner_up", "served_vs_best", "best_vs_runner_up")}
    if best.acc0 < LOW_ALPHA1:
        ctx["verdict"] = "low under every wiring"
    elif best.wiring != served.wiring and ctx["served_vs_best"]["separated"]:
        # Named only where every wiring within chance of the best agrees: each kind of difference they all share is
        # established; the rest (which exact taps, say) is reported as not told apart.
        kinds, cands = established(ws)
        ctx["claims"] = {"established": kinds, "plausible": cands}
        evidence |= {"claims": ctx["claims"]}
        if not kinds:
            ctx["verdict"] = "unexplained"
            alts = "; ".join(f"{c['text']} acc_0 {c['acc_0']:.2f}" for c in cands[1:4])
            findings.append(
                Finding(
                    "WIRING_UNEXPLAINED",
                    "target.aux",
                    f"the served wiring ({served.wiring.describe(L)}, acc_0 {served.acc0:.2f}) is clearly not what the "
                    f"draft was trained on, but which wiring it was is not told apart: the best, "
                    f"{best.wiring.describe(L)} (acc_0 {best.acc0:.2f}), is not clearly better than {alts}, and they "
                    "differ from the served one in different ways",
                    evidence,
                    "measure on more tokens (--wiring-tokens), or ask whoever trained the draft which layers and "
                    "pairing its data held",
                    0.5,
                    support="unexplained",
                )
            )
        else:
            ctx["verdict"] = "mismatch"
            code = code_of(kinds)
            also = ""
            if len(cands) > 1:
                also = (f"; {len(cands) - 1} other wiring(s) within chance of it differ from the served one the same "
                        f"way ({cands[1]['text']}, acc_0 {cands[1]['acc_0']:.2f})")  # fmt: skip
            findings.append(
                Finding(
                    code,
                    "target.aux",
                    f"measured, not assumed: the draft was {line} (it predicts the target far better on the features "
                    f"it was trained on than on those it is served){also}",
                    evidence | {"differences": kinds},
                    _fix(best.wiring, L),
                    0.9,
                    support="measured",
                )
            )
    elif best.wiring != served.wiring:
        # better somewhere else, but not beyond chance on these positions: no claim either way
        ctx["verdict"] = "not told apart"
        ctx["note"] = (
            f"{best.wiring.describe(L)} scores acc_0 {best.acc0:.2f} against the served {served.acc0:.2f}, within "
            f"chance on {ctx['served_vs_best']['positions']} positions: measure on more tokens (--wiring-tokens)"
        )
    else:
        ctx["verdict"] = "served is the trained wiring"
    if ctx["verdict"] in ("low under every wiring", "not told apart"):  # nothing says it was trained for it
        ctx["line"] = "best measured " + line.removeprefix("trained for ")
    profile = best.acceptance(f"teacher-forced under the best wiring ({best.wiring.describe(L)})")
    ctx["profile"] = profile.to_dict()
    if "SHIFT_OFF_BY_ONE" in (ctx.get("claims") or {}).get("established", []):
        # TTT's later steps read the draft's own outputs at the pairing it was trained with; unrolled at another
        # pairing their acceptance says nothing about how the draft was trained
        ctx["profile_note"] = "NO_TTT and UNDERTRAINED are not judged: the draft was trained at another pairing"
        return findings, ctx
    behaviour = diagnose_behaviour(None, profile)
    findings += [f for f in behaviour.findings if f.code in ("NO_TTT", "UNDERTRAINED")]
    return findings, ctx


def format_wiring(ctx: dict) -> list[str]:
    """The report's lines for context["wiring"]."""
    lines = [f"wiring     {ctx['line']} ({ctx['wirings_scored']} wirings scored at step 0; {ctx['mode']})"]
    best_label = "best" if ctx["line"].startswith("best measured") else "trained for"
    for key in ("trained_for", "served"):
        s = ctx[key]
        acc = " ".join("-" if x is None else f"{x:.2f}" for x in s["acc"])
        alpha = " ".join("-" if x is None else f"{x:.2f}" for x in s["alpha"])
        label = best_label if key == "trained_for" else "served"
        lines.append(f"           {label:<11} acc_k [{acc}], α_k [{alpha}] over {s['positions']} "
                     "positions")  # fmt: skip
    if ctx.get("declared"):
        d = ctx["declared"]
        how = "inferred from its ids" if ctx.get("declared_inferred") else "recorded in its eaglescope section"
        lines.append(f"           declared    {d['wiring']['text']} ({how}): acc_0 {d['acc'][0]}")
    if ctx.get("note"):
        lines.append(f"           {ctx['note']}")
    return lines


# -- doctor --measure-wiring -------------------------------------------------------------------------------------
def served_wirings(static_ctx: dict, engines: tuple[str, ...], declared: TapContract) -> dict[str, Wiring]:
    """What each checked engine feeds the draft: the checkpoint's ids read by its convention (static.check_engines);
    the declared taps where no engine was checked."""
    out: dict[str, Wiring] = {}
    caps = static_ctx.get("engines") or {}
    for e in engines:
        cap = (caps.get(e) or {}).get("captures")
        if cap is not None and len(cap) == declared.count:
            out[e] = Wiring(tuple(cap))
    return out or {"declared": Wiring(declared.layers)}


def measure(
    target_dir: Path | str,
    draft_dir: Path | str,
    static_ctx: dict,
    engines: tuple[str, ...],
    data: Path | str | None = None,
    layer_states: Path | str | None = None,
    tokens: int = 256,
    device: str | None = None,
    dtype=None,
    models=None,
    steps: int = 5,
    radius: int | None = 3,
) -> tuple[list[Finding], dict]:
    """doctor --measure-wiring: the record (engine-recorded states with a head-only target, else a target forward
    over --data), the search, its findings and context["wiring"]. `models`: a callable returning (target, LoadedDraft)
    with the target's embedding in the draft (doctor's loader, or the pair it has loaded already)."""
    import warnings

    from eaglescope.detective.acceptance_sources import load_samples
    from eaglescope.models.draft import load_draft
    from eaglescope.models.targets import parse_device, parse_dtype
    from eaglescope.models.targets.head import read_fingerprint

    if tokens < 8:
        raise EagleScopeError("--wiring-tokens must be >= 8")
    if layer_states is None and data is None:
        raise EagleScopeError(
            "--measure-wiring needs the target's per-layer states: --data (the target runs here) or --layer-states DIR "
            "(recorded by the engine; the target directory then needs only its config, embedding, final norm, lm_head)"
        )
    L = read_fingerprint(target_dir)[1].num_layers
    dev = parse_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, dev)
    if layer_states is not None:
        parts = load_head_parts(target_dir)
        record = record_from_files(layer_states, parts, L, tokens)
        embedding, parts = parts.embedding, None  # lm_head (gigabytes at Kimi's vocabulary) is done with
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an inferred contract is reported by the static checks
            loaded = load_draft(draft_dir, L, device=dev, dtype=dt)
        if not loaded.has_embedding:
            # the target's table itself, not a copy into the draft's: one table of 2.3 GB at Kimi's shape, not two
            table = loaded.model.embed_tokens.weight
            if tuple(embedding.shape) != tuple(table.shape):
                raise EagleScopeError(
                    f"the target's embedding is {list(embedding.shape)}, the draft's {list(table.shape)}"
                )
            loaded.model.embed_tokens.weight = torch.nn.Parameter(embedding.to(dev, dt), requires_grad=False)
        del embedding
    else:
        target, loaded = models()
        samples = load_samples(data, getattr(target, "tokenizer", None), 64)
        record = record_from_target(target, samples, tokens)
    declared = loaded.contract.taps
    served = served_wirings(static_ctx, engines, declared)
    first = next(iter(served.values()))
    t0 = time.perf_counter()
    ws = search_wiring(loaded.model, record, first, Wiring(declared.layers), steps, radius, tuple(served.values()))
    seconds = time.perf_counter() - t0
    findings, ctx = findings_of(ws)
    ctx["served_by"] = next(iter(served))
    ctx["declared_taps"] = list(declared.layers)
    ctx["declared_inferred"] = loaded.contract.inferred
    ctx["engines"] = {e: {"wiring": w.to_dict(L), "acc_0": round(ws.scored[w].acc0, 4)} for e, w in served.items()}
    ctx["codes"] = [f.code for f in findings]
    ctx["search_seconds"] = round(seconds, 2)
    return findings, ctx
