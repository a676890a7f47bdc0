"""Speculative decoding reproduces vanilla greedy decoding exactly, whatever the proposer proposes.

Random tiny targets (native Llama-family path and the generic transformers path, including a
non-Llama OLMo-2), random-weight EAGLE-3 drafts, prompt lookup and small draft LMs, random
prompts and tree shapes: the output must be vanilla's, token for token. Scripted proposers pin
the extremes (always, never, sometimes accepted) and the statistics they must produce.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from drafts import make_draft
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from models import make_checkpoint
from safetensors.torch import load_file, save_file

from eaglescope.decode.generation import DecodeSettings
from eaglescope.decode.loop import generate_speculative
from eaglescope.decode.speculative import (
    DraftLMProposer,
    Eagle3Proposer,
    NgramProposer,
    Proposer,
    build_proposer,
    target_embedding,
)
from eaglescope.decode.tree import DraftTree, parse_tree_shape
from eaglescope.decode.vanilla import SamplingConfig, generate_vanilla
from eaglescope.errors import EagleScopeError
from eaglescope.models.draft import save_draft
from eaglescope.models.targets import load_target
from eaglescope.taps import TapContract

FAST = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.generate],  # shrinking re-runs slow decodes for minutes; a failing case prints as is
)
NATIVE = {  # name: (family, seed, overrides)
    "llama": ("llama", 0, {}),
    "qwen3": ("qwen3", 1, {}),
    "qwen2": ("qwen2", 2, {}),
    "mistral16": ("mistral", 3, {"vocab_size": 16}),  # small vocabulary: random drafts get accepted often
}
OLMO_TAPS = TapContract((0, 1, 3), 4)


def _olmo2(path: Path) -> Path:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(
        vocab_size=48,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
    )
    torch.manual_seed(5)
    Olmo2ForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    out = {n: make_checkpoint(f, tmp_path_factory.mktemp(n), seed=s, **o) for n, (f, s, o) in NATIVE.items()}
    out["olmo2"] = _olmo2(tmp_path_factory.mktemp("olmo2"))
    out["lm96"] = make_checkpoint("qwen3", tmp_path_factory.mktemp("lm96"), seed=7)  # a draft LM for 96-token targets
    out["lm16"] = make_checkpoint("llama", tmp_path_factory.mktemp("lm16"), seed=8, vocab_size=16)
    return out


@pytest.fixture(scope="module")
def targets(ckpts) -> dict:
    t = {n: load_target(ckpts[n], device="cpu", dtype=torch.float32) for n in NATIVE}
    t["llama-hf"] = load_target(ckpts["llama"], device="cpu", dtype=torch.float32, backend="hf")
    t["olmo2"] = load_target(ckpts["olmo2"], device="cpu", dtype=torch.float32, backend="hf")
    for name, tgt in t.items():
        tgt.set_taps(OLMO_TAPS if name == "olmo2" else TapContract.default(tgt.num_layers))
    assert type(t["llama-hf"]).__name__ == "HFTarget" and type(t["llama"]).__name__ == "NativeTarget"
    return t


@pytest.fixture(scope="module")
def drafts(ckpts, targets):
    """drafts(target name, seed, reduced) → an Eagle3Draft with the target's embedding, built once."""
    cache = {}

    def get(name: str, seed: int, reduced: bool):
        key = (name, seed, reduced)
        if key not in cache:
            tgt = targets[name]
            path = ckpts["llama" if name == "llama-hf" else name]
            n = tgt.vocab_size // 3 if reduced else None
            d, _ = make_draft(path, taps=tgt.taps, draft_vocab_size=n, seed=seed)
            d.load_target_embedding(target_embedding(tgt))
            cache[key] = d
        return cache[key]

    return get


@pytest.fixture(scope="module")
def draft_lms(ckpts) -> dict:
    return {n: load_target(ckpts[n], device="cpu", dtype=torch.float32) for n in ("lm96", "lm16", "llama")}


def assert_lossless(target, proposer: Proposer, prompt: list[int], n: int, stop_ids=None):
    """Speculative greedy == vanilla greedy, and the round statistics account for every emitted token."""
    ref = generate_vanilla(target, prompt, n, stop_ids=stop_ids)
    res = generate_speculative(target, proposer, prompt, n, stop_ids=stop_ids)
    assert res.token_ids == ref.token_ids
    assert res.finish_reason == ref.finish_reason
    s = res.stats
    emitted = len(res.token_ids) - 1  # the first token comes from the prefill, not from a round
    if s.rounds == 0:
        assert emitted == 0
    else:  # every round but the last emits accepted + 1 in full; the last may be cut by EOS or the budget
        assert s.emitted_tokens - (s.accepted[-1] + 1) < emitted <= s.emitted_tokens
    assert all(0 <= a <= d for a, d in zip(s.accepted, s.drafted_depth, strict=True))
    return res


prompts = st.lists(st.integers(0, 10**6), min_size=1, max_size=20)
chains = st.integers(1, 6).map(lambda k: (k, 1, k + 1))
trees = st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(2, 40))
shapes = st.one_of(chains, trees)


def _prompt(raw: list[int], vocab: int) -> list[int]:
    return [t % vocab for t in raw]


# -- losslessness: EAGLE-3 ---------------------------------------------------------------------------------
@settings(max_examples=200, **FAST)
@given(
    name=st.sampled_from(list(NATIVE)),
    seed=st.integers(0, 3),
    reduced=st.booleans(),
    raw=prompts,
    shape=shapes,
    n=st.integers(1, 24),
)
# a stop token accepted past the budget: the output ends at the budget, and so does the reason ("length")
@example(name="mistral16", seed=3, reduced=False, raw=[1978, 0, 2575], shape=(6, 1, 19), n=17)
def test_eagle3_greedy_equals_vanilla_native(targets, drafts, name, seed, reduced, raw, shape, n):
    tgt = targets[name]
    prompt = _prompt(raw, tgt.vocab_size)
    prop = Eagle3Proposer(drafts(name, seed, reduced), *shape, max_len=len(prompt) + n + 1)
    assert_lossless(tgt, prop, prompt, n)


@settings(max_examples=60, **FAST)
@given(
    name=st.sampled_from(["llama-hf", "olmo2"]),
    seed=st.integers(0, 2),
    reduced=st.booleans(),
    raw=prompts,
    shape=shapes,
    n=st.integers(1, 12),
)
def test_eagle3_greedy_equals_vanilla_generic_hf(targets, drafts, name, seed, reduced, raw, shape, n):
    tgt = targets[name]
    prompt = _prompt(raw, tgt.vocab_size)
    prop = Eagle3Proposer(drafts(name, seed, reduced), *shape, max_len=len(prompt) + n + 1)
    assert_lossless(tgt, prop, prompt, n)


def test_native_and_hf_backends_agree_on_one_draft(targets, drafts):
    """The same checkpoint and draft through both backends: same tokens and the same acceptance history."""
    prompt, shape = [3, 14, 15, 92, 65, 35], (4, 3, 10)
    runs = []
    for name in ("llama", "llama-hf"):
        prop = Eagle3Proposer(drafts(name, 1, False), *shape, max_len=40)
        runs.append(assert_lossless(targets[name], prop, prompt, 20, stop_ids=[]))
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats.accepted == runs[1].stats.accepted


# -- losslessness: prompt lookup and draft LMs -------------------------------------------------------------
@settings(max_examples=80, **FAST)
@given(
    name=st.sampled_from(list(NATIVE) + ["olmo2"]),
    raw=prompts,
    k=st.integers(1, 6),
    max_ngram=st.integers(1, 4),
    n=st.integers(1, 24),
)
def test_ngram_greedy_equals_vanilla(targets, name, raw, k, max_ngram, n):
    tgt = targets[name]
    prompt = _prompt(raw, tgt.vocab_size)
    assert_lossless(tgt, NgramProposer(k, max_ngram=max_ngram), prompt, 12 if name == "olmo2" else n)


@settings(max_examples=40, **FAST)
@given(
    pair=st.sampled_from([("llama", "lm96"), ("qwen3", "lm96"), ("mistral16", "lm16")]),
    raw=prompts,
    k=st.integers(1, 6),
    n=st.integers(1, 24),
)
def test_draft_lm_greedy_equals_vanilla(targets, draft_lms, pair, raw, k, n):
    tgt, lm = targets[pair[0]], draft_lms[pair[1]]
    prompt = _prompt(raw, tgt.vocab_size)
    prop = DraftLMProposer(lm, k, SamplingConfig(), max_len=len(prompt) + n + 1)
    assert_lossless(tgt, prop, prompt, n)


def test_ngram_accepts_a_repeated_phrase(targets):
    """Prompt lookup on a target that loops: the continuation of the loop is in the prompt, so it is accepted."""
    tgt = targets["llama"]
    ref = generate_vanilla(tgt, [4, 9], 40, stop_ids=[]).token_ids
    prompt = [4, 9, *ref[:30]]  # the greedy output of a random tiny model settles into short cycles
    res = assert_lossless(tgt, NgramProposer(4), prompt, 10, stop_ids=[])
    assert res.stats.accept_length > 1.5


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_lm_identical_to_target_accepts_everything(targets, ckpts, k):
    """A draft LM with the target's own weights: every round is fully accepted, including its cache rollback."""
    tgt = targets["llama"]
    lm = load_target(ckpts["llama"], device="cpu", dtype=torch.float32)
    rounds = 4
    n = 1 + rounds * (k + 1)
    res = assert_lossless(tgt, DraftLMProposer(lm, k, SamplingConfig(), max_len=40), [7, 1, 8], n, stop_ids=[])
    assert res.stats.accepted == [k] * rounds


# -- extremes: always, never, sometimes accepted --------------------------------------------------------------
class ScriptedProposer(Proposer):
    """A chain of k read off the target's known greedy continuation; positions where `wrong(i)` holds are
    replaced by a token the target will not pick (i = index into the generated tokens)."""

    name = "scripted"

    def __init__(self, prompt: list[int], continuation: list[int], k: int, vocab: int, wrong=lambda i: False):
        self.prompt, self.cont, self.k, self.vocab, self.wrong = prompt, continuation, k, vocab, wrong

    @property
    def max_nodes(self) -> int:
        return self.k + 1

    def propose(self, tokens, root_position) -> DraftTree:
        done = len(tokens) - len(self.prompt)
        assert tokens[len(self.prompt) :] == self.cont[:done]  # the target really emitted the continuation
        nxt = self.cont[done : done + self.k]
        draft = [(t + 1) % self.vocab if self.wrong(done + j) else t for j, t in enumerate(nxt)]
        return DraftTree.chain([tokens[-1], *draft])


def expected_accepts(n: int, k: int, wrong) -> list[int]:
    """Accepted lengths round by round: the leading run of right tokens, until n tokens are out."""
    out, done = [], 1
    while done < n:
        a = 0
        while a < k and not wrong(done + a):
            a += 1
        out.append(a)
        done += a + 1
    return out


PROMPT = [11, 22, 33, 44]


def _scripted(tgt, k: int, n: int, wrong=lambda i: False) -> ScriptedProposer:
    cont = generate_vanilla(tgt, PROMPT, n + k + 1, stop_ids=[]).token_ids
    return ScriptedProposer(PROMPT, cont, k, tgt.vocab_size, wrong)


@pytest.mark.parametrize("name", ["llama", "olmo2"])
@pytest.mark.parametrize("k", [1, 4, 6])
def test_oracle_proposer_is_always_fully_accepted(targets, name, k):
    tgt, rounds = targets[name], 4
    n = 1 + rounds * (k + 1)  # every round full: no truncated last round
    res = assert_lossless(tgt, _scripted(tgt, k, n), PROMPT, n, stop_ids=[])
    s = res.stats
    assert s.rounds == rounds and s.accepted == [k] * rounds
    assert s.accept_length == k + 1
    assert s.alpha == [1.0] * k and s.accepted_per_position == [1.0] * k
    assert s.histogram == [0] * k + [rounds]


@pytest.mark.parametrize("name", ["llama", "olmo2"])
def test_always_wrong_proposer_is_never_accepted(targets, name):
    tgt, k, n = targets[name], 3, 9
    res = assert_lossless(tgt, _scripted(tgt, k, n, wrong=lambda i: True), PROMPT, n, stop_ids=[])
    s = res.stats
    assert s.rounds == n - 1 and s.accepted == [0] * (n - 1)
    assert s.accept_length == 1.0
    assert s.alpha[0] == 0.0 and all(math.isnan(a) for a in s.alpha[1:])  # no round got past position 1
    assert s.accepted_per_position == [0.0] * k


def test_sometimes_wrong_proposer_statistics_match_the_history(targets):
    """Every third generated token corrupted: τ strictly between the extremes, and every statistic equals
    its definition applied to the accepted-length history worked out by hand."""
    tgt, k, n = targets["llama"], 4, 40
    wrong = lambda i: i % 3 == 2  # noqa: E731
    res = assert_lossless(tgt, _scripted(tgt, k, n, wrong), PROMPT, n, stop_ids=[])
    s, hist = res.stats, expected_accepts(n, k, wrong)
    assert s.accepted == hist and s.rounds == len(hist)
    assert 1.0 < s.accept_length < k + 1
    assert s.accept_length == pytest.approx(sum(a + 1 for a in hist) / len(hist))
    for pos in range(1, k + 1):
        reached = [a for a in hist if a >= pos - 1]
        exp_alpha = sum(a >= pos for a in reached) / len(reached) if reached else math.nan
        got = s.alpha[pos - 1]
        assert (math.isnan(got) and math.isnan(exp_alpha)) or got == pytest.approx(exp_alpha)
        assert s.accepted_per_position[pos - 1] == pytest.approx(sum(a >= pos for a in hist) / len(hist))
    # a round accepts at most 2 here: the third token of any run of three is corrupted
    assert max(hist) <= 2 and s.alpha[2] == 0.0


# -- stopping: EOS and the budget ------------------------------------------------------------------------------
def test_eos_inside_accepted_drafts_truncates_like_vanilla(targets):
    tgt, k = targets["llama"], 4
    found = 0
    for prompt in ([11, 22, 33, 44], [5, 6], [90, 1, 2, 3, 4, 5], [60], [17, 17, 17]):
        cont = generate_vanilla(tgt, prompt, 30, stop_ids=[]).token_ids
        for j in range(1, 30):
            # (j - 1) % (k + 1) < k: generated index j is an accepted draft, not a round's bonus token
            if (j - 1) % (k + 1) < k and cont[j] not in cont[:j]:
                stop = [cont[j]]
                prop = ScriptedProposer(prompt, cont, k, tgt.vocab_size)
                res = assert_lossless(tgt, prop, prompt, 30, stop_ids=stop)
                assert res.token_ids == cont[: j + 1] and res.finish_reason == "eos"
                assert res.stats.rounds == (j - 1) // (k + 1) + 1
                found += 1
                break
    assert found >= 2


def test_eos_as_first_token_runs_no_round(targets, drafts):
    tgt = targets["llama"]
    first = generate_vanilla(tgt, PROMPT, 1).token_ids[0]
    prop = Eagle3Proposer(drafts("llama", 0, False), 3, 1, 4, max_len=20)
    res = assert_lossless(tgt, prop, PROMPT, 10, stop_ids=[first])
    assert res.token_ids == [first] and res.stats.rounds == 0 and res.finish_reason == "eos"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 11, 12])
def test_max_new_tokens_respected_exactly(targets, n):
    tgt, k = targets["llama"], 4
    res = assert_lossless(tgt, _scripted(tgt, k, n), PROMPT, n, stop_ids=[])
    assert len(res.token_ids) == n and res.finish_reason == "length"


def test_context_limit_ends_generation_like_vanilla(targets, drafts):
    tgt = targets["llama"]
    prompt = [(7 * i) % tgt.vocab_size for i in range(tgt.max_positions - 5)]
    prop = Eagle3Proposer(drafts("llama", 0, False), 3, 3, 8, max_len=tgt.max_positions + 1)
    res = assert_lossless(tgt, prop, prompt, 50, stop_ids=[])
    assert len(res.token_ids) == 5 and res.finish_reason == "context"


# -- misconfiguration -----------------------------------------------------------------------------------------
def _settings(draft: Path | None, proposer: str = "eagle3", chain: int | None = 3, tree: str | None = None):
    return DecodeSettings(8, draft=None if draft is None else str(draft), proposer=proposer, chain=chain, tree=tree)


def _saved_draft(ckpts, targets, out: Path, reduced: bool = False, **fingerprint_changes) -> Path:
    tgt = targets["llama"]
    d, contract = make_draft(ckpts["llama"], draft_vocab_size=32 if reduced else None, seed=4)
    contract.target = dataclasses.replace(tgt.fingerprint, **fingerprint_changes)
    return save_draft(d, contract, out)


def test_saved_draft_loads_and_stays_lossless(ckpts, targets, drafts, tmp_path):
    """The positive control for the refusals below: a matching draft goes through build_proposer."""
    tgt = targets["llama"]
    path = _saved_draft(ckpts, targets, tmp_path / "ok", reduced=True)
    prop = build_proposer(_settings(path, chain=None, tree="3,2,6"), tgt, max_len=40)
    assert isinstance(prop, Eagle3Proposer) and (prop.depth, prop.top_k, prop.total_tokens) == (3, 2, 6)
    assert_lossless(tgt, prop, PROMPT, 16)


@pytest.mark.parametrize(
    "field,value", [("vocab_size", 128), ("hidden_size", 32), ("num_layers", 12), ("tokenizer_sha256", "0" * 64)]
)
def test_draft_for_another_target_is_refused(ckpts, targets, tmp_path, field, value):
    tgt = targets["llama"]
    if field == "tokenizer_sha256":  # the hash check needs a target with a tokenizer of its own
        tgt = _target_with_tokenizer(ckpts["llama"], tmp_path / "tok_target")
    path = _saved_draft(ckpts, targets, tmp_path / "d", **{field: value})
    with pytest.raises(EagleScopeError, match="tokenizer" if field == "tokenizer_sha256" else f"{field}={value}"):
        build_proposer(_settings(path), tgt, max_len=40)


def _target_with_tokenizer(src: Path, out: Path):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, out)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w3", eos_token="w2").save_pretrained(out)
    tgt = load_target(out, device="cpu", dtype=torch.float32)
    assert tgt.fingerprint.tokenizer_sha256 is not None
    return tgt


def test_reduced_vocab_draft_without_d2t_is_refused(ckpts, targets, tmp_path):
    path = _saved_draft(ckpts, targets, tmp_path / "d", reduced=True)
    sd = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k not in ("d2t", "t2d")}, str(path / "model.safetensors"))
    with pytest.raises(EagleScopeError, match="d2t"):
        build_proposer(_settings(path), targets["llama"], max_len=40)


@pytest.mark.parametrize("layers,num_layers,match", [([2, 4, 9], 8, "out of range"), ([2, 6, 9], 12, "12-layer")])
def test_draft_taps_that_do_not_fit_the_target_are_refused(ckpts, targets, tmp_path, layers, num_layers, match):
    path = _saved_draft(ckpts, targets, tmp_path / "d")
    cfg = json.loads((path / "config.json").read_text())
    cfg["eaglescope"]["taps"]["layers"] = layers
    cfg["eaglescope"]["taps"]["num_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EagleScopeError, match=match):
        build_proposer(_settings(path), targets["llama"], max_len=40)


def test_draft_lm_with_another_vocabulary_is_refused(ckpts, targets):
    with pytest.raises(EagleScopeError, match="vocabulary"):
        build_proposer(_settings(ckpts["lm16"], "draft-lm"), targets["llama"], max_len=40)


def test_eagle3_without_a_draft_is_refused(targets):
    with pytest.raises(EagleScopeError, match="--draft"):
        build_proposer(_settings(None), targets["llama"], max_len=40)


def test_target_without_taps_is_refused(ckpts, drafts):
    tgt = load_target(ckpts["llama"], device="cpu", dtype=torch.float32)  # no taps set
    prop = Eagle3Proposer(drafts("llama", 0, False), 2, 1, 3, max_len=20)
    with pytest.raises(EagleScopeError, match="tap"):
        generate_speculative(tgt, prop, PROMPT, 5)


@pytest.mark.parametrize("chain,tree", [(0, None), (None, "3,2"), (None, "a,b,c"), (None, "0,2,6"), (None, "3,2,1")])
def test_bad_tree_shapes_are_refused(chain, tree):
    with pytest.raises(EagleScopeError, match="--chain|--tree"):
        parse_tree_shape(chain, tree)


def test_tree_shapes_parse():
    assert parse_tree_shape(3, None) == (3, 1, 4)
    assert parse_tree_shape(None, "7,10,60") == (7, 10, 60)
    assert parse_tree_shape(None, None) == (7, 10, 60)
