"""What tests/vllm/test_vllm_capture.py serves in vLLM: a tiny target, three trained drafts (one EAGLE 3.1), and the
six faults made the way users make them (in the files vLLM serves, never in a trace). Runs in eaglescope's environment.

The target and data are test_vllm_serving.py's, built once for both modules (test_vllm_serving.base: a Llama trained
on an order-2 Markov chain, head dim 32 for vLLM's CPU attention); the drafts tap [2, 4, 6], not the engines' default,
so that the exported config names its ids and the id conventions of the engines matter.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

from safetensors.torch import load_file, save_file
from test_vllm_serving import REDUCED_VOCAB, TRAIN_SETTINGS, cli, order2_chain

from eaglescope.config import TrainConfig
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
# The EAGLE 3.1 draft with all three options: norm_before_fc (the option SGLang issue 32226 lost), one fc_norm per tap
# and norm_output. With fc_norm the per-tap RMSNorm after the skipped one normalises its scale away, so only
# input_norm's trained weights (within a few % of 1 after 80 steps) tell the fault from the clean draft, and vLLM's fc
# output may stay within doctor's tolerance of the trained one: the case doctor once missed (issue 58), named by fc.py's
# eagle31_below_tolerance (fc with the norm skipped reproduces the trace far more closely than fc as trained).
EAGLE31 = {"norm_before_fc": True, "fc_norm": True, "norm_output": True}
# the runs served without a fault (doctor must find them healthy)
CLEAN = ("clean", "clean-eagle31")
# fault → the code doctor must name first from its vLLM trace (doctor given the draft the user has: `doctor_draft`)
FAULTS = {
    "tap-ids-shifted": "TAP_OFF_BY_ONE",  # (a) eagle_aux_hidden_state_layer_ids one layer late in the served config
    "sglang-legacy-export": "ENGINE_TAP_CONVENTION",  # (b) `export --to sglang-legacy` served in vLLM
    "no-vocab-map": "VOCAB_MAP",  # (c) d2t/t2d dropped from a reduced-vocabulary export
    "ttt-1": "NO_TTT",  # (d) `train --ttt-length 1`
    "other-template": "TEMPLATE_MISMATCH",  # (e) the served target's chat template is not the trained one
    # (f) the served config lost norm_before_fc (top level and eagle_config) but the weights keep input_norm.weight:
    # vLLM then builds no input_norm and drops the weight (llama_eagle3.py load_weights maps "input_norm." to None),
    # SGLang issue 32226 / PR 32334 in vLLM. doctor gets the 3.1 draft as trained: the trace shows fc without the norm.
    "eagle31-flag-lost": "EAGLE31_NORM",
}
# fault → the code doctor must name first from vLLM's metrics alone, doctor given the served draft directory
METRICS_FAULTS = FAULTS | {"eagle31-flag-lost": "EAGLE31_IGNORED"}  # (f): config and weights disagree (static)


def _train(root: Path, target: Path, prep: Path, name: str, ttt: int, **options) -> Path:
    out = root / f"train-{name}"
    cfg = TrainConfig(
        target=str(target),
        data=str(prep),
        out=str(out),
        taps=",".join(map(str, TAPS)),
        draft_vocab_size=REDUCED_VOCAB,
        ttt_length=ttt,
        **TRAIN_SETTINGS,
        **options,
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


def build(root: Path, b: dict, prompts: int = 2) -> dict:
    """{"runs": {name: {"target", "draft", "doctor_draft"}}, "conversations", "long_conversations", "trained"}: the
    clean pairs and each fault, from test_vllm_serving.base's target and data (`b`); `doctor_draft` is the draft the
    user hands doctor (the served one unless a fault is made in the served copy of a correct draft)."""
    rng, perm, target = b["rng"], b["perm"], b["target"]
    clean_trained = _train(root, target, b["prep"], "clean", K)
    ttt1_trained = _train(root, target, b["prep"], "ttt-1", 1)
    eagle31_trained = _train(root, target, b["prep"], "clean-eagle31", K, **EAGLE31)
    clean = _export(clean_trained, target, "vllm", root / "vllm-clean")
    clean31 = _export(eagle31_trained, target, "vllm", root / "vllm-clean-eagle31")

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

    def drop_norm_before_fc(cfg: dict) -> None:
        del cfg["norm_before_fc"], cfg["eagle_config"]["norm_before_fc"]

    flag_lost = _edited(clean31, root / "vllm-eagle31-flag-lost", config=drop_norm_before_fc)
    runs = {
        "clean": (target, clean),
        "clean-eagle31": (target, clean31),
        "tap-ids-shifted": (target, _edited(clean, root / "vllm-tap-ids-shifted", config=shift_ids)),
        "sglang-legacy-export": (target, _export(clean_trained, target, "sglang-legacy", root / "sglang-legacy")),
        "no-vocab-map": (target, _edited(clean, root / "vllm-no-vocab-map", weights=drop_map)),
        "ttt-1": (target, _export(ttt1_trained, target, "vllm", root / "vllm-ttt-1")),
        "other-template": (other, clean),
        "eagle31-flag-lost": (target, flag_lost, clean31),
    }
    conversations = [[{"role": "user", "content": order2_chain(rng, perm, rng.randint(8, 16))}] for _ in range(prompts)]
    # prompts long enough for vLLM to prefill in several chunks (CHUNKED engine arguments)
    long = [[{"role": "user", "content": order2_chain(rng, perm, rng.randint(30, 48))}] for _ in range(prompts)]
    return {
        "runs": {
            name: {"target": str(r[0]), "draft": str(r[1]), "doctor_draft": str(r[-1])} for name, r in runs.items()
        },
        "conversations": conversations,
        "long_conversations": long,
        "trained": {"clean": str(clean_trained), "ttt-1": str(ttt1_trained), "clean-eagle31": str(eagle31_trained)},
    }
