"""The cases the independent engine puts to `eaglescope doctor`: clean runs (healthy expected) and one run per
injected fault (the named cause expected first, at the first stage the fault changes). Shared by
tests/test_independent_engine.py and tests/engines/fault_table.py.

`doctor_today` records, per trace mode, what doctor says where it is wrong today: the test marks those cases
xfail(strict) so they flip to failures when doctor is fixed, and the table shows them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from engines.plain_eagle3 import PlainEagle3
from engines.tiny import greedy_reference, make_draft, make_target

UNEXPLAINED = "DIVERGENCE_UNEXPLAINED"
TREE = {"depth": 3, "top_k": 3, "total_tokens": 8}
CHAIN = {"depth": 3, "chain": True}
MAX_NEW = 14


@dataclass
class Setup:
    target_dir: Path
    draft_dir: Path
    prompt: list[int]
    guide: list[int]  # prompt + the target's greedy continuation


def build_setups(root: Path) -> dict[str, Setup]:
    """a: 8 layers x 64; b: 12 layers x 96 (6 heads, 3 kv heads); ls: a's target, a draft with logit_scale 2; id: a's
    target, a draft over the whole vocabulary (its d2t is the identity); nbf: a's target, an EAGLE 3.1 draft with
    norm_before_fc; fcn: a's target, an EAGLE 3.1 draft with fc_norm and norm_output."""
    root = Path(root)
    ta = make_target(root / "target-a", seed=0)
    tb = make_target(
        root / "target-b",
        seed=1,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=12,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    pa, pb = list(range(5, 15)), [3, 17, 29, 41, 53, 7, 11, 19, 23, 31, 37, 43]
    ga = pa + greedy_reference(ta, pa, MAX_NEW + 16)
    gb = pb + greedy_reference(tb, pb, MAX_NEW + 16)
    return {
        "a": Setup(ta, make_draft(root / "draft-a", ta, seed=0), pa, ga),
        "b": Setup(tb, make_draft(root / "draft-b", tb, seed=1, draft_vocab_size=64), pb, gb),
        "ls": Setup(ta, make_draft(root / "draft-ls", ta, seed=2, logit_scale=2.0), pa, ga),
        "id": Setup(ta, make_draft(root / "draft-id", ta, seed=3, draft_vocab_size=96), pa, ga),
        "nbf": Setup(ta, make_draft(root / "draft-nbf", ta, seed=4, norm_before_fc=True), pa, ga),
        "fcn": Setup(ta, make_draft(root / "draft-fcn", ta, seed=5, fc_norm=True, norm_output=True), pa, ga),
    }


@dataclass
class Case:
    id: str
    fault: str | None = None
    expected: tuple[str, ...] = ()  # acceptable top codes; () = healthy
    stage: str | None = None  # the first divergent stage (the top finding's stage)
    round: int | None = None
    setup: str = "a"
    engine: dict = field(default_factory=dict)  # PlainEagle3 options
    run: dict = field(default_factory=lambda: dict(TREE))  # generate options
    guided: bool = True
    mode: str = "full"
    doctor_today: str | None = None  # what doctor says when it gets this case wrong (→ xfail strict)
    catalogue: bool = True  # False: no code names this fault; DIVERGENCE_UNEXPLAINED is the right answer
    needs: tuple[str, ...] = ()  # stages an unexplained finding must say the trace lacks (a shallow trace)

    @property
    def healthy(self) -> bool:
        return not self.expected


def record(case: Case, setups: dict[str, Setup], out: Path) -> Path:
    S = setups[case.setup]
    engine = PlainEagle3(S.target_dir, S.draft_dir, fault=case.fault, **case.engine)
    engine.generate(S.prompt, MAX_NEW, trace=out, mode=case.mode, guide=S.guide if case.guided else None, **case.run)
    return out


def diagnose(case: Case, setups: dict[str, Setup], out: Path):
    """(doctor's report, seconds doctor took) for the case's trace."""
    from eaglescope.detective.doctor import run_doctor

    S = setups[case.setup]
    trace = record(case, setups, out)
    t0 = time.perf_counter()
    report = run_doctor(S.target_dir, S.draft_dir, trace=trace, device="cpu")
    return report, time.perf_counter() - t0


class Recorded:
    """Each case's trace, recorded once under `root`, and doctor's report on it with the full target: the draft-side
    replay's tests diagnose the very same traces again and compare (tests/test_independent_engine.py)."""

    def __init__(self, setups: dict[str, Setup], root: Path) -> None:
        self.setups, self.root = setups, Path(root)
        self._traces: dict[str, Path] = {}
        self._full: dict[str, object] = {}

    def trace(self, case: Case) -> Path:
        if case.id not in self._traces:
            self._traces[case.id] = record(case, self.setups, self.root / case.id)
        return self._traces[case.id]

    def full(self, case: Case):
        """doctor's report on the case's trace, with the target's layers (a full replay)."""
        from eaglescope.detective.doctor import run_doctor

        if case.id not in self._full:
            S = self.setups[case.setup]
            self._full[case.id] = run_doctor(S.target_dir, S.draft_dir, trace=self.trace(case), device="cpu")
        return self._full[case.id]


def said(report) -> str:
    """doctor's verdict in one line: healthy, or the top finding's code@stage rRound."""
    if report.healthy:
        return "healthy"
    top = report.findings[0]
    return f"{top.code}@{top.stage} r{top.round}"


def verdict(case: Case, report) -> tuple[bool, str]:
    """(doctor right?, what it said in one line)."""
    line = said(report)
    if report.healthy:
        return case.healthy, line
    top = report.findings[0]
    if case.healthy:
        return False, line
    ok = top.code in case.expected and top.stage == case.stage and top.round == case.round
    if not case.catalogue:
        ok = ok and all(f.code == UNEXPLAINED for f in report.findings)
    if case.needs:
        ok = ok and set(case.needs) <= set(top.evidence.get("missing_stages") or ())
    return ok, line


def _bf16(**kw) -> dict:
    return {"dtype": torch.bfloat16, **kw}


def _sampled(run: dict, temperature: float, seed: int) -> dict:
    return {**run, "temperature": temperature, "seed": seed}


_WIDE = {"depth": 4, "top_k": 4, "total_tokens": 12}
_SHALLOW = {"stages": "shallow"}

# -- clean runs: healthy expected -------------------------------------------------------------------------------------
CLEAN = [
    Case("tree", guided=False),
    Case("chain", run=dict(CHAIN), guided=False),
    Case("chain5", run={"depth": 5, "chain": True}, guided=False),
    Case("wide-tree", run=dict(_WIDE), guided=False),
    Case("tree-accepting"),
    Case("chain-accepting", run=dict(CHAIN)),
    Case("tree-fingerprint", guided=False, mode="fingerprint"),
    Case("chain-fingerprint", run=dict(CHAIN), guided=False, mode="fingerprint"),
    Case("tree-accepting-fingerprint", mode="fingerprint"),
    Case("bf16-tree", engine=_bf16(), guided=False),
    Case("bf16-chain-accepting", engine=_bf16(), run=dict(CHAIN)),
    Case("bf16-tree-accepting", engine=_bf16()),
    # bf16 rounding moves rows by 2-5% here: a fingerprint's 16-dim projections estimate a row's error within tens of
    # percent, which the fingerprint comparison allows for
    Case("bf16-fingerprint", engine=_bf16(), mode="fingerprint"),
    Case("bf16-chain-fingerprint", engine=_bf16(), run=dict(CHAIN), guided=False, mode="fingerprint"),
    # a bf16 near-tie puts step 0's top-3 in another order than the float32 replay's: the replay follows the ids in
    # their recorded rank order, and the frontier rows are paired by content
    Case("12layers-bf16-fingerprint", setup="b", engine=_bf16(), mode="fingerprint"),
    Case("12layers-tree", setup="b", guided=False),
    Case("12layers-chain-accepting", setup="b", run=dict(CHAIN)),
    Case("12layers-fingerprint", setup="b", mode="fingerprint"),
    Case("12layers-bf16", setup="b", engine=_bf16()),
    Case("logit-scale-tree", setup="ls", guided=False),
    Case("logit-scale-accepting-fingerprint", setup="ls", mode="fingerprint"),
    Case("identity-map-tree", setup="id"),
    Case("all-layers-tapped", engine={"record_taps": "all"}),
    Case("no-per-tap-stages", engine={"record_taps": "none"}),
    # another frontier order (creation order): the rows of a tree step are the same nodes in another order
    Case("creation-order-chain", engine={"frontier": "creation"}, run=dict(CHAIN)),
    Case("creation-order-tree", engine={"frontier": "creation"}, guided=False),
    Case("creation-order-tree-accepting", engine={"frontier": "creation"}),
    Case("creation-order-wide", engine={"frontier": "creation"}, run=dict(_WIDE)),
    Case("creation-order-fingerprint", engine={"frontier": "creation"}, mode="fingerprint"),
    Case("creation-order-12layers", setup="b", engine={"frontier": "creation"}),
    Case(
        "creation-order-bf16-wide-fingerprint", engine=_bf16(frontier="creation"), run=dict(_WIDE), mode="fingerprint"
    ),
    # docs/trace-format.md's worked example: top-k of every step-0 row (n = m), not of the root's row only
    Case("step0-topk-every-row", engine={"step0_topk_rows": "all"}),
    # the manifest example's `decoding` key without `settings` (both are documented as what eaglescope reads)
    Case("meta-decoding-only", engine={"meta_keys": "decoding"}),
    # sampling: the engine draws each token from the target at a temperature; the replay follows its decisions
    Case("sampled-tree", run=_sampled(TREE, 1.0, 1), guided=False),
    Case("sampled-chain-accepting", run=_sampled(CHAIN, 0.5, 2)),
    Case("sampled-wide-fingerprint", run=_sampled(_WIDE, 1.0, 3), mode="fingerprint"),
    Case("sampled-bf16-creation-order", engine=_bf16(frontier="creation"), run=_sampled(TREE, 0.8, 4)),
    Case("sampled-12layers", setup="b", run=_sampled(TREE, 1.0, 5)),
    # EAGLE 3.1 drafts: norm_before_fc; fc_norm with norm_output (the next step receives the post-norm output)
    Case("eagle31-norm-before-fc-tree", setup="nbf", guided=False),
    Case("eagle31-norm-before-fc-chain-accepting", setup="nbf", run=dict(CHAIN)),
    Case("eagle31-norm-before-fc-fingerprint", setup="nbf", mode="fingerprint"),
    Case("eagle31-norm-before-fc-chain-fingerprint", setup="nbf", run=dict(CHAIN), mode="fingerprint"),
    Case("eagle31-fc-norm-output-tree", setup="fcn", guided=False),
    Case("eagle31-fc-norm-output-chain-accepting", setup="fcn", run=dict(CHAIN)),
    Case("eagle31-fc-norm-output-fingerprint", setup="fcn", mode="fingerprint"),
    Case("eagle31-fc-norm-output-chain-fingerprint", setup="fcn", run=dict(CHAIN), mode="fingerprint"),
    # shallow traces: target.aux, top-k and the tree only
    Case("shallow-tree", engine=dict(_SHALLOW)),
    Case("shallow-identity-map-fingerprint", setup="id", engine=dict(_SHALLOW), mode="fingerprint"),
]


# -- faults: (id, fault, expected codes, stage, round, options) -------------------------------------------------------
def _fault(id, fault, expected, stage, rnd, **kw) -> list[Case]:
    today = kw.pop("doctor_today", {})
    if isinstance(today, str):
        today = {"full": today, "fingerprint": today}
    out = []
    for mode in ("full", "fingerprint"):
        out.append(
            Case(f"{id}-{mode}", fault, tuple(expected), stage, rnd, mode=mode, doctor_today=today.get(mode), **kw)
        )
    return out


_OFFSET = "POSITION_OFFSET"
FAULT_CASES: list[Case] = [
    *_fault("tap_plus_one", "tap_plus_one", ["TAP_OFF_BY_ONE"], "target.aux", 0),
    *_fault("tap_plus_one-from-round2", "tap_plus_one", ["TAP_OFF_BY_ONE"], "target.aux", 2, engine={"fault_from": 2}),
    *_fault("tap_minus_one-12layers", "tap_minus_one", ["TAP_OFF_BY_ONE"], "target.aux", 0, setup="b"),
    *_fault("tap_wrong_layer", "tap_wrong_layer", ["TAP_WRONG_LAYER"], "target.aux", 0),
    *_fault("tap_order", "tap_order", ["TAP_ORDER"], "target.aux", 0),
    *_fault("tap_embedding", "tap_embedding", ["TAP_EMBEDDING"], "target.aux", 0),
    *_fault("tap_normed-12layers", "tap_normed", ["TAP_NORMED"], "target.aux", 0, setup="b"),
    *_fault(
        "eagle2_wiring",
        "eagle2_wiring",
        ["FC_SKIPPED"],
        "target.aux",
        0,
    ),
    *_fault("fc_skipped", "fc_skipped", ["FC_SKIPPED"], "draft.fc.out", 1),
    *_fault(
        "fc_repeated",
        "fc_repeated",
        ["FC_REPEATED"],
        "draft.step1.hidden_in",
        1,
    ),
    *_fault("feedback_target", "feedback_target", ["FEEDBACK_TARGET_FEATURES"], "draft.step1.hidden_in", 1),
    *_fault("feedback_postnorm", "feedback_postnorm", ["FEEDBACK_POSTNORM"], "draft.step1.hidden_in", 1),
    *_fault(
        "feedback_postnorm-chain-from-round3",
        "feedback_postnorm",
        ["FEEDBACK_POSTNORM"],
        "draft.step1.hidden_in",
        3,
        engine={"fault_from": 3},
        run=dict(CHAIN),
    ),
    *_fault("stale_first_rows", "stale_first_rows", ["STALE_ACCEPTED"], "next.hidden_in", 1),
    *_fault(
        "stale_first_rows-12layers-from-round2",
        "stale_first_rows",
        ["STALE_ACCEPTED"],
        "next.hidden_in",
        2,
        setup="b",
        engine={"fault_from": 2},
    ),
    # the emitted tokens' own positions: which code is "right" is a matter of naming (the rows are not the accepted
    # positions; equivalently each feature sits one position after the token it is paired with)
    *_fault(
        "own_position_features",
        "own_position_features",
        ["STALE_ACCEPTED", "SHIFT_OFF_BY_ONE"],
        "next.hidden_in",
        1,
    ),
    *_fault("rope_tree_offset", "rope_tree_offset", [_OFFSET], "draft.step1.hidden_out", 1),
    # RoPE is relative: a catch-up pass shifted as a whole (queries and committed keys alike) computes the same
    # step 0; the first stage it changes is tree step 1, whose queries are not shifted
    *_fault("rope_catchup_offset", "rope_catchup_offset", [_OFFSET], "draft.step1.hidden_out", 1),
    *_fault(
        "rope_catchup_offset-from-round2",
        "rope_catchup_offset",
        [_OFFSET],
        "draft.step0.hidden_out",
        2,
        engine={"fault_from": 2},
    ),
    *_fault("pairing_shift", "pairing_shift", ["SHIFT_OFF_BY_ONE"], "draft.step0.embed_in", 1),
    *_fault("other_embedding", "other_embedding", ["EMBEDDING_MISMATCH"], "draft.step0.embed_in", 1),
    *_fault("embedding_other_version", "embedding_other_version", ["EMBEDDING_MISMATCH"], "draft.step0.embed_in", 1),
    *_fault("vocab_map_lost", "vocab_map_lost", ["VOCAB_MAP"], "draft.step0.topk", 1),
    *_fault(
        "vocab_map_lost-chain-from-round2",
        "vocab_map_lost",
        ["VOCAB_MAP"],
        "draft.step0.topk",
        2,
        engine={"fault_from": 2},
        run=dict(CHAIN),
    ),
    *_fault("d2t_arange", "d2t_arange", ["VOCAB_MAP"], "draft.step0.topk", 1),
    *_fault("d2t_regenerated", "d2t_regenerated", ["LM_HEAD_MAP_MISALIGNED"], "draft.step0.topk", 1),
    *_fault("logit_scale_ignored", "logit_scale_ignored", ["EAGLE31_IGNORED"], "draft.step0.topk", 1, setup="ls"),
    *_fault("final_norm_skipped", "final_norm_skipped", ["DRAFT_FINAL_NORM_SKIPPED"], "draft.step0.topk", 1),
    # EAGLE 3.1 drift: options read wrongly by the engine (SGLang issue 32226 / PR 32334 ignored norm_before_fc)
    *_fault("norm_before_fc_ignored", "norm_before_fc_ignored", ["EAGLE31_NORM"], "draft.fc.out", 1, setup="nbf"),
    *_fault(
        "norm_before_fc_ignored-chain-from-round2",
        "norm_before_fc_ignored",
        ["EAGLE31_NORM"],
        "draft.fc.out",
        2,
        setup="nbf",
        engine={"fault_from": 2},
        run=dict(CHAIN),
    ),
    *_fault("fc_norm_as_one", "fc_norm_as_one", ["EAGLE31_NORM"], "draft.fc.out", 1, setup="fcn"),
    *_fault(
        "norm_before_fc_per_segment",
        "norm_before_fc_per_segment",
        ["EAGLE31_NORM"],
        "draft.fc.out",
        1,
        setup="nbf",
    ),
    *_fault("norm_before_fc_assumed", "norm_before_fc_assumed", ["EAGLE31_NORM"], "draft.fc.out", 1),
    *_fault("fc_norm_ignored", "fc_norm_ignored", ["EAGLE31_NORM"], "draft.fc.out", 1, setup="fcn"),
    *_fault("fc_norm_assumed-12layers", "fc_norm_assumed", ["EAGLE31_NORM"], "draft.fc.out", 1, setup="b"),
    # norm_output read either way: the logits are the same, what the next step receives is not
    *_fault(
        "norm_output_other_meaning",
        "norm_output_other_meaning",
        ["EAGLE31_NORM"],
        "draft.step0.hidden_out",
        1,
        setup="fcn",
    ),
    *_fault(
        "norm_output_other_meaning-chain",
        "norm_output_other_meaning",
        ["EAGLE31_NORM"],
        "draft.step0.hidden_out",
        1,
        setup="fcn",
        run=dict(CHAIN),
    ),
    *_fault("norm_output_assumed", "norm_output_assumed", ["EAGLE31_NORM"], "draft.step0.hidden_out", 1),
    *_fault(
        "norm_output_assumed-chain-from-round3",
        "norm_output_assumed",
        ["EAGLE31_NORM"],
        "draft.step0.hidden_out",
        3,
        engine={"fault_from": 3},
        run=dict(CHAIN),
    ),
    # other frontier orders, bf16 and sampling under a fault
    *_fault(
        "feedback_postnorm-creation-order-wide",
        "feedback_postnorm",
        ["FEEDBACK_POSTNORM"],
        "draft.step1.hidden_in",
        1,
        engine={"frontier": "creation"},
        run=dict(_WIDE),
    ),
    *_fault(
        "rope_tree_offset-creation-order-wide",
        "rope_tree_offset",
        [_OFFSET],
        "draft.step1.hidden_out",
        1,
        engine={"frontier": "creation"},
        run=dict(_WIDE),
    ),
    *_fault("tap_order-bf16", "tap_order", ["TAP_ORDER"], "target.aux", 0, engine=_bf16()),
    *_fault(
        "fc_repeated-bf16-chain",
        "fc_repeated",
        ["FC_REPEATED"],
        "draft.step1.hidden_in",
        1,
        engine=_bf16(),
        run=dict(CHAIN),
    ),
    *_fault(
        "feedback_target-sampled",
        "feedback_target",
        ["FEEDBACK_TARGET_FEATURES"],
        "draft.step1.hidden_in",
        1,
        run=_sampled(TREE, 1.0, 6),
    ),
    # shallow traces (target.aux, top-k, the tree): causes reproducible from the top-k are named there; others are
    # unexplained at the first top-k that differs, naming the stages the trace would need
    *_fault("vocab_map_lost-shallow", "vocab_map_lost", ["VOCAB_MAP"], "draft.step0.topk", 1, engine=dict(_SHALLOW)),
    *_fault(
        "final_norm_skipped-shallow",
        "final_norm_skipped",
        ["DRAFT_FINAL_NORM_SKIPPED"],
        "draft.step0.topk",
        1,
        engine=dict(_SHALLOW),
    ),
    # (a RoPE offset moves step 1's log-probs by less than a bf16 tie here: a shallow trace does not show it at all)
    *_fault(
        "feedback_postnorm-shallow",
        "feedback_postnorm",
        [UNEXPLAINED],
        "draft.step1.topk",
        1,
        engine=dict(_SHALLOW),
        needs=("draft.step1.hidden_in",),
    ),
    *_fault(
        "stale_first_rows-shallow",
        "stale_first_rows",
        [UNEXPLAINED],
        "draft.step0.topk",
        2,
        engine=dict(_SHALLOW),
        needs=("draft.fc.out", "draft.step0.hidden_out"),
    ),
    # same logits either way: a shallow trace first shows it at step 1's top-k and cannot say why
    *_fault(
        "norm_output_other_meaning-shallow",
        "norm_output_other_meaning",
        [UNEXPLAINED],
        "draft.step1.topk",
        1,
        setup="fcn",
        engine=dict(_SHALLOW),
        needs=("draft.step0.hidden_out",),
    ),
    # the draft's map is the identity: a top-k that differs is no evidence about the map
    *_fault(
        "kv_swapped-shallow-identity-map",
        "kv_swapped",
        [UNEXPLAINED],
        "draft.step0.topk",
        1,
        setup="id",
        engine=dict(_SHALLOW),
        catalogue=False,
        needs=("draft.step0.hidden_out",),
    ),
    # outside the catalogue (invented here)
    *_fault("rms_eps_wrong", "rms_eps_wrong", [UNEXPLAINED], "draft.step0.hidden_out", 1, catalogue=False),
    *_fault("kv_swapped", "kv_swapped", [UNEXPLAINED], "draft.step0.hidden_out", 1, catalogue=False),
    *_fault("draft_kv_leak", "draft_kv_leak", [UNEXPLAINED], "draft.step0.hidden_out", 2, catalogue=False),
    *_fault("gqa_mapping", "gqa_mapping", [UNEXPLAINED], "draft.step0.hidden_out", 1, catalogue=False),
    *_fault("rope_base_wrong", "rope_base_wrong", [UNEXPLAINED], "draft.step0.hidden_out", 1, catalogue=False),
    *_fault("residual_dropped", "residual_dropped", [UNEXPLAINED], "draft.step0.hidden_out", 1, catalogue=False),
    *_fault("rope_interleaved", "rope_interleaved", [UNEXPLAINED], "draft.step0.hidden_out", 1, catalogue=False),
    *_fault("concat_order", "concat_order", [UNEXPLAINED], "draft.step0.hidden_out", 1, catalogue=False),
]
