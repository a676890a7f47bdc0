"""fast/tuning.py: a tuning file's launch settings reach the fused verify (by row count) and the fused draft level
through the engine, the kernels they name are the ones that run, decoding stays vanilla greedy under them, and a bad
file is one clear error naming it. Under Triton's interpreter in float32."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from drafts import make_draft  # noqa: E402
from models import WIDE_HEADS, make_checkpoint  # noqa: E402
from tolerance import assert_draft_step_matches_modules, assert_step_matches_modules  # noqa: E402

from eaglescope.decode.speculative import draft_slot_cache, target_embedding  # noqa: E402
from eaglescope.decode.vanilla import generate_vanilla  # noqa: E402
from eaglescope.errors import EagleScopeError  # noqa: E402
from eaglescope.fast import FastEagle, FastTarget, fused_draft, fused_verify, tuning  # noqa: E402
from eaglescope.fast import invariant as inv  # noqa: E402
from eaglescope.fast.fused_verify import CUBLAS_PRODUCTS, FLASH_LAUNCH, K_SPLITS, FusedVerify  # noqa: E402
from eaglescope.models.targets import load_target  # noqa: E402
from eaglescope.models.targets.llama import fuse_projections  # noqa: E402
from eaglescope.taps import TapContract  # noqa: E402

pytestmark = pytest.mark.skipif(not inv.available("cpu"), reason="needs TRITON_INTERPRET=1 on a CPU-only machine")

SMALL = [16, 16, 1, 2]  # interpreter-sized tiles


def _write(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


def _counting(monkeypatch, module, name: str) -> list:
    calls: list = []
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def test_each_row_count_runs_its_entrys_kernels_and_matches_the_modules(tmp_path, monkeypatch):
    """Entries for up to 4 rows (every product on the Triton kernel, a swapped o tile, flash attention in 3 splits of
    32-row programs) and up to 16 (o and down as partials over K, flash attention in 2 splits of 16-row programs);
    past 16 rows the built-ins. Each verify is held to the modules,
    and which products went to cuBLAS, whole or in slices, is counted, so an entry read but not run fails."""
    ckpt = make_checkpoint("llama", tmp_path, seed=4, num_hidden_layers=2, **WIDE_HEADS)
    model = fuse_projections(copy.deepcopy(load_target(ckpt, device="cpu", dtype=torch.float32).model))
    small = {name: tuple(SMALL) for name in ("qkv", "o", "gate_up", "down", "lm_head")}
    doc = {
        "verify": [
            {"max_rows": 16, "k_splits": {"o": 2, "down": 2}, "flash_launch": [16, 32, 1, 2, 2]},
            {
                "max_rows": 4,
                "cublas": [],
                "blocks": {**{k: list(v) for k, v in small.items()}, "o": SMALL + [1]},
                "flash_launch": [32, 32, 1, 2, 3],
            },
        ]
    }
    loaded = tuning.load_tuning(_write(tmp_path / "t.json", doc))
    assert [rows for rows, _ in loaded.verify] == [4, 16]  # sorted by max_rows
    ft = FastTarget(model, size=96, taps=(0, 1), float32_logits=True)
    fv = FusedVerify(model, ft.cache, taps=(0, 1), blocks=small, by_rows=loaded.verify)
    s3, s8, s20 = fv.settings(3), fv.settings(8), fv.settings(20)
    assert s3.cublas == () and s3.blocks["o"] == tuple(SMALL + [1]) and s3.flash_launch == (32, 32, 1, 2, 3)
    assert s8.cublas == CUBLAS_PRODUCTS and s8.k_splits == {**K_SPLITS, "o": 2, "down": 2}
    assert s8.flash_launch == (16, 32, 1, 2, 2) and s20 == fv.settings() and s20.flash_launch == FLASH_LAUNCH
    # flash attention's partials made once, for both splitting launches: no row count remakes them under another's
    # captured graph
    flash_part = fv._flash_part
    assert flash_part is not None
    mms = _counting(monkeypatch, fused_verify, "_mm")
    splits = _counting(monkeypatch, fused_verify, "split_k_mm")
    ft.prefill(torch.arange(3, 9))
    layers = len(model.model.layers)
    for T, want_mm, want_split in ((3, 0, 0), (8, 2 * layers, 2 * layers), (20, 4 * layers, 0)):
        slots = 6 + torch.arange(T)
        mask = torch.arange(96)[None, :] <= slots[:, None]
        toks = torch.randint(0, model.args.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
        mms.clear(), splits.clear()
        assert_step_matches_modules(ft, fv, toks, slots, mask, slots, layers + 1)
        # 8 rows: q/k/v and gate/up whole, o and down in slices; 20: all four whole
        assert (len(mms), len(splits)) == (want_mm, want_split), T
        assert not fv.count.any() and fv._flash_part is flash_part


def test_decoding_under_a_tuning_file_is_vanilla_greedy_and_runs_what_it_says(tmp_path, monkeypatch):
    """$EAGLESCOPE_TUNING read by the engine: the verify's entry and the draft level's K splits are the ones the
    round runs (counted), and the tokens are vanilla greedy's."""
    ckpt = make_checkpoint("llama", tmp_path, seed=7, num_hidden_layers=7, **WIDE_HEADS)
    tgt = load_target(ckpt, device="cpu", dtype=torch.float32)
    tgt.set_taps(TapContract.default(tgt.num_layers))
    draft, _ = make_draft(ckpt, taps=tgt.taps, seed=14, scale=1.0)
    draft.load_target_embedding(target_embedding(tgt))
    fuse_projections(draft)
    doc = {"verify": [{"max_rows": 64, "k_splits": {"qkv": 2, "down": 2}, "cublas": ["qkv", "o", "down"],
                       "blocks": {"gate_up": SMALL + [1]}}],
           "draft": {"k_splits": {"o": 2}, "stream": {"gate_up": SMALL}}}  # fmt: skip
    monkeypatch.setenv(tuning.ENV, str(_write(tmp_path / "tuning.json", doc)))
    ft = FastTarget(copy.deepcopy(tgt.model), 64, taps=tgt.taps.layers, fuse=True, fused_decode=True, fused_verify=True)
    assert ft.tuning.path == str(tmp_path / "tuning.json") and len(ft.tuning.sha256) == 64
    verify_splits = _counting(monkeypatch, fused_verify, "split_k_mm")
    draft_splits = _counting(monkeypatch, fused_draft, "split_k_mm")
    prompt, n = [3, 17, 5, 40, 22, 9, 11], 12
    fe = FastEagle(ft, draft, 3, 3, 8, max_len=len(prompt) + n + 2)
    assert fe.fused_layer.k_splits == {"o": 2, "down": 1}
    assert fe.fused_layer.stream == {"gate_up": tuple(SMALL)}
    draft_stream = _counting(monkeypatch, fused_draft, "stream_mm")
    fast = fe.generate(prompt, n)
    assert fast.tokens == generate_vanilla(tgt, prompt, n, stop_ids=[]).token_ids
    assert sum(fast.accepted) > 0
    layers = len(tgt.model.model.layers)
    # every verify: q/k/v and down in slices on every layer; every draft step: o in slices, down whole
    assert verify_splits and len(verify_splits) % (2 * layers) == 0
    assert draft_splits and all(r <= fe.fused_layer.rows for r in draft_splits)
    assert draft_stream and len(draft_stream) == len(draft_splits)  # gate/up on stream_mm at every draft step


def test_a_verify_entrys_stream_launches_run_at_its_row_counts(tmp_path, monkeypatch):
    """An entry's `stream` (fast.stream_mm's launches) for up to 8 rows: those products on stream_mm there, held to
    the modules; past 8 rows the built-in (none on this CPU)."""
    ckpt = make_checkpoint("llama", tmp_path, seed=4, num_hidden_layers=2, **WIDE_HEADS)
    model = fuse_projections(copy.deepcopy(load_target(ckpt, device="cpu", dtype=torch.float32).model))
    doc = {
        "verify": [
            {"max_rows": 8, "stream": {"qkv": [16, 16, 2, 2], "down": [16, 16, 1, 2], "lm_head": [16, 16, 1, 2]}}
        ]
    }
    loaded = tuning.load_tuning(_write(tmp_path / "t.json", doc))
    ft = FastTarget(model, size=96, taps=(0, 1), float32_logits=True)
    fv = FusedVerify(model, ft.cache, taps=(0, 1), by_rows=loaded.verify)
    named = {"qkv": (16, 16, 2, 2), "down": (16, 16, 1, 2), "lm_head": (16, 16, 1, 2)}
    assert fv.settings(5).stream == named and fv.settings(20).stream == {}
    calls = _counting(monkeypatch, fused_verify, "stream_mm")
    ft.prefill(torch.arange(3, 9))
    layers = len(model.model.layers)
    for T, want in ((5, 2 * layers + 1), (20, 0)):
        slots = 6 + torch.arange(T)
        mask = torch.arange(96)[None, :] <= slots[:, None]
        toks = torch.randint(0, model.args.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
        calls.clear()
        assert_step_matches_modules(ft, fv, toks, slots, mask, slots, layers + 1)
        assert len(calls) == want, T


def test_a_device_file_is_found_by_the_gpus_name_and_the_environment_wins(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.delenv(tuning.ENV, raising=False)
    cuda = torch.device("cuda")
    assert tuning.tuning_for(cuda) is tuning.BUILT_IN  # no file for this GPU: the built-ins
    _write(tmp_path / "NVIDIA_Test_GPU.json", {"device": "NVIDIA Test GPU", "draft": {"k_splits": {"down": 2}}})
    assert tuning.tuning_for(cuda).draft_k_splits == {"down": 2}
    assert tuning.tuning_for(torch.device("cpu")) is tuning.BUILT_IN  # device files are for GPUs
    other = _write(tmp_path / "other.json", {"device": "NVIDIA Other", "verify": [{"max_rows": 8, "cublas": []}]})
    monkeypatch.setenv(tuning.ENV, str(other))
    monkeypatch.setattr(logging.getLogger("eaglescope"), "propagate", True)  # the CLI's logging may have cut it
    with caplog.at_level(logging.WARNING, logger="eaglescope.fast.tuning"):
        chosen = tuning.tuning_for(cuda)
    assert chosen.verify == ((8, {"cublas": ()}),) and chosen.draft_k_splits is None
    assert "measured on NVIDIA Other" in caplog.text


def test_a_tuning_reads_back_from_its_document(tmp_path):
    doc = {"device": "NVIDIA H200", "source": {"commit": "abc"},
           "verify": [{"max_rows": 24, "cublas": ["o"], "cublaslt": [], "blocks": {"qkv": [16, 128, 4, 3, 1]},
                       "k_splits": {"o": 2}, "flash_launch": [16, 128, 8, 2, 3], "stream": {"qkv": [64, 128, 2, 3]}},
                      {"max_rows": 64, "cublas": []}],
           "draft": {"k_splits": {"o": 2, "down": 2}, "stream": {"lm_head": [64, 256, 1, 3]}}}  # fmt: skip
    first = tuning.load_tuning(_write(tmp_path / "a.json", doc))
    assert first.document() == doc
    again = tuning.load_tuning(_write(tmp_path / "b.json", first.document()))
    assert (again.verify, again.draft_k_splits, again.device, again.source, again.draft_stream) == (
        first.verify,
        first.draft_k_splits,
        first.device,
        first.source,
        {"lm_head": (64, 256, 1, 3)},
    )


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "is not JSON"),
        ('{"verify": [], "blocks": {}}', "unknown key(s) ['blocks']"),
        ('{"verify": [{"cublas": []}]}', "max_rows is a row count 2..64, not None"),
        ('{"verify": [{"max_rows": 65}]}', "max_rows is a row count 2..64, not 65"),
        ('{"verify": [{"max_rows": true}]}', "max_rows is a row count"),
        ('{"verify": [{"max_rows": 8}, {"max_rows": 8}]}', "two verify entries for the same max_rows"),
        ('{"verify": [{"max_rows": 8, "cublas": ["lm_head"]}]}', "cublas lists products of"),
        ('{"verify": [{"max_rows": 8, "cublas": ["o"], "cublaslt": ["down"]}]}', "cublaslt names products left"),
        ('{"verify": [{"max_rows": 8, "blocks": {"o": [16, 16, 1]}}]}', "blocks of o is 4 or 5 positive integers"),
        ('{"verify": [{"max_rows": 8, "blocks": {"o": [16, 0, 1, 2]}}]}', "blocks of o is 4 or 5 positive"),
        ('{"verify": [{"max_rows": 8, "blocks": {"attn": [16, 16, 1, 2]}}]}', "unknown key(s) ['attn']"),
        ('{"verify": [{"max_rows": 8, "k_splits": {"gate_up": 2}}]}', "unknown key(s) ['gate_up']"),
        ('{"verify": [{"max_rows": 8, "k_splits": {"o": 0}}]}', "o is cut into a positive number"),
        ('{"verify": [{"max_rows": 8, "flash_launch": [16, 128, 8, 2, 0]}]}', "flash_launch is 4 or 5 positive"),
        ('{"draft": {"k_splits": {"qkv": 2}}}', "unknown key(s) ['qkv']"),
        ('{"verify": [{"max_rows": 8, "stream": {"o": [64, 128, 2]}}]}', "stream of o is 4 positive integers"),
        ('{"verify": [{"max_rows": 8, "stream": {"embed": [64, 128, 1, 3]}}]}', "unknown key(s) ['embed']"),
        ('{"verify": [{"max_rows": 8, "stream": {"lm_head": [64, 128, 2, 3]}}]}', "no kernel after it to sum K"),
        ('{"draft": {"stream": {"gate_up": [64, 128, 2, 3]}}}', "no kernel after it to sum K splits"),
        ('{"verify": {"max_rows": 8}}', "'verify' is a list of entries"),
        ("[]", "the file is an object"),
    ],
)
def test_a_bad_tuning_file_is_one_error_naming_it(tmp_path, monkeypatch, text, says):
    path = tmp_path / "bad.json"
    path.write_text(text)
    monkeypatch.setenv(tuning.ENV, str(path))
    with pytest.raises(EagleScopeError) as e:
        tuning.tuning_for(torch.device("cpu"))
    message = str(e.value)
    assert message.startswith(f"tuning file {path}") and says in message and "\n" not in message
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "missing.json"))
    with pytest.raises(EagleScopeError, match="missing.json"):
        tuning.tuning_for(torch.device("cpu"))


def test_an_entry_that_leaves_cublaslt_a_product_not_on_cublas_is_refused(tmp_path):
    """Checked against the verify's own settings: cuBLASLt named by the entry for a product the built-ins (not
    the entry) leave on the Triton kernel."""
    ckpt = make_checkpoint("llama", tmp_path, num_hidden_layers=1, **WIDE_HEADS)
    model = fuse_projections(load_target(ckpt, device="cpu", dtype=torch.float32).model)
    cache = FastTarget(model, size=16).cache
    with pytest.raises(ValueError, match="settings for up to 8 rows: cuBLASLt runs products left to cuBLAS"):
        FusedVerify(model, cache, cublas=("o",), by_rows=[(8, {"cublaslt": ("down",)})])


@pytest.mark.parametrize("path", sorted(tuning.TUNED_DIR.glob("*.json")), ids=lambda p: p.name)
def test_each_committed_tuning_file_loads_under_its_gpus_name(path, tmp_path):
    """fast/tuned/: every file checks, is named for the GPU it was measured on, and its settings (swept at 8B widths)
    verify a target of other widths as the modules do, at each entry's row count; its draft entry runs a draft
    level as the draft's modules do."""
    tuned = tuning.load_tuning(path)
    assert tuned.device and tuning.device_file(tuned.device) == path
    assert tuned.verify and tuned.source.get("commit")
    ckpt = make_checkpoint("llama", tmp_path, num_hidden_layers=1, **WIDE_HEADS)
    model = fuse_projections(copy.deepcopy(load_target(ckpt, device="cpu", dtype=torch.float32).model))
    ft = FastTarget(model, size=96, taps=(0,), float32_logits=True)
    fv = FusedVerify(model, ft.cache, taps=(0,), by_rows=tuned.verify)
    ft.prefill(torch.arange(3, 9))
    for T in sorted({rows for rows, _ in tuned.verify}):
        slots = 6 + torch.arange(T)
        mask = torch.arange(96)[None, :] <= slots[:, None]
        toks = torch.randint(0, model.args.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
        assert_step_matches_modules(ft, fv, toks, slots, mask, slots, 2)
    if tuned.draft_k_splits:
        draft, _ = make_draft(ckpt, taps=TapContract((0,), 1), seed=3, scale=1.0)
        fuse_projections(draft)
        cache = draft_slot_cache(draft, 32)
        fused = fused_draft.FusedDraftStep(draft, cache, rows=4, k_splits=tuned.draft_k_splits)
        assert fused.k_splits == {**fused_draft.DRAFT_K_SPLITS, **tuned.draft_k_splits}
        g = torch.Generator().manual_seed(4)
        H, slots = draft.config.hidden_size, 9 + torch.arange(4)
        mask = torch.arange(32)[None, :] <= slots[:, None]
        embeds, hidden = torch.randn(4, H, generator=g), torch.randn(4, H, generator=g)
        assert_draft_step_matches_modules(fused, draft, embeds, hidden, torch.full((4,), 9), slots, mask)
