"""`doctor --measure-wiring` (detective/wiring.py): what a draft was trained on, measured from its teacher-forced
acceptance under candidate wirings, never read from its labels.

The drafts are trained here by eaglescope's own TTT forward and loss (train/ttt.py: ttt_unroll, ttt_loss) on a tiny
Llama target's real hidden states, the faults made in the training DATA the way a foreign pipeline makes them: layer
taps one off, segments concatenated in another order, features paired with their own token (an unshifted pairing),
and TTT length 1. Every draft is saved without an `eaglescope` section (a draft you did not train: its config names
no taps, so every engine feeds it the default [2, L//2, L-3]). The search must find the wiring each was trained for,
with the target's layers (a target forward over --data) and without them (a head-only directory plus per-layer
states in vLLM's extract_hidden_states layout): the same codes. The drafts fit their few hundred tokens closely (the
regime where a draft has learned what its features are), and they are measured on those tokens.

    the rule        fc is linear per segment: the cached projections are draft.project, EAGLE 3.1 norms included;
                    the decision names nothing when the best is not clearly better (WIRING_UNEXPLAINED)
    the faults      off by one → TAP_OFF_BY_ONE, order → TAP_ORDER, unshifted pairing → SHIFT_OFF_BY_ONE,
                    TTT 1 → NO_TTT with the served wiring the trained one; clean → nothing
    head-only       the same codes from engine-recorded per-layer states and a target without layers
    the CLI         --json carries context.wiring; bad input is one line and exit 2
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from layerless import layerless_copy
from models import make_checkpoint
from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir

from eaglescope.cli import main
from eaglescope.decode.speculative import target_embedding
from eaglescope.detective.acceptance_sources import load_samples
from eaglescope.detective.doctor import run_doctor
from eaglescope.detective.wiring import (
    NORMED_FINAL,
    RAW_FINAL,
    Score,
    SegmentProjections,
    Wiring,
    WiringSearch,
    code_of,
    difference,
    findings_of,
    record_from_target,
    save_layer_states,
)
from eaglescope.models.draft import DraftConfig, DraftContract, Eagle3Draft, save_draft
from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract
from eaglescope.train.ttt import ttt_loss, ttt_unroll

L = 8
SERVED = (2, 4, 5)  # the default taps [2, L//2, L-3]: what every engine feeds a draft whose config names none
WORDS = "hello there how are you today the capital of france is paris think step by step two plus four".split()
STEPS, LR, BATCH = 300, 5e-3, 8
TOKENS = 2048  # every token of the data: the drafts are measured where they were trained
# name → (the wiring its training data held, TTT length, the code doctor must name, or None)
CASES = {
    "clean": (Wiring(SERVED), 3, None),
    "taps-off-by-one": (Wiring((1, 3, 4)), 3, "TAP_OFF_BY_ONE"),
    "order-swapped": (Wiring((4, 2, 5)), 3, "TAP_ORDER"),
    "unshifted-pairing": (Wiring(SERVED, 1), 3, "SHIFT_OFF_BY_ONE"),
    "no-ttt": (Wiring(SERVED), 1, "NO_TTT"),
}


def _features(record, wiring: Wiring) -> torch.Tensor:
    """What a pipeline with this wiring stores as the aux of each position: the segments, row t holding position
    t + shift (zeros past the end)."""
    aux = torch.cat([record.states[s] for s in wiring.segments], -1)
    d = wiring.shift
    return torch.cat([aux[:, d:], torch.zeros_like(aux[:, :d])], 1) if d > 0 else aux


def _train(world: dict, wiring: Wiring, ttt: int, out: Path) -> Path:
    """A draft trained by eaglescope's TTT forward and loss on features of `wiring`, saved without an eaglescope
    section (its config names no taps)."""
    torch.manual_seed(0)
    rec, cfg = world["record"], json.loads((world["target"] / "config.json").read_text())
    taps = TapContract(SERVED, L)
    draft = Eagle3Draft(DraftConfig.for_target(cfg, taps, cfg["vocab_size"]))
    draft.load_target_embedding(world["embedding"])
    aux, ids, logits = _features(rec, wiring), rec.input_ids, world["logits"]
    mask = rec.valid.clone()
    if wiring.shift > 0:
        mask &= torch.cat([rec.valid[:, wiring.shift :], torch.zeros_like(rec.valid[:, : wiring.shift])], 1)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=LR)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        idx = torch.randint(0, ids.shape[0], (BATCH,), generator=g)
        loss = ttt_loss(draft, ttt_unroll(draft, ids[idx], aux[idx], ttt), logits[idx], mask[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_draft(draft.eval(), DraftContract(taps=taps, ttt_length=ttt), out)
    cfg_path = out / "config.json"
    hf = json.loads(cfg_path.read_text())
    hf.pop("eaglescope")
    cfg_path.write_text(json.dumps(hf, indent=2))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A tiny Llama target with a chat tokenizer, chat data, its hidden states of every layer, and one draft per
    case; a copy of the target without its layers and the same states as an engine records them."""
    root = tmp_path_factory.mktemp("wiring")
    tok = load(make_tokenizer_dir(root, LLAMA3, vocab_size=300))
    target_dir = make_checkpoint("llama", root / "target", num_hidden_layers=L, vocab_size=len(tok))
    tok.save_pretrained(target_dir)
    rng = random.Random(0)
    convs = [
        {"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))},
                      {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(16))}]}
        for _ in range(16)
    ]  # fmt: skip
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    target = load_target(target_dir, device="cpu", dtype=torch.float32)
    samples = load_samples(data, target.tokenizer, 64)
    record = record_from_target(target, samples, TOKENS)
    with torch.no_grad():
        logits = target.hidden_states(record.input_ids).logits
    world = {"root": root, "target": target_dir, "data": data, "record": record, "logits": logits,
             "embedding": target_embedding(target).detach()}  # fmt: skip
    world["drafts"] = {name: _train(world, w, ttt, root / f"draft-{name}") for name, (w, ttt, _) in CASES.items()}
    world["headonly"] = layerless_copy(target_dir, root / "target-headonly", final_norm=True)
    states = root / "layer-states"
    states.mkdir()
    for b in range(record.input_ids.shape[0]):
        n = int(record.valid[b].sum())
        hs = torch.stack([record.states[i][b, :n] for i in range(L)] + [record.states[RAW_FINAL][b, :n]], 1)
        save_layer_states(states / f"request-{b:03d}.safetensors", record.input_ids[b, :n], hs)
    world["states"] = states
    return world


def _doctor(world: dict, case: str, headonly: bool):
    if headonly:
        return run_doctor(world["headonly"], world["drafts"][case], measure_wiring=True, layer_states=world["states"],
                          wiring_tokens=TOKENS, engines=("vllm",), device="cpu", dtype="float32")  # fmt: skip
    return run_doctor(world["target"], world["drafts"][case], data=world["data"], measure_wiring=True,
                      wiring_tokens=TOKENS, engines=("vllm",), device="cpu", dtype="float32", prompts=1,
                      max_new_tokens=4, eval_samples=2)  # fmt: skip


# -- the rule ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"fc_norm": True}, {"norm_before_fc": True}])
def test_summed_segment_projections_are_the_drafts_own_projection(world, options):
    """fc is linear per segment, so the search sums cached per-segment projections: for every EAGLE 3.1 variant
    the sum equals draft.project over the concatenated segments (any sources, in any order)."""
    cfg = json.loads((world["target"] / "config.json").read_text())
    draft = Eagle3Draft(DraftConfig.for_target(cfg, TapContract(SERVED, L), cfg["vocab_size"], **options))
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))  # norm weights away from 1, so a skipped norm shows
    proj = SegmentProjections(draft, world["record"])
    for w in (Wiring(SERVED), Wiring((5, 0, RAW_FINAL)), Wiring((NORMED_FINAL, 3, 3))):
        want = draft.project(torch.cat([world["record"].states[s] for s in w.segments], -1))
        torch.testing.assert_close(proj.features(w), want, rtol=1e-4, atol=1e-4)


def test_difference_names_each_kind_of_wiring_fault():
    s = Wiring((2, 4, 5))
    assert difference(Wiring((1, 3, 4)), s) == ["TAP_OFF_BY_ONE"]
    assert difference(Wiring((4, 2, 5)), s) == ["TAP_ORDER"]
    assert difference(Wiring((2, 4, 5), 1), s) == ["SHIFT_OFF_BY_ONE"]
    assert difference(Wiring((0, 4, 5)), s) == ["TAP_EMBEDDING"]
    assert difference(Wiring((2, 4, NORMED_FINAL)), Wiring((2, 4, RAW_FINAL))) == ["TAP_NORMED"]
    assert code_of(difference(Wiring((1, 30, 5)), s)) == "TRAINED_WIRING_MISMATCH"
    assert code_of(difference(Wiring((1, 3, 4), 1), s)) == "TRAINED_WIRING_MISMATCH"
    assert difference(s, s) == []


def _score(wiring: Wiring, hits: list[bool]) -> Score:
    h = torch.tensor(hits)[None, :, None]
    return Score(wiring, 1, h, torch.ones_like(h), 0.0)


def test_a_best_wiring_not_clearly_better_than_another_is_unexplained():
    """Served far below two wirings within chance of each other that differ from it in different ways (taps one off,
    taps reordered): WIRING_UNEXPLAINED, never a named cause. Two that differ the same way (both one off, in two or
    three segments): that way is named, and the other candidate listed beside it."""
    n = 400
    served = _score(Wiring((2, 4, 5)), [i % 5 == 0 for i in range(n)])  # acc_0 0.2
    best = _score(Wiring((1, 3, 4)), [i % 10 < 7 for i in range(n)])  # 0.70
    reordered = _score(Wiring((4, 2, 5)), [i % 10 < 7 and i % 40 != 1 for i in range(n)])  # 0.675, 10 rows apart
    ws = WiringSearch(served, best, reordered, None, {s.wiring: s for s in (served, best, reordered)}, L, "test")
    findings, ctx = findings_of(ws)
    assert [f.code for f in findings if f.stage == "target.aux"] == ["WIRING_UNEXPLAINED"]
    assert ctx["verdict"] == "unexplained" and ctx["claims"]["established"] == []
    close = _score(Wiring((1, 3, 5)), [i % 10 < 7 and i % 40 != 1 for i in range(n)])  # one off in two segments
    ws = WiringSearch(served, best, close, None, {s.wiring: s for s in (served, best, close)}, L, "test")
    findings, ctx = findings_of(ws)
    assert [f.code for f in findings if f.stage == "target.aux"] == ["TAP_OFF_BY_ONE"]
    assert [c["text"] for c in ctx["claims"]["plausible"]][1].startswith("taps [1, 3, 5]")
    far = _score(Wiring((4, 2, 5)), [i % 10 < 4 for i in range(n)])  # 0.40: the reordering is ruled out
    ws = WiringSearch(served, best, far, None, {s.wiring: s for s in (served, best, far)}, L, "test")
    assert [f.code for f in findings_of(ws)[0] if f.stage == "target.aux"] == ["TAP_OFF_BY_ONE"]


# -- the faults, with and without the target's layers -------------------------------------------------------------
@pytest.mark.parametrize("headonly", [False, True], ids=["target-forward", "head-only"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_search_recovers_the_trained_wiring(world, case, headonly):
    wiring, _, code = CASES[case]
    report = _doctor(world, case, headonly)
    w = report.context["wiring"]
    assert w["trained_for"]["wiring"]["segments"] == list(wiring.segments), w["line"]
    assert w["trained_for"]["wiring"]["shift"] == wiring.shift, w["line"]
    assert w["served"]["wiring"]["segments"] == list(SERVED)
    if code is None:
        assert w["verdict"] == "served is the trained wiring" and w["codes"] == [], w
    elif code == "NO_TTT":
        assert w["verdict"] == "served is the trained wiring" and w["codes"] == ["NO_TTT"], w
    else:
        assert w["verdict"] == "mismatch" and w["codes"][0] == code, w
        assert w["trained_for"]["acc"][0] > w["served"]["acc"][0] + 0.05
        mine = [f for f in report.findings if f.code == code]
        assert mine and mine[0].support == "measured" and "measured, not assumed" in mine[0].verdict
    assert w["mode"].startswith("recorded by the engine" if headonly else "a target forward in process")


def test_head_only_loads_no_layer_and_reads_the_engines_states(world):
    """The head-only directory has no decoder layer, and a mode that needed one could not have run on it."""
    from eaglescope.detective.draft_replay import layers_on_disk

    assert layers_on_disk(world["headonly"], L) == 0
    report = _doctor(world, "taps-off-by-one", headonly=True)
    assert report.context["wiring"]["mode"].startswith("recorded by the engine")


def test_a_recorded_contract_read_by_another_engine_convention_is_checked_against_behaviour(world, tmp_path):
    """The off-by-one draft with its true taps [1, 3, 4] recorded and written as ids [1, 3, 4]: vLLM feeds them, and
    the search agrees (healthy wiring); SGLang's Llama rule reads the ids as [2, 4, 5], and the search measures the
    record right and the engine wrong (TAP_OFF_BY_ONE beside the static ENGINE_TAP_CONVENTION)."""
    import shutil

    draft = shutil.copytree(world["drafts"]["taps-off-by-one"], tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    cfg["eaglescope"] = DraftContract(taps=TapContract((1, 3, 4), L), ttt_length=3).to_dict()
    (draft / "config.json").write_text(json.dumps(cfg))
    kw = dict(measure_wiring=True, layer_states=world["states"], wiring_tokens=TOKENS, device="cpu", dtype="float32")
    w = run_doctor(world["headonly"], draft, engines=("vllm",), **kw).context["wiring"]
    assert w["verdict"] == "served is the trained wiring" and w["codes"] == [], w["line"]
    report = run_doctor(world["headonly"], draft, engines=("sglang-legacy",), **kw)
    w = report.context["wiring"]
    assert w["served"]["wiring"]["taps"] == [2, 4, 5] and w["trained_for"]["wiring"]["taps"] == [1, 3, 4]
    assert w["declared"]["wiring"]["taps"] == [1, 3, 4] and w["declared"]["acc"] == w["trained_for"]["acc"]
    assert w["codes"][0] == "TAP_OFF_BY_ONE"
    assert {"ENGINE_TAP_CONVENTION", "TAP_OFF_BY_ONE"} <= {f.code for f in report.findings}


def test_too_few_tokens_never_name_a_wrong_cause(world):
    """On 40 tokens the off-by-one draft's wiring may not be told apart: doctor then names it or says it cannot,
    never another cause."""
    report = run_doctor(world["headonly"], world["drafts"]["taps-off-by-one"], measure_wiring=True,
                        layer_states=world["states"], wiring_tokens=40, engines=("vllm",), device="cpu",
                        dtype="float32")  # fmt: skip
    w = report.context["wiring"]
    named = [c for c in w["codes"] if c not in ("NO_TTT", "UNDERTRAINED")]
    assert named in ([], ["TAP_OFF_BY_ONE"], ["WIRING_UNEXPLAINED"]), w


# -- the CLI -------------------------------------------------------------------------------------------------------
def test_cli_json_carries_the_measured_wiring(world, capsys):
    rc = main(["doctor", "--target", str(world["headonly"]), "--draft", str(world["drafts"]["order-swapped"]),
               "--measure-wiring", "--layer-states", str(world["states"]), "--wiring-tokens", str(TOKENS),
               "--engine", "vllm", "--device", "cpu", "--dtype", "float32", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["findings"][0]["code"] == "TAP_ORDER"
    assert out["context"]["wiring"]["trained_for"]["wiring"]["segments"] == [4, 2, 5]
    assert "TRAINED_WIRING_MISMATCH" in out["codes"] and "WIRING_UNEXPLAINED" in out["codes"]
    rc = main(["doctor", "--target", str(world["headonly"]), "--draft", str(world["drafts"]["order-swapped"]),
               "--measure-wiring", "--layer-states", str(world["states"]), "--wiring-tokens", str(TOKENS),
               "--engine", "vllm", "--device", "cpu", "--dtype", "float32"])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 1 and "wiring     trained for segments [hs[4], hs[2], hs[5]]" in text


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--layer-states", "X"], "--layer-states is read by --measure-wiring"),
        (["--measure-wiring"], "--measure-wiring needs --data"),
        (["--measure-wiring", "--layer-states", "MISSING"], "holds no *.safetensors"),
    ],
)
def test_cli_bad_input_is_one_line(world, capsys, extra, says):
    rc = main(["doctor", "--target", str(world["headonly"]), "--draft", str(world["drafts"]["clean"]), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and says in err and len(err.splitlines()) == 1, err
