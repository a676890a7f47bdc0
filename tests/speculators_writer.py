"""Write an EAGLE-3 draft checkpoint with speculators' own code, as `speculators train` builds and saves it. Runs in the
speculators environment (scripts/speculators_env.sh), never in eaglescope's: it imports speculators, torch,
safetensors and the standard library only.

    python speculators_writer.py SPEC.json

SPEC: a list of {"verifier": DIR, "out": DIR, "draft_vocab_size": N, "target_layer_ids": [ids] | null, "ttt_steps": K,
       "norm_before_fc": bool, "fc_norm": bool, "norm_output": bool, "vocab_map": FILE.safetensors | null (d2t, t2d),
       "weights": FILE.safetensors | null, "seed": int}, written in turn (one import of speculators for all)

The draft is built the way speculators 0.9.0's trainer builds it (train/cli.py build_draft_model without
--draft-config or --from-pretrained): `create_transformer_layer_config` from the verifier's config (one llama layer,
its default 2048-token sliding window), then `Eagle3DraftModel.from_training_args`, which loads the vocabulary map and
the verifier's embedding and lm_head rows; fc and the layer keep speculators' random initialisation. Saved with
`save_pretrained`, as `speculators train` saves its checkpoints. "weights": the
draft's trained tensors under the LlamaForCausalLMEagle3 names (`midlayer.*`: an eaglescope checkpoint), loaded into
speculators' model before it saves, so that a draft that accepts sometimes is served from speculators' files.
Printed on stdout, one JSON line per draft:
{"out", "speculators_version", "target_layer_ids", "files"}.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from importlib.metadata import version


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    specs = json.loads(open(argv[0]).read())
    for spec in specs:
        write(spec)
    return 0


def write(spec: dict) -> None:
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(int(spec.get("seed", 0)))
    layer = create_transformer_layer_config(
        verifier_name_or_path=spec["verifier"],
        num_layers=1,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=2048,  # speculators train's default (train/config/schema.py)
        full_attention_indices=[],
    )
    d2t = t2d = None
    if spec.get("vocab_map"):
        m = load_file(spec["vocab_map"])
        d2t, t2d = m["d2t"], m["t2d"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "target layers not explicitly set" where the test means it
        model = Eagle3DraftModel.from_training_args(
            verifier_config=layer,
            t2d=t2d,
            d2t=d2t,
            draft_vocab_size=spec["draft_vocab_size"],
            norm_before_residual=False,
            norm_before_fc=bool(spec.get("norm_before_fc")),
            fc_norm=bool(spec.get("fc_norm")),
            norm_output=bool(spec.get("norm_output")),
            ttt_steps=int(spec["ttt_steps"]),
            verifier_name_or_path=spec["verifier"],
            target_layer_ids=spec.get("target_layer_ids"),
        )
    if spec.get("norm_before_fc") or spec.get("fc_norm"):
        # RMSNorm weights start at 1, where a norm left out would go unseen; make them tell
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(("input_norm.", "fc_norm.")):
                    p.uniform_(0.5, 1.5)
    if spec.get("weights"):
        trained = {("layers.0." + k[len("midlayer.") :]) if k.startswith("midlayer.") else k: v
                   for k, v in load_file(spec["weights"]).items()}  # fmt: skip
        own = {k for k in model.state_dict() if not k.startswith(("verifier_", "embed_tokens."))}
        if set(trained) - {"embed_tokens.weight"} != own:
            raise SystemExit(f"weights do not fit speculators' model: {sorted(set(trained) ^ own)}")
        model.load_state_dict(trained, strict=False)
    model.save_pretrained(spec["out"])
    info = {
        "out": spec["out"],
        "speculators_version": version("speculators"),
        "target_layer_ids": list(model.target_layer_ids),
        "files": sorted(os.listdir(spec["out"])),
    }
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
