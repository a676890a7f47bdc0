"""The foreign pipeline: EAGLE-3 drafts made the way the field makes them, by code eaglescope did not write, so that
doctor can be judged on drafts and training data it never touched.

    target      a tiny Llama pretrained here on an order-2 Markov chain (x[t+2] is a permutation, chosen by x[t+1],
                of x[t]): a target with real structure, whose next token needs the two before it
    samples     prompts from the chain and the target's own greedy answers (the EAGLE recipe: `eaglescope prepare
                --regenerate` writes them; only their token ids and loss masks leave eaglescope)
    rows        `speculators prepare-data` on those rows (its Arrow dataset and token_freq.pt)
    hidden      vLLM 0.32's own `extract_hidden_states` speculative method with its ExampleHiddenStatesConnector, as
                speculators' scripts/launch_vllm.py configures it (the aux layer ids, then the final id L); one
                hs_<i>.safetensors per sample (extract_runner.py)
    drafts      `speculators train` (0.9.0: its Eagle3DraftModel, its shift_batch, its loss, TTT 3) on the CPU in
                float32 (train_runner.py: the one change is the device), saved in speculators' format

The faults are made in that pipeline, each one step of it done the way a user gets it wrong:

    taps-off-by-one   the hidden states generated at layer ids one above the ids the training (and so the served
                      config) declares: launch_vllm.py --target-layer-ids 3 5 6, `speculators train` without them
    unshifted         the trainer's shift_batch replaced by an unshifted pairing (token t with the features of t)
    final-post-norm   the final state taken after the target's final norm (what transformers' output_hidden_states
                      holds last), by a standardising step that rewrites the files
    ttt-1             `speculators train --ttt-steps 1`
    features-shifted  (data only, not trained) a standardising step that moves each sample's aux features one
                      position earlier than their tokens

Everything is built once per test session (`foreign_pipeline`) under one tmp_path_factory directory, or, with
EAGLESCOPE_FOREIGN_DIR=DIR, once into DIR and reused by later sessions while DIR/pipeline.json is there.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "vllm"))  # vllm_support, runner_common

from vllm_support import RUNNER as VLLM_RUNNER  # noqa: E402
from vllm_support import runner_env  # noqa: E402

from eaglescope.config import PrepareConfig  # noqa: E402
from eaglescope.corpus import COMPLETION_TEMPLATE, train_tokenizer  # noqa: E402
from eaglescope.data.prepare import prepare  # noqa: E402
from eaglescope.data.shards import PreparedData  # noqa: E402
from eaglescope.pretrain import PretrainConfig, pretrain, save_target  # noqa: E402

EXTRACT_RUNNER = HERE / "extract_runner.py"
TRAIN_RUNNER = HERE / "train_runner.py"
DATASET_ROWS = HERE / "dataset_rows.py"

SYMBOLS = "abcdefgh"  # one byte-level token each (the tokenizer learns no merges)
VOCAB = 258  # 256 bytes + 2 specials
LAYERS = 8
DEFAULT_IDS = [2, LAYERS // 2, LAYERS - 3]  # what speculators and vLLM take when no ids are given
OFF_BY_ONE_IDS = [i + 1 for i in DEFAULT_IDS]
MAX_LEN = 128  # the target's max_position_embeddings
SAMPLE_LEN = 64
N_SAMPLES = 96
DRAFT_VOCAB = 32
K = 3  # served draft tokens per round
MAX_NEW = 48
N_PROMPTS = 8
TIMEOUT_S = 900

CLEAN = "clean"
TAPS_OFF_BY_ONE = "taps-off-by-one"
UNSHIFTED = "unshifted"
FINAL_POST_NORM = "final-post-norm"
TTT_1 = "ttt-1"
FEATURES_SHIFTED = "features-shifted"
ALL_LAYERS = "all-layers"
HELD_OUT = 24
HELD_OUT_DIR = "held-out"
TRAINED = [CLEAN, TAPS_OFF_BY_ONE, UNSHIFTED, FINAL_POST_NORM, TTT_1]
DATA_CASES = [CLEAN, TAPS_OFF_BY_ONE, FINAL_POST_NORM, FEATURES_SHIFTED]  # the hidden-state directories

# speculators train, as every case runs it (a case's own flags win)
TRAIN_FLAGS = {
    "speculator-type": "eagle3",
    "num-layers": "1",
    "draft-vocab-size": str(DRAFT_VOCAB),
    "total-seq-len": "512",  # 8 samples packed per step, 12 steps an epoch
    "epochs": "16",
    "checkpoint-freq": "16",  # one checkpoint at the end (and speculators' own one after the first epoch)
    "optimizer": "adamw",
    "lr": "1e-2",
    "ttt-steps": "3",
    "hidden-states-dtype": "float32",
    "num-workers": "0",
    "on-missing": "raise",
    "train-data-ratio": "0.9",
    "log-freq": "1000",
    "seed": "0",
    # torch's flex attention (speculators' default) has no backward on the CPU; speculators' own sdpa path, the same
    # draft layer with a dense mask
    "draft-attn-impl": "sdpa",
    "loss-implementation": "eager",  # its fused losses are Triton kernels; eager is the same loss in plain torch
}
CASE_FLAGS: dict[str, dict[str, str]] = {TTT_1: {"ttt-steps": "1"}}


@dataclass
class Pipeline:
    root: Path
    target: Path
    samples: list[list[int]]  # token ids of each training sample
    loss_masks: list[list[int]]
    prompts: list[list[int]]  # held-out prompts for serving
    hidden: dict[str, Path] = field(default_factory=dict)  # case -> directory of hs_<i>.safetensors
    extracted_ids: dict[str, list[int]] = field(default_factory=dict)  # case -> the layer ids vLLM extracted
    spec_data: Path | None = None  # speculators prepare-data's output
    drafts: dict[str, Path] = field(default_factory=dict)  # case -> speculators checkpoint
    served: dict[str, dict] = field(default_factory=dict)  # case -> vLLM's counts
    seconds: dict[str, float] = field(default_factory=dict)


# -- the target and its samples ------------------------------------------------------------------------------------
def order2_chain(rng: random.Random, perm: list[list[int]], n: int, p: float = 0.9) -> str:
    x = [rng.randrange(len(perm)), rng.randrange(len(perm))]
    while len(x) < n:
        x.append(perm[x[-1]][x[-2]] if rng.random() < p else rng.randrange(len(perm)))
    return "".join(SYMBOLS[i] for i in x)


def chain_permutations(rng: random.Random) -> list[list[int]]:
    """The chain's rule: for each previous symbol, the permutation that maps the one before it to the next."""
    return [rng.sample(range(len(SYMBOLS)), len(SYMBOLS)) for _ in SYMBOLS]


def held_out_conversations(n: int, seed: int = 1) -> list[dict]:
    """Conversations from the same chain the target learned (the same rule: its permutations come first from
    Random(0), as in build_target), with text drawn from another seed: data no draft was trained on."""
    perm = chain_permutations(random.Random(0))
    rng = random.Random(seed)
    return [
        {"messages": [{"role": "user", "content": order2_chain(rng, perm, rng.randint(8, 16))},
                      {"role": "assistant", "content": "a"}]}  # the target writes the answer (regenerate)
        for _ in range(n)
    ]  # fmt: skip


def build_target(root: Path) -> tuple[Path, list[list[int]], list[list[int]], list[list[int]]]:
    """The target, its samples (prompt + its own greedy answer) with their loss masks, and held-out prompts."""
    rng = random.Random(0)
    perm = chain_permutations(rng)
    tok = train_tokenizer([SYMBOLS], VOCAB, root / "tokenizer", COMPLETION_TEMPLATE)

    def ids(text: str) -> torch.Tensor:
        return torch.tensor(tok(text)["input_ids"])

    pcfg = PretrainConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=LAYERS,
        num_heads=2,  # head_dim 32: vLLM's CPU attention has no kernel below 32
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
        for _ in range(N_SAMPLES)
    ]
    (root / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = regenerate(target, root / "conversations.jsonl", root / "regenerated")
    samples = [data.sample(i)["input_ids"].tolist() for i in range(data.num_samples)]
    masks = [data.sample(i)["loss_mask"].tolist() for i in range(data.num_samples)]
    prompts = [tok(order2_chain(rng, perm, rng.randint(8, 16)))["input_ids"] for _ in range(N_PROMPTS)]
    return target, samples, masks, prompts


# -- subprocesses in the engines' environments ----------------------------------------------------------------------
def run_json(python: str, runner: Path, spec: dict, root: Path, name: str, env: dict[str, str]) -> dict:
    """Run `runner SPEC OUT` in another environment and return OUT; a failure says why with the log's tail."""
    spec_path, out, log = root / f"{name}.spec.json", root / f"{name}.out.json", root / f"{name}.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    out.unlink(missing_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(
            [python, str(runner), str(spec_path), str(out)], stdout=f, stderr=subprocess.STDOUT, env=env,
            timeout=TIMEOUT_S, check=False,
        )  # fmt: skip
    tail = "\n".join(log.read_text().splitlines()[-30:])
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{runner.name} exited {proc.returncode} (log {log}):\n{tail}")
    return json.loads(out.read_text())


def regenerate(target: Path, conversations: Path, out: Path) -> PreparedData:
    """`eaglescope prepare --regenerate`: each conversation's answer replaced by the target's own greedy one."""
    prepare(
        PrepareConfig(target=str(target), data=str(conversations), out=str(out), max_length=SAMPLE_LEN,
                      regenerate=True, regen_max_new_tokens=48, device="cpu", dtype="float32"),
        progress=False,
    )  # fmt: skip
    return PreparedData.open(out)


def held_out_ids(p: Pipeline) -> list[list[int]]:
    """HELD_OUT prompts no draft was trained on, answered by the target itself as served traffic is (the prepared
    directory doctor's --data reads), and their token ids (what vLLM extracts every layer of)."""
    conversations = p.root / "held-out.jsonl"
    conversations.write_text("".join(json.dumps(c) + "\n" for c in held_out_conversations(HELD_OUT)))
    data = regenerate(p.target, conversations, p.root / HELD_OUT_DIR)
    return [data.sample(i)["input_ids"].tolist() for i in range(data.num_samples)]


def extract(p: Pipeline, vllm_python: str) -> None:
    """vLLM's extract_hidden_states at the default ids and at the ids one off, plus the final id L, as
    launch_vllm.py appends it; both engines in one vLLM process."""
    runs = [
        {"name": CLEAN, "layer_ids": [*DEFAULT_IDS, LAYERS], "samples": p.samples, "out": str(p.root / "hs" / CLEAN)},
        {"name": TAPS_OFF_BY_ONE, "layer_ids": [*OFF_BY_ONE_IDS, LAYERS], "samples": p.samples,
         "out": str(p.root / "hs" / TAPS_OFF_BY_ONE)},
        # every layer (ids 0..L: the embedding, each layer's output, the last before the final norm) of held-out
        # conversations, rendered as doctor renders them: what `doctor --layer-states` reads for a head-only target
        {"name": ALL_LAYERS, "layer_ids": list(range(LAYERS + 1)), "samples": held_out_ids(p),
         "out": str(p.root / "hs" / ALL_LAYERS)},
    ]  # fmt: skip
    t = time.perf_counter()
    out = run_json(vllm_python, EXTRACT_RUNNER, {"target": str(p.target), "max_model_len": MAX_LEN, "runs": runs},
                   p.root, "extract", runner_env())  # fmt: skip
    p.seconds["extract"] = time.perf_counter() - t
    for run in runs:
        rec = out["runs"][run["name"]]
        if rec["error"]:
            raise RuntimeError(f"vLLM extraction {run['name']}: {rec['error']}\n{rec.get('traceback', '')}")
        p.hidden[run["name"]] = Path(run["out"])
        p.extracted_ids[run["name"]] = run["layer_ids"]


# -- the standardising steps that make the data faults --------------------------------------------------------------
def final_norm_weight(target: Path) -> tuple[torch.Tensor, float]:
    cfg = json.loads((target / "config.json").read_text())
    return load_file(str(target / "model.safetensors"))["model.norm.weight"], float(cfg["rms_norm_eps"])


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Every hs_<i>.safetensors of `src` through `edit(hidden_states [T, n, H]) -> [T, n, H]`, written to `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("hs_*.safetensors")):
        d = load_file(str(f))
        d["hidden_states"] = edit(d["hidden_states"]).contiguous()
        save_file(d, str(dst / f.name))
    return dst


def post_norm_final(p: Pipeline) -> None:
    """The final state replaced by the target's final RMSNorm of it (the normed state a transformers forward's
    output_hidden_states ends with)."""
    w, eps = final_norm_weight(p.target)

    def edit(hs: torch.Tensor) -> torch.Tensor:
        hs = hs.clone()
        last = hs[:, -1].float()
        hs[:, -1] = (last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * w).to(hs.dtype)
        return hs

    p.hidden[FINAL_POST_NORM] = rewrite(p.hidden[CLEAN], p.root / "hs" / FINAL_POST_NORM, edit)
    p.extracted_ids[FINAL_POST_NORM] = p.extracted_ids[CLEAN]


def shift_features(p: Pipeline) -> None:
    """Each position's aux features replaced by the next position's (the last keeps its own): features one token
    ahead of the tokens they are stored with."""

    def edit(hs: torch.Tensor) -> torch.Tensor:
        hs = hs.clone()
        hs[:-1, :-1] = hs[1:, :-1].clone()
        return hs

    p.hidden[FEATURES_SHIFTED] = rewrite(p.hidden[CLEAN], p.root / "hs" / FEATURES_SHIFTED, edit)
    p.extracted_ids[FEATURES_SHIFTED] = p.extracted_ids[CLEAN]


def build_data(root: Path, vllm_python: str, spec_bin: Path) -> Pipeline:
    """The target, speculators' dataset of its samples, and vLLM's hidden states of them, clean and faulty."""
    t = time.perf_counter()
    target, samples, masks, prompts = build_target(root)
    p = Pipeline(root, target, samples, masks, prompts)
    p.seconds["target"] = time.perf_counter() - t
    prepare_rows(p, spec_bin)
    extract(p, vllm_python)
    post_norm_final(p)
    shift_features(p)
    return p


def env_for(python: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TRITON_INTERPRET"):
        env.pop(key, None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", DO_NOT_TRACK="1")
    return env


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- speculators: prepare-data and train ----------------------------------------------------------------------------
def speculators_bin() -> Path:
    """The speculators environment's bin directory (scripts/speculators_env.sh); raises when it is not complete."""
    venv = Path(os.environ.get("EAGLESCOPE_SPECULATORS_VENV") or REPO / ".eaglescope" / "venv-speculators")
    if not (venv / ".eaglescope-speculators-complete").is_file() or not (venv / "bin" / "speculators").is_file():
        raise RuntimeError(f"no complete speculators environment at {venv} (bash scripts/speculators_env.sh)")
    return venv / "bin"


def prepare_rows(p: Pipeline, spec_bin: Path) -> None:
    """`speculators prepare-data` on the samples as speculator-format rows (input_ids, loss_mask): its Arrow dataset
    and token_freq.pt (its draft vocabulary comes from those frequencies)."""
    rows = p.root / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": s, "loss_mask": m}) + "\n"
                            for s, m in zip(p.samples, p.loss_masks, strict=True)))  # fmt: skip
    out = p.root / "spec-data"
    argv = [str(spec_bin / "speculators"), "prepare-data", "--model", str(p.target), "--data", str(rows),
            "--output", str(out), "--seq-length", str(SAMPLE_LEN), "--num-preprocessing-workers", "1",
            "--no-skip-token-freq"]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env_for(str(spec_bin)), timeout=TIMEOUT_S,
                          check=False, cwd=p.root)  # fmt: skip
    p.seconds["prepare-data"] = time.perf_counter() - t
    if proc.returncode != 0 or not (out / "token_freq.pt").is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"speculators prepare-data exited {proc.returncode}:\n{tail}")
    p.spec_data = out
    # prepare-data shuffles; hs_<i> belongs to the dataset's row i (generate-offline-data's naming)
    dumped = p.root / "dataset-rows.json"
    proc = subprocess.run([str(spec_bin / "python"), str(DATASET_ROWS), str(out), str(dumped)], capture_output=True,
                          text=True, env=env_for(str(spec_bin)), timeout=TIMEOUT_S, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"dataset_rows.py exited {proc.returncode}: {proc.stderr[-2000:]}")
    rows = json.loads(dumped.read_text())
    p.samples, p.loss_masks = [r["input_ids"] for r in rows], [r["loss_mask"] for r in rows]


def train_argv(p: Pipeline, case: str, hidden: Path, save: Path) -> list[str]:
    flags = {**TRAIN_FLAGS, **CASE_FLAGS.get(case, {})}
    argv = ["--verifier-name-or-path", str(p.target), "--data-path", str(p.spec_data), "--hidden-states-path",
            str(hidden), "--save-path", str(save), "--log-dir", str(save.parent / "logs")]  # fmt: skip
    for k, v in flags.items():
        argv += [f"--{k}", v]
    return argv


def train(p: Pipeline, case: str, spec_bin: Path) -> Path:
    """One draft of `case`, trained by speculators in its own environment; returns its checkpoint directory."""
    hidden = p.hidden[CLEAN if case in (UNSHIFTED, TTT_1) else case]
    save = p.root / "drafts" / case
    spec = {"argv": train_argv(p, case, hidden, save), "fault": UNSHIFTED if case == UNSHIFTED else None}
    t = time.perf_counter()
    out = run_json(str(spec_bin / "python"), TRAIN_RUNNER, spec, p.root, f"train-{case}", env_for(str(spec_bin)))
    p.seconds[f"train {case}"] = time.perf_counter() - t
    if out["error"]:
        raise RuntimeError(f"speculators train ({case}): {out['error']}\n{out.get('traceback', '')}")
    p.drafts[case] = Path(out["checkpoint"])
    return p.drafts[case]


# -- serving in vLLM ------------------------------------------------------------------------------------------------
def tau(counts: list[dict]) -> float:
    """Mean accepted length per round, the bonus token counted (docs/field.md §5)."""
    drafts = sum(c["num_drafts"] for c in counts)
    return (sum(c["num_accepted_tokens"] for c in counts) + drafts) / max(drafts, 1)


def serve(p: Pipeline, vllm_python: str, cases: list[str]) -> None:
    """Every draft of `cases` served by vLLM (eagle3, K draft tokens) on the held-out prompts, one process."""
    spec = {"target": str(p.target), "prompts": p.prompts, "max_tokens": MAX_NEW, "num_speculative_tokens": K,
            "max_model_len": MAX_LEN, "runs": [{"name": c, "draft": str(p.drafts[c])} for c in cases]}  # fmt: skip
    t = time.perf_counter()
    out = run_json(vllm_python, VLLM_RUNNER, spec, p.root, "serve", runner_env())
    p.seconds["serve"] = time.perf_counter() - t
    for c in cases:
        rec = out["runs"][c]
        if rec["error"]:
            raise RuntimeError(f"vLLM could not serve the {c} draft: {rec['error']}\n{rec.get('traceback', '')}")
        p.served[c] = {"tau": tau(rec["spec"]), "spec": rec["spec"], "engine": rec["engine"], "outputs": rec["outputs"]}


def build(root: Path, vllm_python: str) -> Pipeline:
    """The whole pipeline: data, the five drafts, and their served acceptance."""
    spec_bin = speculators_bin()
    p = build_data(root, vllm_python, spec_bin)
    for case in TRAINED:
        train(p, case, spec_bin)
    serve(p, vllm_python, TRAINED)
    save(p)
    return p


# -- reuse across sessions ------------------------------------------------------------------------------------------
MANIFEST = "pipeline.json"


def save(p: Pipeline) -> None:
    """What was built, so that EAGLESCOPE_FOREIGN_DIR can hand it to a later session (written last: its presence
    means the build completed)."""
    d = {
        "target": str(p.target), "samples": p.samples, "loss_masks": p.loss_masks, "prompts": p.prompts,
        "hidden": {k: str(v) for k, v in p.hidden.items()}, "extracted_ids": p.extracted_ids,
        "spec_data": str(p.spec_data), "drafts": {k: str(v) for k, v in p.drafts.items()}, "served": p.served,
        "seconds": p.seconds,
    }  # fmt: skip
    tmp = p.root / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(d))
    tmp.replace(p.root / MANIFEST)


def load(root: Path) -> Pipeline | None:
    f = root / MANIFEST
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    return Pipeline(
        root, Path(d["target"]), d["samples"], d["loss_masks"], d["prompts"],
        hidden={k: Path(v) for k, v in d["hidden"].items()}, extracted_ids=d["extracted_ids"],
        spec_data=Path(d["spec_data"]), drafts={k: Path(v) for k, v in d["drafts"].items()}, served=d["served"],
        seconds=d["seconds"],
    )  # fmt: skip
