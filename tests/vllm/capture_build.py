"""What tests/vllm/test_vllm_capture.py serves in vLLM: a tiny target, two trained drafts, and the five faults made
the way users make them (in the files vLLM serves, never in a trace). Runs in eaglescope's environment.

The target and data are test_vllm_serving.py's (a Llama trained on an order-2 Markov chain, head dim 32 for vLLM's
CPU attention); the drafts tap [2, 4, 6], not the engines' default, so that the exported config names its ids and
the id conventions of the engines matter.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from test_vllm_serving import LAYERS, MAX_LEN, REDUCED_VOCAB, SYMBOLS, VOCAB, cli, order2_chain

from eaglescope.config import PrepareConfig, TrainConfig
from eaglescope.corpus import COMPLETION_TEMPLATE, train_tokenizer
from eaglescope.data.prepare import prepare
from eaglescope.pretrain import PretrainConfig, pretrain, save_target
from eaglescope.train.loop import train

TAPS = [2, 4, 6]
K = 3  # draft tokens per round
# A chat template the draft never saw: each user turn wrapped in role markers. Same tokenizer, other prompt ids.
OTHER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]: {% endif %}"
)
# vLLM prefills a prompt longer than its token budget in chunks, batched with the other request's prefill
CHUNKED = {"max_num_batched_tokens": 16, "max_num_seqs": 4}
# fault → the code doctor must name first
FAULTS = {
    "tap-ids-shifted": "TAP_OFF_BY_ONE",  # (a) eagle_aux_hidden_state_layer_ids one layer late in the served config
    "sglang-legacy-export": "ENGINE_TAP_CONVENTION",  # (b) `export --to sglang-legacy` served in vLLM
    "no-vocab-map": "VOCAB_MAP",  # (c) d2t/t2d dropped from a reduced-vocabulary export
    "ttt-1": "NO_TTT",  # (d) `train --ttt-length 1`
    "other-template": "TEMPLATE_MISMATCH",  # (e) the served target's chat template is not the trained one
}


def _train(root: Path, target: Path, name: str, ttt: int) -> Path:
    out = root / f"train-{name}"
    cfg = TrainConfig(
        target=str(target),
        data=str(root / "prep"),
        out=str(out),
        taps=",".join(map(str, TAPS)),
        draft_vocab_size=REDUCED_VOCAB,
        ttt_length=ttt,
        max_steps=80,  # as in test_vllm_serving: about half the drafted tokens accepted
        batch_size=8,
        lr=2e-3,
        eval_fraction=0.25,
        max_length=64,
        device="cpu",
        dtype="float32",
    )
    train(cfg, progress=False)
    return out


def _export(trained: Path, target: Path, engine: str, out: Path) -> Path:
    t = str(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what each engine will capture is the point of some of these
        rc, _, err = cli(["export", "--draft", str(trained), "--to", engine, "--out", str(out), "--target", t])
    assert rc == 0, err
    return out


def _edited(src: Path, out: Path, config=None, weights=None) -> Path:
    shutil.copytree(src, out)
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if weights is not None:
        sd = load_file(str(out / "model.safetensors"))
        weights(sd)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build(root: Path, prompts: int = 2) -> dict:
    """{"runs": {name: {"target", "draft"}}, "conversations", "targets", "trained"}: the clean pair and each fault."""
    rng = random.Random(0)
    perm = [rng.sample(range(len(SYMBOLS)), len(SYMBOLS)) for _ in SYMBOLS]
    tok = train_tokenizer([SYMBOLS], VOCAB, root / "tokenizer", COMPLETION_TEMPLATE)

    def ids(text: str) -> torch.Tensor:
        return torch.tensor(tok(text)["input_ids"])

    pcfg = PretrainConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=LAYERS,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_position_embeddings=MAX_LEN,
        seq_len=64,
        batch_size=16,
        steps=300,
        lr=2e-3,
        warmup=20,
        seed=0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model, stats = pretrain(
        pcfg, ids(order2_chain(rng, perm, 40_000)), ids(order2_chain(rng, perm, 4000)), "cpu", False
    )
    target = save_target(model, pcfg, root / "target", root / "tokenizer", extra={"stats": stats})
    rows = [
        {
            "messages": [
                {"role": "user", "content": order2_chain(rng, perm, rng.randint(8, 16))},
                {"role": "assistant", "content": "a"},
            ]
        }
        for _ in range(48)
    ]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(
        PrepareConfig(
            target=str(target),
            data=str(root / "data.jsonl"),
            out=str(root / "prep"),
            max_length=64,
            draft_vocab_size=REDUCED_VOCAB,
            regenerate=True,
            regen_max_new_tokens=40,
            device="cpu",
            dtype="float32",
        ),
        progress=False,
    )
    clean_trained = _train(root, target, "clean", K)
    ttt1_trained = _train(root, target, "ttt-1", 1)
    clean = _export(clean_trained, target, "vllm", root / "vllm-clean")

    # (e) the same weights and tokenizer under another chat template
    other = root / "target-other-template"
    shutil.copytree(target, other)
    tcfg_path = other / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["chat_template"] = OTHER_TEMPLATE
    tcfg_path.write_text(json.dumps(tcfg, indent=2))
    (other / "chat_template.jinja").unlink(missing_ok=True)

    def shift_ids(cfg: dict) -> None:
        cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = [t + 1 for t in TAPS]

    def drop_map(sd: dict) -> None:
        del sd["d2t"], sd["t2d"]

    runs = {
        "clean": (target, clean),
        "tap-ids-shifted": (target, _edited(clean, root / "vllm-tap-ids-shifted", config=shift_ids)),
        "sglang-legacy-export": (target, _export(clean_trained, target, "sglang-legacy", root / "sglang-legacy")),
        "no-vocab-map": (target, _edited(clean, root / "vllm-no-vocab-map", weights=drop_map)),
        "ttt-1": (target, _export(ttt1_trained, target, "vllm", root / "vllm-ttt-1")),
        "other-template": (other, clean),
    }
    conversations = [[{"role": "user", "content": order2_chain(rng, perm, rng.randint(8, 16))}] for _ in range(prompts)]
    # prompts long enough for vLLM to prefill in several chunks (CHUNKED engine arguments)
    long = [[{"role": "user", "content": order2_chain(rng, perm, rng.randint(30, 48))}] for _ in range(prompts)]
    return {
        "runs": {name: {"target": str(t), "draft": str(d)} for name, (t, d) in runs.items()},
        "conversations": conversations,
        "long_conversations": long,
        "trained": {"clean": str(clean_trained), "ttt-1": str(ttt1_trained)},
    }
