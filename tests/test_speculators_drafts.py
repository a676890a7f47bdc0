"""Drafts written by speculators' own code (0.9.0: `create_transformer_layer_config` + `Eagle3DraftModel
.from_training_args` + `save_pretrained`, as `speculators train` builds and saves them; tests/speculators_writer.py)
are read by every eaglescope command as written: eaglescope computes speculators' own forward at every TTT step
(tests/speculators_runner.py runs speculators' `Eagle3DraftModel`), decodes losslessly with them, exports them, and
`inspect` says which of their properties the files declare and how doctor measures the rest.

Three drafts for tests/models.py's tiny 8-layer Llama: plain EAGLE-3 with explicit ids and a reduced vocabulary;
EAGLE 3.1 with fc_norm and norm_output at full vocabulary and default ids; EAGLE 3.1 with norm_before_fc and the
embedding among its taps. speculators runs in its own environment (scripts/speculators_env.sh), found as
tests/test_speculators.py finds it: without it every test here is skipped with one reason, and
EAGLESCOPE_REQUIRE_SPECULATORS=1 makes that a failure.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from models import make_checkpoint
from safetensors.torch import load_file, save_file
from test_speculators import RUNNER, run, spec_bin  # noqa: F401 - spec_bin is a fixture; the import skips as it does

from eaglescope.cli import main
from eaglescope.export import load_target_embedding
from eaglescope.models.draft import load_draft
from eaglescope.models.vocab import build_draft_vocab
from eaglescope.train.ttt import shift_left, ttt_unroll

WRITER = Path(__file__).resolve().parent / "speculators_writer.py"
L, V, H = 8, 96, 64  # tests/models.py TINY
DRAFT_VOCAB = 48
T = 128  # speculators' flex attention builds its masks in blocks of 128 positions
# name: what speculators_writer.py is asked for
DRAFTS = {
    "eagle3": {"target_layer_ids": [1, 4, 6], "draft_vocab_size": DRAFT_VOCAB, "ttt_steps": 3},
    "eagle31-fc-norm": {
        "target_layer_ids": None,
        "draft_vocab_size": V,
        "ttt_steps": 5,
        "fc_norm": True,
        "norm_output": True,
    },  # fmt: skip
    "eagle31-norm-before-fc": {
        "target_layer_ids": [0, 3, 6],
        "draft_vocab_size": DRAFT_VOCAB,
        "ttt_steps": 2,
        "norm_before_fc": True,
    },  # fmt: skip
}


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def written(tmp_path_factory, spec_bin: Path) -> dict:  # noqa: F811 - the fixture imported above
    root = tmp_path_factory.mktemp("speculators-drafts")
    target = make_checkpoint("llama", root / "target")
    counts = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_draft_vocab(counts, DRAFT_VOCAB)
    save_file({"d2t": d2t, "t2d": t2d}, str(root / "vocab.safetensors"))
    specs = [
        {"verifier": str(target), "out": str(root / name), "seed": i,
         "vocab_map": str(root / "vocab.safetensors") if s["draft_vocab_size"] < V else None, **s}
        for i, (name, s) in enumerate(DRAFTS.items())
    ]  # fmt: skip
    (root / "specs.json").write_text(json.dumps(specs))
    t0 = time.perf_counter()
    proc = run([str(spec_bin / "python"), str(WRITER), str(root / "specs.json")])
    sys.stderr.write(f"speculators wrote {len(specs)} drafts in {time.perf_counter() - t0:.1f}s\n")
    infos = {Path(j["out"]).name: j for j in map(json.loads, proc.stdout.strip().splitlines())}
    return {"root": root, "target": target, "d2t": d2t, "t2d": t2d, "infos": infos,
            "drafts": {name: root / name for name in DRAFTS}}  # fmt: skip


@pytest.fixture(params=list(DRAFTS))
def name(request) -> str:
    return request.param


def test_the_files_are_speculators_own_and_read_as_written(written, name):
    d = written["drafts"][name]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["speculators_version"] == "0.9.0"
    assert "transformer_layer_config" in cfg and "hidden_size" not in cfg  # the layout that was refused before
    loaded = load_draft(d, L)
    spec, c = DRAFTS[name], loaded.model.config
    assert loaded.format == "speculators"
    assert list(loaded.contract.taps.layers) == (spec["target_layer_ids"] or [2, L // 2, L - 3])
    assert written["infos"][name]["target_layer_ids"] == list(loaded.contract.taps.layers)
    assert (c.norm_before_fc, c.fc_norm, c.norm_output) == (
        bool(spec.get("norm_before_fc")), bool(spec.get("fc_norm")), bool(spec.get("norm_output"))
    )  # fmt: skip
    assert c.draft_vocab_size == spec["draft_vocab_size"] and c.vocab_size == V and not c.norm_before_residual
    assert loaded.has_embedding  # speculators saves the verifier's embedding
    assert torch.equal(loaded.model.embed_tokens.weight, load_target_embedding(written["target"]))
    vocab = loaded.declared.get("vocab_map")
    if spec["draft_vocab_size"] < V:
        assert torch.equal(loaded.model.d2t, written["d2t"]) and torch.equal(loaded.model.t2d, written["t2d"])
        assert vocab.source == "d2t/t2d saved in the weights"
    else:  # speculators saves no map at full vocabulary
        assert vocab.value == "identity" and vocab.source.startswith("no d2t saved")


STEPS = 3


@pytest.fixture(scope="module")
def forwards(written, spec_bin: Path) -> dict:  # noqa: F811 - the fixture imported above
    """speculators' own forward (tests/speculators_runner.py, one process for every draft) on random features and
    tokens: {name: (ids, aux, {step{k}: logits})}."""
    root, argv, inputs = written["root"], [], {}
    for i, name in enumerate(DRAFTS):
        g = torch.Generator().manual_seed(i + 1)
        ids = torch.randint(0, V, (1, T), generator=g)
        aux = torch.randn(1, T, 3 * H, generator=g)
        inputs[name] = (ids, aux)
        # speculators pairs each position's features with the *next* token (its shift_batch has already shifted them)
        x = {"aux": aux, "input_ids": shift_left(ids, 1).contiguous(), "position_ids": torch.arange(T)[None],
             "ttt_steps": torch.tensor(STEPS)}  # fmt: skip
        save_file(x, str(root / f"{name}-in.safetensors"))
        argv += [
            str(written["drafts"][name]),
            str(root / f"{name}-in.safetensors"),
            str(root / f"{name}-out.safetensors"),
        ]
    run([str(spec_bin / "python"), str(RUNNER), *argv])
    return {name: (*inputs[name], load_file(str(root / f"{name}-out.safetensors"))) for name in DRAFTS}


def test_eaglescope_computes_speculators_own_forward_at_every_ttt_step(written, forwards, name):
    ids, aux, theirs = forwards[name]
    loaded = load_draft(written["drafts"][name], L)
    with torch.no_grad():
        ours = ttt_unroll(loaded.model, ids, aux, STEPS).logits
    for k in range(STEPS):
        err = (theirs[f"step{k}"] - ours[k]).abs().max().item()
        assert err < 1e-4, (name, k, err)
        assert torch.equal(theirs[f"step{k}"].argmax(-1), ours[k].argmax(-1)), (name, k)


def test_generate_with_the_speculators_draft_is_lossless(written, name):
    prompt = ",".join(str(i) for i in range(3, 40, 3))
    base = ["generate", "--target", str(written["target"]), "--prompt-ids", prompt, "--max-new-tokens", "24",
            "--device", "cpu", "--dtype", "float32", "--json"]  # fmt: skip
    rc, out, err = cli(base)
    assert rc == 0, err
    vanilla = json.loads(out)
    for how in (["--chain", "3"], []):  # a chain, and the default tree
        rc, out, err = cli([*base, "--draft", str(written["drafts"][name]), *how])
        assert rc == 0, err
        spec = json.loads(out)
        assert spec["token_ids"] == vanilla["token_ids"], (name, how)


def test_bench_takes_it_and_every_method_equals_vanilla(written, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": list(range(s, s + 12))}) + "\n" for s in (5, 17)))
    argv = ["bench", "--target", str(written["target"]), "--draft", str(written["drafts"]["eagle3"]), "--prompts",
            str(prompts), "--max-new-tokens", "16", "--method", "vanilla", "--method", "chain=3", "--json"]  # fmt: skip
    rc, out, err = cli(argv)
    assert rc == 0, err  # 0: every method's output equals vanilla greedy's


def test_inspect_says_what_speculators_files_declare_and_how_to_measure_the_rest(written):
    d, t = written["drafts"]["eagle3"], written["target"]
    rc, out, err = cli(["inspect", str(d), "--target", str(t), "--json"])
    assert rc == 0, err
    r = json.loads(out)
    assert r["format"] == "speculators" and r["architectures"] == ["Eagle3DraftModel"]
    p = {x["name"]: x for x in r["declared"]["properties"]}
    assert p["taps"]["status"] == "declared" and p["taps"]["value"] == [1, 4, 6]
    assert "eagle_aux_hidden_state_layer_ids" in p["taps"]["source"]
    assert p["taps"]["measure"] == f"eaglescope doctor --target {t} --draft {d} --data DATA.jsonl --measure-wiring"
    assert p["tap_convention"]["status"] == "declared" and p["tap_convention"]["value"] == "vllm"
    assert p["ttt_length"]["status"] == "declared" and p["ttt_length"]["value"] == 3
    assert p["target"]["status"] == "declared" and p["target"]["value"]["name_or_path"] == str(t)
    assert p["shift"]["status"] == "assumed" and "--measure-wiring" in p["shift"]["measure"]
    assert p["attention_window"]["value"] == 2048  # speculators train's default window, which vLLM applies
    assert p["embedding"]["measure"] == f"eaglescope inspect {d} --target {t}"
    assert r["embedding"] == {"saved": True, "matches_target": True}
    assert r["engines"]["vllm"]["captures"] == [1, 4, 6] and r["engines"]["vllm"]["matches_contract"]
    rc, text, err = cli(["inspect", str(d), "--target", str(t)])
    assert rc == 0, err
    assert "speculators format" in text and "DECLARED" in text and "ASSUMED" in text
    assert f"measure:  eaglescope doctor --target {t} --draft {d} --data DATA.jsonl --measure-wiring" in text


# (SGLang cannot capture the embedding, tap 0, for a Llama target: export refuses that draft for it, as it should)
@pytest.mark.parametrize(("engine", "draft"), [("vllm", "eagle31-norm-before-fc"), ("sglang", "eagle3")])
def test_export_writes_the_engines_layout_with_the_same_weights_and_taps(written, tmp_path, engine, draft):
    d, t = written["drafts"][draft], written["target"]
    out = tmp_path / f"export-{engine}"
    rc, text, err = cli(["export", "--draft", str(d), "--to", engine, "--out", str(out), "--target", str(t), "--json"])
    assert rc == 0, err
    src, exp = load_draft(d, L), load_draft(out, L)
    assert exp.format == "eaglescope" and exp.contract.taps == src.contract.taps and exp.contract.inferred
    s1, s2 = src.model.state_dict(), exp.model.state_dict()
    for k, v in s1.items():
        if k != "embed_tokens.weight":  # the export leaves the embedding to the engine, as engines want
            assert torch.equal(v, s2[k]), k


def test_doctor_reads_it(written):
    rc, out, err = cli(["doctor", "--target", str(written["target"]), "--draft", str(written["drafts"]["eagle3"]),
                        "--json"])  # fmt: skip
    assert rc in (0, 1), err
    r = json.loads(out)
    assert r["context"]["static"]["taps"] == [1, 4, 6]


def _copy(src: Path, out: Path, edit) -> Path:
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda c: c["transformer_layer_config"].update(mystery=1), "'transformer_layer_config.mystery'"),
        (lambda c: c["speculators_config"]["verifier"].update(revision="x"), "'speculators_config.verifier.revision'"),
        (lambda c: c.update(mask_token_id=5), "'mask_token_id'"),
        (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "model_type is 'qwen3'"),
        (lambda c: c.update(speculators_model_type="dflash"), "speculators 'dflash' checkpoint"),
        (lambda c: c.update(fc_norm=True, norm_before_fc=True), "norm_before_fc and fc_norm"),
    ],
    ids=["layer-key", "verifier-key", "top-key", "qwen3-layer", "dflash", "both-norms"],
)
def test_what_is_not_understood_is_refused_in_one_line(written, tmp_path, edit, named):
    d = _copy(written["drafts"]["eagle3"], tmp_path / "bad", edit)
    rc, out, err = cli(["inspect", str(d), "--target", str(written["target"])])
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert named in err


def test_a_missing_norm_before_residual_is_read_as_speculators_trained_it_and_said(written, tmp_path):
    d = _copy(written["drafts"]["eagle3"], tmp_path / "no-nbr", lambda c: c.pop("norm_before_residual"))
    rc, out, err = cli(["inspect", str(d), "--target", str(written["target"]), "--json"])
    assert rc == 0, err
    r = json.loads(out)
    assert r["config"]["norm_before_residual"] is False
    assert any(w.startswith("READ:") and "vLLM 0.32 as true" in w for w in r["warnings"])
