"""A product's weights into the GPU's L2 cache, on a side stream, while the small kernels before it run.

Why: in a 24-row verify at 8B the weights stream from memory only while a product runs. Between the products sit
the small kernels (two RMSNorms, RoPE and the cache write, attention, SiLU·up: ~18 µs a layer on an H200) and a
launch gap before and after each (~0.9 µs inside a CUDA graph): about a fifth of a layer's time, during which
memory is mostly idle (bench/NOTES.md, "Session of 2026-12-06, sixth"). Hopper's `cp.async.bulk.prefetch.L2` asks
the memory system to bring a range of bytes into L2; nothing is written and no register waits for it.

Issued from inside the small kernels themselves it cost more than it saved (an H100, e52e91d: the 24-row verify
5.978 → 6.073 ms with o's weights asked by the RoPE kernel, 6.312 with every product's first bytes asked by the
norms and SiLU): a kernel that asks is not done until the bytes have come, so the small kernel took as long as the
prefetch and everything after it waited. Here a prefetch is its own small launch on a side stream, forked from the
main stream where the product before has been queued (it starts when that product ends) and joined back by the
caller before it returns (a CUDA graph capture needs every forked stream joined): the small kernels on the main
stream run beside it.

What is prefetched, per product: the first `fraction` of each row's K range, or of each of its K slices when the
product runs as split_k_mm's partials (each slice's product starts at the slice's first column, so those bytes are
read first); fraction 1 is the whole matrix in large pieces (o at 8B is 33.5 MB; an H100's or H200's L2 holds 50).

The instruction exists from sm_90 on; under Triton's interpreter (the CPU tests) there is no inline assembly, so
nothing is launched there or on older GPUs.
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
# a whole matrix is asked in pieces of up to this many bytes (whole rows)
PIECE = 1 << 16
# requests a program issues at once (one per thread of its 4 warps), and the programs of a launch: few, so that a
# prefetch still running when the next product starts holds few of its SMs
LANES = 128
PROGRAMS = 8

if triton is not None:
    _LANES = tl.constexpr(LANES)

    @triton.jit
    def _l2_prefetch_kernel(pf, pf_rows, pf_stride, pf_seg, PF_BYTES: tl.constexpr, PF_SEGS: tl.constexpr):
        """`cp.async.bulk.prefetch.L2` of PF_BYTES at byte offsets r * pf_stride + s * pf_seg of pf, for rows
        r < pf_rows and segments s < PF_SEGS, spread over the launch's programs."""
        step = tl.num_programs(0) * _LANES
        base = pf.to(tl.pointer_type(tl.int8))
        n = pf_rows * PF_SEGS
        for i0 in range(tl.program_id(0) * _LANES, n, step):
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
    """Whether `device` can prefetch into L2 (a GPU of compute capability 9.0 or later, with Triton)."""
    return triton is not None and device.type == "cuda" and _prefetches(device)


def prefetch_plan(weight: torch.Tensor, fraction: float, splits: int = 1) -> dict:
    """The prefetch kernel's arguments for `fraction` (0 < fraction <= 1) of each row's `splits` K slices of a
    [N, K] weight: pf_rows requests' rows `pf_stride` bytes apart, PF_SEGS slices `pf_seg` bytes apart, PF_BYTES from
    each slice's start (rounded down to 16 bytes, at least 16). A whole contiguous matrix is asked in pieces of whole
    rows up to PIECE bytes."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"an L2 prefetch takes a fraction of each row in (0, 1], not {fraction}")
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
    if want == seg and seg * splits == row:  # the whole matrix, contiguous: r rows a request, r dividing N
        r = max(d for d in range(1, max(1, PIECE // row) + 1) if N % d == 0)
        return {"pf": weight, "pf_rows": N // r, "pf_stride": r * row, "pf_seg": 0, "PF_BYTES": r * row,
                "PF_SEGS": 1}  # fmt: skip
    return {"pf": weight, "pf_rows": N, "pf_stride": row, "pf_seg": seg, "PF_BYTES": want, "PF_SEGS": splits}


def prefetch_bytes(plan: dict) -> int:
    """The bytes a prefetch_plan asks for."""
    return plan["pf_rows"] * plan["PF_SEGS"] * plan["PF_BYTES"]


def check_fractions(fractions: dict[str, float], where: str) -> dict[str, float]:
    """{product: fraction} checked: known products, fractions in [0, 1] (0: none)."""
    bad = set(fractions) - set(PRODUCTS)
    if bad:
        raise ValueError(f"{where}: L2 prefetch names the products {PRODUCTS}, not {sorted(bad)}")
    for name, f in fractions.items():
        if not 0.0 <= float(f) <= 1.0:
            raise ValueError(f"{where}: the L2 prefetch of {name} is a fraction in [0, 1], not {f}")
    return {name: float(f) for name, f in fractions.items()}


class L2Prefetcher:
    """Prefetch launches on a side stream of `device`, each after the main stream's work queued so far; `join` makes
    the main stream wait for them (call it before returning, and inside the same graph capture). Nothing where the
    device cannot (`supported`)."""

    def __init__(self, device: torch.device) -> None:
        self.side = torch.cuda.Stream(device) if supported(device) else None
        self.pending = False

    def __call__(self, weight: torch.Tensor, fraction: float, splits: int = 1) -> None:
        if self.side is None or fraction == 0.0:
            return
        plan = prefetch_plan(weight, fraction, splits)
        self.side.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(self.side):
            _l2_prefetch_kernel[(PROGRAMS,)](**plan, num_warps=LANES // 32)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.pending = False
