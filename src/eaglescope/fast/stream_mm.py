"""Products of a few rows against a layer's weight, the weight's tiles fetched by TMA (Hopper's tensor-memory
accelerator): x [T, K] @ weight.T for the fused verify's 24 rows and the fused draft level's 1-7.

Why: at these row counts a product is a weight stream, and the libraries read the narrow ones well under the copy
bandwidth (q/k/v, o, down: 80-92% on an H100) because their tiles are sized for more rows. Here one program owns a
column tile of the weight (the tensor-core product's M side, where the few rows could not fill it) and a slice of K;
TMA brings each [BN, BK] weight tile into shared memory on one thread's request, several tiles ahead (STAGES), so
the SM's warps spend their issue slots on the product, not on addresses. Rows past T come back as zeros.
bench/skinny_products.py measured it against cuBLAS, cuBLASLt and split_k_mm at every product of the 8B verify
(24 rows) and draft level (4 rows) on one H100 (bench/results/skinny-products-20261206T125137.json): faster at all
nine, by 1-3% for the wide ones and 3-10% for q/k/v, down and the draft's head (88.7 against 98.6 µs).

With one split the output is [T, N] in x's dtype (float32 accumulation, rounded once, as a library product); with
more, float32 partials [splits, T, N] in split order, which the next kernel sums (the fused verify's norm and RoPE
kernels do, as they sum split_k_mm's). Hopper or later; under Triton's interpreter it runs on the CPU for the tests.
"""

from __future__ import annotations

import torch

from eaglescope.fast.invariant import INTERPRETED, triton

if triton is not None:
    import triton.language as tl

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton before host-side tensor descriptors (3.4)
        TensorDescriptor = None
else:
    TensorDescriptor = None

# (BN weight rows a program, BK, K splits, pipeline stages) per product: the fastest of bench/skinny_products.py's
# sweep on an H100 (skinny-products-20261206T125137.json) at the 8B verify's 24 rows and the draft level's 4. The
# verify's lm_head can run on it too (a tuning file's "stream" key names it), but has no default launch: at 24 rows
# its _rows_gemm_kernel already reads the 128k head as fast (343.0 against 342.2 µs on an H100,
# skinny-products-20261206T155709.json)
STREAM_LAUNCH: dict[str, dict[str, tuple[int, int, int, int]]] = {
    "verify": {"qkv": (64, 128, 2, 3), "o": (64, 128, 4, 3), "gate_up": (128, 128, 1, 3), "down": (64, 128, 4, 3)},
    "draft": {"qkv": (64, 128, 4, 3), "o": (64, 128, 4, 3), "gate_up": (64, 128, 1, 6), "down": (64, 128, 4, 3),
              "lm_head": (64, 256, 1, 3)},
}  # fmt: skip
# the products whose next kernel sums float32 partials (so their launch may split K): q/k/v's by the RoPE kernel,
# o's and down's by the next norm
SUMMED = ("qkv", "o", "down")
MAX_ROWS = 256  # a TMA box is at most 256 rows
WARPS = 4

if triton is not None:

    @triton.jit
    def _stream_mm_kernel(w_desc, x_desc, y, T, N, K_SLICE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                          BK: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
        """Program (column tile, split): y[split, :T, tile] = x[:T, slice] @ w[tile, slice].T, accumulated in float32
        in K order. UPCAST: the operands to float32 first (the interpreter's tl.dot misreads bf16 tiles that came
        from a descriptor; the GPU's does not)."""
        n0 = tl.program_id(0) * BN
        sp = tl.program_id(1)
        acc = tl.zeros((BN, BM), tl.float32)
        for k in tl.range(sp * K_SLICE, (sp + 1) * K_SLICE, BK, num_stages=STAGES):
            w = w_desc.load([n0, k])
            x = x_desc.load([0, k])
            if UPCAST:
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")  # float32 tiles: no TF32 rounding
        n = n0 + tl.arange(0, BN)
        t = tl.arange(0, BM)
        at = y + sp * T * N + t[None, :] * N + n[:, None]
        tl.store(at, acc.to(y.dtype.element_ty), mask=(t[None, :] < T) & (n[:, None] < N))


def stream_available(device: torch.device | str) -> bool:
    """Whether stream_mm runs here by default: a Hopper-or-later GPU and a Triton with tensor descriptors. (Under
    the interpreter it runs when asked, but is no default: the interpreted tl.dot rounds a row by its place in the
    tile, fast/invariant.py.)"""
    device = torch.device(device)
    if TensorDescriptor is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def default_stream(kind: str, weight: torch.Tensor) -> dict[str, tuple[int, int, int, int]]:
    """STREAM_LAUNCH[kind] ("verify" or "draft") where stream_mm runs by default for weights like `weight`: on a
    Hopper-or-later GPU, in bf16 or fp16 (the launches were measured there; float32 tiles take twice the shared
    memory and no tensor cores, so float32 runs it only where a caller names launches), else none."""
    if weight.dtype not in (torch.bfloat16, torch.float16) or not stream_available(weight.device):
        return {}
    return dict(STREAM_LAUNCH[kind])


def stream_fits(x: torch.Tensor, weight: torch.Tensor, launch: tuple[int, ...]) -> bool:
    """Whether `launch` can run x @ weight.T: whole BK tiles in every K slice, rows a TMA box holds, 16-byte aligned
    rows (TMA's rule for a descriptor's strides and base)."""
    bn, bk, splits, _ = launch
    T, K = x.shape
    size = x.element_size()
    aligned = all(t.stride(1) == 1 and t.stride(0) * size % 16 == 0 and t.data_ptr() % 16 == 0 for t in (x, weight))
    return (
        TensorDescriptor is not None
        and 1 <= T <= MAX_ROWS
        and weight.shape[1] == K
        and x.dtype == weight.dtype
        and K % (splits * bk) == 0
        and aligned
    )


def stream_mm(x: torch.Tensor, weight: torch.Tensor, launch: tuple[int, ...], out: torch.Tensor | None = None):
    """x [T, K] @ weight.T per `launch` (BN, BK, splits, stages): [T, N] in x's dtype with one split (into `out`
    where given), else float32 partials [splits, T, N] for the next kernel to sum."""
    if not stream_fits(x, weight, launch):
        raise ValueError(f"stream_mm cannot run {tuple(x.shape)} @ {tuple(weight.shape)}.T at launch {launch}")
    bn, bk, splits, stages = launch
    T, K = x.shape
    N = weight.shape[0]
    if splits > 1:
        out = torch.empty(splits, T, N, device=x.device, dtype=torch.float32)
    elif out is None:
        out = torch.empty(T, N, device=x.device, dtype=x.dtype)
    bm = max(16, triton.next_power_of_2(T))
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    _stream_mm_kernel[(triton.cdiv(N, bn), splits)](w_desc, x_desc, out, T, N, K_SLICE=K // splits, BN=bn, BM=bm,
                                                    BK=bk, STAGES=stages, UPCAST=INTERPRETED, num_warps=WARPS,
                                                    num_stages=stages)  # fmt: skip
    return out


def stream_launch(launches: dict[str, tuple[int, ...]], name: str, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[int, ...] | None:  # fmt: skip
    """The launch for product `name` if stream_mm runs it here: named in `launches`, no bias (the library product
    adds it), and a shape the launch fits; else None (the caller's library path)."""
    launch = launches.get(name)
    if launch is None or bias is not None or not stream_fits(x, weight, launch):
        return None
    return launch
