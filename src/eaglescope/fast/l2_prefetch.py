"""A product's weights into the GPU's L2 cache while the small kernels before it run.

Why: in a 24-row verify at 8B the weights stream from memory only while a product runs. Between the products sit
the small kernels (two RMSNorms, RoPE and the cache write, attention, SiLU·up: ~18 µs a layer on an H200) and a
launch gap before and after each (~0.9 µs inside a CUDA graph): about a quarter of a layer's time, during which
memory is idle (bench/NOTES.md, "Session of 2026-12-06, sixth"). Hopper's `cp.async.bulk.prefetch.L2` asks the
memory system to bring a range of bytes into L2 and returns at once: no registers, no wait, nothing written. A
small kernel that issues it for the next product's first bytes keeps memory busy through its own run and the
gaps, and the product then reads those bytes from L2. The small kernel's own results are unchanged (a prefetch
reads, and only into the cache), so its callers' outputs are bit for bit the same with or without it.

What is prefetched, per product: the first `fraction` of each row's K range, or of each of its K slices when the
product runs as split_k_mm's partials (each slice's products start at the slice's first column, so those bytes are
the ones read first). Fraction 1 is the whole matrix (o at 8B is 33.5 MB; an H100's or H200's L2 holds 50 MB).

The instruction exists from sm_90 on; under Triton's interpreter (the CPU tests) there is no inline assembly, so
`prefetch_args` asks for nothing there and on older GPUs, and the kernels' PF_BYTES = 0 compiles the call away.
"""

from __future__ import annotations

import functools

import torch

from eaglescope.fast.invariant import triton

if triton is not None:
    import triton.language as tl

# the products a verify or a fused draft level may prefetch, in the order a layer runs them
PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")
# bulk prefetch sizes and addresses are multiples of 16 bytes (PTX ISA, cp.async.bulk.prefetch)
ALIGN = 16
# prefetch requests a program issues at once: one per thread of a 4-warp program
LANES = 128

if triton is not None:
    _LANES = tl.constexpr(LANES)

    @triton.jit
    def l2_prefetch(pf, pf_rows, pf_stride, pf_seg, PF_BYTES: tl.constexpr, PF_SEGS: tl.constexpr):
        """Issue `cp.async.bulk.prefetch.L2` of PF_BYTES at byte offsets r * pf_stride + s * pf_seg of pf, for rows
        r < pf_rows and segments s < PF_SEGS, spread over every program of the launch (a 1- or 2-D grid); PF_BYTES
        0: nothing (compiled away)."""
        if PF_BYTES > 0:
            pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            step = tl.num_programs(0) * tl.num_programs(1) * _LANES
            base = pf.to(tl.pointer_type(tl.int8))
            n = pf_rows * PF_SEGS
            for i0 in range(pid * _LANES, n, step):
                i = i0 + tl.arange(0, _LANES)
                at = (i // PF_SEGS).to(tl.int64) * pf_stride + (i % PF_SEGS).to(tl.int64) * pf_seg
                at = tl.where(i < n, at, 0)  # a lane past the end asks again for the first bytes: harmless
                tl.inline_asm_elementwise(
                    f"cp.async.bulk.prefetch.L2.global [$1], {PF_BYTES};\n\tmov.u32 $0, 0;",
                    "=r,l",
                    [base + at],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )


@functools.cache
def _prefetches(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can prefetch into L2 (a GPU of compute capability 9.0 or later)."""
    return triton is not None and device.type == "cuda" and _prefetches(device)


def prefetch_args(weight: torch.Tensor, fraction: float = 0.0, splits: int = 1) -> dict:
    """A small kernel's launch keywords that prefetch `fraction` (0 < fraction <= 1) of each of a [N, K] weight's
    rows, or of each of its `splits` K slices, into L2 (prefetch_plan); keywords that ask for nothing where fraction
    is 0 or the device cannot (`supported`)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"an L2 prefetch takes a fraction of each row in [0, 1], not {fraction}")
    if fraction == 0.0 or not supported(weight.device):
        return {"pf": weight, "pf_rows": 0, "pf_stride": 0, "pf_seg": 0, "PF_BYTES": 0, "PF_SEGS": 1}
    return prefetch_plan(weight, fraction, splits)


def prefetch_plan(weight: torch.Tensor, fraction: float, splits: int = 1) -> dict:
    """The keywords for `fraction` of each row's K slices of a [N, K] weight on any device: N rows `pf_stride` bytes
    apart, `PF_SEGS` slices `pf_seg` bytes apart, `PF_BYTES` from each slice's start (rounded down to 16 bytes, at
    least 16)."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"an L2 prefetch reads [N, K] weights with unit-stride rows, not {tuple(weight.shape)}")
    N, K = weight.shape
    if splits < 1 or K % splits:
        raise ValueError(f"an L2 prefetch cuts K = {K} into equal slices: {splits} does not divide it")
    size, row = weight.element_size(), weight.stride(0) * weight.element_size()
    seg = K // splits * size
    if weight.data_ptr() % ALIGN or row % ALIGN or seg % ALIGN:
        raise ValueError("an L2 prefetch needs 16-byte aligned rows and K slices")
    want = min(seg, max(ALIGN, int(seg * fraction) // ALIGN * ALIGN))
    return {"pf": weight, "pf_rows": N, "pf_stride": row, "pf_seg": seg, "PF_BYTES": want, "PF_SEGS": splits}


def prefetch_bytes(args: dict) -> int:
    """The bytes `prefetch_args`'s keywords ask for."""
    return args["pf_rows"] * args["PF_SEGS"] * args["PF_BYTES"]


def check_fractions(fractions: dict[str, float], where: str) -> dict[str, float]:
    """{product: fraction} checked: known products, fractions in [0, 1]."""
    bad = set(fractions) - set(PRODUCTS)
    if bad:
        raise ValueError(f"{where}: L2 prefetch names the products {PRODUCTS}, not {sorted(bad)}")
    for name, f in fractions.items():
        if not 0.0 <= float(f) <= 1.0:
            raise ValueError(f"{where}: the L2 prefetch of {name} is a fraction in [0, 1], not {f}")
    return {name: float(f) for name, f in fractions.items()}
