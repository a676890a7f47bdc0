"""Each `sgl_kernel` stand-in (tests/sglang/stand_ins) against SGLang 0.5.23's own version of the op. Runs in the
SGLang environment (scripts/sglang_env.sh), with the stand-ins on the path and TRITON_INTERPRET=1, so that SGLang's
Triton kernels (the GPU path of the same ops, in the installed sglang package) run on the CPU as the reference:

    python kernel_check.py OUT.json

OUT: {op: {"cases": n, "mismatches": [first few descriptions], "max_abs_diff": float (attention only)}}. Inputs come
from SGLang's own producers where it has them: the draft trees from `select_top_k_tokens` and
`organize_draft_results`, the verify inputs from `build_tree_kernel_efficient`. Attention is compared with SGLang's
torch-native backend (`TorchNativeAttnBackend`, plain SDPA over the same KV pool) and, for tree verify, with the
causal path on chain-shaped trees and with explicitly masked SDPA otherwise.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402

CASES = 12
RESULT: dict[str, dict] = {}


def record(op: str, ok: bool, what: str, diff: float | None = None) -> None:
    r = RESULT.setdefault(op, {"cases": 0, "mismatches": []})
    r["cases"] += 1
    if not ok and len(r["mismatches"]) < 5:
        r["mismatches"].append(what)
    if diff is not None:
        r["max_abs_diff"] = max(r.get("max_abs_diff", 0.0), diff)


def pool(g: torch.Generator, bs: int, pool_len: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A req_to_token table ([bs + 2, pool_len] int32) of distinct random slots, the requests in shuffled rows."""
    req_to_token = torch.randperm(slots, generator=g)[: (bs + 2) * pool_len].view(bs + 2, pool_len).int()
    req_pool_indices = torch.randperm(bs + 2, generator=g)[:bs]
    seq_lens = torch.randint(1, pool_len // 2, (bs,), generator=g)
    return req_to_token.contiguous(), req_pool_indices, seq_lens


def check_cache_ops(g: torch.Generator) -> None:
    import sgl_kernel
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous, assign_extend_cache_locs
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc, fill_bonus_tokens
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
    from sglang.srt.utils import next_power_of_2

    for case in range(CASES):
        bs, pool_len = int(torch.randint(1, 5, (1,), generator=g)), 64
        for index_dtype in (torch.int32, torch.int64):
            rtt, rpi, sl = pool(g, bs, pool_len, 4096)
            rpi, sl = rpi.to(index_dtype), sl.to(index_dtype)
            ends = sl + torch.randint(0, 8, (bs,), generator=g).to(index_dtype)
            n = int((ends - sl).sum())
            loc = torch.randperm(4096, generator=g)[:n] + 5000
            ours, ref = rtt.clone(), rtt.clone()
            sgl_kernel.assign_req_to_token_pool_cpu(rpi, ours, sl, ends, loc, pool_len)
            assign_req_to_token_pool[(bs,)](rpi, ref, sl, ends, loc, pool_len, next_power_of_2(bs))
            record("assign_req_to_token_pool_cpu", torch.equal(ours, ref), f"case {case} {index_dtype}")

            ours, ref = torch.full((n,), -7), torch.full((n,), -7)
            sgl_kernel.assign_extend_cache_locs_cpu(rpi, rtt, sl, ends, ours, pool_len)
            assign_extend_cache_locs[(bs,)](rpi, rtt, sl, ends, ref, pool_len, next_power_of_2(bs))
            record("assign_extend_cache_locs_cpu", torch.equal(ours, ref), f"case {case} {index_dtype}")

            topk, steps = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
            ours, ref = torch.full((bs * topk * steps,), -7), torch.full((bs * topk * steps,), -7)
            sgl_kernel.assign_draft_cache_locs_contiguous_cpu(rpi, rtt, sl, ours, pool_len, topk, steps)
            assign_draft_cache_locs_contiguous[(bs,)](rpi, rtt, sl, ref, pool_len, topk, steps, BS=bs)
            record("assign_draft_cache_locs_contiguous_cpu", torch.equal(ours, ref), f"case {case} {index_dtype}")

            # The draft decode table: documented layout (spec.cpp), built here independently.
            table = sgl_kernel.build_draft_decode_metadata_cpu(rtt, rpi, sl, topk, steps, pool_len)
            ok = table.shape == (bs * topk, pool_len) and table.dtype == torch.int32
            for b in range(bs):
                src, s = rtt[int(rpi[b])], int(sl[b])
                for t in range(topk):
                    want = torch.cat([src[:s], src[s + t * steps : s + (t + 1) * steps]])
                    ok = ok and torch.equal(table[b * topk + t, : s + steps], want)
            record("build_draft_decode_metadata_cpu", ok, f"case {case} {index_dtype}")

        stride = int(torch.randint(1, 5, (1,), generator=g))
        tokens = torch.randint(0, 1000, (bs, stride), generator=g).int()
        lens = torch.randint(1, stride + 1, (bs,), generator=g).int()
        ours, ref = torch.zeros(bs, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32)
        sgl_kernel.fill_bonus_tokens_cpu(tokens, lens, ours, stride)
        fill_bonus_tokens[(bs,)](tokens, lens, ref, stride)
        record("fill_bonus_tokens_cpu", torch.equal(ours, ref), f"case {case}")

        size = bs * stride
        accept = torch.arange(size).int()
        accept[torch.rand(size, generator=g) < 0.4] = -1
        out_loc = torch.randperm(4096, generator=g)[:size]
        kept = int((accept != -1).sum())
        ours, ref = torch.full((size,), -7), torch.full((size,), -7)
        sgl_kernel.fill_accept_out_cache_loc_cpu(accept, out_loc, ours)
        fill_accept_out_cache_loc[(size,)](accept, out_loc, ref, next_power_of_2(size))
        record("fill_accept_out_cache_loc_cpu", torch.equal(ours[:kept], ref[:kept]), f"case {case}")


def draft_tree(g: torch.Generator, bs: int, topk: int, steps: int, num_verify: int, vocab: int = 50):
    """A draft tree as SGLang's EAGLE worker makes one: `steps` rounds of select_top_k_tokens over random draft
    distributions, then organize_draft_results."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    def topk_of(rows: int):
        p = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, dim=-1)
        return torch.topk(p, topk, dim=-1)

    topk_p, topk_index = topk_of(bs)
    hidden, scores = torch.randn(bs, 8, generator=g), None
    score_list, token_list, parents_list = [], [], []
    for i in range(steps):
        _, hidden, scores, tree_info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        score_list.append(tree_info[0])
        token_list.append(tree_info[1])
        parents_list.append(tree_info[2])
        if i < steps - 1:
            topk_p, topk_index = topk_of(bs * topk)
    return organize_draft_results(score_list, token_list, parents_list, num_verify)


def check_tree_ops(g: torch.Generator) -> None:
    import sgl_kernel
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, verify_tree_greedy_triton
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    for case in range(CASES):
        bs = int(torch.randint(1, 4, (1,), generator=g))
        topk = int(torch.randint(1, 4, (1,), generator=g))
        steps = int(torch.randint(1, 5, (1,), generator=g))
        num_verify = int(torch.randint(2, topk * steps + 2, (1,), generator=g)) if topk > 1 else steps + 1
        parent_list, sel, draft_tokens = draft_tree(g, bs, topk, steps, num_verify)
        seq_lens = torch.randint(3, 20, (bs,), generator=g)
        for mode in (TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK):
            size = bs * num_verify * num_verify + (int(seq_lens.sum()) * num_verify if mode == TreeMaskMode.FULL_MASK
                                                   else 0)  # fmt: skip
            outs = []
            for fn in (sgl_kernel.build_tree_kernel_efficient_cpu, sgl_build_tree_kernel_triton):
                mask = torch.ones(size, dtype=torch.bool)
                pos = torch.full((bs * num_verify,), -7)
                ri, rnt, rns = torch.full((3, bs, num_verify), -1).clone()
                fn(parent_list, sel, seq_lens, mask, pos, ri, rnt, rns, topk, steps, num_verify, int(mode))
                outs.append((mask, pos, ri, rnt, rns))
            ok = all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
            record("build_tree_kernel_efficient_cpu", ok, f"case {case} bs={bs} topk={topk} steps={steps} {mode}")

        # verify: the target agrees with the draft at random nodes, so paths of every length get accepted
        _, _, ri, rnt, rns = outs[0]
        bonus = torch.randint(0, 50, (bs, 1), generator=g)
        candidates = torch.cat([bonus, draft_tokens], dim=1)
        target = torch.randint(0, 50, (bs, num_verify), generator=g)
        for b in range(bs):  # make each node's target token its first child's draft token, most of the time
            for node in range(num_verify):
                child = int(rnt[b, node])
                if child != -1 and torch.rand(1, generator=g) < 0.7:
                    target[b, node] = candidates[b, child]
        spec_steps = steps + 1
        outs = []
        for fn in (sgl_kernel.verify_tree_greedy_cpu, verify_tree_greedy_triton):
            predicts = torch.full((bs * num_verify,), -7, dtype=torch.int32)
            accept_index = torch.full((bs, spec_steps), -1, dtype=torch.int32)
            accept_num = torch.full((bs,), -7, dtype=torch.int32)
            fn(predicts, accept_index, accept_num, candidates, ri, rnt, rns, target)
            outs.append((predicts, accept_index, accept_num))
        ok = all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
        record("verify_tree_greedy_cpu", ok, f"case {case} bs={bs} topk={topk} steps={steps}")


def check_copy(g: torch.Generator) -> None:
    import sgl_kernel
    from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled

    for case in range(CASES):
        layers = [torch.randn(32, 4, 8, generator=g) for _ in range(3)]
        n = int(torch.randint(1, 8, (1,), generator=g))
        src, tgt = torch.randperm(32, generator=g)[:n], torch.randperm(32, generator=g)[:n]
        results = []
        for run in ("ours", "ref"):
            bufs = [t.clone() for t in layers]
            ptrs = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)
            strides = torch.tensor([t[0].numel() * t.element_size() for t in bufs], dtype=torch.int64)
            if run == "ours":
                sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
            else:  # in the interpreter the pointers are plain addresses, as on the GPU
                tile = 128
                grid = (len(bufs), (int(strides.max()) + tile - 1) // tile)
                copy_all_layer_kv_cache_tiled[grid](ptrs, strides, tgt, src, n, 8, BYTES_PER_TILE=tile)
            results.append(bufs)
        ok = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
        record("copy_all_layer_kv_cache_cpu", ok, f"case {case}")

        # weak_ref_tensor: the same memory, shape and dtype (what the graph runners read through it)
        t = layers[case % 3][: 1 + case]
        ref = sgl_kernel.weak_ref_tensor(t)
        ok = ref.data_ptr() == t.data_ptr() and ref.shape == t.shape and ref.dtype == t.dtype and torch.equal(ref, t)
        record("weak_ref_tensor", ok, f"case {case}")


def check_attention(g: torch.Generator) -> None:
    import torch.nn.functional as F
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)  # only its SDPA helpers are used
    for case in range(CASES):
        bs, pool_len = int(torch.randint(1, 4, (1,), generator=g)), 48
        hq, hk = [(4, 2), (2, 2), (4, 1)][case % 3]
        d, dv = (16, 16) if case % 2 == 0 else (24, 16)  # MLA-like: keys wider than values
        scale = d**-0.5
        rtt, rpi, sl = pool(g, bs, pool_len, 512)
        k_buf, v_buf = torch.randn(512, hk, d, generator=g), torch.randn(512, hk, dv, generator=g)

        # decode: one query per request over its first seq_lens tokens; the new token's k/v written at loc first
        q = torch.randn(bs, hq, d, generator=g)
        key, value = torch.randn(bs, hk, d, generator=g), torch.randn(bs, hk, dv, generator=g)
        loc = torch.stack([rtt[int(rpi[b]), int(sl[b]) - 1] for b in range(bs)]).long()
        ours_k, ours_v, out = k_buf.clone(), v_buf.clone(), torch.empty(bs, hq, dv)
        logits = torch.empty(bs, hq, 8, dv + 1)
        torch.ops.sgl_kernel.decode_attention_cpu(q, ours_k, ours_v, 1.0, 1.0, out, key, value, loc, logits, rtt, rpi,
                                                  sl, scale, 0.0, False, 0, None, None)  # fmt: skip
        ref_k, ref_v, ref = k_buf.clone(), v_buf.clone(), torch.empty(bs, hq, dv)
        ref_k[loc], ref_v[loc] = key, value
        backend._run_sdpa_forward_decode(q, ref, ref_k, ref_v, rtt, rpi, sl, scaling=scale, enable_gqa=hq != hk)
        diff = float((out - ref).abs().max())
        ok = torch.equal(ours_k, ref_k) and torch.equal(ours_v, ref_v) and diff < 1e-5
        record("decode_attention_cpu", ok, f"case {case} diff {diff}", diff)

        # extend: the last ext of seq_lens tokens are new (already in the pool, as the backend stores them first)
        ext = torch.minimum(torch.randint(1, 6, (bs,), generator=g), sl)
        start = torch.cumsum(ext, 0) - ext
        q = torch.randn(int(ext.sum()), hq, d, generator=g)
        rows = torch.cat([rtt[int(rpi[b]), int(sl[b] - ext[b]) : int(sl[b])] for b in range(bs)]).long()
        k_new, v_new = k_buf[rows], v_buf[rows]
        out, ref = torch.empty(q.shape[0], hq, dv), torch.empty(q.shape[0], hq, dv)
        torch.ops.sgl_kernel.extend_attention_cpu(q, k_new, v_new, out, k_buf, v_buf, 1.0, 1.0, rtt, rpi, sl, ext,
                                                  start.int(), int(ext.max()), scale, 0.0, False, 0, None, None, None,
                                                  True)  # fmt: skip
        backend._run_sdpa_forward_extend(q, ref, k_buf, v_buf, rtt, rpi, sl, sl - ext, ext, scaling=scale,
                                         enable_gqa=hq != hk, causal=True)  # fmt: skip
        diff = float((out - ref).abs().max())
        record("extend_attention_cpu", diff < 1e-5, f"case {case} causal diff {diff}", diff)

        # tree verify: a QLEN_ONLY mask over the new tokens (the prefix visible); reference: SDPA with that mask
        tree = torch.rand(int((ext * ext).sum()), generator=g) < 0.5
        out = torch.empty(q.shape[0], hq, dv)
        torch.ops.sgl_kernel.extend_attention_cpu(q, k_new, v_new, out, k_buf, v_buf, 1.0, 1.0, rtt, rpi, sl, ext,
                                                  start.int(), int(ext.max()), scale, 0.0, False, 0, None, None, tree,
                                                  True)  # fmt: skip
        offset, diffs = 0, []
        for b in range(bs):
            n, s = int(ext[b]), int(sl[b])
            visible = torch.ones(n, s, dtype=torch.bool)
            visible[:, s - n :] = tree[offset : offset + n * n].view(n, n)
            offset += n * n
            seq = rtt[int(rpi[b]), :s].long()
            kk = k_buf[seq].transpose(0, 1).repeat_interleave(hq // hk, 0)
            vv = v_buf[seq].transpose(0, 1).repeat_interleave(hq // hk, 0)
            qq = q[int(start[b]) : int(start[b]) + n].transpose(0, 1)
            want = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=visible, scale=scale).transpose(0, 1)
            got = out[int(start[b]) : int(start[b]) + n]
            rows_seen = visible.any(-1)  # a row that sees nothing is NaN in both
            if rows_seen.any():
                diffs.append(float((got[rows_seen] - want[rows_seen]).abs().max()))
        worst = max(diffs, default=0.0)
        record("extend_attention_cpu", worst < 1e-5, f"case {case} tree diff {worst}", worst)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: kernel_check.py OUT.json", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    for check in (check_cache_ops, check_tree_ops, check_copy, check_attention):
        try:
            check(g)
        except Exception as e:  # noqa: BLE001 - the test names the check that could not run
            RESULT.setdefault(f"error:{check.__name__}", {"cases": 0, "mismatches": [f"{type(e).__name__}: {e}"]})
    with open(argv[1], "w") as f:
        json.dump(RESULT, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
