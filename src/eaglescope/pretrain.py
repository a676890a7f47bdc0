"""Train a small Llama-architecture target from scratch and save it as a Hugging Face checkpoint.

The demo (CPU, minutes) and the GPU benchmark (H200, ~4 minutes) both need a target that nothing has
to download; this is the nanoGPT-style loop that makes one. The saved directory is a normal
checkpoint (config.json, model.safetensors, tokenizer, generation_config.json), so every other
command, and transformers itself, loads it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from eaglescope.models.targets.llama import LlamaArgs, LlamaModel, RopeSpec
from eaglescope.outputs import staged_dir
from eaglescope.progress import Progress


@dataclass
class PretrainConfig:
    vocab_size: int
    hidden_size: int = 192
    num_layers: int = 8
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 1024
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 600
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    seed: int = 0
    rope_theta: float = 10000.0
    eos_token_id: int = 0
    pad_token_id: int | None = None
    compile: bool = False
    # Fit the run to a wall-clock budget: after a few timed steps, `steps` shrinks so the whole cosine
    # schedule ends inside the budget (a slow CPU gets fewer steps, not a truncated schedule).
    time_budget_s: float | None = None

    def args(self) -> LlamaArgs:
        head_dim = self.hidden_size // self.num_heads
        return LlamaArgs(
            model_type="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=1e-5,
            max_position_embeddings=self.max_position_embeddings,
            rope=RopeSpec(self.rope_theta),
            tie_word_embeddings=True,
        )

    def hf_config(self) -> dict:
        a = self.args()
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": a.vocab_size,
            "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size,
            "num_hidden_layers": a.num_layers,
            "num_attention_heads": a.num_heads,
            "num_key_value_heads": a.num_kv_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": a.max_position_embeddings,
            "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope.theta,
            "rope_scaling": None,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": None,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }


def init_weights(model: LlamaModel, num_layers: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std = 0.02 / math.sqrt(2 * num_layers)  # GPT-2's scaling keeps the residual stream's variance flat
                p.copy_(torch.randn(p.shape, generator=g) * std)


def lr_at(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _batch(tokens: torch.Tensor, cfg: PretrainConfig, g: torch.Generator, device) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(cfg.seq_len + 1)[None]
    return tokens[idx].to(device, non_blocking=True)


@torch.no_grad()
def evaluate_loss(model: LlamaModel, tokens: torch.Tensor, cfg: PretrainConfig, device, batches: int = 8) -> float:
    g = torch.Generator().manual_seed(1234)
    model.eval()
    losses = []
    for _ in range(batches):
        b = _batch(tokens, cfg, g, device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = _logits(model, b[:, :-1])
        losses.append(float(F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten())))
    model.train()
    return sum(losses) / len(losses)


def _logits(model: LlamaModel, x: torch.Tensor) -> torch.Tensor:
    B, T = x.shape
    positions = torch.arange(T, device=x.device).expand(B, T)
    return model(x, positions, None)[0]


def pretrain(
    cfg: PretrainConfig,
    train_tokens: torch.Tensor,  # 1-D int64
    heldout_tokens: torch.Tensor | None,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> tuple[LlamaModel, dict]:
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    model = LlamaModel(cfg.args())
    init_weights(model, cfg.num_layers, cfg.seed)
    model = model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    step_fn = torch.compile(_logits) if cfg.compile else _logits
    g = torch.Generator().manual_seed(cfg.seed)
    bar = Progress(cfg.steps, "pretrain target", "steps", enabled=progress)
    t0 = time.perf_counter()
    loss_val, steps_done = float("nan"), 0
    total = cfg.steps
    step = 0
    while step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        b = _batch(train_tokens, cfg, g, device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = step_fn(model, b[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        if cfg.time_budget_s is not None and step == 4:
            per_step = (time.perf_counter() - t0) / 5
            total = max(10, min(total, int(cfg.time_budget_s / per_step)))
            cfg.steps = total  # the schedule (lr_at) follows the fitted length
            bar.set_total(total)
        if step % 10 == 0 or step == total - 1:
            loss_val = float(loss.detach())
            bar.set_postfix(loss=f"{loss_val:.3f}")
        bar.update(1)
        step += 1
    bar.close()
    seconds = time.perf_counter() - t0
    stats = {
        "steps": steps_done,
        "train_loss": float(loss.detach()),
        "seconds": seconds,
        "tokens_per_second": steps_done * cfg.batch_size * cfg.seq_len / seconds,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if heldout_tokens is not None and heldout_tokens.numel() > cfg.seq_len + 1:
        stats["heldout_loss"] = evaluate_loss(model, heldout_tokens, cfg, device)
    return model.eval(), stats


def save_target(
    model: LlamaModel, cfg: PretrainConfig, out: Path, tokenizer_dir: Path | None = None, extra: dict | None = None
) -> Path:
    """Write a Hugging Face checkpoint directory (atomically)."""
    with staged_dir(out) as tmp:
        sd = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
        sd.pop("lm_head.weight", None)  # tied: transformers re-ties it from embed_tokens on load
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg.hf_config(), indent=2) + "\n")
        gen = {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).iterdir():
                if f.is_file():
                    (tmp / f.name).write_bytes(f.read_bytes())
        (tmp / "eaglescope_pretrain.json").write_text(json.dumps({"config": asdict(cfg), **(extra or {})}, indent=2))
    return Path(out)
