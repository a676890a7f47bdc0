"""eaglescope drafts served by a real SGLang 0.5.23: SGLang loads `eaglescope export --to sglang` as written, decodes
the same greedy tokens as `eaglescope generate` and as plain greedy decoding, and its per-request counts
(`meta_info`: verify rounds, and how many rounds accepted 0..K drafts) equal eaglescope's, prompt by prompt and so at
every draft position — for a Llama target and a DeepSeek-V3 target, each with default and other taps, which proves
both of SGLang's layer-id rules on the engine: `llama.py` adds 1 to every id, `deepseek_v2.py` adds 1 only when the
first id is 1. The Llama target's drafts use Llama attention, one of them EAGLE 3.1 with all three options; the
DeepSeek-V3 target's drafts are MLA drafts (`train --draft-arch mla`), one of them with EAGLE 3.1's fc_norm and
norm_output.

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

import concurrent.futures
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
from eaglescope.detective.engine_logs import parse_engine_log, read_engine_log

sys.path.insert(0, str(HERE.parent / "vllm"))  # tests/vllm's target, data and helpers are reused as they are
from capture_build import _edited as edited  # noqa: E402 - a copy of an export, its config/weights edited
from test_vllm_serving import TRAIN_SETTINGS, base, cli, order2_chain  # noqa: E402

RUNNER = HERE / "sglang_runner.py"
K = 3  # draft tokens per round: speculative_num_steps
MAX_NEW = 32
N_PROMPTS = 4
RUNNER_TIMEOUT_S = 2400  # every run together
REDUCED_VOCAB = 32

# The MLA draft of a random target learns little in 80 steps at 2e-3 (tests/vllm's experience; here 80 steps at 5e-3
# accepted 3 drafts in 59 rounds): 200 steps at 5e-3.
MLA = ["--draft-arch", "mla", "--lr", "5e-3", "--max-steps", "200"]
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
    # deepseek_v2.py: +1 only when the first id is 1. MLA drafts (SGLang: Eagle3DeepseekV2ForCausalLM in
    # kimi_k25_eagle3.py), as DeepSeek-V3 / Kimi-K2 targets are served; the default-tap one with EAGLE 3.1's fc_norm
    # and norm_output (kimi_k25_eagle3.py has no norm_before_fc, and export refuses it for MLA drafts)
    "dsv3-default": ("deepseek_v3", [*MLA, "--fc-norm", "--norm-output"], None, [2, 4, 5]),
    "dsv3-taps-3-4-6": ("deepseek_v3", [*MLA, "--taps", "3,4,6"], [3, 4, 6], [3, 4, 6]),  # first id not 1: kept
    "dsv3-taps-2-3-6": ("deepseek_v3", [*MLA, "--taps", "2,3,6"], [1, 2, 5], [2, 3, 6]),  # first id 1: +1 to all
}


# The faults SGLang serves, each made the way a user makes it, with the target it is served for and the codes doctor
# must name first from what SGLang reports (its meta_info, its log), given the directory SGLang served.
SEED_TAPS = "0,3,6"  # the seed incident's shape: the embedding output, a middle and a late layer (Kimi-K2.5)
FAULTS = {
    # the DeepSeek-V3 draft's ids rewritten in the Llama family's convention (+1 to every id): taps [3, 4, 6] as ids
    # [2, 3, 5], which deepseek_v2.py keeps as written (first id not 1) and so captures [2, 3, 5]
    "fault-llama-convention-ids": ("deepseek_v3", {"ENGINE_TAP_CONVENTION"}),
    # the seed scenario: taps with the embedding, a draft trained without TTT (ttt_length 1). The embedding tap is
    # served as trained (deepseek_v2.py keeps ids [0, 3, 6]): what SGLang's reports show is the missing TTT
    "fault-seed": ("deepseek_v3", {"NO_TTT"}),
    # d2t/t2d dropped from a reduced-vocabulary export: SGLang then maps draft ids to the first target ids
    "fault-no-vocab-map": ("llama", {"VOCAB_MAP"}),
    # the served config lost norm_before_fc (SGLang issue 32226's symptom): SGLang builds no input norm and skips the
    # weight; doctor, handed the served directory, sees its config and weights disagree
    "fault-norm-before-fc-lost": ("llama", {"EAGLE31_IGNORED"}),
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
    # the faults, made in the files SGLang serves, from the drafts above (the seed's: a draft of its own)
    seed = train_and_export(dsv3, dsv3_prep, root / "sglang-seed", [*MLA, "--taps", SEED_TAPS, "--ttt-length", "1"])
    faults = {
        "fault-llama-convention-ids": edited(drafts["dsv3-taps-3-4-6"], root / "fault-llama-convention-ids",
                                             config=lambda c: c["eagle_config"].update(
                                                 eagle_aux_hidden_state_layer_ids=[2, 3, 5])),
        "fault-seed": seed,
        "fault-no-vocab-map": edited(drafts["llama-default"], root / "fault-no-vocab-map",
                                     weights=lambda sd: [sd.pop("d2t"), sd.pop("t2d")]),
        "fault-norm-before-fc-lost": edited(drafts["llama-eagle31"], root / "fault-norm-before-fc-lost",
                                            config=drop_norm_before_fc),
    }  # fmt: skip
    return {"targets": targets, "drafts": drafts, "faults": faults, "prompts": prompts}


def drop_norm_before_fc(cfg: dict) -> None:
    del cfg["norm_before_fc"], cfg["eagle_config"]["norm_before_fc"]


def eaglescope_generate(target: Path, prompt: list[int], draft: Path | None) -> dict:
    argv = ["generate", "--target", str(target), "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", str(MAX_NEW), "--device", "cpu", "--dtype", "float32", "--json"]  # fmt: skip
    if draft is not None:
        argv += ["--draft", str(draft), "--chain", str(K)]
    rc, out, err = cli(argv)
    assert rc == 0, err
    return json.loads(out)


def serve_one_by_one(python: str, spec: dict, root: Path, deadline: float) -> dict:
    """Each run in its own runner process, one after the other: SGLang ends its whole process tree, the caller
    included, when a scheduler dies (kill_process_tree), so a run SGLang refuses must not take the others with it.
    {name: the run's record, with "log": its SGLang log}."""
    runs = {}
    for run in spec["runs"]:
        name = run["name"]
        spec_path, out, log = root / f"{name}.spec.json", root / f"{name}.out.json", root / f"{name}.sglang.log"
        spec_path.write_text(json.dumps({**spec, "runs": [run]}))
        with log.open("w") as f:
            try:
                rc = subprocess.run([python, str(RUNNER), str(spec_path), str(out)], stdout=f,
                                    stderr=subprocess.STDOUT, env=sglang_env(),
                                    timeout=max(1.0, deadline - time.monotonic())).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = "timeout"
        result = json.loads(out.read_text()) if out.exists() else {}
        rec = result.get("runs", {}).get(name)
        if rec is None:  # the runner died with its engine before writing the run
            tail = [ln for ln in log.read_text().splitlines() if ln.strip()][-3:]
            rec = {"error": f"SGLang runner exited {rc}: {' | '.join(tail)}", "outputs": [], "meta": []}
        rec["log"] = log.read_text()
        runs[name] = rec
    return runs


@pytest.fixture(scope="module")
def served(tmp_path_factory, sglang_python: str) -> dict:
    """SGLang serving every draft in turn, and eaglescope generate on the same prompts meanwhile."""
    root = tmp_path_factory.mktemp("sglang")
    t0 = time.perf_counter()
    env = build(root, base(tmp_path_factory))
    built = time.perf_counter() - t0
    spec = {"prompts": env["prompts"], "max_tokens": MAX_NEW, "num_steps": K,
            "runs": [{"name": name, "target": str(env["targets"][family]), "draft": str(env["drafts"][name])}
                     for name, (family, *_rest) in CASES.items()]
                    + [{"name": name, "target": str(env["targets"][family]), "draft": str(env["faults"][name])}
                       for name, (family, _) in FAULTS.items()]}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sglang = pool.submit(serve_one_by_one, sglang_python, spec, root, time.monotonic() + RUNNER_TIMEOUT_S)
        # eaglescope decodes while SGLang serves
        ours = {name: [eaglescope_generate(env["targets"][family], p, env["drafts"][name]) for p in env["prompts"]]
                for name, (family, *_rest) in CASES.items()}  # fmt: skip
        greedy = {family: [eaglescope_generate(t, p, None) for p in env["prompts"]]
                  for family, t in env["targets"].items()}  # fmt: skip
        runs = sglang.result()
    served = {"env": env, "sglang": runs, "ours": ours, "greedy": greedy,
              "logs": {name: r["log"] for name, r in runs.items()}}  # fmt: skip
    sys.stderr.write(f"built in {built:.1f}s; SGLang done {time.perf_counter() - t0:.1f}s after the start\n")
    sys.stderr.write(acceptance_table(served))
    (root / "acceptance.txt").write_text(acceptance_table(served))
    return served


def padded(histogram: list[int]) -> list[int]:
    """A histogram over 0..K accepted drafts (SGLang's stops at the largest count seen)."""
    return list(histogram) + [0] * (K + 1 - len(histogram))


def counts(stats: dict) -> list[int]:
    """eaglescope's --json stats as SGLang's meta_info histogram: rounds that accepted exactly 0..K drafts."""
    return padded(stats["histogram"])


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
        theirs = [padded(m["spec_correct_drafts_histogram"]) for m in run["meta"]]
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
    if "fault" in metafunc.fixturenames:
        metafunc.parametrize("fault", list(FAULTS))
    if "source" in metafunc.fixturenames:
        metafunc.parametrize("source", ["meta_info", "log"])


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
        assert padded(m["spec_correct_drafts_histogram"]) == counts(r["stats"])


def test_the_drafts_accept_sometimes_at_every_depth(served, name):
    # Guards the equality above from being vacuous: equal counts of nothing, or of everything, prove little; and a
    # draft handed the wrong layers would not accept at all, so acceptance at every depth also backs the tap rule.
    hist = [sum(c) for c in zip(*(counts(r["stats"]) for r in served["ours"][name]), strict=True)]
    pos = per_position(hist)
    assert all(c > 0 for c in pos), (name, hist)
    assert hist[0] > 0 or pos[-1] < sum(hist), (name, hist)


def test_sglangs_own_meta_info_read_by_doctor_gives_eaglescopes_acceptance(served, name, tmp_path):
    """engine_logs.py reads SGLang's per-request meta_info (saved as JSON, as a user saves Engine.generate's or the
    HTTP server's responses): τ and the per-position rates are eaglescope's, exactly."""
    run = loaded(served, name)
    saved = tmp_path / "meta.json"
    saved.write_text(json.dumps([{"meta_info": m} for m in run["meta"]]))
    got = read_engine_log(saved)
    ours = served["ours"][name]
    rounds = sum(r["stats"]["rounds"] for r in ours)
    hist = [sum(c) for c in zip(*(counts(r["stats"]) for r in ours), strict=True)]
    assert (got.engine, got.kind, got.drafts) == ("sglang", "meta_info", rounds)
    assert got.accept_length == pytest.approx(1 + sum(n * h for n, h in enumerate(hist)) / rounds)
    assert got.per_position == pytest.approx([p / rounds for p in per_position(hist)])


def test_sglangs_own_log_read_by_doctor_gives_eaglescopes_accept_length(served, name):
    """The decode lines SGLang printed (decode_log_interval=1: one line per verify round, `accept len` printed with
    two decimals) read by engine_logs.py: τ is eaglescope's, to the print's rounding."""
    loaded(served, name)
    got = parse_engine_log(served["logs"][name])
    ours = served["ours"][name]
    tokens = sum(r["stats"]["rounds"] + sum(n * h for n, h in enumerate(counts(r["stats"]))) for r in ours)
    assert got.engine == "sglang"
    assert got.accept_length == pytest.approx(tokens / sum(r["stats"]["rounds"] for r in ours), abs=0.01)


# -- diagnosis from what SGLang reports --------------------------------------------------------------------------
def reported(served: dict, name: str, source: str, root: Path) -> Path:
    """What SGLang reported for a run, saved as a user saves it: the responses' meta_info (JSON), or its log."""
    run = loaded(served, name)
    path = root / f"{name}.{'json' if source == 'meta_info' else 'log'}"
    if source == "meta_info":
        path.write_text(json.dumps([{"meta_info": m} for m in run["meta"]]))
    else:
        path.write_text(served["logs"][name])
    return path


def doctor(target: Path, draft: Path, engine_log: Path) -> tuple[dict, float]:
    t0 = time.perf_counter()
    rc, out, err = cli(["doctor", "--target", str(target), "--draft", str(draft), "--engine-log", str(engine_log),
                        "--json"])  # fmt: skip
    seconds = time.perf_counter() - t0
    assert rc in (0, 1), err
    report = json.loads(out)
    assert report["healthy"] is (rc == 0)
    return report, seconds


SECONDS: dict[str, float] = {}


def test_clean_sglang_runs_are_healthy_from_sglangs_reports(served, name, source, tmp_path):
    """The Llama target's drafts (trained on its own continuations) come out healthy. The DeepSeek-V3 target is
    random, and its drafts accept little (τ 1.06-1.08 in SGLang and in eaglescope alike): doctor then says only that
    (UNDERTRAINED, with nothing to compare), never a wiring fault such as a tap, vocabulary or norm finding."""
    family = CASES[name][0]
    report, seconds = doctor(served["env"]["targets"][family], served["env"]["drafts"][name],
                             reported(served, name, source, tmp_path))  # fmt: skip
    SECONDS[f"{name} {source}"] = seconds
    assert report["context"]["acceptance"]["engine_log"]["engine"] == "sglang"
    if family == "llama":
        assert report["healthy"], report["findings"]
    else:
        assert [f["code"] for f in report["findings"]] == ["UNDERTRAINED"], report["findings"]


def test_fault_is_named_first_from_sglangs_reports(served, fault, source, tmp_path):
    family, expected = FAULTS[fault]
    report, seconds = doctor(served["env"]["targets"][family], served["env"]["faults"][fault],
                             reported(served, fault, source, tmp_path))  # fmt: skip
    SECONDS[f"{fault} {source}"] = seconds
    found = [f["code"] for f in report["findings"]]
    sys.stderr.write(f"{fault} from SGLang's {source}: {found} in {seconds:.1f}s\n")
    assert found and found[0] in expected, report["findings"]
    assert expected <= set(found), report["findings"]
