"""doctor's replay attends the draft tree as the traced engine did, as the trace's meta says (draft_tree_attention):
each node its ancestors (EAGLE-2's tree; the default, so older traces and eaglescope's and vLLM's replay as before), or
each top-k column its own earlier rows (SGLang's layout). A trace decoded under one convention replays healthy under
it and diverges under the other at draft.step2.hidden_out, on exactly the rows whose parent sits in another column; a
chain is the same under both. The column decoder here is eaglescope's own proposer under that convention, so this
shows the replay's plumbing; that SGLang attends so is shown on SGLang's own traces
(tests/sglang/test_sglang_code_faults.py test_the_replay_follows_sglangs_column_attention)."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from drafts import make_draft
from faults import Setup, record
from models import make_checkpoint

from eaglescope import trace as T
from eaglescope.cli import main
from eaglescope.decode.speculative import Eagle3Proposer
from eaglescope.detective.diagnose import diagnose_trace
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import save_draft
from eaglescope.models.targets import load_target

PROMPT = list(range(5, 15))
TREE, CHAIN = (3, 2, 6), (3, 1, 4)  # a tree of depth 3, top-k 2: SGLang's shape in tests/sglang
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    root = tmp_path_factory.mktemp("tree-attention")
    ckpt = make_checkpoint("llama", root / "target", seed=0)
    draft, contract = make_draft(ckpt, draft_vocab_size=48, scale=1.0, seed=3)
    save_draft(draft, contract, root / "draft")
    return Setup(load_target(ckpt, device="cpu"), root / "draft", root, PROMPT, ckpt)


def with_convention(src: Path, dst: Path, attention: str | None) -> Path:
    """A copy of trace `src` whose meta names `attention` (None: no key, as an older trace)."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / T.MANIFEST).read_text())
    manifest["meta"].pop(T.DRAFT_TREE_ATTENTION, None)
    if attention is not None:
        manifest["meta"][T.DRAFT_TREE_ATTENTION] = attention
    (dst / T.MANIFEST).write_text(json.dumps(manifest))
    return dst


def crossing_rows(trace_dir: Path, rnd: int) -> list[int]:
    """The step-2 rows of round `rnd` whose parent (the step-1 row whose output they read) is another row."""
    t = T.load_trace(trace_dir)
    h_in, h_out = t.get(T.draft_hidden_in(2), rnd), t.get(T.draft_hidden_out(1), rnd)
    parents = [next(p for p in range(h_out.shape[0]) if torch.equal(h_in[r], h_out[p])) for r in range(h_in.shape[0])]
    return [r for r, p in enumerate(parents) if p != r]


def findings(setup: Setup, trace_dir: Path) -> list:
    return diagnose_trace(setup.target, setup.draft(), trace_dir)[0]


def diverges_on_crossing_rows(setup: Setup, trace_dir: Path) -> None:
    found = findings(setup, trace_dir)
    assert [(f.code, f.stage) for f in found] == [("DIVERGENCE_UNEXPLAINED", T.draft_hidden_out(2))], found
    rows = crossing_rows(trace_dir, found[0].round)
    assert rows and found[0].evidence["rows"] == rows


@pytest.fixture(scope="module")
def traces(setup, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tree-attention-traces")
    column = partial(Eagle3Proposer, tree_attention=T.TREE_COLUMN)
    return {
        "ancestors": record(setup, root / "ancestors", shape=TREE, max_new_tokens=NEW_TOKENS)[0],
        "column": record(setup, root / "column", proposer_cls=column, shape=TREE, max_new_tokens=NEW_TOKENS)[0],
        "chain": record(setup, root / "chain", shape=CHAIN, max_new_tokens=NEW_TOKENS)[0],
    }


def test_a_column_tree_replays_healthy_under_its_convention_only(setup, traces, tmp_path):
    assert findings(setup, with_convention(traces["column"], tmp_path / "column", T.TREE_COLUMN)) == []
    diverges_on_crossing_rows(setup, with_convention(traces["column"], tmp_path / "as-old", None))


def test_an_ancestors_tree_replays_as_before_and_diverges_under_the_column_convention(setup, traces, tmp_path):
    assert T.DRAFT_TREE_ATTENTION not in T.load_trace(traces["ancestors"]).meta  # eaglescope's own: the default
    assert findings(setup, traces["ancestors"]) == []
    assert findings(setup, with_convention(traces["ancestors"], tmp_path / "named", T.TREE_ANCESTORS)) == []
    diverges_on_crossing_rows(setup, with_convention(traces["ancestors"], tmp_path / "column", T.TREE_COLUMN))


def test_a_chain_is_the_same_under_both_conventions(setup, traces, tmp_path):
    assert findings(setup, traces["chain"]) == []
    assert findings(setup, with_convention(traces["chain"], tmp_path / "column", T.TREE_COLUMN)) == []


def test_an_unknown_convention_is_refused_in_one_line(setup, traces, tmp_path):
    odd = with_convention(traces["chain"], tmp_path / "odd", "siblings")
    with pytest.raises(EagleScopeError, match="draft_tree_attention must be one of ancestors, column, got 'siblings'"):
        findings(setup, odd)


def test_doctor_says_it_followed_the_column_layout_without_a_finding(setup, traces, tmp_path, capsys):
    trace = with_convention(traces["column"], tmp_path / "column", T.TREE_COLUMN)
    capsys.readouterr()
    rc = main(["doctor", "--target", str(setup.target_dir), "--draft", str(setup.draft_dir), "--trace", str(trace),
               "--json"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert (rc, report["healthy"]) == (0, True), report["findings"]
    assert any("top-k column" in n and "not a fault of the draft" in n for n in report["context"]["notes"])
    capsys.readouterr()
    assert main(["doctor", "--target", str(setup.target_dir), "--draft", str(setup.draft_dir), "--trace",
                 str(traces["ancestors"]), "--json"]) == 0  # fmt: skip
    assert not any("top-k column" in n for n in json.loads(capsys.readouterr().out)["context"]["notes"])
