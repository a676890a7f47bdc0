"""Run at start-up by every Python process that has tests/sglang/stand_ins on its path (SGLang's, in tests/sglang).
Two CPU-only fixes, neither touching SGLang's files.

1. torchvision.
PyPI's torchvision is a CUDA build: its native library needs libtorch_cuda.so, which the CPU torch of the SGLang test
environment does not have. torchvision then imports without its operators, except that
`torchvision/_meta_registrations.py` registers fake kernels for `torchvision::nms` and `::qnms` unconditionally and
fails with "operator torchvision::nms does not exist". SGLang 0.5.23 imports torchvision.transforms at start-up
(srt/multimodal/internvl_utils.py), so SGLang would not start. When, and only when, torchvision's native library did
not load, this declares those two operators' schemas (no kernels: calling them still fails) just before torchvision's
meta registrations run. Text models never call a torchvision operator.

2. torch.cuda.synchronize. SGLang 0.5.23's MLA draft (srt/models/kimi_k25_eagle3.py set_embed and
set_embed_and_head) calls torch.cuda.synchronize() unconditionally, which raises on a torch built without CUDA, so the
draft could not start on a CPU. Where CUDA is unavailable it is made a no-op (there is no device to wait for).
"""

from __future__ import annotations

import sys


class _DeclareNmsWithoutNativeOps:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision._meta_registrations":
            import torch
            import torchvision.extension

            if not torchvision.extension._has_ops():
                for op in ("nms", "qnms"):
                    schema = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
                    torch.library.define(f"torchvision::{op}", schema)
        return None  # the ordinary finders import the module


sys.meta_path.insert(0, _DeclareNmsWithoutNativeOps())


def _no_cuda_to_wait_for(device=None) -> None:
    return None


def _patch_cuda_synchronize() -> None:
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = _no_cuda_to_wait_for


_patch_cuda_synchronize()
