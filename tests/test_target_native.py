"""The native Llama-family path matches transformers on the same checkpoint (logits and every tap)."""

from __future__ import annotations

import json

import pytest
import torch
from models import load_hf, make_checkpoint

from eaglescope.decode.vanilla import generate_vanilla
from eaglescope.errors import EagleScopeError
from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
ALL_TAPS = None  # filled per model: every valid tap index


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def all_taps(target) -> TapContract:
    return TapContract(tuple(range(target.num_layers)), target.num_layers)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    family = request.param
    extra = {}
    if family == "llama":
        extra["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    d = make_checkpoint(family, tmp_path_factory.mktemp(family), seed=FAMILIES.index(family), **extra)
    hf = load_hf(d)
    target = load_target(d, device="cpu", dtype=torch.float32)
    target.set_taps(all_taps(target))
    return family, hf, target


def hf_run(hf, ids: list[int]):
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states


def check_taps(aux: torch.Tensor, hidden_states, rows: slice | list[int], H: int) -> None:
    for j, hs in enumerate(hidden_states[:-1]):  # the last entry is the final normed state: never a tap
        assert rel_err(aux[:, j * H : (j + 1) * H], hs[0][rows]) <= 1e-4, f"tap {j}"


def test_prefill_matches_transformers(pair):
    _, hf, target = pair
    ids = torch.randint(0, target.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_logits, ref_hs = hf_run(hf, ids)
    target.reset(64)
    out = target.forward(torch.tensor(ids))
    assert rel_err(out.logits, ref_logits) <= 1e-4
    check_taps(out.aux, ref_hs, slice(None), target.hidden_size)


def test_step_by_step_decode_matches_transformers(pair):
    _, hf, target = pair
    ids = torch.randint(0, target.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ref_logits, ref_hs = hf_run(hf, ids)
    target.reset(64)
    target.forward(torch.tensor(ids[:5]))
    target.commit()
    for t in range(5, len(ids)):
        out = target.forward(torch.tensor([ids[t]]))
        target.commit()
        assert rel_err(out.logits[0], ref_logits[t]) <= 1e-4, t
        check_taps(out.aux, ref_hs, [t], target.hidden_size)


# root + two branches, one of depth 3: parents precede children
TREE_PARENTS = [-1, 0, 0, 1, 1, 3, 2]


def tree_paths(parents: list[int]) -> list[list[int]]:
    paths = []
    for i in range(len(parents)):
        path, j = [], i
        while j != -1:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


def test_tree_masked_forward_matches_each_path(pair):
    _, hf, target = pair
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, target.vocab_size, (11,), generator=g).tolist()
    tree_tokens = torch.randint(0, target.vocab_size, (len(TREE_PARENTS),), generator=g)
    paths = tree_paths(TREE_PARENTS)
    depth = torch.tensor([len(p) - 1 for p in paths])
    mask = torch.zeros(len(paths), len(paths), dtype=torch.bool)
    for i, p in enumerate(paths):
        mask[i, p] = True
    target.reset(64)
    target.forward(torch.tensor(prompt))
    target.commit()
    out = target.forward(tree_tokens, positions=len(prompt) + depth, tree_mask=mask)
    for i, p in enumerate(paths):
        ref_logits, ref_hs = hf_run(hf, prompt + tree_tokens[p].tolist())
        assert rel_err(out.logits[i], ref_logits[-1]) <= 1e-4, f"node {i}"
        H = target.hidden_size
        for j, hs in enumerate(ref_hs[:-1]):
            assert rel_err(out.aux[i, j * H : (j + 1) * H], hs[0, -1]) <= 1e-4
    # keep the deepest path, then decode one more token: the cache must hold exactly prompt + path
    keep = paths[5]
    target.commit(torch.tensor(keep))
    assert target.cache_len == len(prompt) + len(keep)
    nxt = 7
    step = target.forward(torch.tensor([nxt]))
    ref_logits, _ = hf_run(hf, prompt + tree_tokens[keep].tolist() + [nxt])
    assert rel_err(step.logits[0], ref_logits[-1]) <= 1e-4


def test_batched_hidden_states_match_transformers(pair):
    _, hf, target = pair
    ids = torch.randint(0, target.vocab_size, (3, 17), generator=torch.Generator().manual_seed(4))
    out = target.hidden_states(ids)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    assert rel_err(out.logits, ref.logits) <= 1e-4
    H = target.hidden_size
    for j, hs in enumerate(ref.hidden_states[:-1]):
        assert rel_err(out.aux[..., j * H : (j + 1) * H], hs) <= 1e-4


def test_greedy_generate_equals_transformers_generate(pair):
    _, hf, target = pair
    for seed in range(3):
        prompt = torch.randint(0, target.vocab_size, (6 + seed,), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            # an explicit attention mask: without one, transformers masks any prompt token equal to pad_token_id
            ref = hf.generate(
                prompt[None],
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        ours = generate_vanilla(target, prompt.tolist(), 24, stop_ids=[])
        assert ours.token_ids == ref[0, len(prompt) :].tolist()


def test_sharded_checkpoint_loads(tmp_path):
    d = make_checkpoint("llama", tmp_path / "m", seed=5)
    hf = load_hf(d)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    target = load_target(tmp_path / "sharded", device="cpu")
    ids = list(range(10))
    target.reset(16)
    assert rel_err(target.forward(torch.tensor(ids)).logits, hf_run(hf, ids)[0]) <= 1e-4


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(EagleScopeError, match="does not exist"):
        load_target(tmp_path / "nope")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(EagleScopeError, match="not valid JSON"):
        load_target(tmp_path / "bad")
    d = make_checkpoint("llama", tmp_path / "shape", seed=6)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EagleScopeError, match="shape"):
        load_target(d, backend="native")
    d2 = make_checkpoint("llama", tmp_path / "rope", seed=6)
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "mystery", "rope_theta": 10000.0}
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EagleScopeError, match="mystery"):
        load_target(d2, backend="native")
    trunc = make_checkpoint("llama", tmp_path / "trunc", seed=6)
    w = trunc / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(EagleScopeError, match="corrupted or truncated"):
        load_target(trunc)


def test_sliding_window_beyond_window_is_refused(tmp_path):
    d = make_checkpoint("mistral", tmp_path / "sw", seed=7, sliding_window=16)
    target = load_target(d, device="cpu")
    target.reset(16)  # within the window: fine
    with pytest.raises(EagleScopeError, match="sliding-window"):
        target.reset(64)


def test_batched_greedy_equals_batch_one_greedy(pair):
    from eaglescope.decode.vanilla import greedy_batch

    _, _, target = pair
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    free = [generate_vanilla(target, p, 16, stop_ids=[]).token_ids for p in prompts]
    stop = [free[1][6]]  # a token that does occur: rows must stop at different steps
    ours = greedy_batch(target, prompts, 16, stop_ids=stop)
    assert ours == [generate_vanilla(target, p, 16, stop_ids=stop).token_ids for p in prompts]
    assert len(ours[1]) <= 7
