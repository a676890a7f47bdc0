"""`eaglescope demo`: the whole product on the embedded default, on a CPU, in minutes, nothing downloaded.

    stdlib sources → BPE tokenizer → small Llama target (a normal HF checkpoint) → conversations
    (code prefix → the target's own continuation) → prepare (vocab map, tap features) → train an
    EAGLE-3 draft with TTT → decode held-out prefixes with and without speculation (outputs must be
    identical) → τ, α_k, tokens/s, speedup → doctor with an HTML report.

`--scenario seed` builds README's seed scenario on the same target and prefixes: taps [0, 3, L-2] (the
embedding output among them) and a draft trained with TTT length 1, then runs the same doctor stage, which
must name NO_TTT.

Every stage caches its output under --workdir, keyed by a hash of its settings and inputs, so a second
run reuses them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eaglescope import trace as T
from eaglescope.corpus import COMPLETION_TEMPLATE, code_prefixes, stdlib_corpus, train_tokenizer
from eaglescope.data.prepare import PrepareConfig, prepare
from eaglescope.decode.loop import generate_speculative, generate_vanilla
from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.decode.stats import SpecStats
from eaglescope.detective.doctor import format_report, run_doctor
from eaglescope.detective.report import write_html
from eaglescope.errors import EagleScopeError
from eaglescope.jsonfile import read_object
from eaglescope.models.draft import check_draft_matches_target, load_draft
from eaglescope.models.targets import load_target
from eaglescope.models.targets.loading import load_tokenizer
from eaglescope.outputs import check_destination, dir_kind, write_file
from eaglescope.pretrain import PretrainConfig, pretrain, save_target
from eaglescope.train.loop import TrainConfig, train

# The seed scenario (README's doctor report, docs/doctor-report.png): the embedding output (tap 0) among the taps and
# a draft trained without training-time test. The demo's doctor stage must name NO_TTT on it.
SCENARIOS = ("default", "seed")
SEED_TTT_LENGTH = 1


def seed_taps(num_layers: int) -> str:
    """The seed scenario's taps: [embedding output, layer 3, L-2]."""
    return f"0,3,{num_layers - 2}"


@dataclass
class DemoConfig:
    workdir: str
    fast: bool = False
    seed: int = 0
    # sizes (overridden by --fast)
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    pretrain_steps: int = 600
    # Pretraining runs by steps, so the result is the same on a fast, slow or busy machine (only the time differs;
    # the progress bar says how much is left). A wall-clock cap is the user's choice (--time-budget): the schedule
    # then shrinks to fit, and a target the cap left too weak is refused rather than shown.
    pretrain_budget_s: float | None = None
    pretrain_batch: int = 16
    seq_len: int = 128
    conversations: int = 400
    prefix_tokens: int = 64
    regen_tokens: int = 96
    draft_steps: int = 300
    draft_batch: int = 8
    draft_lr: float = 3e-3
    eval_prompts: int = 12
    eval_new_tokens: int = 96
    chain: int = 4
    scenario: str = "default"  # "default": the healthy pipeline; "seed": taps [0, 3, L-2], a TTT-1 draft

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise EagleScopeError(f"--scenario must be one of {', '.join(SCENARIOS)}, got {self.scenario!r}")
        if self.fast:
            self.pretrain_steps, self.conversations, self.draft_steps = 200, 96, 100
            self.eval_prompts, self.eval_new_tokens = 6, 64

    def stage_key(self, stage: str, fields: tuple[str, ...], extra: str = "") -> str:
        d = {f: getattr(self, f) for f in fields}
        return hashlib.sha256(json.dumps([stage, d, extra], sort_keys=True).encode()).hexdigest()[:16]


TARGET_FIELDS = (
    "seed",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "pretrain_steps",
    "pretrain_batch",
    "seq_len",
)
DATA_FIELDS = TARGET_FIELDS + ("conversations", "prefix_tokens", "regen_tokens")
DRAFT_FIELDS = DATA_FIELDS + ("draft_steps", "draft_batch", "draft_lr")


def default_workdir() -> Path:
    base = os.environ.get("EAGLESCOPE_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eaglescope"
    )
    return Path(base) / "demo"


# The demo's --workdir is its cache: a directory it made itself (marked), holding only what it writes. A user's
# directory of other things given by mistake is refused before anything is written into it.
DEMO_MARKER = ".eaglescope-demo"


def _demo_kind():
    names = ["target", "tokenizer", "prepared*", "draft*", "conversations.jsonl", "trace", "doctor-report*.html"]
    return dir_kind("demo work directory", markers=[DEMO_MARKER], entries=[*names, "demo-results*.json", DEMO_MARKER])


def open_workdir(work: Path) -> None:
    check_destination(work, _demo_kind(), flag="--workdir")
    work.mkdir(parents=True, exist_ok=True)
    (work / DEMO_MARKER).write_text("eaglescope demo cache: every entry here is rebuilt on demand\n")


# The demo's account of each step is its output, read as it happens: it goes to this logger, which the command
# writes to stdout as it stands (indented tables included); elsewhere it is ordinary INFO logging.
STEPS = logging.getLogger(__name__ + ".steps")


def _say(msg: str) -> None:
    STEPS.info(msg)


def _cached(path: Path, key: str) -> bool:
    stamp = path / ".eaglescope-stage"
    return stamp.is_file() and stamp.read_text().strip() == key


def _stamp(path: Path, key: str) -> None:
    (path / ".eaglescope-stage").write_text(key + "\n")


def build_target(cfg: DemoConfig, work: Path) -> Path:
    corpus = stdlib_corpus()
    key = cfg.stage_key("target", TARGET_FIELDS, corpus.sha256)
    out = work / "target"
    if _cached(out, key):
        _say(f"[1/5] target: cached at {out}")
        return out
    t0 = time.perf_counter()
    _say(
        f"[1/5] target: {len(corpus.train)} stdlib files for training, {len(corpus.heldout)} held out "
        f"(list sha256 {corpus.sha256[:12]})"
    )
    tok_dir = work / "tokenizer"
    texts = corpus.read(corpus.train, max_bytes=2_000_000)
    tok = train_tokenizer(texts, cfg.vocab_size, tok_dir, COMPLETION_TEMPLATE)
    train_ids = _tokenize(tok, corpus.read(corpus.train))
    held_ids = _tokenize(tok, corpus.read(corpus.heldout))
    _say(f"      BPE tokenizer ({len(tok)} tokens); {train_ids.numel():,} training tokens")
    pcfg = PretrainConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        seq_len=cfg.seq_len,
        batch_size=cfg.pretrain_batch,
        steps=cfg.pretrain_steps,
        seed=cfg.seed,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        time_budget_s=cfg.pretrain_budget_s,
        lr=4e-3,
        warmup=30,
    )
    cap = "" if cfg.pretrain_budget_s is None else f", capped at {cfg.pretrain_budget_s:.0f} s by --time-budget"
    _say(f"      pretraining {cfg.pretrain_steps} steps{cap} (progress and time left on stderr)")
    model, stats = pretrain(pcfg, train_ids, held_ids, device="cpu")
    save_target(model, pcfg, out, tok_dir, extra={"stats": stats, "corpus_sha256": corpus.sha256})
    _say(
        f"      trained a {stats['parameters'] / 1e6:.1f}M-parameter Llama in {time.perf_counter() - t0:.0f}s "
        f"({stats['steps']} steps, {stats['tokens_per_second']:.0f} tok/s); held-out loss "
        f"{stats.get('heldout_loss', float('nan')):.2f} nats/token"
    )
    check_target_sound(cfg, out, stats)
    _stamp(out, key)  # only a sound target is cached: a weak one is retrained next time
    return out


# -- is the result worth showing? ----------------------------------------------------------------------------
MORE_STEPS = "run it again with more --pretrain-steps"
LIFT_CAP = "run it again without --time-budget (every step runs), or with a larger one"


def repeated_share(ids: list[int]) -> float:
    """The share of the most frequent token: near 1 when a model emits one token forever."""
    return max(ids.count(t) for t in set(ids)) / len(ids) if ids else 1.0


def check_target_sound(cfg: DemoConfig, target_dir: Path, stats: dict) -> None:
    """A target too weak to mean anything makes every later number meaningless (τ 5.0 from a model that repeats
    one token is repetition, not speculation): refuse it in one line."""
    target = load_target(target_dir, device="cpu", dtype=torch.float32)
    prompts = _prefixes(cfg, stdlib_corpus().heldout, target.tokenizer, 4, cfg.seed + 5, 48)
    outputs = [generate_vanilla(target, p, 32, stop_ids=[]).token_ids for p in prompts]
    share = repeated_share([t for o in outputs for t in o])
    uniform = math.log(stats.get("vocab_size") or cfg.vocab_size)
    loss = stats.get("heldout_loss", float("nan"))
    problems = []
    if not (math.isfinite(loss) and loss < uniform - 2.0):
        problems.append(f"held-out loss {loss:.2f} nats/token (guessing uniformly gives {uniform:.2f})")
    if share > 0.5:
        problems.append(f"{share:.0%} of its greedy output is one token")
    if not problems:
        return
    fix = MORE_STEPS
    if stats["steps"] < cfg.pretrain_steps:  # only a cap the user set (--time-budget) cuts the steps short
        problems.append(f"the {cfg.pretrain_budget_s:.0f} s time cap stopped it after {stats['steps']} of "
                        f"{cfg.pretrain_steps} steps")  # fmt: skip
        fix = LIFT_CAP
    raise EagleScopeError(f"the demo's target is too weak to mean anything: {'; '.join(problems)}; {fix}")


def check_draft_sound(metrics: dict) -> None:
    acc = metrics.get("acc") or [0.0]
    if not acc or not (acc[0] == acc[0]) or acc[0] < 0.3:
        raise EagleScopeError(
            f"the demo's draft learned too little to mean anything (held-out acc_0 {acc[0]:.2f}); a stronger target "
            "helps: run it again without --time-budget, or with more --pretrain-steps"
        )


def _tokenize(tok, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _prefixes(cfg: DemoConfig, files: list[Path], tok, n: int, seed: int, length: int) -> list[list[int]]:
    return code_prefixes(files, tok, n, seed, length, chunk_chars=1500)


def build_data(cfg: DemoConfig, work: Path, target_dir: Path, taps: str | None = None, name: str = "prepared") -> Path:
    """The target's own continuations of code prefixes, with its tap features at `taps` (None: the default)."""
    key = cfg.stage_key("data", DATA_FIELDS, (target_dir / ".eaglescope-stage").read_text() + str(taps))
    out = work / name
    if _cached(out, key):
        _say(f"[2/5] data: cached at {out}")
        return out
    t0 = time.perf_counter()
    tok = load_tokenizer(target_dir)
    corpus = stdlib_corpus()
    prefixes = _prefixes(cfg, corpus.train, tok, cfg.conversations, cfg.seed + 1, cfg.prefix_tokens)
    jsonl = work / "conversations.jsonl"
    with jsonl.open("w") as f:
        for ids in prefixes:
            # The answer is regenerated by the target (the EAGLE-3 recipe); the placeholder is never trained on.
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": tok.decode(ids)},
                            {"role": "assistant", "content": "pass"},
                        ]
                    }
                )
                + "\n"
            )
    _say(
        f"[2/5] data: {len(prefixes)} code prefixes; the target writes its own continuations, then its tap "
        f"features{'' if taps is None else f' at taps [{taps}]'} are stored"
    )
    prepare(
        PrepareConfig(
            target=str(target_dir),
            data=str(jsonl),
            out=str(out),
            regenerate=True,
            regen_max_new_tokens=cfg.regen_tokens,
            hidden_states=True,
            taps=taps,
            max_length=cfg.seq_len * 2,
            device="cpu",
            dtype="float32",
            overwrite=True,
        )
    )
    _stamp(out, key)
    _say(f"      prepared in {time.perf_counter() - t0:.0f}s")
    return out


def build_draft(
    cfg: DemoConfig, work: Path, target_dir: Path, data_dir: Path, ttt_length: int = 7, name: str = "draft"
) -> Path:
    key = cfg.stage_key(name, DRAFT_FIELDS, (data_dir / ".eaglescope-stage").read_text() + str(ttt_length))
    out = work / name
    if _cached(out, key):
        _say(f"[3/5] {name}: cached at {out}")
        return out
    t0 = time.perf_counter()
    _say(f"[3/5] {name}: training an EAGLE-3 draft with TTT length {ttt_length}")
    result = train(
        TrainConfig(
            target=str(target_dir),
            data=str(data_dir),
            out=str(out),
            ttt_length=ttt_length,
            max_steps=cfg.draft_steps,
            batch_size=cfg.draft_batch,
            lr=cfg.draft_lr,
            warmup_steps=20,
            seed=cfg.seed,
            device="cpu",
            dtype="float32",
            overwrite=True,
        )
    )
    m = result.metrics
    check_draft_sound(m)
    _stamp(out, key)
    _say(
        f"      trained in {time.perf_counter() - t0:.0f}s; held-out acc_k "
        f"{_fmt(m.get('acc', []))}, predicted τ {m.get('predicted_accept_length', float('nan')):.2f}"
    )
    return out


def _fmt(xs, n: int = 4) -> str:
    return "[" + ", ".join("-" if x is None else f"{x:.2f}" for x in list(xs)[:n]) + (", …]" if len(xs) > n else "]")


def evaluate(cfg: DemoConfig, work: Path, target_dir: Path, draft_dir: Path) -> dict:
    _say(
        f"[4/5] decode {cfg.eval_prompts} held-out prefixes, {cfg.eval_new_tokens} new tokens each, "
        f"with and without speculation (greedy)"
    )
    target = load_target(target_dir, device="cpu", dtype=torch.float32)
    loaded = load_draft(draft_dir, target.num_layers)
    check_draft_matches_target(loaded.contract, target.fingerprint)
    loaded.model.load_target_embedding(target_embedding(target))
    target.set_taps(loaded.contract.taps)
    prompts = _prefixes(cfg, stdlib_corpus().heldout, target.tokenizer, cfg.eval_prompts, cfg.seed + 2, 64)
    settings = {"chain": (cfg.chain, 1, cfg.chain + 1), "tree": (5, 3, 16)}
    rows = {"vanilla": {"tokens": 0, "seconds": 0.0}}
    for name in settings:
        rows[name] = {"tokens": 0, "seconds": 0.0, "stats": SpecStats(), "identical": 0}
    # warm-up so the first timed call does not pay one-off costs
    generate_vanilla(target, prompts[0], 8, stop_ids=[])
    for p in prompts:
        v = generate_vanilla(target, p, cfg.eval_new_tokens, stop_ids=[])
        rows["vanilla"]["tokens"] += len(v.token_ids)
        rows["vanilla"]["seconds"] += v.seconds
        for name, shape in settings.items():
            prop = Eagle3Proposer(loaded.model, *shape, max_len=len(p) + cfg.eval_new_tokens + 2)
            s = generate_speculative(target, prop, p, cfg.eval_new_tokens, stop_ids=[])
            r = rows[name]
            r["tokens"] += len(s.token_ids)
            r["seconds"] += s.seconds
            r["stats"].merge(s.stats)
            r["identical"] += int(s.token_ids == v.token_ids)
    share = repeated_share([t for p in prompts for t in generate_vanilla(target, p, 32, stop_ids=[]).token_ids])
    if share > 0.5:  # τ would only measure repetition
        raise EagleScopeError(f"the target's greedy output is {share:.0%} one token, so τ would measure repetition; "
                              f"{MORE_STEPS}")  # fmt: skip
    base = rows["vanilla"]["tokens"] / rows["vanilla"]["seconds"]
    table = []
    for name, r in rows.items():
        tps = r["tokens"] / r["seconds"]
        st = r.get("stats")
        row = {
            "method": name if name == "vanilla" else f"eagle3 {name} {settings[name]}",
            "tokens_per_second": tps,
            "speedup": tps / base,
        }
        if st is not None:
            row.update(
                accept_length=st.accept_length,
                alpha=st.alpha,
                identical=f"{r['identical']}/{len(prompts)}",
                eta=(tps / base) / st.accept_length,
            )
        table.append(row)
    _print_table(table)
    identical = all(r.get("identical", "x/x").split("/")[0] == str(len(prompts)) for r in table[1:])
    _say(
        "      speculative outputs are "
        + (
            "identical to vanilla greedy on every prompt"
            if identical
            else "NOT identical to vanilla greedy on some prompts"
        )
    )
    return {"rows": table, "identical": identical}


def _print_table(rows: list[dict]) -> None:
    _say(f"      {'method':<28}{'τ':>6}  {'α_1..α_4':<26}{'tok/s':>8}{'speedup':>9}{'η':>6}  identical")
    for r in rows:
        tau = f"{r['accept_length']:.2f}" if "accept_length" in r else "-"
        alpha = _fmt(r["alpha"]) if "alpha" in r else "-"
        eta = f"{r['eta']:.2f}" if "eta" in r else "-"
        _say(
            f"      {r['method']:<28}{tau:>6}  {alpha:<26}{r['tokens_per_second']:>8.1f}{r['speedup']:>8.2f}x"
            f"{eta:>6}  {r.get('identical', '-')}"
        )


def record_trace(cfg: DemoConfig, work: Path, target_dir: Path, draft_dir: Path) -> Path:
    """A trace of eaglescope's own decoding of one held-out prefix: what doctor compares with its replay."""

    target = load_target(target_dir, device="cpu", dtype=torch.float32)
    loaded = load_draft(draft_dir, target.num_layers)
    loaded.model.load_target_embedding(target_embedding(target))
    target.set_taps(loaded.contract.taps)
    prompt = _prefixes(cfg, stdlib_corpus().heldout, target.tokenizer, 1, cfg.seed + 3, 48)[0]
    out = work / "trace"
    rec = T.TraceRecorder(out, mode="full", producer="eaglescope-demo")
    rec.set_meta(prompt_ids=prompt, settings={"chain": cfg.chain, "tree": None}, taps=loaded.contract.taps.to_dict())
    prop = Eagle3Proposer(loaded.model, cfg.chain, 1, cfg.chain + 1, max_len=len(prompt) + 34, recorder=rec)
    generate_speculative(target, prop, prompt, 32, stop_ids=[], recorder=rec)
    return rec.close()


def run_doctor_stage(cfg: DemoConfig, work: Path, target_dir: Path, draft_dir: Path, data_dir: Path) -> dict:
    _say("[5/5] doctor: static checks, trace vs golden replay, served vs expected acceptance, HTML report")
    trace_dir = record_trace(cfg, work, target_dir, draft_dir)
    report = run_doctor(
        str(target_dir),
        str(draft_dir),
        data=str(data_dir),
        trace=str(trace_dir),
        prompts=4,
        max_new_tokens=48,
        device="cpu",
        dtype=torch.float32,
        depth=cfg.chain,
    )
    name = "doctor-report.html" if cfg.scenario == "default" else f"doctor-report-{cfg.scenario}.html"
    html = write_html(report, work / name)
    if report.healthy:
        _say("      healthy: no findings")
    for f in report.findings[:3]:
        _say(f"      {f.code} ({f.support}): {f.verdict}")
    for line in format_report(report).splitlines():  # the numbers behind the verdict, and what could not be judged
        if line.startswith(("served ", "expected ", "predicted ", "training ", "note: ")):
            _say(f"      {line}")
    _say(f"      report: {html}")
    return report.to_dict()


def run_demo(cfg: DemoConfig) -> dict:
    work = Path(cfg.workdir).expanduser()
    open_workdir(work)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    what = "" if cfg.scenario == "default" else f", {cfg.scenario} scenario"
    _say(f"eaglescope demo ({'fast' if cfg.fast else 'full'}{what}) — artifacts in {work}")
    target_dir = build_target(cfg, work)
    if cfg.scenario == "seed":
        data_dir = build_data(cfg, work, target_dir, taps=seed_taps(cfg.num_layers), name="prepared-seed")
        draft_dir = build_draft(cfg, work, target_dir, data_dir, ttt_length=SEED_TTT_LENGTH, name="draft-seed")
        results = {"identical": True}  # the decode table is the default scenario's; here doctor is the point
    else:
        data_dir = build_data(cfg, work, target_dir)
        draft_dir = build_draft(cfg, work, target_dir, data_dir)
        results = evaluate(cfg, work, target_dir, draft_dir)
    results["doctor"] = run_doctor_stage(cfg, work, target_dir, draft_dir, data_dir)
    results["seconds"] = time.perf_counter() - t0
    results["config"] = asdict(cfg)
    # what ran, not what was asked: a --time-budget cap may have cut pretraining short
    results["target"] = (read_object(target_dir / "eaglescope_pretrain.json", EagleScopeError) or {}).get("stats")

    name = "demo-results.json" if cfg.scenario == "default" else f"demo-results-{cfg.scenario}.json"
    write_file(work / name, json.dumps(results, indent=2, default=str) + "\n")
    _say(
        f"done in {results['seconds']:.0f}s. Try: eaglescope generate --target {target_dir} --draft {draft_dir} "
        "--prompt 'def read_config(path):' --chain 4 --json"
    )
    return results


__all__ = ["DemoConfig", "run_demo", "default_workdir", "STEPS"]
