"""`doctor`'s static checks: each fires on its injected checkpoint fault and stays quiet on a clean checkpoint,
for targets of several sizes and depths."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from models import make_checkpoint
from safetensors.torch import load_file, save_file

from eaglescope.detective.findings import CODES
from eaglescope.detective.static import static_checks
from eaglescope.export import load_target_embedding
from eaglescope.models.draft import DraftConfig, DraftContract, Eagle3Draft, save_draft
from eaglescope.models.targets.loading import fingerprint_of, read_config
from eaglescope.models.vocab import build_draft_vocab
from eaglescope.taps import TapContract

# (family, layers, hidden, heads, kv heads): a spread of depths and widths.
SHAPES = [
    ("llama", 8, 64, 4, 2),
    ("qwen2", 12, 32, 4, 4),
    ("mistral", 10, 48, 6, 2),
]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module", params=SHAPES, ids=[f"{s[0]}-L{s[1]}-H{s[2]}" for s in SHAPES])
def target(request, tmp_path_factory) -> Path:
    family, layers, hidden, heads, kv = request.param
    d = make_checkpoint(
        family,
        tmp_path_factory.mktemp("t") / family,
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=2 * hidden,
    )
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


def draft_for(target: Path, taps: tuple[int, ...] | None = None, n_vocab: int = 48, seed: int = 0):
    cfg = read_config(target)
    L = cfg["num_hidden_layers"]
    tc = TapContract.default(L) if taps is None else TapContract(taps, L)
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Draft(DraftConfig.for_target(cfg, tc, n_vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.set_vocab_map(*build_draft_vocab(torch.randint(0, 50, (cfg["vocab_size"],), generator=g), n_vocab))
    return model, DraftContract(taps=tc, target=fingerprint_of(target, cfg), ttt_length=7, loss_mask_shift="shifted")


def codes(findings) -> list[str]:
    return [f.code for f in findings]


def rewrite(draft_dir: Path, edit_sd=None, edit_cfg=None) -> Path:
    """Edit a saved checkpoint in place, the way a broken conversion script would."""
    sd = load_file(str(draft_dir / "model.safetensors"))
    cfg = json.loads((draft_dir / "config.json").read_text())
    if edit_sd:
        edit_sd(sd)
    if edit_cfg:
        edit_cfg(cfg)
    save_file(sd, str(draft_dir / "model.safetensors"))
    (draft_dir / "config.json").write_text(json.dumps(cfg))
    return draft_dir


def test_clean_checkpoint_has_no_findings(target, tmp_path):
    model, contract = draft_for(target)
    findings, ctx = static_checks(target, save_draft(model, contract, tmp_path / "d"))
    assert findings == []
    L = read_config(target)["num_hidden_layers"]
    assert ctx["engines"]["vllm"]["captures"] == [2, L // 2, L - 3]
    assert ctx["engines"]["sglang"]["matches_contract"] and ctx["vocab_map"]["has_d2t"]


def test_clean_embedding_tap_contract_and_saved_target_embedding_have_no_findings(target, tmp_path):
    L = read_config(target)["num_hidden_layers"]
    model, contract = draft_for(target, taps=(0, 3, L - 2))  # the seed scenario's [embedding, 3, L-2]
    model.load_target_embedding(load_target_embedding(target))
    d = save_draft(model, contract, tmp_path / "d", save_embedding=True)
    findings, ctx = static_checks(target, d)
    assert findings == [], [f.verdict for f in findings]
    assert ctx["embedding"]["matches_target"] is True
    # legacy SGLang cannot capture the embedding: reported in the context, not as a finding
    assert ctx["engines"]["sglang-legacy"]["matches_contract"] is False


def test_wrong_fingerprint_is_contract_mismatch(target, tmp_path):
    model, contract = draft_for(target)
    fp = contract.target
    contract.target = dataclasses.replace(fp, hidden_size=fp.hidden_size * 2, tokenizer_sha256="ab" * 32)
    findings, _ = static_checks(target, save_draft(model, contract, tmp_path / "d"))
    assert codes(findings) == ["CONTRACT_MISMATCH"]
    diffs = findings[0].evidence["differs"]
    assert diffs["hidden_size"] == [fp.hidden_size * 2, fp.hidden_size]
    assert "tokenizer_sha256" not in diffs  # this target has no tokenizer: nothing to compare


def test_draft_for_another_width_is_contract_mismatch(target, tmp_path):
    cfg = read_config(target)
    other = make_checkpoint(
        "llama", tmp_path / "other", num_hidden_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"] + 16
    )
    model, contract = draft_for(other)
    findings, _ = static_checks(target, save_draft(model, contract, tmp_path / "d"))
    assert "CONTRACT_MISMATCH" in codes(findings)
    f = next(f for f in findings if f.code == "CONTRACT_MISMATCH")
    assert f.evidence["differs"]["fc_in_features"] == [3 * (cfg["hidden_size"] + 16), 3 * cfg["hidden_size"]]


def test_sglang_ids_off_by_one(target, tmp_path):
    L = read_config(target)["num_hidden_layers"]
    taps = (1, L // 2, L - 2)
    model, contract = draft_for(target, taps=taps)
    # ids written as-is (vLLM convention): newer SGLang sees a first id of 1 and adds +1 to all of them
    findings, ctx = static_checks(target, save_draft(model, contract, tmp_path / "d"))
    assert codes(findings) == ["ENGINE_TAP_CONVENTION"]
    ev = findings[0].evidence
    assert ev["engine"] == "sglang" and ev["offset"] == 1 and ev["captures"] == [t + 1 for t in taps]
    assert ctx["engines"]["vllm"]["matches_contract"]


def test_specforge_ids_under_vllm_are_off_by_one(target, tmp_path):
    L = read_config(target)["num_hidden_layers"]
    taps = (3, L // 2, L - 2)
    model, contract = draft_for(target, taps=taps)
    d = save_draft(model, contract, tmp_path / "d", tap_ids=[t - 1 for t in taps])  # "output of layer i"
    findings, _ = static_checks(target, d)
    by_engine = {f.evidence["engine"]: f.evidence for f in findings if f.code == "ENGINE_TAP_CONVENTION"}
    assert set(by_engine) == {"sglang", "vllm"}  # first id 2 ≠ 1: newer SGLang reads them as-is too
    assert all(e["offset"] == -1 for e in by_engine.values())
    # restricting to the engine actually serving keeps only its finding
    findings, _ = static_checks(target, d, engines=("vllm",))
    assert [f.evidence["engine"] for f in findings] == ["vllm"]


def test_missing_vocab_map_on_reduced_vocab(target, tmp_path):
    model, contract = draft_for(target)
    d = rewrite(save_draft(model, contract, tmp_path / "d"), edit_sd=lambda sd: (sd.pop("d2t"), sd.pop("t2d")))
    findings, ctx = static_checks(target, d)
    assert codes(findings) == ["VOCAB_MAP"] and findings[0].support == "declared"
    assert ctx["vocab_map"]["has_d2t"] is False


def test_identity_map_on_reduced_vocab(target, tmp_path):
    model, contract = draft_for(target)
    V = read_config(target)["vocab_size"]

    def identity(sd):
        sd["d2t"] = torch.zeros(48, dtype=torch.int64)
        sd["t2d"] = torch.arange(V) < 48

    findings, ctx = static_checks(target, rewrite(save_draft(model, contract, tmp_path / "d"), edit_sd=identity))
    assert codes(findings) == ["VOCAB_MAP"] and ctx["vocab_map"]["d2t_all_zero"]


def test_full_vocab_without_map_is_fine(target, tmp_path):
    V = read_config(target)["vocab_size"]
    model, contract = draft_for(target, n_vocab=V)
    d = rewrite(save_draft(model, contract, tmp_path / "d"), edit_sd=lambda sd: (sd.pop("d2t"), sd.pop("t2d")))
    assert static_checks(target, d)[0] == []


def test_unsorted_d2t_is_vocab_map(target, tmp_path):
    model, contract = draft_for(target)

    def swap(sd):
        ids = sd["d2t"] + torch.arange(48)
        ids[[0, 1]] = ids[[1, 0]]
        sd["d2t"] = ids - torch.arange(48)

    findings, ctx = static_checks(target, rewrite(save_draft(model, contract, tmp_path / "d"), edit_sd=swap))
    assert codes(findings) == ["VOCAB_MAP"] and "increasing" in ctx["vocab_map"]["error"]


def test_saved_random_embedding_differs_from_targets(target, tmp_path):
    model, contract = draft_for(target)  # embed_tokens left at its random init
    findings, ctx = static_checks(target, save_draft(model, contract, tmp_path / "d", save_embedding=True))
    assert codes(findings) == ["EMBEDDING_MISMATCH"]
    assert ctx["embedding"]["rel_err"] > 0.5


def test_bf16_copy_of_the_targets_embedding_is_not_a_mismatch(target, tmp_path):
    model, contract = draft_for(target)
    model.load_target_embedding(load_target_embedding(target).bfloat16().float())
    findings, ctx = static_checks(target, save_draft(model, contract, tmp_path / "d", save_embedding=True))
    assert findings == [] and 0 < ctx["embedding"]["rel_err"] < 1e-2


def test_template_hash_mismatch(target, tmp_path):
    model, contract = draft_for(target)
    contract.target = dataclasses.replace(contract.target, chat_template_sha256="0" * 64)
    findings, _ = static_checks(target, save_draft(model, contract, tmp_path / "d"))
    assert codes(findings) == ["TEMPLATE_MISMATCH"]
    assert findings[0].evidence["target_sha256"] == fingerprint_of(target, read_config(target)).chat_template_sha256


def test_every_finding_serialises_with_a_registered_code(target, tmp_path):
    model, contract = draft_for(target, taps=(1, 4, 6))
    contract.target = dataclasses.replace(contract.target, chat_template_sha256="0" * 64)
    findings, _ = static_checks(target, save_draft(model, contract, tmp_path / "d", save_embedding=True))
    assert len(findings) == 3
    for f in findings:
        d = json.loads(json.dumps(f.to_dict()))
        assert d["code"] in CODES and {"stage", "verdict", "evidence", "fix"} <= set(d)


def test_eagle31_norm_whose_flag_was_lost_is_named(tmp_path):
    """The SGLang 32226 / PR 32334 incident, statically: the weights hold input_norm (norm_before_fc) but the served
    config no longer sets the flag, so an engine skips the norm; and the reverse."""
    from drafts import make_draft
    from models import make_checkpoint

    t = make_checkpoint("llama", tmp_path / "t")
    model, contract = make_draft(t, draft_vocab_size=48, norm_before_fc=True, fc_norm=True)
    d = save_draft(model, contract, tmp_path / "d")
    findings, ctx = static_checks(t, d)
    assert [f.code for f in findings] == [] and ctx["layer"]["eagle31"]["norm_before_fc"]

    def lose_flag(cfg):
        cfg["eagle_config"].pop("norm_before_fc")
        cfg.pop("norm_before_fc")

    findings, _ = static_checks(t, rewrite(d, edit_cfg=lose_flag))
    assert [(f.code, f.evidence["flag"]) for f in findings] == [("EAGLE31_IGNORED", "norm_before_fc")]
    findings, _ = static_checks(t, rewrite(d, edit_sd=lambda sd: sd.pop("fc_norm.0.weight")))
    assert any(f.code == "EAGLE31_IGNORED" and f.evidence["flag"] == "fc_norm" for f in findings)


def test_mla_draft_served_as_llama_and_vllm_ignoring_norm_before_fc_are_named(tmp_path):
    from drafts import make_draft
    from models import make_checkpoint

    t = make_checkpoint("deepseek_v3", tmp_path / "ds")
    model, contract = make_draft(t, draft_vocab_size=48, arch="mla", norm_before_fc=True)
    d = save_draft(model, contract, tmp_path / "mla")
    findings, _ = static_checks(t, d, engines=("vllm",))
    assert [(f.code, f.evidence.get("engine")) for f in findings] == [("EAGLE31_IGNORED", "vllm")]

    def as_llama(cfg):
        for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            cfg.pop(k)
        cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLMEagle3"], "llama"

    findings, _ = static_checks(t, rewrite(d, edit_cfg=as_llama))
    assert findings[0].code == "DRAFT_ARCH_MISMATCH" and "MLA" in findings[0].verdict


def test_an_inferred_contract_is_labelled_inferred_wherever_it_is_shown(tmp_path, capsys):
    """A checkpoint without an eaglescope section (official EAGLE, SpecForge): its taps are the engines' reading of
    its config, not a record of training. doctor (text, JSON, HTML), inspect and export say so, never "the draft
    was trained on [...]", and an export keeps the label in the section it writes."""
    from eaglescope.cli import main
    from eaglescope.detective.doctor import format_report, run_doctor
    from eaglescope.detective.report import html_of

    target = make_checkpoint("llama", tmp_path / "t", num_hidden_layers=8)
    model, contract = draft_for(target, taps=(3, 4, 6))
    # SpecForge's "output of layer i" ids, and no eaglescope section: the ids are all there is
    d = rewrite(save_draft(model, contract, tmp_path / "d", tap_ids=[2, 3, 5]), edit_cfg=lambda c: c.pop("eaglescope"))
    findings, ctx = static_checks(target, d)
    assert ctx["contract"]["inferred"] is True and ctx["taps"] == [3, 4, 6]
    tap_findings = [f for f in findings if f.stage == "target.aux"]
    assert tap_findings  # vLLM reads SpecForge's ids one layer early
    for f in tap_findings:
        assert "INFERRED" in f.verdict and "was trained on" not in f.verdict, f.verdict

    report = run_doctor(target, d)
    text = format_report(report)
    assert "contract   INFERRED from the specforge convention" in text and "was trained on" not in text
    assert "INFERRED" in html_of(report)

    assert main(["inspect", str(d), "--target", str(target)]) == 0
    shown = capsys.readouterr().out
    assert "INFERRED from the specforge convention" in shown and "training   unknown" in shown
    assert "was trained on" not in shown

    out = tmp_path / "vllm"
    assert main(["export", "--draft", str(d), "--to", "vllm", "--out", str(out), "--target", str(target)]) == 0
    shown = capsys.readouterr().out
    assert "= INFERRED taps" in shown and "trained taps" not in shown
    section = json.loads((out / "config.json").read_text())["eaglescope"]
    assert section["inferred"] is True and section["taps"]["layers"] == [3, 4, 6]
    # read back, the exported checkpoint is still an inferred contract, not a record
    _, ctx = static_checks(target, out)
    assert ctx["contract"]["inferred"] is True
    assert "contract   INFERRED" in format_report(run_doctor(target, out))
