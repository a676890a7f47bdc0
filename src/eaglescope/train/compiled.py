"""`train --compile`: the training step's elementwise work fused by torch.compile, region by region.

Why: at 8B shape a step's matrix products run near the GPU's bf16 rate, and what is left is eager elementwise work,
one kernel per operation, each reading and writing whole [B, T, H] (or [B, T, FFN]) tensors: RMSNorm's six, RoPE's
five on q and k, SiLU and the gate product, the residual adds, and as many again in the draft's backward
(docs/training-speed.md has the profile). Compiled, each group becomes one or two Triton kernels.

What is compiled (regional compilation: a region's code is compiled once and serves every module running it):
- the target's decoder layers, whole (native Llama-family targets; transformers' models are left as they are): the
  target runs under inference mode, so only forward graphs;
- the draft layer's parts around its attention (`attention_input`: the two norms and the concatenation;
  `rotated_qkv`: the q/k/v products and RoPE; `feed_forward`: the post-attention norm, the MLP and the residual), its
  final norm and EAGLE 3.1's norms before fc. The attention itself stays outside: flex attention (train/attention.py)
  is compiled on its own, with its block masks built and kept outside any graph. (The loss needs no compilation: on
  a GPU it is two Triton kernels of its own, train/loss_kernels.py.)

The same function either way: the compiled regions compute what the modules compute (`tests/gpu` checks the loss, the
gradients and a trained draft's held-out acc_k against the eager run). The cost is a one-off compilation in the first
steps (the first is left out of the speed report; evaluation, in no-grad mode, compiles once more), so it pays on runs
of more than a few hundred steps, not on a demo's seconds: it is off unless asked for.
"""

from __future__ import annotations

import torch

from eaglescope.models.draft import Eagle3Draft
from eaglescope.models.drafts.llama import DraftAttention
from eaglescope.models.targets.llama import NativeTarget


def compile_training(target, draft: Eagle3Draft) -> list[str]:
    """Compile `target`'s layers (a native target) and the draft's regions in place → what was compiled, by name.
    The modules keep their parameters and names (state dicts, checkpoints and DDP see the same modules)."""
    # fast/ is the decoding fast path; imported here, where --compile asks for it, so the trainer never loads it
    from eaglescope.fast.layers import compile_layers

    done = []
    if isinstance(target, NativeTarget):
        compile_layers(target.model.model.layers)
        done.append(f"target: {len(target.model.model.layers)} decoder layers")
    layer = draft.midlayer
    layer.attention_input = torch.compile(layer.attention_input)
    layer.feed_forward = torch.compile(layer.feed_forward)
    done.append("draft: attention input, feed-forward")
    if type(layer.self_attn) is DraftAttention:  # an MLA draft's attention is one module of its own
        layer.self_attn.rotated_qkv = torch.compile(layer.self_attn.rotated_qkv)
        done.append("draft: q/k/v and RoPE")
    norms = [draft.norm, draft.input_norm, *(draft.fc_norm or [])]
    for norm in norms:
        if norm is not None:
            norm.compile()
    done.append("draft: norms")
    return done
