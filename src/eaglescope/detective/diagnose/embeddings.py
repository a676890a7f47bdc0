"""Causes in the token embeddings the draft reads: shifted tokens, another table."""

from __future__ import annotations

import math

import torch

from eaglescope import trace as T
from eaglescope.detective.diagnose.evidence import Cmp, Evidence, fp_slack
from eaglescope.detective.diagnose.judge import Hypothesis, judge, tensor_hypothesis, unexplained_finding
from eaglescope.detective.findings import Finding
from eaglescope.detective.replay import comparable_rows, pairwise_row_errors, row_norms


def _sequence(ev: Evidence) -> list[int]:
    """The emitted sequence the traced run followed: prompt, first token, then each round's tokens."""
    seq = list(ev.golden.meta.get("prompt_ids", []))
    for rnd in sorted(ev.golden.rounds()):
        bonus = ev.g(T.VERIFY_BONUS, rnd)
        if rnd == 0:
            seq.append(int(bonus.flatten()[0]))
            continue
        acc, toks = ev.g(T.VERIFY_ACCEPTED, rnd), ev.g(T.VERIFY_TOKENS, rnd)
        if acc is None or toks is None or bonus is None:
            break
        seq += [int(toks[i]) for i in acc.flatten().tolist()] + [int(bonus.flatten()[0])]
    return seq


_TABLE_CHUNK = 8192  # rows of the embedding table compared at once: a 163840 x 7168 table is 9.4 GB in float64


def _nearest_rows(emb: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the table row nearest to each row, ||row - that table row|| / ||that table row||), in float64, the
    table read in chunks so that a large vocabulary is never copied whole."""
    x = rows.detach().double().cpu()
    best_d = torch.full((x.shape[0],), math.inf, dtype=torch.float64)
    best_i = torch.zeros(x.shape[0], dtype=torch.long)
    for start in range(0, emb.shape[0], _TABLE_CHUNK):
        part = emb[start : start + _TABLE_CHUNK].detach().double().cpu()
        d, i = torch.cdist(x, part).min(dim=-1)
        closer = d < best_d
        best_d, best_i = torch.where(closer, d, best_d), torch.where(closer, i + start, best_i)
    norms = emb[best_i].detach().double().cpu().norm(dim=-1)
    return best_i, best_d / norms.clamp_min(1e-12)


def _tokens_of(emb: torch.Tensor, rows: torch.Tensor) -> list[int] | None:
    """The token whose embedding each row is (the golden rows are the target's table exactly), or None."""
    idx, rel = _nearest_rows(emb, rows)
    return [int(i) for i in idx.tolist()] if bool((rel <= 1e-3).all()) else None


def diagnose_embed(ev: Evidence, rnd: int, stage: str, observed, step: int) -> list[Finding]:
    gold = ev.g(stage, rnd)
    if gold is None:
        return []
    emb = ev.draft.embed_tokens.weight
    clean = ev.compare(observed, gold)
    hyps: list[Hypothesis] = []
    if step == 0:
        seq = _sequence(ev)
        P = gold.shape[0]
        # pending features sit at positions [start, start+P) and pair with the token after each position
        prompt_len = len(ev.golden.meta.get("prompt_ids", []))
        start = _committed_before(ev, rnd, prompt_len)
        right = [seq[p + 1] if 0 <= p + 1 < len(seq) else 0 for p in range(start, start + P)]
        for name, ids, layout in _shifted_tokens(seq, start, P, right):
            cand = emb[torch.tensor(ids, device=emb.device)].float().cpu()
            hyps.append(
                tensor_hypothesis(
                    ev, observed, "SHIFT_OFF_BY_ONE", name, _shift_verdict(name, layout, right[-1]), _SHIFT_FIX, cand,
                    bonus_row=layout,
                )
            )  # fmt: skip
    found = judge(ev, stage, rnd, clean, hyps)
    if found:
        return found
    if (other := _other_tokens(emb, gold, observed, ev.tol(observed))) is not None:
        return [_other_tokens_finding(stage, rnd, *other, embedded=True)]
    return judge(ev, stage, rnd, clean, _other_table_hypotheses(ev, rnd, stage, observed, gold))


_SHIFT_FIX = "pair features at position t with the embedding of token t+1"


def _shifted_tokens(seq: list[int], start: int, P: int, right: list[int]):
    """(name, token per row, bonus-row layout) of the step-0 pairings a shift mistake gives for the P rows from
    position `start`: each row's own token or the one two ahead, plainly, and as an engine lays them out that writes
    the round's newest token (the bonus) on the row it samples from after shifting (vLLM's set_inputs_first_pass
    writes next_token_ids at token_indices_to_sample): every row shifted but the last, which stays right."""
    for delta, name in ((0, "the token at the feature's own position"), (2, "the token two ahead")):
        ids = [seq[p + delta] if 0 <= p + delta < len(seq) else 0 for p in range(start, start + P)]
        yield name, ids, False
        if P > 1:
            yield f"{name}, the sampled row keeping the newest token", ids[:-1] + right[-1:], True


def _shift_verdict(name: str, layout: bool, newest: int) -> str:
    if not layout:
        return f"step-0 inputs pair each feature with {name} instead of the next token"
    what = name.removesuffix(", the sampled row keeping the newest token")
    return (
        f"step-0 inputs pair each feature with {what} instead of the next token, except the row the draft samples "
        f"from, which holds the round's newest token ({newest}) as the engine writes it there after the shift "
        "(vLLM's padded drafter batch): the rotation by one before it was skipped or doubled"
    )


def _other_tokens_finding(stage: str, rnd: int, rows: list[int], fed: list[int], want: list[int], embedded: bool):
    held = (
        f"the target's embedding of tokens {fed}, not of {want}: the embedding is right but"
        if embedded
        else (f"tokens {fed}, not {want}:")
    )
    return unexplained_finding(
        stage,
        rnd,
        f"{stage} rows {rows} are {held} other tokens were fed at those rows (no named hypothesis covers that)",
        {"rows": rows, "fed_tokens": fed, "expected_tokens": want},
        "pair each position's features with the token after it at every row (vLLM 0.32's padded drafter "
        "batch pairs the last row of a prefill chunk with the prompt's last token: disable_padded_drafter_"
        "batch, or prefill unchunked)",
    )


def diagnose_tokens(ev: Evidence, rnd: int, stage: str, observed, step: int) -> list[Finding]:
    """The token ids step 0 read (draft.step0.tokens), compared exactly: a shift mistake, in vLLM's layout or plainly,
    or other tokens at a few rows. A later step's tokens are the previous step's drafts, so a difference there shows
    at that step's top-k first."""
    gold = ev.g(stage, rnd)
    if step != 0 or gold is None or not isinstance(observed, torch.Tensor) or observed.shape != gold.shape:
        return []
    obs, want = [int(x) for x in observed.flatten().tolist()], [int(x) for x in gold.flatten().tolist()]
    seq = _sequence(ev)
    start = _committed_before(ev, rnd, len(ev.golden.meta.get("prompt_ids", [])))
    bad = [i for i, (a, b) in enumerate(zip(obs, want)) if a != b]
    clean = Cmp(2.0, len(bad) / max(len(obs), 1), bad)
    hyps = [
        Hypothesis("SHIFT_OFF_BY_ONE", name, _shift_verdict(name, layout, want[-1]), _SHIFT_FIX,
                   lambda ids=ids: 0.0 if ids == obs else 2.0, evidence={"bonus_row": layout, "rows_read": len(obs)})
        for name, ids, layout in _shifted_tokens(seq, start, len(obs), want)
    ]  # fmt: skip
    found = judge(ev, stage, rnd, clean, hyps)
    if found or len(bad) == len(obs):
        return found
    return [_other_tokens_finding(stage, rnd, bad, [obs[i] for i in bad], [want[i] for i in bad], embedded=False)]


def _other_table_hypotheses(ev: Evidence, rnd: int, stage: str, observed, gold: torch.Tensor) -> list[Hypothesis]:
    """EMBEDDING_MISMATCH reproduced from the trace itself: every row is the engine's embedding of its (right) token as
    the engine embeds that token wherever else it recurs in the trace from this round on (another row, step or round),
    and none is the target's. An engine that embeds with another table (another model, another version of it) passes;
    one whose rows vary for the same token, or that feeds other tokens, does not."""
    emb = ev.draft.embed_tokens.weight
    tokens = _tokens_of(emb, gold) or []
    here = comparable_rows(observed, observed)
    elsewhere: dict[int, list[torch.Tensor]] = {}  # token → the trace's comparable rows of it at other places
    for e in ev.trace.events:
        # before this round the engine's embeddings matched the target's (the divergence starts here)
        if not tokens or T.parse_stage(e.stage)[0] != "draft.embed_in" or e.round < rnd:
            continue
        g = ev.g(e.stage, e.round)
        toks = _tokens_of(emb, g) if g is not None else None
        rows = comparable_rows(ev.trace.load(e), observed)
        if toks is None or rows.shape[1] != here.shape[1]:
            continue
        for i, t in enumerate(toks):
            elsewhere.setdefault(t, []).append((e.stage, e.round, i, rows[i]))
    norms = row_norms(observed)
    errors = [
        float((here[j] - row).norm() / norms[j].clamp_min(1e-30))
        for j, t in enumerate(tokens)
        for where_stage, where_round, i, row in elsewhere.get(t, [])
        if (where_stage, where_round, i) != (stage, rnd, j)
    ]
    checked = sum(1 for j, t in enumerate(tokens) if len(elsewhere.get(t, [])) > 1)
    slack = fp_slack(here.shape[1]) if isinstance(observed, T.Fingerprint) else 1.0

    def score() -> float | None:
        # nothing else in the trace to reproduce these rows from: the hypothesis cannot be tested
        return max(errors) / (ev.tol(observed) * slack) if errors else None

    fix = "use the target's embed_tokens in the draft (do not ship or load another embedding, nor another version's)"
    reproduced = Hypothesis(
        "EMBEDDING_MISMATCH",
        "another embedding table",
        f"{stage} differs from the target's embedding of the same tokens, and the engine embeds each token the same "
        f"way wherever it recurs in the trace ({checked} of {len(tokens)} rows checked against {len(errors)} other "
        "occurrences): another table",
        fix,
        score,
        evidence={"rows_checked": checked, "rows": len(tokens), "occurrences": len(errors)},
    )
    if errors:
        return [reproduced]

    def no_token_of_the_table() -> float | None:
        # no row is any token's row of the target's table (the tokens are not merely other ones)
        nearest = math.inf
        for start in range(0, emb.shape[0], _TABLE_CHUNK):
            err = pairwise_row_errors(observed, emb[start : start + _TABLE_CHUNK].detach().float().cpu())
            if err is None:
                return None
            nearest = min(nearest, float(err.min()))
        return None if nearest <= ev.tol(observed) * slack else 0.0

    return [
        Hypothesis(
            "EMBEDDING_MISMATCH",
            "another embedding table (unconfirmed)",
            f"{stage} differs from the target's embedding of the same tokens and no row is any token's row of the "
            "target's table: another table, by elimination (no token recurs in the trace to confirm that the engine "
            "embeds it the same way each time)",
            fix,
            no_token_of_the_table,
            max_weight=0.6,
        )
    ]


def _other_tokens(emb: torch.Tensor, gold, observed, tol: float) -> tuple[list[int], list[int], list[int]] | None:
    """(rows, fed token ids, expected token ids) when the rows of `observed` that differ from `gold` are each exactly
    a row of the embedding table (so the table is right and the tokens are not); None otherwise."""
    if not (isinstance(observed, torch.Tensor) and isinstance(gold, torch.Tensor)) or observed.shape != gold.shape:
        return None
    a, b = observed.double().cpu(), gold.double().cpu()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
    rows = [int(i) for i in torch.nonzero(err > tol).flatten().tolist()]
    if not rows or len(rows) == a.shape[0]:  # every row differs: a table or a shift, not a few wrong tokens
        return None

    def lookup(x: torch.Tensor) -> list[int] | None:
        idx, rel = _nearest_rows(emb, x)
        return [int(i) for i in idx.tolist()] if bool((rel <= tol).all()) else None

    fed, want = lookup(a[rows]), lookup(b[rows])
    if fed is None or want is None:
        return None
    return rows, fed, want


def _committed_before(ev: Evidence, rnd: int, prompt_len: int) -> int:
    """First position of round `rnd`'s pending features: the root position of round rnd-1 (0 for round 1)."""
    if rnd <= 1:
        return 0
    pos = prompt_len
    for r in range(1, rnd - 1):
        acc = ev.g(T.VERIFY_ACCEPTED, r)
        pos += 1 + (0 if acc is None else acc.numel())
    return pos
