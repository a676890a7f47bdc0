"""The doctor's HTML report: one self-contained file (figures are base64 PNGs; no scripts, fonts or links).

    banner          healthy, or the most likely finding
    findings        code, stage, verdict, evidence, fix
    acceptance      α_k per position: served vs predicted (teacher-forced) vs training
    norms           per-segment norms, trace vs replay   (context["segment_norms"]: {"trace", "replay", "labels"})
    divergence map  rel. error by stage × round           (context["stage_table"]: [{round, stage, rel_err, match}])

Every part is optional: a report without a trace has no norms or map, and says so instead of failing.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jinja2
import numpy as np

from eaglescope.detective.acceptance import MIN_REACHED
from eaglescope.detective.findings import CODES, DoctorReport, stage_rank
from eaglescope.figures import png_data_uri, pyplot
from eaglescope.outputs import OutputKind, check_destination, write_file

GENERATOR = '<meta name="generator" content="eaglescope doctor">'


def _is_report(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    return GENERATOR in head or "<title>eaglescope doctor" in head  # the title: reports from before the tag


# What `doctor --html` may replace without asking: an earlier doctor report, never any other file.
REPORT = OutputKind("doctor HTML report", is_dir=False, recognise=_is_report)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;
color:#1d2329;background:#fff}
h1{font-size:22px;margin:0 0 12px}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde2e6;padding-bottom:4px}
.banner{padding:14px 18px;border-radius:8px;font-size:17px;margin-bottom:8px}
.ok{background:#e3f4e6;border:1px solid #7cc48a}.bad{background:#fde8e6;border:1px solid #e08b80}
.banner b{font-size:19px}.muted{color:#68737d;font-size:13px}
table{border-collapse:collapse;width:100%;font-size:13px}th,td{border:1px solid #dde2e6;padding:5px 7px;
text-align:left;vertical-align:top}th{background:#f3f5f7}code{font-size:12px}
td.ev{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11px;max-width:420px;word-break:break-word}
img{max-width:100%;border:1px solid #eef0f2;border-radius:4px}
"""


def _num(x) -> float:
    if x is None:
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


# -- figures -----------------------------------------------------------------------------------------------------
def _alpha_shown(a: dict) -> list[float]:
    """α_k to plot: positions reached by fewer than MIN_REACHED rounds are noise, so they are left out."""

    ys = [_num(x) for x in a.get("alpha") or []]
    reached = a.get("reached") or []
    return [math.nan if k < len(reached) and (reached[k] or 0) < MIN_REACHED else y for k, y in enumerate(ys)]


def acceptance_figure(acc: dict | None) -> str | None:
    """Left: conditional α_k served vs predicted (vs training). Right: teacher-forced acc_k, where a draft that
    cannot read its own features (no TTT) shows as a drop after step 1."""
    if not acc:
        return None
    series = []
    for key, style in (("served", "o-"), ("expected", "D-."), ("predicted", "s--"), ("training", "^:")):
        a = acc.get(key)
        if a and any(not math.isnan(y) for y in _alpha_shown(a)):
            series.append((key, a, style))
    accs = [(k, acc[k]) for k in ("predicted", "training") if acc.get(k) and acc[k].get("acc")]
    if not series and not accs:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 if accs else 1, figsize=(11 if accs else 7.5, 3.6), squeeze=False)
    ax = axes[0][0]
    for key, a, style in series:
        ys = _alpha_shown(a)
        tau = _num(a.get("accept_length"))
        label = f"{key}: {a.get('source', key)}" + ("" if math.isnan(tau) else f" (τ {tau:.2f})")
        ax.plot(range(1, len(ys) + 1), ys, style, label=label, linewidth=2, markersize=6)
    from matplotlib.ticker import MaxNLocator  # matplotlib loads only when a figure is drawn (figures.pyplot)

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("conditional acceptance α_k")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8, loc="best")
    ax.set_title("Served vs predicted α_k", fontsize=11)
    if accs:
        ax = axes[0][1]
        for (key, a), style in zip(accs, ("s--", "^:"), strict=False):
            ys = [_num(x) for x in a["acc"]]
            ax.plot(range(1, len(ys) + 1), ys, style, label=f"{key}: {a.get('source', key)}", linewidth=2)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft step k (teacher-forced)")
        ax.set_ylabel("acc_k (unconditional)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        ax.set_title("Teacher-forced acc_k: flat with TTT, falling without", fontsize=11)
    fig.tight_layout()
    return png_data_uri(fig)


def _by_segment(rows, n_labels: int) -> list[list[float]]:
    """Values per segment. diagnose writes rows (one per round) × segments; a flat list is one value each."""
    if all(not isinstance(v, (list, tuple)) for v in rows):
        return [[_num(v)] for v in rows]
    rows = [list(r) if isinstance(r, (list, tuple)) else [r] for r in rows]
    width = max((len(r) for r in rows), default=0)
    if n_labels and width == n_labels:  # rows × segments → segments × rows
        return [[_num(r[j]) if j < len(r) else math.nan for r in rows] for j in range(width)]
    return [[_num(v) for v in r] for r in rows]


def norms_figure(norms: dict | None) -> str | None:
    """Per-segment norms, trace vs replay: bars when there is one value per segment, else lines."""
    if not norms or not norms.get("trace") or not norms.get("replay"):
        return None
    labels = list(norms.get("labels") or [])
    trace, replay = _by_segment(norms["trace"], len(labels)), _by_segment(norms["replay"], len(labels))
    n = max(len(trace), len(replay))
    if not n:
        return None
    labels += [f"segment {i}" for i in range(len(labels), n)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    if all(len(v) == 1 for v in trace + replay):
        xs = list(range(n))
        t = [v[0] for v in trace] + [math.nan] * (n - len(trace))
        r = [v[0] for v in replay] + [math.nan] * (n - len(replay))
        ax.bar([x - 0.2 for x in xs], t, 0.4, label="trace", color="#d9534f")
        ax.bar([x + 0.2 for x in xs], r, 0.4, label="golden replay", color="#4a90d9")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels[:n], fontsize=9)
    else:
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i in range(n):
            c = colors[i % len(colors)]
            if i < len(trace):
                ax.plot(range(len(trace[i])), trace[i], "-", color=c, label=f"{labels[i]} trace", linewidth=2)
            if i < len(replay):
                ax.plot(range(len(replay[i])), replay[i], "--", color=c, label=f"{labels[i]} replay", linewidth=1.5)
        ax.set_xlabel(norms.get("x_label", "round"))
    ax.set_ylabel("mean row norm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(norms.get("title", "Per-segment norms of target.aux: trace vs replay"), fontsize=11)
    return png_data_uri(fig)


def _stage_key(stage: str):

    return stage_rank(stage), stage


def divergence_figure(table: list[dict] | None) -> str | None:
    """Heat map of log10 relative error, stages (pipeline order) × rounds; mismatches outlined."""
    if not table:
        return None
    rows = [r for r in table if isinstance(r, dict) and "stage" in r]
    if not rows:
        return None
    stages = sorted({str(r["stage"]) for r in rows}, key=_stage_key)
    rounds = sorted({int(r.get("round") or 0) for r in rows})
    si = {s: i for i, s in enumerate(stages)}
    ri = {r: i for i, r in enumerate(rounds)}

    grid = np.full((len(stages), len(rounds)), np.nan)
    bad = np.zeros_like(grid, dtype=bool)
    for r in rows:
        i, j = si[str(r["stage"])], ri[int(r.get("round") or 0)]
        e = _num(r.get("rel_err"))
        grid[i, j] = math.log10(max(e, 1e-12)) if not math.isnan(e) else np.nan
        bad[i, j] |= r.get("match") is False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(min(2.5 + 0.5 * len(rounds), 11), 1.2 + 0.32 * len(stages)))
    im = ax.imshow(grid, aspect="auto", cmap="RdYlGn_r", vmin=-8, vmax=0, interpolation="nearest")
    for i, j in zip(*np.nonzero(bad), strict=True):
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.8))
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels(stages, fontsize=8)
    ax.set_xticks(range(len(rounds)))
    ax.set_xticklabels([str(r) for r in rounds], fontsize=8)
    ax.set_xlabel("round")
    fig.colorbar(im, ax=ax, label="log10 relative error")
    ax.set_title("Divergence map: trace vs golden replay (outlined = mismatch)", fontsize=11)
    return png_data_uri(fig)


def first_divergent_stage(ctx: dict) -> str | None:
    """ "stage (round r)" from diagnose's context["first_divergence"] (or a plain "first_divergent_stage")."""
    fd = ctx.get("first_divergence")
    if isinstance(fd, dict) and fd.get("stage"):
        return f"{fd['stage']} (round {fd.get('round')})"
    return ctx.get("first_divergent_stage")


# -- the page ---------------------------------------------------------------------------------------------------
def _rounded(x):
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def _evidence(ev) -> str:
    text = json.dumps(_rounded(ev), default=str, allow_nan=True)
    return text if len(text) <= 600 else text[:600] + " …"


def _safe(fn, *args) -> tuple[str | None, str | None]:
    # A plot that cannot be drawn (odd context, no matplotlib) must not lose the rest of the report.
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001
        return None, f"could not draw this figure ({type(e).__name__}: {e})"


def _figure(title: str, fn, arg, missing: str) -> dict:
    src, err = _safe(fn, arg)
    return {"title": title, "src": src, "missing": err or missing}


def _shown(xs, fmt: str) -> str:
    return " ".join("-" if math.isnan(_num(x)) else format(_num(x), fmt) for x in xs or []) or "-"


def _acceptance_rows(acc: dict) -> list[dict]:
    rows = []
    for key in ("served", "expected", "predicted", "training"):
        a = acc.get(key)
        if not a:
            continue
        tau = _num(a.get("accept_length"))
        shown = "-" if math.isnan(tau) else f"{tau:.2f}"
        if a.get("accept_length_interval"):
            lo, hi = a["accept_length_interval"]
            shown += f" [{lo:.2f}, {hi:.2f}]"
        rows.append(
            {
                "key": key,
                "source": a.get("source", ""),
                "tau": shown,
                "alpha": _shown(a.get("alpha"), ".2f"),
                "reached": _shown(a.get("reached"), ".0f"),
                "acc": _shown(a.get("acc"), ".2f"),
            }
        )
    return rows


def _checkpoint_rows(static: dict) -> list[tuple[str, str]]:
    rows = []
    taps = static.get("taps")
    if taps is not None:
        names = "; ".join(static.get("tap_names") or [])
        contract = static.get("contract") or {}
        # a contract read from no eaglescope section is the engines' reading of the config, not a record
        label = (
            f"INFERRED from the {contract.get('inferred_from') or 'engine default'} (config.json has no eaglescope"
            " section; the real training taps are unknown)"
            if contract.get("inferred")
            else "(recorded by training)"
        )
        rows.append(("taps", f"{taps} {names} {label}"))
    for eng, r in (static.get("engines") or {}).items():
        if isinstance(r, dict):
            rows.append((eng, f"captures {r.get('captures')} {'ok' if r.get('matches_contract') else 'MISMATCH'}"))
    rows += [(key, _evidence(static[key])) for key in ("vocab_map", "embedding") if key in static]
    return rows


def _findings_rows(findings: list[dict]) -> list[dict]:
    rows = []
    for f in findings:
        stage = f["stage"] or "-"
        if f.get("round") is not None:
            stage += f" (round {f['round']})"
        rows.append({**f, "stage": stage, "meaning": CODES.get(f["code"], ""), "evidence": _evidence(f["evidence"])})
    return rows


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{{ generator|safe }}
<title>{{ title }}</title><style>{{ css|safe }}</style></head><body>
<h1>{{ title }}</h1>
{% if inputs %}<p class="muted">{% for k, v in inputs %}{{ k }} <code>{{ v }}</code>{% if not loop.last %}, {% endif %}
{% endfor %}</p>{% endif %}
{% if healthy %}<div class="banner ok"><b>Healthy</b>: no findings.</div>
{% else %}{% set top = findings[0] %}<div class="banner bad"><b>{{ top.code }}</b> — {{ top.verdict }}
<br><span class="muted">fix: {{ top.fix }} · stage {{ top.stage }} · support: {{ top.support }}
· {{ findings|length }} finding(s)</span></div>{% endif %}
{% if findings %}<h2>Findings (most likely first)</h2><table><tr><th>#</th><th>code</th><th>stage</th>
<th>support</th><th>verdict</th><th>fix</th><th>evidence</th></tr>
{% for f in findings %}<tr><td>{{ loop.index }}</td><td><b>{{ f.code }}</b><br>
<span class='muted'>{{ f.meaning }}</span></td><td><code>{{ f.stage }}</code></td>
<td>{{ f.support }}</td><td>{{ f.verdict }}</td>
<td>{{ f.fix }}</td><td class='ev'>{{ f.evidence }}</td></tr>
{% endfor %}</table>{% endif %}
{% if acceptance %}<h2>Acceptance</h2><table><tr><th></th><th>source</th><th>τ [95%]</th><th>α_k</th>
<th>reached k</th><th>acc_k</th></tr>
{% for a in acceptance %}<tr><td>{{ a.key }}</td><td>{{ a.source }}</td><td>{{ a.tau }}</td>
<td><code>{{ a.alpha }}</code></td><td><code>{{ a.reached }}</code></td><td><code>{{ a.acc }}</code></td></tr>
{% endfor %}</table>{% endif %}
{% for fig in figures %}<h2>{{ fig.title }}</h2>
{% if fig.src %}<img alt="{{ fig.title }}" src="{{ fig.src }}">
{% else %}<p class="muted">{{ fig.missing }}</p>{% endif %}
{% endfor %}
{% if checkpoint %}<h2>Checkpoint</h2><table>
{% for k, v in checkpoint %}<tr><th>{{ k }}</th><td class='ev'>{{ v }}</td></tr>
{% endfor %}</table>{% endif %}
{% if notes %}<h2>Notes</h2><ul>{% for n in notes %}<li>{{ n }}</li>{% endfor %}</ul>{% endif %}
</body></html>
"""
_TEMPLATE = jinja2.Environment(autoescape=True).from_string(_PAGE)


def html_of(report: DoctorReport, title: str = "eaglescope doctor") -> str:
    d = report.to_dict()
    ctx = d.get("context") or {}
    fds = first_divergent_stage(ctx)
    no_trace = "no trace compared (pass --trace)"
    figures = [
        _figure(
            "Per-position acceptance",
            acceptance_figure,
            ctx.get("acceptance"),
            "no acceptance measured (pass --data or --engine-log)",
        ),
        _figure("Per-segment norms", norms_figure, ctx.get("segment_norms"), no_trace),
        _figure(
            "Divergence map by stage" + (f" — first divergent stage: {fds}" if fds else ""),
            divergence_figure,
            ctx.get("stage_table"),
            no_trace,
        ),
    ]
    inputs = [(k, v) for k, v in (ctx.get("inputs") or {}).items() if v not in (None, [], "")]
    return _TEMPLATE.render(
        generator=GENERATOR,
        css=_CSS,
        title=title,
        inputs=inputs,
        healthy=report.healthy,
        findings=_findings_rows(d["findings"]),
        acceptance=_acceptance_rows(ctx.get("acceptance") or {}),
        figures=figures,
        checkpoint=_checkpoint_rows(ctx.get("static") or {}),
        notes=ctx.get("notes") or [],
    )


def write_html(report: DoctorReport, path: str | os.PathLike) -> Path:
    """Write the report atomically (a temp file beside it, then a rename); only ever over an earlier report."""
    check_destination(path, REPORT, flag="--html")
    return write_file(path, html_of(report))
