"""Training speed and memory (docs/training-speed.md): the model FLOPs that `train` reports against what torch's
FlopCounterMode counts over a real run, the chunked soft cross-entropy against the dense one it replaced (loss,
gradients, held-out acc_k of a trained draft), what the loss keeps for the backward, and bench/train_speed.py
--smoke."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from eaglescope.cli import main
from eaglescope.data.shards import PreparedData
from eaglescope.train import loop as train_loop
from eaglescope.train import ttt
from eaglescope.train.loop import TrainConfig, split_indices, train
from eaglescope.train.speed import FlopModel, format_speed, peak_bf16_flops
from eaglescope.train.ttt import STEP_WEIGHT, Teacher, TTTLoss, draft_vocab_ids, shift_left, teacher_of, ttt_unroll

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import train_speed  # noqa: E402  (bench/train_speed.py: the synthetic prepared data and the smoke run)


# -- the dense soft cross-entropy the chunked one replaced in train/ttt.py, as the reference ------------------------
def dense_ttt_loss(draft, unrolled, teacher, loss_mask, valid=None, per_sample=False, doc=None) -> TTTLoss:
    assert doc is None  # the reference is of padded batches (packed ones: tests/test_train_pack.py)
    vocab_ids = draft_vocab_ids(draft)
    if isinstance(teacher, torch.Tensor):
        teacher = teacher_of(vocab_ids, teacher)
    target_argmax = teacher.argmax
    in_vocab = draft.t2d[target_argmax]
    p_all = torch.softmax(teacher.logits.float(), dim=-1)
    mask = loss_mask.bool()
    if valid is not None:
        mask = mask & valid.bool()
    total = torch.zeros(())
    step_loss, step_acc, step_count = [], [], []
    for k, logits in enumerate(unrolled.logits):
        p = shift_left(p_all, k + 1)
        supervised = shift_left(mask, k + 2, False)
        trainable = supervised & shift_left(in_vocab, k + 1, False)
        ce = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        if per_sample:
            lk = ((ce * trainable).sum(-1) / trainable.sum(-1).clamp_min(1)).mean()
        else:
            lk = (ce * trainable).sum() / trainable.sum().clamp_min(1)
        total = total + (STEP_WEIGHT**k) * lk
        hit = (vocab_ids[logits.argmax(-1)] == shift_left(target_argmax, k + 1)) & supervised
        ns = int(supervised.sum())
        step_loss.append(float(lk.detach()))
        step_acc.append(float(hit.sum()) / ns if ns else float("nan"))
        step_count.append(ns)
    return TTTLoss(total, step_loss, step_acc, step_count)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("speed") / "target", seed=5)


@pytest.mark.parametrize("per_sample", [False, True])
def test_chunked_loss_equals_the_dense_one_in_value_and_gradients(tiny, monkeypatch, per_sample):
    # 7 rows per chunk: chunks end inside samples and across them, and the teacher row k+1 later crosses a chunk edge
    monkeypatch.setattr(ttt, "CHUNK_ELEMENTS", 7 * 40)
    draft, _ = make_draft(tiny, draft_vocab_size=40, seed=2)
    draft.train()
    g = torch.Generator().manual_seed(0)
    B, T, K = 3, 11, 4
    ids = torch.randint(0, 96, (B, T), generator=g)
    aux = torch.randn(B, T, draft.fc.in_features, generator=g)
    target_logits = 3 * torch.randn(B, T, 96, generator=g)
    target_logits[0, 5, int((~draft.t2d).nonzero()[0])] = 30.0  # a teacher whose argmax the draft cannot emit
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).long()
    valid = torch.ones(B, T, dtype=torch.long)
    valid[2, 8:] = 0  # padding
    results = {}
    for name, fn in (("chunked", ttt.ttt_loss), ("dense", dense_ttt_loss)):
        draft.zero_grad()
        res = fn(draft, ttt_unroll(draft, ids, aux, K), target_logits, loss_mask, valid, per_sample=per_sample)
        res.loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        results[name] = (res, grads)
    (a, ga), (b, gb) = results["chunked"], results["dense"]
    assert float(a.loss.detach()) == pytest.approx(float(b.loss.detach()), rel=1e-6)
    assert a.step_loss == pytest.approx(b.step_loss, rel=1e-6)
    assert a.step_acc == b.step_acc and a.step_count == b.step_count
    assert ga.keys() == gb.keys() and "lm_head.weight" in ga and "fc.weight" in ga
    for n in ga:
        scale = gb[n].abs().max()
        assert scale > 0, n
        torch.testing.assert_close(ga[n], gb[n], rtol=0, atol=1e-5 * float(scale), msg=n)


def saved_bytes(fn, draft, T: int, K: int) -> int:
    """Bytes the loss keeps for the backward beyond the draft logits and the teacher (which the step holds anyway)."""
    torch.manual_seed(0)
    ids, aux = torch.randint(0, 96, (1, T)), torch.randn(1, T, draft.fc.in_features)
    unrolled = ttt_unroll(draft, ids, aux, K)
    teacher = teacher_of(draft_vocab_ids(draft), torch.randn(1, T, 96))
    held = {x.untyped_storage().data_ptr() for x in [*unrolled.logits, teacher.logits]}
    seen: dict[int, int] = {}

    def pack(x):
        s = x.untyped_storage()
        if s.data_ptr() not in held:
            seen[s.data_ptr()] = s.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(draft, unrolled, teacher, torch.ones(1, T, dtype=torch.long))
    return sum(seen.values())


def test_the_loss_keeps_nothing_vocabulary_sized_for_the_backward(tiny):
    draft, _ = make_draft(tiny, draft_vocab_size=80, seed=1)
    T, K, Vd = 64, 7, 80
    dense, chunked = saved_bytes(dense_ttt_loss, draft, T, K), saved_bytes(ttt.ttt_loss, draft, T, K)
    # the dense form keeps log q and the shifted p in float32 per step: 2 × 4 bytes × Vd per position
    assert dense >= K * T * Vd * 4 * 2
    # the chunked one: only [T]-sized weights per step
    assert chunked <= K * T * 4 * 2, chunked


def sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def sdpa_cpu_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kw) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def test_model_flops_per_token_match_flopcountermode_over_a_real_training_step(tiny, tmp_path):
    """One optimizer step of `train` (4 samples) plus its final evaluation (2 held-out samples), under torch's
    FlopCounterMode: its matmul FLOPs equal the formula's linear parts exactly, and its attention FLOPs (SDPA runs
    the whole rectangle, masked pairs included) equal the formula's allowed pairs scaled to the rectangles."""
    n, K, Vd = 24, 3, 48
    data = train_speed.write_prepared(tmp_path / "data", tiny, num_samples=6, length=n, draft_vocab=Vd)
    train_idx, eval_idx = split_indices(6, 1 / 3)
    assert (len(train_idx), len(eval_idx)) == (4, 2)
    cfg = TrainConfig(target=str(tiny), data=str(data), out=str(tmp_path / "draft"), ttt_length=K, max_steps=1,
                      batch_size=4, eval_fraction=1 / 3, max_length=n, device="cpu", dtype="float32")  # fmt: skip
    aten = torch.ops.aten
    ops = {
        aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_backward_flops,
    }
    with FlopCounterMode(display=False, custom_mapping=ops) as counter:
        res = train(cfg, progress=False)
    counts = counter.get_flop_counts()["Global"]
    sdpa = sum(v for op, v in counts.items() if "attention" in str(op))
    matmul = counter.get_total_flops() - sdpa
    assert matmul > 0 and sdpa > 0

    from eaglescope.models.draft import load_draft
    from eaglescope.models.targets import load_target

    target = load_target(tiny, device="cpu", dtype=torch.float32)
    model = FlopModel.of(target, json.loads((tiny / "config.json").read_text()), load_draft(tmp_path / "draft").model,
                         K, online=True)  # fmt: skip
    p = model.parts(n)
    # linear products: the training samples forward and backward, the held-out ones forward only (evaluation)
    train_linear = p["target_linear"] + p["draft_forward"] + p["draft_backward"] - 3 * p["draft_attention"]
    eval_linear = p["target_linear"] + p["draft_linear"]
    assert matmul == 4 * train_linear + 2 * eval_linear
    # attention as executed: the target's causal T×T square per layer, the draft's step k a T×(k+1)T rectangle
    causal = n * (n + 1) // 2
    target_rect = p["target_attention"] // causal * n * n
    draft_pairs = sum(causal + k * n for k in range(K))
    draft_rect = p["draft_attention"] // draft_pairs * sum((k + 1) * n * n for k in range(K))
    assert p["target_attention"] % causal == 0 and p["draft_attention"] % draft_pairs == 0
    # torch counts the backward as flash kernels run it, the scores recomputed: 5 products to the forward's 2. The
    # model FLOPs count 2 (no recomputation): model["draft_backward"] holds 2 × the draft's attention.
    assert sdpa == 4 * (target_rect + (1 + 2.5) * draft_rect) + 2 * (target_rect + draft_rect)

    # what train reported: the one step's tokens and FLOPs per token
    speed = res.metrics["speed"]
    assert speed["tokens"] == 4 * n and speed["timed_steps"] == 1
    assert speed["model_flops_per_token"] == pytest.approx(p["total"] / n, rel=1e-12)
    assert p["total"] == p["target_linear"] + p["target_attention"] + p["draft_forward"] + p["draft_backward"]
    assert speed["tokens_per_second"] == pytest.approx(speed["tokens"] / speed["seconds"])
    assert speed["model_flops_per_second"] == pytest.approx(speed["model_flops_per_token"] * speed["tokens_per_second"])
    assert speed["fraction_of_peak"] is None and speed["device"] == "cpu"
    assert speed["peak_memory_bytes"] > 10 * 2**20
    saved = json.loads((tmp_path / "draft" / "training_metrics.json").read_text())
    assert saved["speed"] == speed


def test_the_8b_shape_counts_what_docs_training_speed_gives(monkeypatch):
    """docs/training-speed.md's worked example: the formula at Llama-3.1-8B shape, its draft on the meta device."""
    from eaglescope.models.draft import Eagle3Draft
    from eaglescope.models.drafts import DraftConfig
    from eaglescope.models.targets.base import TargetFingerprint
    from eaglescope.models.targets.llama import LlamaArgs, LlamaModel
    from eaglescope.taps import TapContract

    cfg = {"model_type": "llama", **train_speed.LLAMA_8B}
    with torch.device("meta"):
        body = LlamaModel(LlamaArgs.from_hf_config(cfg))
        draft = Eagle3Draft(DraftConfig.for_target(cfg, TapContract.default(32), 32000))

    class Target:
        model = body
        fingerprint = TargetFingerprint("LlamaForCausalLM", 32, 4096, 128256)

    p = FlopModel.of(Target, cfg, draft, 7, online=True).parts(2048)
    H, I, V, L, d = 4096, 14336, 128256, 32, 128
    layer = H * 32 * d + 2 * H * 8 * d + 32 * d * H + 3 * H * I
    assert p["target_linear"] == 2 * 2048 * (L * layer + H * V)
    draft_layer = 2 * H * 32 * d + 2 * (2 * H * 8 * d) + 32 * d * H + 3 * H * I
    assert p["draft_linear"] == 2 * 2048 * (3 * H * H + 7 * (draft_layer + H * 32000))
    doc = (Path(__file__).parents[1] / "docs" / "training-speed.md").read_text()
    for key in ("target_linear", "target_attention", "draft_forward", "draft_backward", "total"):
        assert f"{p[key] / 2048 / 1e9:.2f}" in doc, (key, f"{p[key] / 2048 / 1e9:.2f}")
    # and the memory the draft's backward keeps per token, as tests/test_train_ddp.py measures it on the meta device
    from test_train_ddp import saved_per_token

    per_token = saved_per_token(draft, 2048, 7, monkeypatch)
    row = " | ".join(f"{b / 1e6:.2f}" for b in [*per_token.values(), sum(per_token.values())])
    assert f"| Llama-3.1-8B shape, draft vocabulary 32,000 | {row} |" in doc, row
    trainable = sum(q.numel() for q in draft.parameters() if q.requires_grad)
    assert f"{trainable / 1e6:.1f} M trainable" in doc


def test_peak_table_names_the_hopper_parts_and_nothing_for_the_cpu(monkeypatch):
    assert peak_bf16_flops(torch.device("cpu")) == ("cpu", None)
    names = (("NVIDIA H200", 989), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
             ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA H200 NVL", 835), ("Some Future GPU", None))  # fmt: skip
    for name, tflops in names:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d, n=name: n)
        assert peak_bf16_flops(torch.device("cuda", 0)) == (name, None if tflops is None else tflops * 1e12)


def test_the_closing_line_says_what_it_measured():
    speed = {"tokens_per_second": 12345.6, "timed_steps": 5, "steps_left_out": 1, "model_flops_per_token": 3.2e10,
             "fraction_of_peak": 0.4, "device": "NVIDIA H200", "peak_memory_bytes": 63.5e9,
             "peak_memory_kind": "torch.cuda.max_memory_allocated"}  # fmt: skip
    line = format_speed(speed)
    assert line.startswith("12,346 tokens/s over 5 step(s) (the first left out); 32 GFLOP/token")
    assert "40.0% of the NVIDIA H200's dense bf16 peak" in line and "peak memory 63.50 GB" in line
    speed |= {"fraction_of_peak": None, "device": "NVIDIA Some GPU"}
    assert "fraction of peak: none (no dense bf16 peak known for NVIDIA Some GPU)" in format_speed(speed)
    assert "model FLOPs not counted (a mixture-of-experts target)" in format_speed(
        speed | {"model_flops_per_token": None}
    )
    assert format_speed(speed | {"tokens_per_second": None}).startswith("no optimizer step ran in this process; peak")


def test_train_cli_ends_with_the_speed_line_and_writes_it_to_the_metrics(tiny, tmp_path, capsys):
    data = train_speed.write_prepared(tmp_path / "data", tiny, num_samples=5, length=16, draft_vocab=48)
    out = tmp_path / "draft"
    argv = ["train", "--target", str(tiny), "--data", str(data), "--out", str(out), "--max-steps", "3",
            "--batch-size", "2", "--ttt-length", "2", "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err.strip().splitlines()
    speed = json.loads((out / "training_metrics.json").read_text())["speed"]
    assert err[-1] == f"eaglescope train: {format_speed(speed)}"
    assert speed["timed_steps"] == 2 and speed["steps_left_out"] == 1 and speed["tokens"] == 2 * 2 * 16
    assert math.isfinite(speed["tokens_per_second"]) and speed["tokens_per_second"] > 0


def test_same_seed_same_heldout_acc_with_the_dense_loss(tmp_path_factory, tmp_path, monkeypatch):
    """The order-2 chain run of tests/test_train.py (TTT 7, 150 steps), trained with the chunked loss and again with
    the dense one: the same held-out acc_k and α_k, and the loss curve to float32 noise."""
    from test_train import STEPS, TTT, config, shared_env

    env = shared_env(tmp_path_factory)
    runs = {}
    for name in ("chunked", "dense"):
        if name == "dense":
            monkeypatch.setattr(train_loop, "ttt_loss", dense_ttt_loss)
        runs[name] = train(config(env, tmp_path / name, ttt_length=TTT, max_steps=STEPS), progress=False)
    a, b = runs["chunked"], runs["dense"]
    assert a.metrics["acc"] == pytest.approx(b.metrics["acc"], abs=1e-9)
    assert a.metrics["alpha"] == pytest.approx(b.metrics["alpha"], abs=1e-9)
    assert a.metrics["acc"][0] > 0.8  # a trained draft, not two untrained ones agreeing
    losses = [(x["loss"], y["loss"]) for x, y in zip(a.history, b.history, strict=True)]
    assert max(abs(x - y) / y for x, y in losses) < 1e-4


def test_bench_train_speed_smoke_runs_the_product_and_reports_each_batch_size(tmp_path, capsys):
    # eager (--no-compile): inductor on this CPU would add half a minute a run; tests/test_train_compiled.py checks it
    assert train_speed.main(["--smoke", "--out", str(tmp_path), "--batch-sizes", "1,2", "--steps", "2", "--no-compile",
                             "--length", "32", "--work", str(tmp_path / "work"), "--profile"]) == 0  # fmt: skip
    (path,) = tmp_path.glob("train-speed-*-smoke.json")
    result = json.loads(path.read_text())
    # --profile: two steps of one more run under torch.profiler, every op with its calls and self time, costliest
    # first. Not which op ranks first: at this size per-call overhead decides that, and it moves with the machine's
    # load (one CI run ranked aten::as_strided above aten::mm).
    profile = result["profile"]
    assert profile["profiled_steps"] == 2 and profile["sorted_by"] == "self_cpu_time_total"
    times = [r["self_ms_per_step"] for r in profile["ops"]]
    assert times == sorted(times, reverse=True)
    mm = next(r for r in profile["ops"] if r["op"] == "aten::mm")
    # each step runs the same unroll, so both profiled steps made the same number of products
    assert mm["calls_per_step"] == int(mm["calls_per_step"]) > 0 and mm["self_ms_per_step"] > 0
    table = path.with_name(path.stem + "-profile.txt").read_text().splitlines()
    first = table[3][: table[2].index("  ")].strip().removesuffix("...")  # the name column, perhaps cut short
    assert first and profile["ops"][0]["op"].startswith(first)  # the table sorted as the JSON
    assert result["commit"] and [r["batch_size"] for r in result["runs"]] == [1, 2]
    assert [r["compiled"] for r in result["runs"]] == [False, False] and result["profile"]["compiled"] is False
    for r in result["runs"]:
        assert r["rc"] == 0, r["stderr_tail"]
        s = r["speed"]
        assert s["tokens"] == r["batch_size"] * 32 and s["timed_steps"] == 1  # 2 steps, the first left out
        assert r["tokens_per_second"] == s["tokens_per_second"] > 0
        assert r["fraction_of_peak"] is None and r["peak_memory_gb"] == s["peak_memory_bytes"] / 1e9 > 0
        assert r["closing_line"] == f"eaglescope train: {format_speed(s)}"
    # both runs trained the same model on the same samples: one FLOP count per token
    a, b = (r["model_flops_per_token"] for r in result["runs"])
    assert a == pytest.approx(b, rel=1e-12)
    assert PreparedData.open(tmp_path / "work" / "data").num_samples == 2 * 2 + 2


def test_teacher_from_the_head_in_chunks_equals_the_full_logits(tiny, monkeypatch):
    from eaglescope.models.targets import load_target

    monkeypatch.setattr(ttt, "CHUNK_ELEMENTS", 5 * 96)  # 5 rows a loss chunk, 20 a head chunk: 2 of 26 rows
    target = load_target(tiny, device="cpu", dtype=torch.float32, taps="default")
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    full = target.hidden_states(ids)
    lean = target.hidden_states(ids, logits=False)
    assert lean.logits is None
    vocab_ids = torch.randperm(96, generator=torch.Generator().manual_seed(2))[:40].sort().values
    a = ttt.teacher_from_head(target.head, lean.final_hidden, vocab_ids, 96)
    b = teacher_of(vocab_ids, full.logits)
    assert isinstance(a, Teacher) and not a.logits.is_inference()
    torch.testing.assert_close(a.logits, b.logits)
    assert torch.equal(a.argmax, b.argmax)
