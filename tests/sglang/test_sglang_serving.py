"""eaglescope drafts served by a real SGLang 0.5.23: SGLang loads `eaglescope export --to sglang` as written, decodes
the same greedy tokens as `eaglescope generate` and as plain greedy decoding, and its per-request counts
(`meta_info`: verify rounds, and how many rounds accepted 0..K drafts) equal eaglescope's, prompt by prompt and so at
every draft position — for a Llama target and a DeepSeek-V3 target, each with default and other taps, which proves
both of SGLang's layer-id rules on the engine: `llama.py` adds 1 to every id, `deepseek_v2.py` adds 1 only when the
first id is 1. Also served: an EAGLE 3.1 draft (all three options) of the Llama target and an MLA draft
(`train --draft-arch mla`) of the DeepSeek-V3 target.

SGLang's own Python runs (scheduler, EAGLE worker v2, draft model, verify); its CPU kernels do not: they are this
project's plain-torch stand-ins (tests/sglang/stand_ins, each tested against SGLang's own version of the op in
test_sgl_kernel_stand_ins.py). SGLang lives in its own environment (scripts/sglang_env.sh) and is driven through
sglang_runner.py in one subprocess that starts one engine per draft; without a usable SGLang every test here is
skipped with one reason (conftest.py).

The Llama target is tests/vllm's (an order-2 Markov chain learnt by a tiny Llama) with drafts trained briefly on its
own continuations, so that they accept often but not always. The DeepSeek-V3 target is tests/models.py's tiny family
(MLA, MoE after the first layer, YaRN RoPE, 8 layers: SGLang's default ids [2, L//2, L-3] need L >= 7), random.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from models import make_checkpoint
from sglang_support import HERE, sglang_env

from eaglescope.config import PrepareConfig
from eaglescope.data.prepare import prepare

sys.path.insert(0, str(HERE.parent / "vllm"))  # tests/vllm's target, data and helpers are reused as they are
from test_vllm_serving import TRAIN_SETTINGS, base, cli, order2_chain  # noqa: E402

RUNNER = HERE / "sglang_runner.py"
K = 3  # draft tokens per round: speculative_num_steps
MAX_NEW = 32
N_PROMPTS = 4
RUNNER_TIMEOUT_S = 900
REDUCED_VOCAB = 32

# name: (target, `train` flags beyond the suite's, the ids SGLang must be handed in eagle_config, taps it captures)
CASES = {
    # llama.py: +1 to every id. Default taps [2, 4, 5] are written as no ids at all (every engine's default).
    "llama-default": ("llama", ["--draft-vocab-size", str(REDUCED_VOCAB)], None, [2, 4, 5]),
    # taps [1, 4, 6] can only be said as ids [0, 3, 5] under +1 (ids [1, 4, 6] would capture [2, 5, 7])
    "llama-taps-1-4-6": ("llama", ["--taps", "1,4,6"], [0, 3, 5], [1, 4, 6]),
    # EAGLE 3.1: norm_before_fc, one fc_norm per tap, norm_output; other taps; reduced vocabulary
    "llama-eagle31": (
        "llama",
        ["--norm-before-fc", "--fc-norm", "--norm-output", "--taps", "1,4,6", "--draft-vocab-size", str(REDUCED_VOCAB)],
        [0, 3, 5],
        [1, 4, 6],
    ),  # fmt: skip
    # deepseek_v2.py: +1 only when the first id is 1
    "dsv3-default": ("deepseek_v3", [], None, [2, 4, 5]),
    "dsv3-taps-3-4-6": ("deepseek_v3", ["--taps", "3,4,6"], [3, 4, 6], [3, 4, 6]),  # first id not 1: kept
    "dsv3-taps-2-3-6": ("deepseek_v3", ["--taps", "2,3,6"], [1, 2, 5], [2, 3, 6]),  # first id 1: +1 to all
    # an MLA draft (SGLang: Eagle3DeepseekV2ForCausalLM in kimi_k25_eagle3.py)
    "dsv3-mla": ("deepseek_v3", ["--draft-arch", "mla", "--lr", "5e-3"], None, [2, 4, 5]),
}


def build_dsv3(root: Path, tok, data: Path) -> tuple[Path, Path]:
    """The DeepSeek-V3 target with the config keys SGLang's deepseek_v2.py reads from real DeepSeek-V3 configs, and
    its data prepared from the suite's conversations."""
    target = make_checkpoint("deepseek_v3", root / "dsv3-target", vocab_size=len(tok), topk_method="noaux_tc",
                             eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(moe_layer_freq=1, scoring_func="sigmoid")
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(target)
    prepare(
        PrepareConfig(target=str(target), data=str(data), out=str(root / "dsv3-prep"), max_length=64,
                      draft_vocab_size=len(tok), regenerate=True, regen_max_new_tokens=40, device="cpu",
                      dtype="float32"),
        progress=False,
    )  # fmt: skip
    return target, root / "dsv3-prep"


def train_and_export(target: Path, prep: Path, out: Path, flags: list[str]) -> Path:
    """`eaglescope train` with the suite's settings and `flags`, then `eaglescope export --to sglang --target`."""
    trained = out.with_name(f"train-{out.name}")
    common = ["--ttt-length", str(K)]
    for key, value in TRAIN_SETTINGS.items():
        common += [f"--{key.replace('_', '-')}", str(value)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc, _, err = cli(["train", "--target", str(target), "--data", str(prep), "--out", str(trained), *common,
                          *flags])  # fmt: skip
    assert rc == 0, err
    rc, _, err = cli(["export", "--draft", str(trained), "--to", "sglang", "--out", str(out), "--target", str(target)])
    assert rc == 0, err
    return out


def build(root: Path, b: dict) -> dict:
    dsv3, dsv3_prep = build_dsv3(root, b["tok"], b["data"])
    targets = {"llama": b["target"], "deepseek_v3": dsv3}
    preps = {"llama": b["prep"], "deepseek_v3": dsv3_prep}
    drafts = {}
    for name, (family, flags, _, _) in CASES.items():
        drafts[name] = train_and_export(targets[family], preps[family], root / f"sglang-{name}", flags)
    tok, rng, perm = b["tok"], b["rng"], b["perm"]
    prompts = [tok(order2_chain(rng, perm, rng.randint(8, 16)))["input_ids"] for _ in range(N_PROMPTS)]
    return {"targets": targets, "drafts": drafts, "prompts": prompts}


def eaglescope_generate(target: Path, prompt: list[int], draft: Path | None) -> dict:
    argv = ["generate", "--target", str(target), "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", str(MAX_NEW), "--device", "cpu", "--dtype", "float32", "--json"]  # fmt: skip
    if draft is not None:
        argv += ["--draft", str(draft), "--chain", str(K)]
    rc, out, err = cli(argv)
    assert rc == 0, err
    return json.loads(out)


def run_logs(log: Path) -> dict[str, str]:
    """The runner's log split by run (sglang_runner.py marks each run's start and end)."""
    runs, name, lines = {}, None, []
    for line in log.read_text().splitlines():
        if line.startswith("=== sglang_runner: run "):
            name, lines = line.removeprefix("=== sglang_runner: run "), []
        elif line.startswith("=== sglang_runner: end ") and name is not None:
            runs[name] = "\n".join(lines) + "\n"
            name = None
        elif name is not None:
            lines.append(line)
    return runs


@pytest.fixture(scope="module")
def served(tmp_path_factory, sglang_python: str) -> dict:
    """One SGLang process serving every draft in turn, and eaglescope generate on the same prompts."""
    root = tmp_path_factory.mktemp("sglang")
    t0 = time.perf_counter()
    env = build(root, base(tmp_path_factory))
    built = time.perf_counter() - t0
    spec = {"prompts": env["prompts"], "max_tokens": MAX_NEW, "num_steps": K,
            "runs": [{"name": name, "target": str(env["targets"][family]), "draft": str(env["drafts"][name])}
                     for name, (family, *_rest) in CASES.items()]}  # fmt: skip
    spec_path, out, log = root / "spec.json", root / "sglang.json", root / "sglang.log"
    spec_path.write_text(json.dumps(spec))
    with log.open("w") as f:
        proc = subprocess.Popen([sglang_python, str(RUNNER), str(spec_path), str(out)], stdout=f,
                                stderr=subprocess.STDOUT, env=sglang_env())  # fmt: skip
        try:
            # eaglescope decodes while SGLang serves
            ours = {name: [eaglescope_generate(env["targets"][family], p, env["drafts"][name]) for p in env["prompts"]]
                    for name, (family, *_rest) in CASES.items()}  # fmt: skip
            greedy = {family: [eaglescope_generate(t, p, None) for p in env["prompts"]]
                      for family, t in env["targets"].items()}  # fmt: skip
            rc = proc.wait(timeout=RUNNER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SGLang runner still running after {RUNNER_TIMEOUT_S} s; log: {log}", pytrace=False)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tail = "\n".join(log.read_text().splitlines()[-30:])
    result = json.loads(out.read_text()) if out.exists() else {}
    assert rc == 0 and "runs" in result, f"SGLang runner exited {rc}:\n{tail}"
    served = {"env": env, "sglang": result["runs"], "ours": ours, "greedy": greedy, "logs": run_logs(log),
              "log": log}  # fmt: skip
    sys.stderr.write(f"built in {built:.1f}s; SGLang {result['sglang_version']} done "
                     f"{time.perf_counter() - t0:.1f}s after the start\n")  # fmt: skip
    sys.stderr.write(acceptance_table(served))
    (root / "acceptance.txt").write_text(acceptance_table(served))
    return served


def counts(stats: dict) -> list[int]:
    """eaglescope's --json stats as SGLang's meta_info histogram: rounds that accepted exactly 0..K drafts."""
    return stats["histogram"] + [0] * (K + 1 - len(stats["histogram"]))


def per_position(histogram: list[int]) -> list[int]:
    """Rounds that accepted at least k drafts, k = 1..K (the count behind acceptance at draft position k)."""
    return [sum(histogram[k:]) for k in range(1, K + 1)]


def acceptance_table(served: dict) -> str:
    rows = ["case                 rounds (eaglescope / SGLang)   accepted at position 1..K (eaglescope / SGLang)"]
    for name in CASES:
        run = served["sglang"].get(name, {})
        if run.get("error"):
            rows.append(f"{name:20s} SGLang failed: {run['error']}")
            continue
        ours = [counts(r["stats"]) for r in served["ours"][name]]
        theirs = [m["spec_correct_drafts_histogram"] for m in run["meta"]]
        total = lambda hs: [sum(c) for c in zip(*(per_position(h) for h in hs), strict=True)]  # noqa: E731
        rounds = (sum(r["stats"]["rounds"] for r in served["ours"][name]),
                  sum(m["spec_verify_ct"] for m in run["meta"]))  # fmt: skip
        rows.append(f"{name:20s} {rounds[0]:>5d} / {rounds[1]:<5d}                  {total(ours)} / {total(theirs)}")
    return "\n".join(rows) + "\n"


def loaded(served: dict, name: str) -> dict:
    run = served["sglang"][name]
    assert run["error"] is None, f"SGLang failed on {name}: {run['error']}\n{run.get('traceback')}"
    return run


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "name" in metafunc.fixturenames:
        metafunc.parametrize("name", list(CASES))


def test_the_export_names_the_ids_sglangs_rule_needs(served, name):
    cfg = json.loads((served["env"]["drafts"][name] / "config.json").read_text())
    assert cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids") == CASES[name][2]
    assert cfg["eaglescope"]["taps"]["layers"] == CASES[name][3]


def test_sglang_speculative_greedy_equals_eaglescope_and_plain_greedy(served, name):
    run = loaded(served, name)
    ours = [r["token_ids"] for r in served["ours"][name]]
    assert run["outputs"] == ours
    family = CASES[name][0]
    assert ours == [r["token_ids"] for r in served["greedy"][family]]
    assert all(len(t) > 1 for t in ours)


def test_sglang_acceptance_counts_equal_eaglescope_per_round_and_position(served, name):
    run = loaded(served, name)
    ours = served["ours"][name]
    for r, m in zip(ours, run["meta"], strict=True):
        assert m["spec_verify_ct"] == r["stats"]["rounds"]
        assert m["spec_correct_drafts_histogram"] == counts(r["stats"])


def test_the_drafts_accept_sometimes_at_every_depth(served, name):
    # Guards the equality above from being vacuous: equal counts of nothing, or of everything, prove little; and a
    # draft handed the wrong layers would not accept at all, so acceptance at every depth also backs the tap rule.
    hist = [sum(c) for c in zip(*(counts(r["stats"]) for r in served["ours"][name]), strict=True)]
    pos = per_position(hist)
    assert all(c > 0 for c in pos), (name, hist)
    assert hist[0] > 0 or pos[-1] < sum(hist), (name, hist)
