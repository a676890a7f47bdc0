"""The user's commands on a GPU, with the defaults a user gets there (the static-shape decoder, bf16): generate
(default, --reference, --trace full and fingerprint), replay, doctor on clean traces and on the CPU suite's trace
mutations, bench. A tiny random Llama (head_dim 64, so the batch-invariant kernels run) and a random draft."""

from __future__ import annotations

import json

import pytest
import torch
from drafts import make_draft
from faults import aux_of_round, edit_trace, permute_segments
from models import make_checkpoint

from eaglescope import trace as T
from eaglescope.detective.diagnose.evidence import PRECISION_16
from eaglescope.detective.replay import replay_hs
from eaglescope.models.draft import save_draft

PROMPT = [(i * 7919) % 500 + 3 for i in range(24)]
NEW = 32
SHAPES = {"chain": ["--chain", "3"], "tree": ["--tree", "3,2,6"]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-commands")
    target = make_checkpoint("llama", root / "target", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)  # fmt: skip
    draft, contract = make_draft(target, draft_vocab_size=128)
    save_draft(draft, contract, root / "draft")
    return root, target, root / "draft"


def generate(cli, target, *extra) -> dict:
    rc, out, err = cli("generate", "--target", target, "--prompt-ids", ",".join(map(str, PROMPT)),
                       "--max-new-tokens", NEW, "--json", *extra)  # fmt: skip
    assert rc == 0, err
    assert len(out["token_ids"]) == NEW
    return out | {"stderr": err}


@pytest.fixture(scope="module")
def traces(models, run_cli):
    """generate --trace on each backend and mode (tree 3,2,6) → {(backend, mode): trace dir}."""
    root, target, draft = models
    out = {}
    for backend, flags in (("default", []), ("reference", ["--reference"])):
        for mode in ("full", "fingerprint"):
            out[backend, mode] = path = root / f"trace-{backend}-{mode}"
            assert run_cli("generate", "--target", target, "--draft", draft, *SHAPES["tree"], "--prompt-ids",
                           ",".join(map(str, PROMPT)), "--max-new-tokens", NEW, "--trace", path, "--trace-mode",
                           mode, "--json", *flags) == 0  # fmt: skip
    return out


# The default decoder runs the target on batch-invariant kernels: a verify's rows are computed as one-token steps
# compute them, so speculation is lossless bit for bit in bf16. The reference decoder's cuBLAS products round
# differently for different row counts, which in bf16 can break a near-tie the other way: it is held to it in float32.
@pytest.mark.parametrize(
    "backend",
    [[], ["--compile"], ["--reference", "--dtype", "float32"]],
    ids=["default", "default-compiled", "reference-float32"],
)
def test_speculative_output_is_vanilla_greedy_on_each_backend(cli, models, backend):
    _, target, draft = models
    vanilla = generate(cli, target, *backend)
    for shape in SHAPES.values():
        spec = generate(cli, target, "--draft", draft, *shape, *backend)
        assert spec["token_ids"] == vanilla["token_ids"], shape
        assert spec["stats"]["rounds"] >= 1
        assert "compiled EAGLE-3 round failed" not in spec["stderr"]  # --compile ran compiled, not its fallback
    if "--reference" not in backend:  # the static-shape decoder is the default on a GPU: nothing says it fell back
        assert "reference decoder" not in spec["stderr"]


def test_both_backends_give_the_same_tokens_in_float32(cli, models):
    # bf16 kernels differ between the backends (batch-invariant against cuBLAS), so a near-tie may break either way
    # there; in float32 the margins of this target are far above the rounding of either
    _, target, draft = models
    ref = generate(cli, target, "--dtype", "float32", "--reference")
    assert generate(cli, target, "--dtype", "float32")["token_ids"] == ref["token_ids"]
    fast_tree = generate(cli, target, "--dtype", "float32", "--draft", draft, *SHAPES["tree"])
    assert fast_tree["token_ids"] == ref["token_ids"]


@pytest.mark.parametrize("backend", ["default", "reference"])
@pytest.mark.parametrize("mode", ["full", "fingerprint"])
def test_trace_is_written_with_every_stage_of_every_round(traces, backend, mode):
    tr = T.load_trace(traces[backend, mode])
    assert tr.mode == mode
    assert tr.meta["prompt_ids"] == PROMPT
    rounds = tr.rounds()
    assert rounds[0] == 0 and len(rounds) >= 3
    for r in rounds[1:]:
        stages = {e.stage for e in tr.events if e.round == r}
        need = {T.TARGET_AUX, T.DRAFT_FC_OUT, T.draft_hidden_out(0), T.draft_topk(2), T.VERIFY_ACCEPTED}
        assert need <= stages, (r, need - stages)
    kinds = {e.kind for e in tr.events if e.dtype.startswith(("float", "bfloat")) and e.part != T.TOPK_LOGPROBS}
    assert kinds == {"full" if mode == "full" else "fingerprint"}
    aux = next(e for e in tr.events if e.stage == T.TARGET_AUX)
    assert aux.dtype == "bfloat16" and aux.shape[-1] == 3 * 256  # the GPU default dtype, three taps


def test_fast_and_reference_traces_hold_the_same_stages(traces):
    fast, ref = T.load_trace(traces["default", "full"]), T.load_trace(traces["reference", "full"])
    assert [(e.round, e.stage, e.part) for e in fast.events] == [(e.round, e.stage, e.part) for e in ref.events]


def test_replay_writes_the_golden_trace_of_a_gpu_trace(cli, models, traces, tmp_path):
    _, target, draft = models
    src = traces["default", "full"]
    rc, _, err = cli("replay", "--target", target, "--draft", draft, "--trace", src, "--out", tmp_path / "golden")
    assert rc == 0, err
    gold, tr = T.load_trace(tmp_path / "golden"), T.load_trace(src)
    assert gold.producer == "eaglescope-replay" and gold.rounds() == tr.rounds()
    assert {replay_hs(i) for i in range(8)} <= set(gold.stages())
    for r in tr.rounds():
        assert torch.equal(gold.get(T.VERIFY_BONUS, r), tr.get(T.VERIFY_BONUS, r))  # it followed the trace
        a, b = tr.get(T.TARGET_AUX, r).double(), gold.get(T.TARGET_AUX, r).double()
        rel = float((a - b).norm() / b.norm())
        assert rel < PRECISION_16.rel, (r, rel)  # the bf16 run against the float32 replay: rounding only
    assert float((a - b).norm() / b.norm()) > 1e-4  # and it did compare a bf16 run, not the replay with itself


@pytest.mark.parametrize("backend", ["default", "reference"])
@pytest.mark.parametrize("mode", ["full", "fingerprint"])
def test_doctor_calls_a_clean_gpu_trace_healthy(cli, models, traces, backend, mode):
    _, target, draft = models
    rc, report, top = cli.doctor(target, draft, traces[backend, mode])
    assert (rc, top) == (0, None), report["findings"][:1]
    table = report["context"]["stage_table"]
    assert len({(r["round"], r["stage"]) for r in table}) > 50  # every round's stages were compared


@pytest.mark.parametrize(
    "edits,expected",
    [
        ({(T.TARGET_AUX, 0): permute_segments([0, 2, 1])}, ("TAP_ORDER", T.TARGET_AUX, 0)),
        ({(T.TARGET_AUX, 2): permute_segments([1, 0, 2])}, ("TAP_ORDER", T.TARGET_AUX, 2)),
        (aux_of_round(2), ("STALE_ACCEPTED", T.NEXT_HIDDEN_IN, 2)),
    ],
    ids=["aux-permuted-round0", "aux-permuted-round2", "every-row-handed-on-round2"],
)
def test_doctor_names_a_mutated_gpu_trace(cli, models, traces, tmp_path, edits, expected):
    _, target, draft = models
    bad = edit_trace(traces["default", "full"], tmp_path / "bad", edits)
    rc, report, top = cli.doctor(target, draft, bad)
    assert (rc, top) == (1, expected), report["findings"][:1]


@pytest.mark.parametrize("compile", [False, True], ids=["plain", "compiled"])
def test_bench_methods_equal_vanilla_greedy(cli, models, tmp_path, compile):
    _, target, draft = models
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": PROMPT[i:]}) + "\n" for i in (0, 4, 8)))
    rc, out, err = cli("bench", "--target", target, "--draft", draft, "--prompts", prompts, "--max-new-tokens", 24,
                       "--method", "vanilla", "--method", "chain=3", "--method", "tree=3,2,6", "--json",
                       *(["--compile"] if compile else []))  # fmt: skip
    assert rc == 0, err  # 0: every method's output equals vanilla greedy's
    assert out["all_identical"] is True and out["device"].startswith("cuda")
    assert [r["method"] for r in out["rows"]] == ["vanilla", "chain=3", "tree=3,2,6"]
    assert all(r["identical_to_vanilla"] == 3 and r["backend"] == "fast" for r in out["rows"]), out["rows"]
    assert [r["compiled_round"] for r in out["rows"]] == [False, compile, compile]  # vanilla has no round to compile


def test_a_bad_tuning_file_is_one_error_line_where_the_fused_kernels_read_it(cli, models, tmp_path, monkeypatch):
    """--no-batch-invariant verifies on the fused kernels, which read $EAGLESCOPE_TUNING (fast/tuning.py): a file
    they cannot use is the one error line naming it, exit 2, and nothing on stdout."""
    _, target, draft = models
    bad = tmp_path / "tuning.json"
    bad.write_text(json.dumps({"verify": [{"max_rows": 8, "blocks": {"o": [64, 64, 4]}}]}))
    monkeypatch.setenv("EAGLESCOPE_TUNING", str(bad))
    rc, out, err = cli("generate", "--target", target, "--draft", draft, *SHAPES["tree"], "--prompt-ids",
                       ",".join(map(str, PROMPT)), "--max-new-tokens", NEW, "--no-batch-invariant")  # fmt: skip
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [f"eaglescope: error: tuning file {bad}: verify entry 0: blocks of o is 4 or 5 "
                                        "positive integers, not [64, 64, 4]"]  # fmt: skip
