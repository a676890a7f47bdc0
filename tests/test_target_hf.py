"""The generic HF target reproduces transformers' own forward: logits and every tap, prefill, decode and trees.

Two families transformers ships natively: DeepSeek-V3 (MLA with a compressed-latent cache + MoE) and OLMo-2.
Each is built tiny and random, saved with save_pretrained (safetensors) and loaded back through HFTarget.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglescope.errors import EagleScopeError
from eaglescope.models.targets.base import sha256_file, sha256_text
from eaglescope.models.targets.hf import HFTarget
from eaglescope.taps import TapContract

VOCAB = 128
LAYERS = 4
TOL = 1e-4
ALL_TAPS = TapContract(tuple(range(LAYERS)), LAYERS)  # every tap, so aux checks each hidden state


def _deepseek_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
    )


def _olmo2_config():
    from transformers import Olmo2Config

    return Olmo2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
    )


def _build(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Separate MoE router scores well, so float rounding between cached and uncached runs never flips an expert.
    for layer in getattr(model.model, "layers", []):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            torch.nn.init.normal_(gate.weight, std=1.0)
    return model


def _save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w3", eos_token="w2", pad_token="w0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)


@pytest.fixture(scope="module", params=["deepseek_v3", "olmo2"])
def family(request, tmp_path_factory):
    """(model_dir, reference transformers model) for one family."""
    path = tmp_path_factory.mktemp(request.param)
    model = _build(_deepseek_config() if request.param == "deepseek_v3" else _olmo2_config())
    model.save_pretrained(path)
    if request.param == "olmo2":
        _save_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def target(family):
    return HFTarget.from_dir(family[0], taps=ALL_TAPS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@torch.no_grad()
def _ref(model, ids: list[int]):
    """transformers' own uncached forward: logits [T, V], hidden states [L+1] x [T, H]."""
    out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.logits[0], [h[0] for h in out.hidden_states]


def _check(out, ref_logits, ref_hs, rows=None) -> None:
    """`out` rows (all, or `rows`) match the reference's last len(rows) positions, logits and every tap."""
    logits, aux = out.logits, out.aux
    if rows is not None:
        logits, aux = logits[rows], aux[rows]
    T = logits.shape[0]
    assert _rel(logits, ref_logits[-T:]) <= TOL
    H = ref_hs[0].shape[-1]
    for k, i in enumerate(ALL_TAPS.layers):
        assert _rel(aux[:, k * H : (k + 1) * H], ref_hs[i][-T:]) <= TOL, f"tap {i}"


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def test_fingerprint_and_metadata(family, target):
    path, model = family
    fp = target.fingerprint
    assert fp.architecture == model.config.architectures[0]
    assert (fp.num_layers, fp.hidden_size, fp.vocab_size) == (LAYERS, 64, VOCAB)
    assert target.max_positions == 256
    assert target.eos_token_ids == [model.config.eos_token_id]
    if (path / "tokenizer.json").is_file():
        assert fp.tokenizer_sha256 == sha256_file(path / "tokenizer.json")
        assert fp.chat_template_sha256 == sha256_text(target.tokenizer.chat_template)
        assert target.tokenizer.encode("w5 w7", add_special_tokens=False) == [5, 7]
    else:
        assert target.tokenizer is None and fp.tokenizer_sha256 is None


def test_the_head_alone_is_the_targets_head(family, target):
    # What `train` reads of a target when the hidden states are stored: the same fingerprint, embedding and logits
    from eaglescope.models.targets.head import load_target_head

    path, model = family
    head = load_target_head(path, target.device, target.dtype)
    assert (head.fingerprint, head.max_positions) == (target.fingerprint, target.max_positions)
    assert not model.config.tie_word_embeddings and head.lm_head is not head.embedding
    assert torch.equal(head.embedding, model.get_input_embeddings().weight)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(head.head(x), target.head(x))


def test_hooks_match_output_hidden_states_in_prefill(family, target):
    ids = _prompt(11, 1)
    target.reset(64)
    out = target.forward(torch.tensor(ids))
    assert out.logits.shape == (11, VOCAB) and out.logits.dtype == torch.float32
    assert out.aux.shape == (11, LAYERS * 64)
    _check(out, *_ref(family[1], ids))


def test_step_by_step_decode_matches_full_forward(family, target):
    ids = _prompt(14, 2)
    ref_logits, ref_hs = _ref(family[1], ids)
    target.reset(64)
    target.forward(torch.tensor(ids[:6]))
    target.commit()
    for t in range(6, len(ids)):
        out = target.forward(torch.tensor([ids[t]]))
        target.commit()
        assert target.cache_len == t + 1
        _check(out, ref_logits[: t + 1], [h[: t + 1] for h in ref_hs])


def _tree_mask(parents: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Ancestor-or-self mask [N, N] and depths, for parents[i] < i (root has -1)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask, depth


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _tree_round(model, target, prompt, parents, tokens, leaf, nxt) -> None:
    mask, depth = _tree_mask(parents)
    target.reset(64)
    target.forward(torch.tensor(prompt))
    target.commit()
    n = target.cache_len
    args = (torch.tensor(tokens), n + torch.tensor(depth), mask)
    out = target.forward(*args)
    again = target.forward(*args)  # forward without commit discards the previous pending entries
    assert torch.equal(out.logits, again.logits)
    for node in range(len(parents)):
        path_ids = [tokens[j] for j in _path(parents, node)]
        _check(out, *_ref(model, prompt + path_ids), rows=[node])
    keep = _path(parents, leaf)
    target.commit(torch.tensor(keep))
    assert target.cache_len == n + len(keep)
    step = target.forward(torch.tensor([nxt]))
    _check(step, *_ref(model, prompt + [tokens[j] for j in keep] + [nxt]))


def test_tree_forward_and_commit_match_transformers_on_each_path(family, target):
    parents = [-1, 0, 0, 1, 1, 2, 2]  # root, two children, four grandchildren
    _tree_round(family[1], target, _prompt(6, 3), parents, _prompt(7, 4), leaf=5, nxt=9)


def test_eager_attention_accepts_the_tree_mask_too(family):
    tgt = HFTarget.from_dir(family[0], taps=ALL_TAPS, attn_implementation="eager")
    assert tgt.model.config._attn_implementation == "eager"
    _tree_round(family[1], tgt, _prompt(5, 10), [-1, 0, 1, 0, 3], _prompt(5, 11), leaf=4, nxt=17)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_tree_and_any_accepted_path_match_transformers(family, target, data):
    n = data.draw(st.integers(1, 6), label="nodes")
    parents = [-1] + [data.draw(st.integers(0, i - 1), label=f"parent{i}") for i in range(1, n)]
    tokens = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n), label="tokens")
    leaf = data.draw(st.integers(0, n - 1), label="leaf")
    prompt = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=8), label="prompt")
    _tree_round(family[1], target, prompt, parents, tokens, leaf, nxt=data.draw(st.integers(3, VOCAB - 1)))


def test_commit_of_nothing_keeps_prefix(family, target):
    ids = _prompt(8, 5)
    target.reset(32)
    target.forward(torch.tensor(ids[:5]))
    target.commit()
    target.forward(torch.tensor([7, 8, 9]))
    target.commit(torch.tensor([], dtype=torch.long))
    assert target.cache_len == 5
    _check(target.forward(torch.tensor(ids[5:])), *_ref(family[1], ids))


def test_batched_hidden_states_with_right_padding(family, target):
    a, b = _prompt(9, 6), _prompt(5, 7)
    ids = torch.tensor([a, b + [0] * 4])
    attn = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    out = target.hidden_states(ids, attn)
    assert out.logits.shape == (2, 9, VOCAB) and out.aux.shape == (2, 9, LAYERS * 64)
    from eaglescope.models.targets.base import TargetOutput

    _check(TargetOutput(out.logits[0], out.aux[0]), *_ref(family[1], a))
    _check(TargetOutput(out.logits[1, :5], out.aux[1, :5]), *_ref(family[1], b))


def _greedy(target: HFTarget, prompt: list[int], max_new: int) -> list[int]:
    target.reset(len(prompt) + max_new)
    out = target.forward(torch.tensor(prompt))
    target.commit()
    gen: list[int] = []
    while True:
        tok = int(out.logits[-1].argmax())
        gen.append(tok)
        if tok in target.eos_token_ids or len(gen) == max_new:
            return gen
        out = target.forward(torch.tensor([tok]))
        target.commit()


def test_greedy_decoding_equals_generate(family, target):
    prompt = _prompt(7, 8)
    ref = family[1].generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)[0, 7:].tolist()
    assert _greedy(target, prompt, 16) == ref


def test_taps_off_gives_no_aux_and_wrong_contract_is_rejected(family):
    tgt = HFTarget.from_dir(family[0])
    assert tgt.hidden_states(torch.tensor([[5, 6, 7]])).aux is None
    with pytest.raises(EagleScopeError, match="10-layer"):
        tgt.set_taps(TapContract((2, 4, 7), 10))
    tgt.set_taps(TapContract((1, 3), LAYERS))
    aux = tgt.hidden_states(torch.tensor([[5, 6, 7]])).aux
    _, hs = _ref(family[1], [5, 6, 7])
    assert _rel(aux[0], torch.cat([hs[1], hs[3]], -1)) <= TOL


def test_sharded_checkpoint_loads(tmp_path):
    model = _build(_olmo2_config(), seed=1)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    tgt = HFTarget.from_dir(tmp_path, taps=ALL_TAPS)
    ids = _prompt(6, 9)
    tgt.reset(16)
    _check(tgt.forward(torch.tensor(ids)), *_ref(model, ids))


# -- bad input: one clear EagleScopeError each -------------------------------------------------


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("small")
    _build(_olmo2_config()).save_pretrained(path)
    return path


def _copy_with_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(EagleScopeError, match="does not exist"):
        HFTarget.from_dir(tmp_path / "nope")
    with pytest.raises(EagleScopeError, match="no config.json"):
        HFTarget.from_dir(tmp_path)


def test_malformed_config(tmp_path, small_dir):
    d = tmp_path / "m"
    shutil.copytree(small_dir, d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(EagleScopeError, match="not valid JSON"):
        HFTarget.from_dir(d)


def test_unknown_architecture(tmp_path, small_dir):
    d = _copy_with_config(small_dir, tmp_path / "u", lambda c: c.update(model_type="zorblax"))
    with pytest.raises(EagleScopeError, match="zorblax"):
        HFTarget.from_dir(d)


@pytest.mark.parametrize("edit", [{"vocab_size": VOCAB * 2}, {"hidden_size": 32}, {"num_hidden_layers": 6}])
def test_weights_that_do_not_fit_the_config_are_refused_not_random_initialised(tmp_path, small_dir, edit):
    d = _copy_with_config(small_dir, tmp_path / "s", lambda c: c.update(edit))
    with pytest.raises(EagleScopeError, match="do not fit its config"):
        HFTarget.from_dir(d)


def test_missing_weights(tmp_path, small_dir):
    d = tmp_path / "w"
    shutil.copytree(small_dir, d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(EagleScopeError, match="no weights"):
        HFTarget.from_dir(d)


def test_remote_code_refused(tmp_path, small_dir):
    d = _copy_with_config(small_dir, tmp_path / "r", lambda c: c.update(auto_map={"AutoConfig": "x.Y"}))
    with pytest.raises(EagleScopeError, match="trust_remote_code"):
        HFTarget.from_dir(d)


def test_sliding_window_model_refused(tmp_path):
    from transformers import Gemma2Config

    cfg = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
    )
    _build(cfg).save_pretrained(tmp_path)
    with pytest.raises(EagleScopeError, match="full-attention"):
        HFTarget.from_dir(tmp_path)
