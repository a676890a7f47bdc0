"""fast/l2_prefetch.py's requests: which bytes of a product's weight the side stream's prefetch asks into L2, and the
inputs it refuses. The kernel's PTX (each request's size) is checked by tests/test_kernels_compile.py; that a verify
or a draft level with prefetching gives the same bits as without, and decodes as vanilla greedy, by tests/gpu."""

from __future__ import annotations

import pytest
import torch

from eaglescope.fast.l2_prefetch import (
    ALIGN,
    PIECE,
    L2Prefetcher,
    check_fractions,
    prefetch_bytes,
    prefetch_plan,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("fraction", [0.5, 0.0625, 1e-6])
def test_a_plan_asks_for_the_start_of_every_rows_k_slices(dtype, splits, fraction):
    w = torch.zeros(48, 4096, dtype=dtype)
    plan = prefetch_plan(w, fraction, splits)
    size = w.element_size()
    seg = 4096 // splits * size
    assert plan["pf"] is w and plan["pf_rows"] == 48 and plan["PF_SEGS"] == splits
    assert plan["pf_stride"] == 4096 * size and plan["pf_seg"] == seg
    # each request: the slice's first bytes, a multiple of 16, at least 16, at most the slice
    assert plan["PF_BYTES"] % ALIGN == 0 and ALIGN <= plan["PF_BYTES"] <= seg
    assert seg * fraction - ALIGN < plan["PF_BYTES"] or plan["PF_BYTES"] == ALIGN
    # the requests' starts: every row, every slice, none twice
    starts = {r * plan["pf_stride"] + s * plan["pf_seg"] for r in range(48) for s in range(splits)}
    assert len(starts) == 48 * splits and max(starts) + plan["PF_BYTES"] <= w.numel() * size


@pytest.mark.parametrize("rows,k", [(4096, 4096), (6144, 4096), (4096, 14336), (7, 4096), (33, 128)])
@pytest.mark.parametrize("splits", [1, 2])
def test_a_whole_matrix_is_asked_once_in_pieces_of_whole_rows(rows, k, splits):
    w = torch.zeros(rows, k, dtype=torch.bfloat16)
    plan = prefetch_plan(w, 1.0, splits)
    row = k * 2
    assert plan["PF_SEGS"] == 1 and plan["pf_seg"] == 0 and plan["PF_BYTES"] == plan["pf_stride"]
    assert plan["PF_BYTES"] % row == 0 and plan["PF_BYTES"] <= max(PIECE, row)
    assert prefetch_bytes(plan) == w.numel() * 2  # every byte, none past the end


def test_a_row_stride_wider_than_k_is_followed():
    w = torch.zeros(16, 8192, dtype=torch.bfloat16)[:, :4096]  # rows 16 KB apart, 8 KB used
    plan = prefetch_plan(w, 1.0)
    assert plan["pf_stride"] == 8192 * 2 and plan["PF_BYTES"] == 4096 * 2


def test_bad_requests_are_refused():
    w = torch.zeros(64, 4096, dtype=torch.bfloat16)
    for bad in (1.5, 0.0, -0.1):
        with pytest.raises(ValueError, match="fraction"):
            prefetch_plan(w, bad)
    with pytest.raises(ValueError, match="does not divide"):
        prefetch_plan(w, 0.5, splits=3)
    with pytest.raises(ValueError, match="unit-stride"):
        prefetch_plan(w.t(), 0.5)
    with pytest.raises(ValueError, match="aligned"):
        prefetch_plan(w.view(-1)[1 : 1 + 63 * 4096].view(63, 4096), 0.5)  # starts 2 bytes into an aligned buffer


def test_where_the_instruction_is_missing_nothing_is_launched():
    """On the CPU (Triton's interpreter has no inline assembly) the prefetcher has no side stream and launches nothing;
    a bad request is still refused."""
    w = torch.zeros(64, 4096, dtype=torch.bfloat16)
    pre = L2Prefetcher(w.device)
    pre(w, 0.5)
    assert pre.side is None and not pre.pending
    pre.join()
    with pytest.raises(ValueError, match="does not divide"):
        L2Prefetcher.__call__(_WithSide(), w, 0.5, 3)


class _WithSide(L2Prefetcher):
    """A prefetcher that has a side stream (a stand-in object: the CPU has none), to reach the request's checks."""

    def __init__(self) -> None:
        self.side, self.pending = object(), False


def test_fractions_name_known_products():
    assert check_fractions({"o": 1, "qkv": 0.25}, "here") == {"o": 1.0, "qkv": 0.25}
    with pytest.raises(ValueError, match="here: L2 prefetch names the products"):
        check_fractions({"attention": 1.0}, "here")
    with pytest.raises(ValueError, match="here: the L2 prefetch of o"):
        check_fractions({"o": 2.0}, "here")
