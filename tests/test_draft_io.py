"""Draft checkpoint I/O: exact round trips, official/SpecForge checkpoints, and refusals of bad ones."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from models import make_checkpoint
from safetensors.torch import load_file, save_file

from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import (
    WEIGHT_NAMES,
    DraftConfig,
    DraftContract,
    Eagle3Draft,
    check_draft_matches_target,
    load_draft,
    save_draft,
)
from eaglescope.models.targets.loading import fingerprint_of, read_config
from eaglescope.models.vocab import build_draft_vocab
from eaglescope.taps import TapContract

L = 8  # tests/models.py TINY: 8 layers, hidden 64, vocab 96
DRAFT_VOCAB = 48


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("target") / "llama")


def make_draft(
    target_dir: Path, taps: tuple[int, ...] | None = None, seed: int = 0
) -> tuple[Eagle3Draft, DraftContract]:
    """A random draft for the tiny target: every tensor random (norms too), a valid reduced vocab map."""
    cfg = read_config(target_dir)
    contract_taps = TapContract.default(L) if taps is None else TapContract(taps, L)
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Draft(DraftConfig.for_target(cfg, contract_taps, draft_vocab_size=DRAFT_VOCAB))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    counts = torch.randint(0, 50, (cfg["vocab_size"],), generator=g)
    model.set_vocab_map(*build_draft_vocab(counts, DRAFT_VOCAB))
    contract = DraftContract(
        taps=contract_taps,
        target=fingerprint_of(target_dir, cfg),
        ttt_length=7,
        loss_mask_shift="shifted",
        draft_vocab_source="loss-masked token counts",
    )
    return model, contract


def write_raw(out: Path, cfg: dict, sd: dict[str, torch.Tensor]) -> Path:
    """A checkpoint directory written by hand, as another tool (or a broken one) would."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def official_state(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in WEIGHT_NAMES}


def test_save_load_round_trip_is_bit_identical(target_dir, tmp_path):
    model, contract = make_draft(target_dir, taps=(0, 3, 6))
    save_draft(model, contract, tmp_path / "draft")
    loaded = load_draft(tmp_path / "draft", target_num_layers=L)
    got, want = loaded.model.state_dict(), model.state_dict()
    assert set(got) == set(want)
    for k in WEIGHT_NAMES:  # everything saved; the embedding is not (engines use the target's)
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k
    # rope params may be spelled differently (rope_parameters vs rope_theta); what matters is the same rotation
    a, b = loaded.model.config, model.config
    assert dataclasses.replace(a, rope=b.rope) == b
    assert (a.rope.theta, a.rope.rope_type) == (b.rope.theta, b.rope.rope_type)
    assert torch.equal(loaded.model.midlayer.inv_freq, model.midlayer.inv_freq)
    assert loaded.contract.taps == contract.taps
    assert loaded.contract.target == contract.target
    assert (loaded.contract.ttt_length, loaded.contract.loss_mask_shift) == (7, "shifted")
    assert loaded.contract.draft_vocab_source == contract.draft_vocab_source
    assert not loaded.contract.inferred and not loaded.has_embedding
    # the file itself holds the docs/field.md §2 names only, d2t as int64 offsets and t2d as bool
    sd = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert set(sd) == set(WEIGHT_NAMES)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool


def test_saved_embedding_round_trips(target_dir, tmp_path):
    model, contract = make_draft(target_dir)
    save_draft(model, contract, tmp_path / "draft", save_embedding=True)
    loaded = load_draft(tmp_path / "draft")
    assert loaded.has_embedding
    assert torch.equal(loaded.model.embed_tokens.weight, model.embed_tokens.weight)


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([1, L // 2 - 1, L - 4], [2, L // 2, L - 3]),  # SpecForge writes "output of layer i" ids
        (None, [2, L // 2, L - 3]),  # official EAGLE: no ids, the engines' shared default
    ],
)
def test_official_and_specforge_checkpoints_load_with_inferred_taps(target_dir, tmp_path, ids, expected):
    model, _ = make_draft(target_dir)
    ckpt = write_raw(tmp_path / "official", model.config.to_hf_config(ids), official_state(model))
    with pytest.warns(UserWarning, match="no eaglescope section"):
        loaded = load_draft(ckpt, target_num_layers=L)
    assert list(loaded.contract.taps.layers) == expected
    assert loaded.contract.inferred and loaded.contract.target is None
    assert torch.equal(loaded.model.fc.weight, model.fc.weight)
    assert torch.equal(loaded.model.d2t, model.d2t)


@pytest.mark.parametrize("prefix", ["layers.0.", "model.layers.0."])
def test_vllm_style_layer_names_load(target_dir, tmp_path, prefix):
    model, contract = make_draft(target_dir)
    save_draft(model, contract, tmp_path / "d")
    sd = {k.replace("midlayer.", prefix, 1): v for k, v in load_file(str(tmp_path / "d" / "model.safetensors")).items()}
    save_file(sd, str(tmp_path / "d" / "model.safetensors"))
    loaded = load_draft(tmp_path / "d")
    assert torch.equal(loaded.model.midlayer.self_attn.q_proj.weight, model.midlayer.self_attn.q_proj.weight)


def test_contractless_checkpoint_without_target_asks_for_target(target_dir, tmp_path):
    model, _ = make_draft(target_dir)
    ckpt = write_raw(tmp_path / "official", model.config.to_hf_config(None), official_state(model))
    with pytest.raises(EagleScopeError, match="pass --target"):
        load_draft(ckpt)


def _broken(target_dir: Path, tmp_path: Path, edit) -> Path:
    """A checkpoint saved by eaglescope, then damaged by `edit(cfg, sd)`."""
    model, contract = make_draft(target_dir)
    good = save_draft(model, contract, tmp_path / "good")
    cfg = json.loads((good / "config.json").read_text())
    sd = load_file(str(good / "model.safetensors"))
    edit(cfg, sd)
    return write_raw(tmp_path / "bad", cfg, sd)


def test_missing_vocab_map_with_reduced_vocab_is_refused(target_dir, tmp_path):
    def edit(cfg, sd):
        del sd["d2t"], sd["t2d"]

    with pytest.raises(EagleScopeError, match="no d2t/t2d map"):
        load_draft(_broken(target_dir, tmp_path, edit))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d2t: d2t.flip(0), "not strictly increasing"),
        (lambda d2t: d2t + 1000, "outside the target vocabulary"),
        (lambda d2t: d2t.to(torch.int32), "int64"),
    ],
)
def test_invalid_d2t_is_refused(target_dir, tmp_path, damage, message):
    def edit(cfg, sd):
        sd["d2t"] = damage(sd["d2t"]).contiguous()

    with pytest.raises(EagleScopeError, match=message):
        load_draft(_broken(target_dir, tmp_path, edit))


def test_fc_width_inconsistent_with_taps_is_refused(target_dir, tmp_path):
    def edit(cfg, sd):
        sd["fc.weight"] = sd["fc.weight"][:, : 2 * 64].contiguous()  # fc reads 2 taps, the contract names 3

    with pytest.raises(EagleScopeError, match="fc reads 2 hidden states .* 3 taps"):
        load_draft(_broken(target_dir, tmp_path, edit))


def test_weight_shape_mismatch_is_refused(target_dir, tmp_path):
    def edit(cfg, sd):
        sd["midlayer.self_attn.q_proj.weight"] = torch.zeros(64, 64)  # q_proj must read the 2H concatenation

    with pytest.raises(EagleScopeError, match="q_proj.weight' has shape \\(64, 64\\), config implies \\(64, 128\\)"):
        load_draft(_broken(target_dir, tmp_path, edit))


def test_missing_weight_is_refused(target_dir, tmp_path):
    def edit(cfg, sd):
        del sd["midlayer.hidden_norm.weight"]

    with pytest.raises(EagleScopeError, match="hidden_norm"):
        load_draft(_broken(target_dir, tmp_path, edit))


def test_truncated_safetensors_is_refused(target_dir, tmp_path):
    model, contract = make_draft(target_dir)
    ckpt = save_draft(model, contract, tmp_path / "d")
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(EagleScopeError, match="corrupted or truncated"):
        load_draft(ckpt)


def test_not_a_draft_is_refused(target_dir):
    with pytest.raises(EagleScopeError, match="not an EAGLE-3 draft"):
        load_draft(target_dir)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vocab_size": 100}, "vocab_size=96"),
        ({"hidden_size": 128}, "hidden_size=64"),
        ({"num_layers": 9}, "8-layer target; this target has 9"),
        ({"tokenizer_sha256": "1" * 64}, "different tokenizer"),
    ],
)
def test_check_draft_matches_target_refuses_another_target(target_dir, change, message):
    _, contract = make_draft(target_dir)
    contract = dataclasses.replace(contract, target=dataclasses.replace(contract.target, tokenizer_sha256="0" * 64))
    same = contract.target
    check_draft_matches_target(contract, same)  # the recorded target itself is accepted
    with pytest.raises(EagleScopeError, match=message):
        check_draft_matches_target(contract, dataclasses.replace(same, **change))


def test_failed_save_leaves_previous_checkpoint_intact(target_dir, tmp_path):
    model, contract = make_draft(target_dir, seed=0)
    out = save_draft(model, contract, tmp_path / "draft")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    other, _ = make_draft(target_dir, seed=1)
    # weights and config are written, then an extra file fails: the half-written temp dir must not win
    with pytest.raises(FileNotFoundError):
        save_draft(other, contract, out, extra_files={"missing-dir/notes.txt": "x"})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]  # no temp or backup left behind
    # and a successful save does replace it
    save_draft(other, contract, out)
    assert torch.equal(load_draft(out).model.fc.weight, other.fc.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
