"""Building blocks of the static-shape path: Linear variants for one-row products and float32 logits, row-wise argmax,
and compile switches (the slot cache and greedy acceptance are the round's own: decode/round.py, decode/verify.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GemvLinear(nn.Module):
    """A Linear whose one-row case is written as multiply-and-sum.

    Why: at batch 1 a decode step is a chain of matrix-vector products. cuBLAS runs them as GEMMs with M=1;
    written as a row reduction, torch.compile emits one bandwidth-bound Triton kernel per product (fp32
    accumulation, weights read once, tunable block sizes). Several rows (verify, prefill) keep F.linear.
    Only for modules that run compiled: eagerly the elementwise product would be materialised."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() != 1:
            return F.linear(x, self.weight, self.bias)
        y = (x.reshape(1, -1).float() * self.weight.float()).sum(-1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], -1)


class Float32Logits(nn.Module):
    """An lm_head with low-precision weights whose logits come out in float32.

    Why: bf16 logits carry ~3 significant digits, so the greedy argmax over them ties often, and any change of
    kernel (a T-token verify instead of a 1-token step) flips those ties and the outputs diverge. The same
    product accumulated in float32 and kept in float32 removes that noise source at no extra weight traffic."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.mm_out_dtype = (
            self.weight.is_cuda and self.weight.dtype != torch.float32 and _has_mm_out_dtype(self.weight)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.mm_out_dtype:
            y = torch.mm(flat, self.weight.t(), out_dtype=torch.float32)
        else:  # no mixed-precision matmul here: upcast (exact, costs one weight conversion per call)
            y = F.linear(flat.float(), self.weight.float())
        return y.view(*x.shape[:-1], -1)


def _has_mm_out_dtype(w: torch.Tensor) -> bool:
    try:
        torch.mm(w[:2], w[:2].t(), out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def use_gemv_reductions(model: nn.Module, enable: bool = True) -> nn.Module:
    """Swap every nn.Linear of `model` for a GemvLinear sharing its weights, or back with enable=False (in place);
    returns `model`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if enable and type(child) is nn.Linear:
                setattr(parent, name, GemvLinear(child))
            elif not enable and isinstance(child, GemvLinear):
                plain = nn.Linear(1, 1, bias=child.bias is not None, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
    return model


def allow_recompiles(limit: int = 64) -> None:
    """Let one compiled function keep up to `limit` graphs (torch's default is 8): the static backend compiles the
    same code once per shape (each decoder layer's, each tree budget's pieces, each draft's), and past the limit
    dynamo silently runs it uncompiled."""
    torch._dynamo.config.cache_size_limit = max(limit, torch._dynamo.config.cache_size_limit)


def compile_layers(modules) -> None:
    """Regional compilation: every decoder layer has the same code, so one compiled block serves them all
    (fuses the norm/RoPE/residual kernels that dominate a batch-1 step) at a fraction of the compile time
    of a whole model per shape."""
    allow_recompiles()
    for m in modules:
        m.compile()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] → x.argmax(-1) (the first maximum of each row), in two parallel stages: the max of each chunk of
    C logits, then the best chunk. Why: torch reduces a row in one thread block, so over a 128k vocabulary one
    argmax took 38 µs of an 8B decode step on an H200 (bench-all-20261129T131731.json, decode_profile)."""
    R, V = x.shape
    chunk = next((c for c in range(2048, 255, -1) if V % c == 0), None)
    if chunk is None:
        return x.argmax(-1)
    vals, idx = x.reshape(R, V // chunk, chunk).max(-1)  # the first maximum within each chunk
    best = vals.argmax(-1, keepdim=True)  # the first chunk holding the row's maximum
    return (best * chunk + idx.gather(-1, best)).squeeze(-1)
