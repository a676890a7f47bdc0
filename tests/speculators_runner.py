"""Load a `speculators convert` output in speculators' own EAGLE-3 model and run its forward. Runs in the speculators
environment (scripts/speculators_env.sh), never in eaglescope's: it imports speculators, torch, safetensors and the
standard library only.

    python speculators_runner.py CONVERTED INPUTS.safetensors OUT.safetensors [CONVERTED INPUTS OUT ...]

INPUTS: aux [1, T, 3H] (the target's taps, concatenated), input_ids [1, T] (already shifted: the token after each
position, as speculators pairs them), position_ids [1, T], ttt_steps (a scalar). OUT: step{k} [1, T, Vd] the draft
logits of TTT step k (what lm_head returned, caught by a forward hook: the forward itself returns only argmax
tokens), embed_tokens, d2t, t2d. Printed on stdout, one JSON line per checkpoint: {"target_layer_ids",
"speculators_version"}. Several triples run in one process (one import of speculators).
"""

from __future__ import annotations

import json
import sys
import warnings
from importlib.metadata import version


def main(argv: list[str]) -> int:
    if not argv or len(argv) % 3:
        print(__doc__, file=sys.stderr)
        return 2
    for i in range(0, len(argv), 3):
        run_one(*argv[i : i + 3])
    return 0


def run_one(converted: str, inputs: str, out: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from speculators.models.eagle3.core import Eagle3DraftModel

    with warnings.catch_warnings():
        # "target layers not explicitly set" is the point of one of the checks, not noise to print
        warnings.simplefilter("ignore")
        model = Eagle3DraftModel.from_pretrained(converted).eval()
    x = load_file(inputs)
    logits: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o.detach().clone()))
    with torch.no_grad():
        model(
            hidden_states=x["aux"],
            input_ids=x["input_ids"],
            document_ids=torch.zeros_like(x["input_ids"]),  # one document: plain causal attention
            position_ids=x["position_ids"],
            ttt_steps=int(x["ttt_steps"]),
        )
    tensors = {f"step{k}": t.contiguous() for k, t in enumerate(logits)}
    tensors["embed_tokens"] = model.embed_tokens.weight.detach().contiguous()
    for name in ("d2t", "t2d"):
        if getattr(model, name, None) is not None:
            tensors[name] = getattr(model, name).contiguous()
    save_file(tensors, out)
    info = {"target_layer_ids": list(model.target_layer_ids), "speculators_version": version("speculators")}
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
