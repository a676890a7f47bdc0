"""The drafts the field serves today: EAGLE 3.1 options and MLA drafts for DeepSeek-V3 / Kimi-K2 targets.

Each draft architecture and option saves and loads bit for bit, decodes losslessly (speculative greedy equals
vanilla greedy, chain and tree), and the MLA layer's attention is DeepSeek-V3's own (transformers' module, same
weights). The 3.1 norms are drawn away from 1, so an option applied or skipped changes the output: each flag is
shown to matter."""

from __future__ import annotations

import pytest
import torch
from drafts import make_draft
from models import make_checkpoint
from tolerance import assert_close_float32
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from eaglescope.cli import main
from eaglescope.decode.loop import generate_speculative, generate_vanilla
from eaglescope.decode.speculative import Eagle3Proposer, target_embedding
from eaglescope.models.draft import load_draft, save_draft
from eaglescope.models.drafts.mla import MLAAttention
from eaglescope.models.targets import load_target

PROMPT = [5, 9, 14, 2, 33, 7, 21, 4, 17, 11, 3]
EAGLE31 = {"norm_before_fc": True, "fc_norm": True, "norm_output": True}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {
        "llama": make_checkpoint("llama", root / "llama"),
        "deepseek_v3": make_checkpoint("deepseek_v3", root / "ds"),
    }


CASES = [
    ("llama", "llama", EAGLE31),
    ("llama", "llama", {"norm_output": True}),
    ("deepseek_v3", "mla", {}),
    ("deepseek_v3", "mla", {"fc_norm": True, "norm_output": True}),
]
IDS = [f"{t}-{a}-{'+'.join(o) or 'eagle3'}" for t, a, o in CASES]


@pytest.mark.parametrize("family, arch, options", CASES, ids=IDS)
def test_save_load_and_lossless_decoding(targets, tmp_path, family, arch, options):
    draft, contract = make_draft(targets[family], draft_vocab_size=48, scale=3.0, arch=arch, random_norms=True,
                                 **options)  # fmt: skip
    path = save_draft(draft, contract, tmp_path / "d")
    loaded = load_draft(path)
    c = loaded.model.config
    assert (c.arch, c.eagle31) == (arch, {**dict.fromkeys(EAGLE31, False), **options})
    a, b = draft.state_dict(), loaded.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "embed_tokens.weight")
    target = load_target(targets[family], device="cpu")
    loaded.model.load_target_embedding(target_embedding(target))
    target.set_taps(loaded.contract.taps)
    want = generate_vanilla(target, PROMPT, 24, stop_ids=[]).token_ids
    for depth, top_k, total in ((4, 1, 5), (3, 3, 8)):
        prop = Eagle3Proposer(loaded.model, depth, top_k, total, max_len=len(PROMPT) + 30)
        got = generate_speculative(target, prop, PROMPT, 24, stop_ids=[])
        assert got.token_ids == want and got.stats.rounds >= 1


@pytest.mark.parametrize("flag", list(EAGLE31))
def test_each_eagle31_flag_changes_what_the_draft_computes(targets, flag):
    """Turning one flag off in the same weights changes the draft's second-step logits: the option is really
    applied (a test whose flags were no-ops could not tell an engine that ignores them). norm_output changes only
    what the next step receives, hence two steps."""
    draft, _ = make_draft(targets["llama"], draft_vocab_size=48, scale=3.0, random_norms=True, **EAGLE31)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, 6, draft.config.num_aux * draft.config.target_hidden_size, generator=g)
    ids = torch.randint(0, 96, (1, 7), generator=g)

    def logits(model):
        cache = model.new_cache(1, 16)
        causal = torch.ones(6, 6, dtype=torch.bool).tril()
        first = model.step(model.embed_tokens(ids[:, :6]), model.project(aux), torch.arange(6)[None], cache, 0,
                           causal[None, None])  # fmt: skip
        second = torch.cat([causal, torch.eye(6, dtype=torch.bool)], 1)[None, None]
        h = model.step(model.embed_tokens(ids[:, 1:]), first, torch.arange(1, 7)[None], cache, 6, second)
        return model.logits(h)

    with torch.no_grad():
        base = logits(draft)
        setattr(draft.config, flag, False)
        if flag == "norm_before_fc":
            draft.input_norm = None
        elif flag == "fc_norm":
            draft.fc_norm = None
        off = logits(draft)
    assert not torch.allclose(base, off, atol=1e-3)


def test_mla_attention_is_deepseek_v3_attention(targets):
    """The MLA draft's attention with transformers' DeepseekV3Attention given the same weights (its q/kv read the
    2H draft input; transformers' reads its hidden size, so that config is built 2H wide and o_proj compared on
    its input): YaRN RoPE, interleaved rope dims and the mscale in the softmax scale included."""
    draft, _ = make_draft(targets["deepseek_v3"], draft_vocab_size=48, arch="mla", scale=1.0)
    c, m = draft.config, draft.config.mla
    ours: MLAAttention = draft.midlayer.self_attn
    hf_cfg = DeepseekV3Config(
        hidden_size=2 * c.hidden_size, num_attention_heads=c.num_heads, num_key_value_heads=c.num_heads,
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_parameters=dict(m.rope_parameters),
        rope_interleave=m.rope_interleave, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, attention_bias=False,
    )  # fmt: skip
    hf_cfg._attn_implementation = "eager"
    theirs = DeepseekV3Attention(hf_cfg, 0).eval()
    sd = {k: v for k, v in ours.state_dict().items() if not k.startswith("o_proj")}
    missing, _ = theirs.load_state_dict(sd, strict=False)
    assert missing == ["o_proj.weight"]
    T = 7
    x = torch.randn(1, T, 2 * c.hidden_size, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(2, 2 + T)[None]
    seen = {}
    ours.o_proj.register_forward_hook(lambda mod, inp, out: seen.__setitem__("ours", inp[0]))
    theirs.o_proj.register_forward_hook(lambda mod, inp, out: seen.__setitem__("theirs", inp[0]))
    with torch.no_grad():
        cos, sin = draft.midlayer.rotary(pos, torch.float32)
        ref_cos, ref_sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, pos)
        torch.testing.assert_close(cos, ref_cos)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        ours(x, cos, sin, causal[None, None], draft.new_cache(1, T), 0)
        float_mask = torch.zeros(T, T).masked_fill(~causal, float("-inf"))[None, None]
        theirs(x, (ref_cos, ref_sin), float_mask)
    # depth 2: the projections, then attention
    assert_close_float32(seen["ours"], seen["theirs"], depth=2, key="MLA attention before o_proj")
    assert ours.scaling != m.qk_head_dim**-0.5  # the YaRN mscale is in play


def test_mla_draft_on_the_fast_path_is_refused_in_one_line(targets, tmp_path, capsys):
    draft, contract = make_draft(targets["deepseek_v3"], draft_vocab_size=48, arch="mla")
    path = save_draft(draft, contract, tmp_path / "mla")
    argv = ["generate", "--target", str(targets["deepseek_v3"]), "--draft", str(path), "--prompt-ids", "5,6,7,8"]
    rc = main([*argv, "--fast", "--device", "cpu", "--chain", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "latent attention" in err or "native target" in err


def test_mla_and_eagle31_drafts_end_to_end_through_the_cli(tmp_path, capsys):
    """A DeepSeek-V3-architecture target on the transformers path: prepare → train --draft-arch mla (with 3.1
    options) → export --to vllm → generate, speculative output equal to vanilla; and a 3.1 Llama-attention draft."""
    import json

    from test_prepare import conversations
    from tokenizers_fixtures import LLAMA3, load, make_tokenizer_dir

    tok = load(make_tokenizer_dir(tmp_path, LLAMA3, vocab_size=300))
    target = make_checkpoint("deepseek_v3", tmp_path / "ds", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                             bos_token_id=tok.bos_token_id)  # fmt: skip
    tok.save_pretrained(target)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations()))

    def cli(*argv: str) -> str:
        capsys.readouterr()
        rc = main([*argv])
        out = capsys.readouterr()
        assert rc == 0, out.err
        return out.out

    llama = make_checkpoint("llama", tmp_path / "llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                            bos_token_id=tok.bos_token_id)  # fmt: skip
    tok.save_pretrained(llama)
    common = ["--device", "cpu", "--dtype", "float32"]
    # (the target, the draft's flags): an MLA 3.1 draft for the DeepSeek target, a Llama 3.1 draft for a Llama one
    for name, t, flags in (("mla", target, ["--draft-arch", "mla", "--fc-norm", "--norm-output"]),
                           ("llama31", llama, ["--norm-before-fc", "--norm-output"])):  # fmt: skip
        prep = tmp_path / f"prep-{name}"
        cli("prepare", "--target", str(t), "--data", str(data), "--out", str(prep), "--taps", "0,3,6",
            "--draft-vocab-size", "64", *common)  # fmt: skip
        prompt = ",".join(map(str, tok.encode("def f(x):", add_special_tokens=True)))
        vanilla = json.loads(cli("generate", "--target", str(t), "--prompt-ids", prompt, "--max-new-tokens", "16",
                                 "--json", *common))["token_ids"]  # fmt: skip
        out = tmp_path / name
        cli("train", "--target", str(t), "--data", str(prep), "--out", str(out), "--max-steps", "3",
            "--batch-size", "4", *flags, *common)  # fmt: skip
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["norm_output"] is True and (cfg.get("kv_lora_rank") is not None) == (name == "mla")
        exported = tmp_path / f"{name}-vllm"
        cli("export", "--draft", str(out), "--to", "vllm", "--out", str(exported), "--target", str(t))
        for draft in (out, exported):
            got = json.loads(cli("generate", "--target", str(t), "--draft", str(draft), "--prompt-ids", prompt,
                                 "--max-new-tokens", "16", "--tree", "3,2,6", "--json", *common))  # fmt: skip
            assert got["token_ids"] == vanilla and got["stats"]["rounds"] >= 1
