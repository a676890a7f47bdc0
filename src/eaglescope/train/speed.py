"""How fast a training run went, judged against the hardware: tokens/s, model FLOPs per token, the fraction of the GPU's
dense bf16 peak, and the peak memory (docs/training-speed.md derives and checks the FLOP count).

Model FLOPs count the matrix products a training step needs, once each, for the real (non-pad) tokens:

    target forward     2 · (weights of its linear layers) + attention      (only its output head, with stored states)
    draft forward      fc once, then per TTT step: 2 · (layer + lm_head weights) + attention
    draft backward     2 × its forward (input and weight gradients), but fc only 1×: its input, the target's
                       features, needs no gradient
    attention          2 · heads · (d_qk + d_v) per (query, key) pair the mask allows: causal pairs for the target;
                       at TTT step k the causal pairs plus k diagonal keys per query for the draft

Not counted: elementwise work (norms, RoPE, SiLU, softmaxes, the loss), embedding lookups, the optimizer, masked-out
attention pairs a kernel computes anyway, padding, recomputation, and evaluation.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets; matched against
# torch.cuda.get_device_name in this order (the first substring found wins, so "H200 NVL" before "H200").
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # H200 SXM, and GH200's Hopper GPU
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312.0),
    ("B200", 2250.0),
    ("L40S", 362.0),
)

# Config keys of mixture-of-experts targets: counting their linear weights would count every expert, not the few a
# token is routed through, so their FLOPs are not estimated (null).
_MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def peak_bf16_flops(device: torch.device) -> tuple[str, float | None]:
    """(device name, dense bf16 peak in FLOP/s or None when unknown: the CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return "cpu" if device.type == "cpu" else device.type, None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return name, tflops * 1e12
    return name, None


def linear_weights(module: nn.Module) -> int:
    """Multiply-accumulates per token of all the module's linear layers (their weights' elements)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


@dataclass(frozen=True)
class Attention:
    heads: int
    d_qk: int
    d_v: int

    @property
    def per_pair(self) -> int:
        """FLOPs of one (query, key) pair in one layer: the score (2·d_qk) and the value product (2·d_v), per head."""
        return 2 * self.heads * (self.d_qk + self.d_v)

    @classmethod
    def of_config(cls, cfg: dict) -> Attention:
        """From a Hugging Face config (Llama family; MLA's split head sizes where the config has them)."""
        heads = int(cfg["num_attention_heads"])
        d = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        d_qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]) if "qk_nope_head_dim" in cfg else d
        return cls(heads, d_qk, int(cfg.get("v_head_dim") or d))


@dataclass(frozen=True)
class FlopModel:
    """Model FLOPs of one training sample, by part; see the module docstring for what is counted."""

    target_linear: int | None  # weights a token passes in the target (all linear layers, or only its head); None: MoE
    target_layers: int  # target layers whose attention runs (0 with stored hidden states)
    target_attention: Attention | None
    fc: int  # the draft's fc weights (step 0 only)
    draft_linear: int  # the draft's other linear weights (layer + lm_head), every TTT step
    draft_attention: Attention
    ttt_length: int

    @classmethod
    def of(cls, target, target_cfg: dict, draft: nn.Module, ttt_length: int, online: bool) -> FlopModel:
        """`target`: the loaded target (a module under `.model`), or with stored hidden states (online=False) anything
        whose fingerprint gives the hidden and vocabulary sizes: then only its output head runs."""
        cfg = target_cfg.get("text_config", target_cfg)
        fp = target.fingerprint
        if not online:
            linear, layers, attention = fp.hidden_size * fp.vocab_size, 0, None
        elif any(cfg.get(k) for k in _MOE_KEYS):
            linear, layers, attention = None, fp.num_layers, None
        else:
            linear, layers, attention = linear_weights(target.model), fp.num_layers, Attention.of_config(cfg)
        fc = draft.fc.weight.numel()
        c = draft.config
        d_attn = Attention(c.num_heads, c.head_dim, c.head_dim)
        if c.mla is not None:
            d_attn = Attention(c.num_heads, c.mla.qk_head_dim, c.mla.v_head_dim)
        return cls(linear, layers, attention, fc, linear_weights(draft) - fc, d_attn, ttt_length)

    def parts(self, n: int) -> dict[str, int | None]:
        """FLOPs by part for one sample of n tokens: the forward's linear and attention products of target and draft,
        the draft's backward, and the total (None when the target's count is unknown)."""
        causal = n * (n + 1) // 2
        target_linear = target_attention = None
        if self.target_linear is not None:
            target_linear = 2 * self.target_linear * n
            target_attention = (
                0 if self.target_attention is None else self.target_layers * self.target_attention.per_pair * causal
            )
        K = self.ttt_length
        draft_linear = 2 * self.fc * n + K * 2 * self.draft_linear * n
        # step k: each query sees the causal step-0 keys and one key of each of the steps 1..k at its own position
        draft_attention = self.draft_attention.per_pair * sum(causal + k * n for k in range(K))
        forward = draft_linear + draft_attention
        backward = 2 * forward - 2 * self.fc * n  # fc: weight gradient only
        total = None if target_linear is None else target_linear + target_attention + forward + backward
        return {
            "target_linear": target_linear,
            "target_attention": target_attention,
            "draft_linear": draft_linear,
            "draft_attention": draft_attention,
            "draft_forward": forward,
            "draft_backward": backward,
            "total": total,
        }

    def total(self, lengths: list[int]) -> int | None:
        """FLOPs of a batch of samples of these lengths, or None when the target's count is unknown."""
        totals = [self.parts(n)["total"] for n in lengths]
        return None if any(t is None for t in totals) else sum(totals)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are): on a GPU the most torch allocated since reset_peak_memory (the caching allocator's
    reserve and other processes not counted); on the CPU the process's peak resident set since it started (it
    cannot be reset: a process that ran something bigger before reports that)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "peak resident set size (getrusage)"


class Throughput:
    """Times optimizer steps (the device synchronised at both ends) and sums their tokens and model FLOPs.

    The first step of a run pays one-off costs (kernel selection, the allocator growing, lazy initialisation), so
    when more than one step ran it is left out of the rates."""

    def __init__(self, device: torch.device, flops: FlopModel) -> None:
        self.device, self.flops = device, flops
        self.steps: list[tuple[float, int, int | None]] = []  # (seconds, tokens, FLOPs) per optimizer step
        self._t0 = 0.0
        self._tokens, self._flops = 0, 0
        reset_peak_memory(device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()
        self._tokens, self._flops = 0, 0

    def add(self, valid: torch.Tensor | list[int]) -> None:
        """One micro-batch: valid [B, T] (1 on real tokens, a sample per row), or its samples' lengths (a packed batch
        holds several samples per row: the attention FLOPs are those of each sample's own length)."""
        lengths = valid if isinstance(valid, list) else valid.sum(-1).tolist()
        self._tokens += int(sum(lengths))
        f = self.flops.total([int(n) for n in lengths])
        self._flops = None if f is None or self._flops is None else self._flops + f

    def stop(self) -> None:
        self._sync()
        self.steps.append((time.perf_counter() - self._t0, self._tokens, self._flops))

    def report(self, world: int = 1, summed=None) -> dict:
        """training_metrics.json's "speed". `summed(values) → values` sums over ranks (None: one process); the rates
        are then the whole job's and the peak fraction is against world × one GPU's peak."""
        timed = self.steps[1:] if len(self.steps) > 1 else self.steps
        seconds = sum(s for s, _, _ in timed)
        tokens = sum(t for _, t, _ in timed)
        flops = None if any(f is None for _, _, f in timed) else sum(f for _, _, f in timed)
        if summed is not None:
            tokens, flops_sum = summed([tokens, -1 if flops is None else flops])
            flops = None if flops_sum < 0 else flops_sum
        name, peak = peak_bf16_flops(self.device)
        mem, mem_kind = peak_memory(self.device)
        per_second = flops / seconds if flops is not None and seconds > 0 else None
        per_token = flops / tokens if flops is not None and tokens else None
        return {
            "timed_steps": len(timed),
            "steps_left_out": len(self.steps) - len(timed),
            "seconds": seconds,
            "tokens": tokens,
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
            "model_flops_per_token": per_token,
            "model_flops_per_second": per_second,
            "device": name,
            "world_size": world,
            "peak_bf16_flops_per_device": peak,
            "fraction_of_peak": per_second / (world * peak) if per_second is not None and peak else None,
            "peak_memory_bytes": mem,
            "peak_memory_kind": mem_kind,
        }


def format_speed(s: dict) -> str:
    """train's closing line: tokens/s, model FLOPs per token, fraction of the peak, peak memory."""
    memory = f"peak memory {s['peak_memory_bytes'] / 1e9:.2f} GB ({s['peak_memory_kind']})"
    if s["tokens_per_second"] is None:
        return f"no optimizer step ran in this process; {memory}"
    line = f"{s['tokens_per_second']:,.0f} tokens/s over {s['timed_steps']} step(s)"
    line += " (the first left out)" if s["steps_left_out"] else ""
    fpt = s["model_flops_per_token"]
    if fpt is None:
        line += "; model FLOPs not counted (a mixture-of-experts target)"
    else:
        line += f"; {fpt / 1e9:.3g} GFLOP/token (model FLOPs)"
        if s["fraction_of_peak"] is not None:
            line += f", {100 * s['fraction_of_peak']:.1f}% of the {s['device']}'s dense bf16 peak"
        else:
            why = "CPU" if s["device"] == "cpu" else f"no dense bf16 peak known for {s['device']}"
            line += f", fraction of peak: none ({why})"
    return f"{line}; {memory}" + ("; compiled (--compile)" if s.get("compiled") else "")


__all__ = ["FlopModel", "Throughput", "format_speed", "peak_bf16_flops", "PEAK_BF16_TFLOPS"]
