"""`eaglescope bench`: a user's own measurement of speculative decoding on their target, draft and prompts.

Every method decodes every prompt through the functions `eaglescope generate` uses — on a GPU the static-shape
backend (`generate --fast`), elsewhere the reference one — after one untimed warm-up run per method. Reported per
method: τ (bonus token included), conditional α_k, tokens/s, speedup over vanilla decoding on the same backend,
η = speedup / τ, and on how many prompts the output is identical to vanilla greedy (it must be all of them).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from eaglescope.backend import Decoder, choose_backend
from eaglescope.data.chat import parse_conversation
from eaglescope.decode.generation import DecodeSettings, GenerationResult, check_prompt
from eaglescope.decode.stats import SpecStats
from eaglescope.decode.tree import parse_tree_shape
from eaglescope.errors import EagleScopeError
from eaglescope.figures import png_data_uri, pyplot
from eaglescope.models.targets.base import Target
from eaglescope.outputs import OutputKind, write_file
from eaglescope.progress import Progress

log = logging.getLogger(__name__)

DEFAULT_METHODS = ("vanilla", "chain=4", "tree=6,4,24", "ngram=4")


@dataclass
class Method:
    name: str  # as given: vanilla | chain=K | tree=D,K,N | ngram=K
    kind: str  # vanilla | eagle3 | ngram
    shape: tuple[int, int, int] | None = None


def parse_method(text: str) -> Method:
    kind, _, arg = text.partition("=")
    if kind == "vanilla" and not arg:
        return Method(text, "vanilla")
    if kind == "chain":
        return Method(text, "eagle3", parse_tree_shape(_int(arg, text), None))
    if kind == "tree":
        return Method(text, "eagle3", parse_tree_shape(None, arg))
    if kind == "ngram":
        return Method(text, "ngram", parse_tree_shape(_int(arg, text), None))
    raise EagleScopeError(f"--method {text!r}: use vanilla, chain=K, tree=DEPTH,TOPK,TOTAL or ngram=K")


def _int(arg: str, text: str) -> int:
    try:
        return int(arg)
    except ValueError:
        raise EagleScopeError(f"--method {text!r}: {arg!r} is not an integer") from None


def read_prompts(path: Path, tokenizer, chat: bool) -> list[list[int]]:
    """Prompts as token ids. A .jsonl file holds one object a line: {"prompt": text}, {"prompt_ids": [ids]}, or a
    conversation ({"messages"| "conversations": ...}, rendered with the chat template, generation prompt added);
    any other file holds one text prompt a line (`chat` wraps each as a user turn)."""
    if not path.is_file():
        raise EagleScopeError(f"--prompts {path}: no such file")
    try:
        lines = [(n, line) for n, line in enumerate(path.read_bytes().decode("utf-8").splitlines(), 1) if line.strip()]
    except UnicodeDecodeError as e:
        raise EagleScopeError(f"--prompts {path} is not UTF-8 text (byte {e.start})") from None
    out = []
    for n, line in lines:
        where = f"{path}:{n}"
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise EagleScopeError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise EagleScopeError(f"{where}: expected a JSON object")
            if "prompt_ids" in obj:
                ids = obj["prompt_ids"]
                if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
                    raise EagleScopeError(f"{where}: prompt_ids must be a non-empty list of token ids")
                out.append(ids)
                continue
            if "prompt" in obj:
                out.append(_encode(str(obj["prompt"]), tokenizer, chat, where))
                continue
            messages = parse_conversation(obj, where)
            if messages and messages[-1]["role"] == "assistant":
                messages = messages[:-1]  # the answer is what the benchmark generates
            out.append(_render(messages, tokenizer, where))
        else:
            out.append(_encode(line, tokenizer, chat, where))
    if not out:
        raise EagleScopeError(f"--prompts {path} holds no prompts")
    return out


def _encode(text: str, tokenizer, chat: bool, where: str) -> list[int]:
    if tokenizer is None:
        raise EagleScopeError(f"{where}: the target has no tokenizer; give prompt_ids in a .jsonl file")
    if chat:
        return _render([{"role": "user", "content": text}], tokenizer, where)
    return tokenizer.encode(text, add_special_tokens=True)


def _render(messages: list[dict], tokenizer, where: str) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise EagleScopeError(f"{where}: rendering a conversation needs the target tokenizer's chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


# -- running ------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    method: str
    backend: str
    tokens: int = 0
    seconds: float = 0.0
    identical: int = 0
    prompts: int = 0
    stats: SpecStats | None = None
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan


class Bench:
    """One loaded target (and draft); `run(method, prompt)` decodes through the backend `generate` would use."""

    def __init__(
        self,
        target: Target,
        draft_dir: str | None,
        fast: bool,
        max_len: int,
        batch_invariant: bool = True,
        compile: bool = False,
    ):
        self.target, self.draft_dir, self.max_len = target, draft_dir, max_len
        self.decoder = "auto" if fast else "reference"
        self.batch_invariant, self.compile = batch_invariant, compile
        self._decoders: dict[str, Decoder] = {}  # one a method: its static runner is built (captured) once
        self._draft = None

    def settings(self, m: Method, max_new: int) -> DecodeSettings:
        draft, proposer = (self.draft_dir, "eagle3") if m.kind == "eagle3" else (None, m.kind)
        chain, tree = (None, ",".join(map(str, m.shape))) if m.shape else (None, None)
        return DecodeSettings(max_new, draft=draft, proposer=proposer, chain=chain, tree=tree, decoder=self.decoder,
                              batch_invariant=self.batch_invariant, compile=self.compile)  # fmt: skip

    def static_runner(self, name: str):
        """The static backend's runner of method `name` once it ran there (use_graph: whether it was captured)."""
        dec = self._decoders.get(name)
        return None if dec is None else dec.static_runner

    def backend(self, m: Method) -> str:
        return choose_backend(self.settings(m, 1), self.target)

    def run(self, m: Method, prompt: list[int], max_new: int) -> GenerationResult:
        dec = self._decoders.get(m.name)
        if dec is None:
            if m.kind == "eagle3" and self.draft_dir is None:
                raise EagleScopeError("EAGLE-3 methods (chain=K, tree=...) need --draft DIR")
            dec = self._decoders[m.name] = Decoder(self.target, self.settings(m, max_new), self.max_len, self._draft)
        res = dec.run(prompt, [], max_new)
        if m.kind == "eagle3":
            self._draft = dec.draft()  # loaded once for every EAGLE-3 method
        return res


def run_bench(
    target: Target,
    draft_dir: str | None,
    prompts: list[list[int]],
    methods: list[Method],
    max_new_tokens: int,
    fast: bool,
    batch_invariant: bool = True,
    progress: bool = True,
    compile: bool = False,
) -> dict:
    """Decode every prompt with every method; → the result object `--json` prints."""
    if not any(m.kind == "vanilla" for m in methods):
        methods = [parse_method("vanilla"), *methods]  # speedup and "identical" are against vanilla
    longest = max(len(p) for p in prompts)
    for p in prompts:
        check_prompt(target, p, max_new_tokens)
    max_len = min(longest + max_new_tokens, target.max_positions)
    bench = Bench(target, draft_dir, fast, max_len, batch_invariant, compile)
    rows = {m.name: Row(m.name, bench.backend(m), stats=None if m.kind == "vanilla" else SpecStats()) for m in methods}
    for m in methods:  # warm-up: graph capture, compilation and caches are not decoding time
        bench.run(m, prompts[0], min(8, max_new_tokens))
    bar = Progress(len(prompts) * len(methods), "bench", "runs", enabled=progress)
    for p in prompts:
        ref = None
        for m in methods:
            res = bench.run(m, p, max_new_tokens)
            r = rows[m.name]
            r.tokens += len(res.token_ids)
            r.seconds += res.seconds
            r.prompts += 1
            r.outputs.append(res.token_ids)
            if m.kind == "vanilla":
                ref = res.token_ids
            if r.stats is not None and res.stats is not None:
                r.stats.merge(res.stats)
            bar.update(1)
        for m in methods:
            rows[m.name].identical += int(rows[m.name].outputs[-1] == ref)
    bar.close()
    base = {b: next(r for r in rows.values() if r.stats is None and r.backend == b) for b in ("fast", "reference")
            if any(r.stats is None and r.backend == b for r in rows.values())}  # fmt: skip
    out_rows = []
    for r in rows.values():
        vanilla = base.get(r.backend) or next(iter(base.values()))
        speedup = r.tokens_per_second / vanilla.tokens_per_second
        row = {
            "method": r.method,
            "backend": r.backend,
            "prompts": r.prompts,
            "new_tokens": r.tokens,
            "seconds": round(r.seconds, 6),
            "tokens_per_second": r.tokens_per_second,
            "speedup": speedup,
            "speedup_baseline": f"vanilla on the {vanilla.backend} backend",
            "identical_to_vanilla": r.identical,
            "compiled_round": bool(getattr(bench.static_runner(r.method), "compiled", False)),
        }
        if r.stats is not None:
            tau = r.stats.accept_length
            row |= {"accept_length": tau, "alpha": r.stats.alpha, "rounds": r.stats.rounds, "eta": speedup / tau}
            row |= {"accepted_per_position": r.stats.accepted_per_position}
        out_rows.append(row)
    return {
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "rows": out_rows,
        "all_identical": all(r["identical_to_vanilla"] == r["prompts"] for r in out_rows),
    }


# -- output -------------------------------------------------------------------------------------------------------
def _f(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(res: dict) -> str:
    lines = [f"{'method':<18}{'backend':<11}{'τ':>6}  {'α_1..α_4':<26}{'tok/s':>9}{'speedup':>9}{'η':>6}  identical"]
    for r in res["rows"]:
        alpha = r.get("alpha")
        shown = (
            "-" if not alpha else "[" + ", ".join(_f(a, ".2f") for a in alpha[:4]) + (", …]" if len(alpha) > 4 else "]")
        )
        lines.append(
            f"{r['method']:<18}{r['backend']:<11}{_f(r.get('accept_length'), '.2f'):>6}  {shown:<26}"
            f"{_f(r['tokens_per_second'], '.1f'):>9}{_f(r['speedup'], '.2f'):>8}x{_f(r.get('eta'), '.2f'):>6}  "
            f"{r['identical_to_vanilla']}/{r['prompts']}"
        )
    lines.append(f"{res['prompts']} prompts × {res['max_new_tokens']} new tokens on {res['device']} ({res['dtype']}); "
                 "speedup against vanilla on the same backend; τ counts the bonus token")  # fmt: skip
    return "\n".join(lines)


BENCH_REPORT_MARK = '<meta name="generator" content="eaglescope bench">'


def _is_bench_report(path: Path) -> bool:
    try:
        return BENCH_REPORT_MARK in path.read_bytes()[:4096].decode("utf-8", "replace")
    except OSError:
        return False


BENCH_REPORT = OutputKind("bench HTML report", is_dir=False, recognise=_is_bench_report)


def figure(res: dict) -> str:
    plt = pyplot()
    rows = res["rows"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [r["method"] for r in rows]
    a1.bar(names, [r["tokens_per_second"] for r in rows], color="#4a7ab5")
    a1.set_ylabel("tokens/s")
    a1.set_title("Throughput (same backend as vanilla)", fontsize=11)
    a1.tick_params(axis="x", rotation=30, labelsize=8)
    for r in rows:
        if r.get("alpha"):
            ys = r["alpha"]
            a2.plot(range(1, len(ys) + 1), ys, "o-", label=f"{r['method']} (τ {r['accept_length']:.2f})")
    a2.set_xlabel("draft position k")
    a2.set_ylabel("conditional α_k")
    a2.set_ylim(-0.02, 1.02)
    a2.grid(alpha=0.3)
    if any(r.get("alpha") for r in rows):
        a2.legend(fontsize=8)
    a2.set_title("Acceptance per position", fontsize=11)
    return png_data_uri(fig)


_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">{{ mark|safe }}<title>eaglescope bench</title>
<style>body{font-family:system-ui,sans-serif;margin:24px;color:#1d2530}table{border-collapse:collapse}
td,th{padding:4px 10px;border-bottom:1px solid #eef0f2;text-align:right}th:first-child,td:first-child{text-align:left}
img{max-width:100%}</style></head><body>
<h1>eaglescope bench</h1>
<p>{{ res.prompts }} prompts × {{ res.max_new_tokens }} new tokens on {{ res.device }} ({{ res.dtype }});
speedup against vanilla decoding on the same backend; τ counts the bonus token; η = speedup / τ.</p>
<table><tr><th>method</th><th>backend</th><th>τ</th><th>α_1..α_k</th><th>tok/s</th><th>speedup</th><th>η</th>
<th>identical</th></tr>
{% for r in res.rows %}<tr><td>{{ r.method }}</td><td>{{ r.backend }}</td>
<td>{{ "%.2f"|format(r.accept_length) if r.accept_length is defined else "-" }}</td>
<td>{{ r.alpha|map("round", 2)|join(", ") if r.alpha is defined else "-" }}</td>
<td>{{ "%.1f"|format(r.tokens_per_second) }}</td><td>{{ "%.2f"|format(r.speedup) }}x</td>
<td>{{ "%.2f"|format(r.eta) if r.eta is defined else "-" }}</td>
<td>{{ r.identical_to_vanilla }}/{{ r.prompts }}</td></tr>
{% endfor %}</table>
<p><img alt="throughput and acceptance per method" src="{{ png }}"></p>
</body></html>
"""


def write_report(res: dict, path: str) -> Path:
    template = jinja2.Environment(autoescape=True).from_string(_HTML)
    return write_file(path, template.render(res=res, png=figure(res), mark=BENCH_REPORT_MARK))


__all__ = [
    "run_bench",
    "read_prompts",
    "parse_method",
    "format_table",
    "write_report",
    "BENCH_REPORT",
    "DEFAULT_METHODS",
]
