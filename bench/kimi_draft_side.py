"""`eaglescope doctor` at the seed's scale on this CPU: a Kimi-K2.5-shaped target whose layers are absent.

    PYTHONPATH=src python bench/kimi_draft_side.py [--out bench/results] [--vocab 163840] [--dtype bfloat16]

Builds in a temporary directory (nothing is downloaded; ~7 GB of disk at the full shape):
- the target as a user without its 1T parameters has it: config.json with DeepSeek-V3's architecture keys and
  Kimi-K2's shape (hidden 7168, 61 layers, vocabulary 163,840, MLA and MoE settings), a word-level tokenizer of that
  vocabulary, and only `model.embed_tokens.weight` and `lm_head.weight` (random, bf16), each in its own shard under
  a safetensors index. No decoder layer exists anywhere.
- an EAGLE-3 draft with an MLA layer (models/drafts/mla.py: the target's q/kv LoRA ranks, rope/nope dims and YaRN RoPE),
  random bf16 weights, a 32,000-token draft vocabulary, the seed's taps [0, 3, 31] (the embedding output among them);
- traces written by a synthetic engine: eaglescope's speculative loop (decode/loop.py) drafting with the draft in
  bf16 against a stand-in target whose verify forward returns random hidden states (tap 0 = the embedding of the
  tokens, as the embedding output is) and whose accept decisions are drawn per round (no such target runs here).
  The faults are made in that engine's own code, by overriding one wiring hook of its proposer (the way an engine's
  code goes wrong), never by editing a trace tensor: fc skipped (step 0 reads the last tap's columns), the draft's
  normed output fed back, every tree position's features handed on instead of the accepted ones, and draft ids used
  as target ids (the vocabulary map lost). The engine shares the proposer with eaglescope's replay, so it is less
  independent than tests/engines/plain_eagle3.py (which proves the same diagnosis at small scale on faults it made
  alone); the diagnosis itself reproduces each fault with its own hypotheses, not with these hooks.

Then runs the product's CLI, `eaglescope doctor --target T --draft D --trace TRACE --json`, once per trace, each in
its own process, and records its wall time and peak resident memory (the child's ru_maxrss). Writes
bench/results/kimi-draft-side-<UTC>.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglescope import trace as T
from eaglescope.decode.generation import SamplingConfig
from eaglescope.decode.loop import ReferenceRunner, decode
from eaglescope.decode.speculative import Eagle3Proposer
from eaglescope.decode.verify import VerifyResult
from eaglescope.models.draft import DraftConfig, DraftContract, Eagle3Draft, load_draft, weight_names
from eaglescope.models.targets.base import Target, TargetOutput
from eaglescope.models.targets.head import EMBEDDING_NAMES
from eaglescope.models.targets.loading import load_tensors
from eaglescope.models.vocab import build_draft_vocab
from eaglescope.taps import TapContract

REPO = Path(__file__).resolve().parents[1]
# Kimi-K2's published config.json shape (DeepSeek-V3 architecture); K2.5 keeps the text model's shape.
KIMI = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "vocab_size": 163840,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TAPS = (0, 3, 31)  # the seed's capture: the embedding output, layer 3's and layer 31's input
DRAFT_VOCAB = 32000
TREE = (3, 4, 8)  # depth, top-k, verified tokens
PROMPT_LEN, MAX_NEW = 24, 20


# -- the checkpoints -------------------------------------------------------------------------------------------------
def _random_bf16(shape: tuple[int, int], std: float, g: torch.Generator, chunk: int = 8192) -> torch.Tensor:
    """Filled in row chunks: a float32 draw of the whole table would be twice its bf16 size."""
    out = torch.empty(shape, dtype=torch.bfloat16)
    for i in range(0, shape[0], chunk):
        out[i : i + chunk] = torch.randn(min(chunk, shape[0] - i), shape[1], generator=g) * std
    return out


def build_target(out: Path, cfg: dict, seed: int = 0) -> Path:
    """config.json, a tokenizer of the whole vocabulary, and the embedding and lm_head alone, one shard each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True)
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out)
    g = torch.Generator().manual_seed(seed)
    shards = {}
    for i, (name, std) in enumerate((("model.embed_tokens.weight", 0.02), ("lm_head.weight", H**-0.5))):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({name: _random_bf16((V, H), std, g)}, str(out / shard), metadata={"format": "pt"})
        shards[name] = shard
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return out


def build_draft(out: Path, cfg: dict, draft_vocab: int, seed: int = 1) -> Path:
    """An MLA EAGLE-3 draft for `cfg`, random bf16 weights (norms around 1, so a norm applied or skipped shows),
    saved as eaglescope saves drafts, without an embedding. Built on the meta device: nothing is allocated twice."""
    taps = TapContract(TAPS, cfg["num_hidden_layers"])
    config = DraftConfig.for_target(cfg, taps, draft_vocab, arch="mla")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Eagle3Draft(config).state_dict().items()}
        names = weight_names(Eagle3Draft(config))
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for k in names:
        shape = shapes[k]
        if k in ("d2t", "t2d"):
            continue
        if len(shape) == 2:
            sd[k] = _random_bf16(tuple(shape), shape[1] ** -0.5, g)
        else:
            sd[k] = (1.0 + 0.2 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    counts = torch.randint(0, 1000, (cfg["vocab_size"],), generator=g)
    sd["d2t"], sd["t2d"] = build_draft_vocab(counts, draft_vocab)
    out.mkdir(parents=True)
    hf = config.to_hf_config(list(TAPS))
    hf["eaglescope"] = DraftContract(taps=taps, ttt_length=7).to_dict()
    hf["torch_dtype"] = "bfloat16"
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


# -- the synthetic engine ----------------------------------------------------------------------------------------
class SyntheticTarget(Target):
    """A target that is not there: each forward returns fresh random hidden states for its taps (tap 0 is the
    embedding output, so it is the embedding of the tokens) and no logits; decisions are the runner's."""

    def __init__(self, cfg: dict, embedding: torch.Tensor, seed: int) -> None:
        from eaglescope.models.targets.base import TargetFingerprint

        self.fingerprint = TargetFingerprint(cfg["architectures"][0], cfg["num_hidden_layers"], cfg["hidden_size"],
                                             cfg["vocab_size"])  # fmt: skip
        self.embedding, self.taps = embedding, None
        self.device, self.dtype = torch.device("cpu"), torch.bfloat16
        self.max_positions, self.eos_token_ids = cfg["max_position_embeddings"], []
        self.g = torch.Generator().manual_seed(seed)
        self._len = self._pending = 0

    def reset(self, max_len: int) -> None:
        self._len = self._pending = 0

    @property
    def cache_len(self) -> int:
        return self._len

    def forward(self, tokens, positions=None, tree_mask=None) -> TargetOutput:
        T_, H = tokens.shape[0], self.hidden_size
        segs = [self.embedding[tokens] if i == 0 else torch.randn(T_, H, generator=self.g) * (1 + i / 8)
                for i in self.taps.layers]  # fmt: skip
        self._pending = T_
        return TargetOutput(torch.empty(T_, 0), torch.cat([s.float() for s in segs], -1).to(torch.bfloat16))

    def commit(self, keep=None) -> None:
        self._len += self._pending if keep is None else int(keep.numel())

    def hidden_states(self, input_ids, attention_mask=None):
        raise NotImplementedError


class SyntheticRunner(ReferenceRunner):
    """The speculative loop with drawn decisions: each round accepts 0-2 levels along the first child, then a bonus."""

    def first_token(self, prefill) -> int:
        return 1000

    def verdict(self, state) -> VerifyResult:
        tree = state.tree
        want = int(torch.randint(0, 3, (1,), generator=self.target.g))
        parents, accepted, node = tree.parents.tolist(), [], 0
        for _ in range(want):
            kids = [i for i, p in enumerate(parents) if p == node]
            if not kids:
                break
            node = kids[0]
            accepted.append(node)
        bonus = int(torch.randint(0, self.target.vocab_size, (1,), generator=self.target.g))
        return VerifyResult(accepted, bonus, [int(tree.tokens[i]) for i in accepted] + [bonus])


class FcSkipped(Eagle3Proposer):
    def features(self, aux):
        return aux[..., -self.draft.config.hidden_size :].to(self.dtype)  # the last tap's columns, no fc


class FeedbackPostnorm(Eagle3Proposer):
    def child_hidden(self, parent_out):
        return self.draft.norm(parent_out)  # the normed output, not the pre-norm one


class StaleFirstRows(Eagle3Proposer):
    first_wrong: int | None = None  # the first round whose hand-off this fault changes

    def next_round_features(self, aux, path):
        rows = torch.arange(path.shape[0], device=path.device)  # the first a+1 verified rows in tree order
        if not torch.equal(rows, path) and self.first_wrong is None:
            self.first_wrong = self.rec.round
        return aux[rows]


class VocabMapLost(Eagle3Proposer):
    def to_target_ids(self, draft_ids):
        return draft_ids  # d2t ignored


# name → (proposer, expected code @ stage, round)
CASES = {
    "clean": (Eagle3Proposer, None),
    "fc_skipped": (FcSkipped, "FC_SKIPPED@draft.fc.out r1"),
    "feedback_postnorm": (FeedbackPostnorm, "FEEDBACK_POSTNORM@draft.step1.hidden_in r1"),
    "stale_first_rows": (StaleFirstRows, "STALE_ACCEPTED@next.hidden_in r{first_wrong}"),
    "vocab_map_lost": (VocabMapLost, "VOCAB_MAP@draft.step0.topk r1"),
}


def write_traces(target_dir: Path, draft_dir: Path, out: Path, cases: dict, seed: int = 2) -> dict[str, tuple]:
    """name → (trace, what doctor should say): one full trace per case, the synthetic engine drafting in bf16 with the
    target's embedding (traces an earlier run left in `out` are reused: the manifest keeps what doctor should say)."""
    done = {name: out / name for name in cases if (out / name / T.MANIFEST).is_file()}
    said = {name: T.load_trace(p).meta.get("bench_expected") for name, p in done.items()}
    if len(done) == len(cases) and None not in said.values():
        return {name: (p, said[name]) for name, p in done.items()}
    cfg = json.loads((target_dir / "config.json").read_text())
    loaded = load_draft(draft_dir, cfg["num_hidden_layers"], dtype=torch.bfloat16)
    emb = load_tensors(target_dir, {"embedding": EMBEDDING_NAMES})["embedding"]
    loaded.model.load_target_embedding(emb)
    del emb
    table = loaded.model.embed_tokens.weight
    prompt = torch.randint(0, cfg["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))
    depth, top_k, total = TREE
    paths = {}
    for name, (proposer_cls, expected) in cases.items():
        target = SyntheticTarget(cfg, table, seed)
        target.set_taps(loaded.contract.taps)
        rec = T.TraceRecorder(out / name, mode="full", producer="synthetic Kimi-K2.5 engine (bench/kimi_draft_side.py)")
        rec.set_meta(prompt_ids=prompt.tolist(), taps=list(TAPS), dtype="bfloat16",
                     settings={"chain": None, "tree": ",".join(map(str, TREE))})  # fmt: skip
        with rec:
            proposer = proposer_cls(loaded.model, depth, top_k, total, PROMPT_LEN + MAX_NEW + total + 2, recorder=rec)
            runner = SyntheticRunner(target, proposer, SamplingConfig(), None, rec)
            decode(runner, prompt.tolist(), MAX_NEW, MAX_NEW, set(), target.device)
            if expected and "{first_wrong}" in expected:
                if proposer.first_wrong is None:
                    raise SystemExit(f"{name}: no round's accepted path differs from the first rows: it never acted")
                expected = expected.format(first_wrong=proposer.first_wrong)
            rec.set_meta(bench_expected=expected or "healthy")
        paths[name] = (out / name, expected or "healthy")
    return paths


# -- running doctor --------------------------------------------------------------------------------------------
def run_doctor_cli(target_dir: Path, draft_dir: Path, trace: Path, dtype: str, log: Path) -> dict:
    """`eaglescope doctor ... --json` in its own process: its report, wall seconds, CPU seconds (user + system: what
    a busy shared machine inflates less than the wall time) and peak RSS in GB."""
    argv = [sys.executable, "-m", "eaglescope.cli", "doctor", "--target", str(target_dir), "--draft", str(draft_dir),
            "--trace", str(trace), "--device", "cpu", "--dtype", dtype, "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    with (log.with_suffix(".out")).open("w") as out, log.with_suffix(".err").open("w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    text = log.with_suffix(".out").read_text()
    if rc not in (0, 1):
        raise SystemExit(f"doctor exited {rc}: {log.with_suffix('.err').read_text()[-2000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return {"report": json.loads(text), "rc": rc, "seconds": seconds, "cpu_seconds": cpu,
            "peak_rss_gb": usage.ru_maxrss / 2**20}  # fmt: skip


def said(report: dict) -> str:
    if report["healthy"]:
        return "healthy"
    f = report["findings"][0]
    return f"{f['code']}@{f['stage']} r{f['round']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="where the JSON goes")
    ap.add_argument("--vocab", type=int, default=KIMI["vocab_size"], help="target vocabulary (embedding rows)")
    ap.add_argument("--dtype", default="bfloat16", help="doctor's --dtype (the draft's weights and replay)")
    ap.add_argument("--keep", type=Path, default=None, help="build here and keep it, or reuse what an earlier run "
                    "built there (default: a temporary directory)")  # fmt: skip
    args = ap.parse_args(argv)
    cfg = {**KIMI, "vocab_size": args.vocab}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kimi-draft-side-") as tmpd:
        root = args.keep or Path(tmpd)
        t0 = time.perf_counter()
        target, draft = root / "target", root / "draft"
        if not (target.exists() and draft.exists()):  # --keep: an earlier build is reused
            build_target(target, cfg)
            build_draft(draft, cfg, min(DRAFT_VOCAB, args.vocab))
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        traces = write_traces(target, draft, root / "traces", CASES)
        written = time.perf_counter() - t0
        disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        runs = []
        for name, (trace, expected) in traces.items():
            r = run_doctor_cli(target, draft, trace, args.dtype, root / f"doctor-{name}")
            rep = r.pop("report")
            got = said(rep)
            runs.append({"case": name, "expected": expected, "doctor": got, "right": got == expected,
                         "replay": rep["context"].get("replay", {}).get("mode"), **r})  # fmt: skip
            print(f"{name}: {got} ({r['seconds']:.1f} s, peak RSS {r['peak_rss_gb']:.2f} GB)", file=sys.stderr)
    result = {
        "what": "eaglescope doctor --trace (draft-side replay) on a Kimi-K2.5-shaped target with its layers absent",
        "commit": rev.strip(),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            # the machine is shared: its 1-minute load average before and after says how busy it was
            "load_average": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
        },  # fmt: skip
        "shape": {
            k: cfg[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "vocab_size",
                "intermediate_size",
                "q_lora_rank",
                "kv_lora_rank",
            )
        }  # fmt: skip
        | {
            "draft_vocab": min(DRAFT_VOCAB, args.vocab),
            "taps": list(TAPS),
            "tree": list(TREE),
            "prompt_tokens": PROMPT_LEN,
            "new_tokens": MAX_NEW,
            "doctor_dtype": args.dtype,
        },  # fmt: skip
        "build_seconds": built,
        "trace_seconds": written,
        "disk_gb": disk / 2**30,
        "runs": runs,
        "all_right": all(r["right"] for r in runs),
        "max_peak_rss_gb": max(r["peak_rss_gb"] for r in runs),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M")
        (args.out / f"kimi-draft-side-{stamp}.json").write_text(text + "\n")
    return 0 if result["all_right"] else 1


if __name__ == "__main__":
    sys.exit(main())
