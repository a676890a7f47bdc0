"""A second, deliberately plain EAGLE-3 decoder: the reference engine the doctor tests run against.

Written from two public documents only — the draft checkpoint format (config.json + model.safetensors:
fc, one Llama-style decoder layer reading cat(embedding, hidden), norm, lm_head, d2t offsets, t2d; the EAGLE 3.1
options norm_before_fc (input_norm over the concatenated taps before fc), fc_norm (fc_norm.<i> per tap segment) and
norm_output (the next step receives the post-norm output, which lm_head reads as it is)) and the
trace format (docs/trace-format.md) — and sharing no code with eaglescope's decoder, draft, target, train or
detective packages (tests/test_independent_engine.py checks the imports). The target is transformers'
`AutoModelForCausalLM` with `output_hidden_states=True`; the trace recorder is `src/eaglescope/trace.py`, loaded
by file path as an engine that copied it would.

Plain beats fast:
- the target is recomputed over the whole sequence for every root-to-leaf path of the tree (no KV cache, no tree
  mask: causal attention over `prefix + path` gives each node exactly its ancestors);
- the draft keeps one list of committed step-0 keys/values (post-RoPE) per position, and tree nodes' keys in a
  dict for the round; every attention is an explicit masked softmax over an explicit key list;
- RMSNorm, RoPE (half-split), GQA, SwiGLU are written out here.

Faults are code changes: `PlainEagle3(..., fault=NAME)` switches one branch below (`FAULTS` lists them), active
from round `fault_from` on (default: the first round where the wiring it breaks is used). `frontier="creation"`
expands the tree frontier in creation order (parent row, then child rank) instead of best-first; `guide`
(the target's known greedy continuation) adds a branch to every tree so that rounds accept several tokens.

Choices the trace format leaves to the engine: `step0_topk_rows` "root" records step 0's top-k for the row that
proposes (what eaglescope records), "all" for every step-0 row (n = m, as the format's worked example computes it);
`meta_keys` writes the tree shape as `settings`, `decoding` or both; `record_taps` "contract" | "all" | "none";
`record_layers` "states" adds every state of the prefill (target.layer.<0..L>, fingerprints), "all" each layer's
input_layernorm of it too (target.layer.<i>.normed);
`stages` "all" records every canonical stage, "shallow" only the easy ones an engine records first (target.aux, the
draft's top-k, the verified tree and its decision: no draft hidden tensor, no per-tap stage, no next.hidden_in);
`aux_full` keeps target.aux in full in a fingerprint trace (what a draft-side replay plays back).

`generate(..., temperature=T)` samples (T > 0): each tree node's next token is drawn from the target's distribution
at temperature T; the walk goes on to the child holding that token, and a token no child holds is the bonus token.
One draw per emitted token from a generator seeded with `seed`: the output is a sample of the target's own
distribution whatever the draft proposes (lossless), the same sequence vanilla sampling draws with that generator.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

# -- the recorder: src/eaglescope/trace.py, by file path (what an engine that copied it would import) --------------
_TRACE_PY = Path(__file__).resolve().parents[2] / "src" / "eaglescope" / "trace.py"


def _load_recorder():
    name = "plain_eagle3_trace"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _TRACE_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


rt = _load_recorder()

# name -> what the engine computes instead of the right thing
FAULTS: dict[str, str] = {
    # capture (the target's taps), from the prefill on
    "tap_plus_one": "every tap one layer late (hs[i+1] recorded and used as tap i)",
    "tap_minus_one": "every tap one layer early (hs[i-1])",
    "tap_wrong_layer": "the last tap taken from layer L-1 instead of its own",
    "tap_order": "taps concatenated high to low",
    "tap_embedding": "the first tap is the embedding output hs[0]",
    "tap_normed": "every tap is the layer's input_layernorm(hs[i]) instead of the raw residual stream",
    "eagle2_wiring": "EAGLE-2 wiring: the final normed state [T, H] handed on; fc skipped by a width check",
    # the draft
    "fc_skipped": "fc not applied: step 0 reads the last tap's H columns of aux",
    "fc_repeated": "steps k>0 read fc(cat(h, 0, 0)): the draft's own output zero-padded to 3H and projected again",
    "feedback_target": "steps k>0 read fc(aux) of the root's feature row instead of the parent's own output",
    "feedback_postnorm": "steps k>0 read norm(parent output) instead of the pre-norm output",
    "stale_first_rows": "next-round features are the first a+1 verified rows in node order, not root + accepted",
    "own_position_features": "next-round features at the emitted tokens' own positions (root dropped, the "
    "rejected node after the path kept)",
    "rope_tree_offset": "tree steps use RoPE position root + level (one too far)",
    "rope_catchup_offset": "catch-up (step 0) uses RoPE position p + 1 for the feature of position p",
    "pairing_shift": "step-0 rows pair the feature of position p with the token at p (not p + 1)",
    "other_embedding": "the draft embeds tokens with another model's table",
    "embedding_other_version": "the draft embeds tokens with another version of the target's table (each row moved by "
    "about 20%, as fine-tuning moves it)",
    "vocab_map_lost": "draft ids used as target ids (d2t ignored)",
    "d2t_arange": "d2t taken as arange(draft_vocab) under the offset convention (target id = 2 * draft id)",
    "d2t_regenerated": "the draft's ids mapped through a regenerated hot-token map (another sorted set of target "
    "tokens, as an engine's own token map file gives) while lm_head's rows were trained for the checkpoint's",
    "final_norm_skipped": "lm_head applied to the layer output without the final norm",
    "logit_scale_ignored": "the draft's logit_scale not applied",
    # EAGLE 3.1 options read wrongly
    "norm_before_fc_ignored": "the draft's norm_before_fc ignored: fc reads the raw concatenated taps (SGLang issue "
    "32226 / PR 32334)",
    "fc_norm_as_one": "fc_norm applied as one RMSNorm over the whole concatenated taps (the segments' weights side by "
    "side) instead of one per tap segment",
    "norm_before_fc_per_segment": "norm_before_fc applied as one RMSNorm per tap segment (input_norm's weight cut in "
    "tap-wide pieces) instead of one over the whole concatenated taps",
    "norm_before_fc_assumed": "a draft without norm_before_fc served with one: a fresh RMSNorm (unit weight) over the "
    "concatenated taps before fc",
    "fc_norm_ignored": "the draft's fc_norm ignored: fc reads the taps without their per-segment norms",
    "fc_norm_assumed": "a draft without fc_norm served with one: fresh RMSNorms (unit weight) per tap segment",
    "norm_output_other_meaning": "norm_output read as 'norm before lm_head' (an older SpecForge's meaning): the next "
    "step receives the pre-norm output",
    "norm_output_assumed": "a draft without norm_output served as if it had it: the next step receives the post-norm "
    "output and lm_head reads it as it is",
    # outside the catalogue
    "rms_eps_wrong": "the draft's RMSNorms use eps 0.1 instead of the config's",
    "kv_swapped": "the draft's k_proj and v_proj weights swapped",
    "draft_kv_leak": "tree nodes' draft keys stay in the cache after the round: later queries attend rejected nodes",
    "gqa_mapping": "query head h reads kv head h % n_kv instead of h // (n_heads / n_kv)",
    "rope_base_wrong": "the draft's RoPE base is 500000 instead of the config's rope_theta",
    "residual_dropped": "the layer's attention residual dropped (h' = attn(x))",
    "rope_interleaved": "RoPE rotates interleaved pairs (GPT-J) instead of the two halves",
    "concat_order": "the layer reads cat(hidden, embedding) instead of cat(embedding, hidden)",
}
# the round a fault first acts in, unless fault_from says otherwise
_FIRST_ROUND = {
    "tap_plus_one": 0,
    "tap_minus_one": 0,
    "tap_wrong_layer": 0,
    "tap_order": 0,
    "tap_embedding": 0,
    "tap_normed": 0,
    "eagle2_wiring": 0,
    "pairing_shift": 0,  # the prefill's pairing is consumed by round 1
}


@dataclass
class RoundLog:
    tokens: list[int]
    parents: list[int]
    accepted: list[int]
    bonus: int


@dataclass
class Result:
    token_ids: list[int]
    rounds: list[RoundLog] = field(default_factory=list)

    @property
    def accepted_total(self) -> int:
        return sum(len(r.accepted) for r in self.rounds)


# -- the draft checkpoint ------------------------------------------------------------------------------------------
@dataclass
class DraftWeights:
    cfg: dict
    w: dict[str, torch.Tensor]
    taps: list[int]
    H: int
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    theta: float
    logit_scale: float
    norm_before_residual: bool
    norm_before_fc: bool  # one RMSNorm (input_norm) over the concatenated taps before fc
    fc_norm: bool  # one RMSNorm per tap segment (fc_norm.<i>) before fc
    norm_output: bool  # the next step receives the post-norm output (lm_head reads it as it is)


def read_draft(draft_dir: Path, num_layers: int, dtype: torch.dtype) -> DraftWeights:
    draft_dir = Path(draft_dir)
    cfg = json.loads((draft_dir / "config.json").read_text())
    sd = load_file(str(draft_dir / "model.safetensors"))
    sd = {k.removeprefix("model.").replace("layers.0.", "midlayer.", 1): v for k, v in sd.items()}
    eagle = cfg.get("eagle_config") or {}
    norm_before_fc = bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False)))  # eagle_config first
    for name, on in (("input_norm.weight", norm_before_fc), ("fc_norm.0.weight", cfg.get("fc_norm"))):
        if on and name not in sd:
            raise ValueError(f"the draft's config sets an EAGLE 3.1 norm but its weights lack {name}")
    if cfg.get("rope_scaling"):
        raise ValueError("plain_eagle3 implements the default RoPE only")
    # taps: the eaglescope contract (HF output_hidden_states indices), else the checkpoint's ids as vLLM reads them,
    # else the engines' default [2, L//2, L-3]
    section = cfg.get("eaglescope") or {}
    taps = (section.get("taps") or {}).get("layers")
    if taps is None:
        taps = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if taps is None:
        taps = [2, num_layers // 2, num_layers - 3]
    H = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    w = {k: (v if k in ("d2t", "t2d") else v.to(dtype)) for k, v in sd.items()}
    if "d2t" not in w:
        w["d2t"] = torch.zeros(w["lm_head.weight"].shape[0], dtype=torch.long)
    w["d2t"] = w["d2t"].long()
    return DraftWeights(
        cfg=cfg,
        w=w,
        taps=[int(i) for i in taps],
        H=H,
        n_heads=n_heads,
        n_kv=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or H // n_heads),
        eps=float(cfg.get("rms_norm_eps", 1e-6)),
        theta=float(cfg.get("rope_theta", 10000.0)),
        logit_scale=float(cfg.get("logit_scale") or 1.0),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        norm_before_fc=norm_before_fc,
        fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", False)),
    )


# -- math, written out ------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool = False) -> torch.Tensor:
    """x [n, heads, d] rotated by its rows' positions [n]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [d/2]
    ang = positions.float()[:, None] * inv[None, :]  # [n, d/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # [n, 1, d/2]
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = xf[..., : d // 2], xf[..., d // 2 :]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.to(x.dtype)


def attention(q, k, v, mask, kv_of_head: torch.Tensor) -> torch.Tensor:
    """q [n, h, d], k/v [S, h_kv, d], mask [n, S] bool (True = may attend) → [n, h*d]."""
    kh, vh = k[:, kv_of_head].float(), v[:, kv_of_head].float()  # [S, h, d]
    scores = torch.einsum("nhd,shd->hns", q.float(), kh) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[None], float("-inf"))
    out = torch.einsum("hns,shd->nhd", scores.softmax(-1), vh)
    return out.reshape(q.shape[0], -1).to(q.dtype)


# -- the engine -------------------------------------------------------------------------------------------------------
class PlainEagle3:
    def __init__(
        self,
        target_dir: str | Path,
        draft_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        fault: str | None = None,
        fault_from: int | None = None,
        frontier: str = "best",
        step0_topk_rows: str = "root",
        meta_keys: str = "both",
        record_taps: str = "contract",
        stages: str = "all",
        aux_full: bool = False,
        record_layers: str = "none",
    ) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
        if frontier not in ("best", "creation"):
            raise ValueError("frontier is 'best' (best-first) or 'creation' (parent row, then child rank)")
        self.fault = fault
        self.fault_from = fault_from if fault_from is not None else _FIRST_ROUND.get(fault or "", 1)
        self.frontier, self.step0_topk_rows, self.meta_keys = frontier, step0_topk_rows, meta_keys
        self.record_taps, self.record_layers = record_taps, record_layers
        if record_layers not in ("none", "states", "all"):
            raise ValueError("record_layers is 'none', 'states' (hs[0..L]) or 'all' (and each layer's normed input)")
        self.aux_full = aux_full
        if stages not in ("all", "shallow"):
            raise ValueError("stages is 'all' or 'shallow' (target.aux, top-k and the tree only)")
        self.shallow = stages == "shallow"
        self.dtype = dtype
        self.target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
        tc = self.target.config
        self.L, self.V, self.target_eps = int(tc.num_hidden_layers), int(tc.vocab_size), float(tc.rms_norm_eps)
        self.d = read_draft(Path(draft_dir), self.L, dtype)
        self.embedding = self.target.get_input_embeddings().weight.detach()
        if fault == "other_embedding":
            g = torch.Generator().manual_seed(4321)
            e = self.embedding.float()
            self.embedding = (torch.randn(e.shape, generator=g) * e.std() + e.mean()).to(dtype)
        elif fault == "embedding_other_version":
            g = torch.Generator().manual_seed(4322)
            e = self.embedding.float()
            self.embedding = (e + 0.2 * e.std() * torch.randn(e.shape, generator=g)).to(dtype)
        w = self.d.w
        self.k_w, self.v_w = w["midlayer.self_attn.k_proj.weight"], w["midlayer.self_attn.v_proj.weight"]
        if fault == "kv_swapped":
            self.k_w, self.v_w = self.v_w, self.k_w
        self.eps = 0.1 if fault == "rms_eps_wrong" else self.d.eps
        self.theta = 500000.0 if fault == "rope_base_wrong" else self.d.theta
        rep = self.d.n_heads // self.d.n_kv
        heads = torch.arange(self.d.n_heads)
        self.kv_of_head = heads % self.d.n_kv if fault == "gqa_mapping" else heads // rep
        d2t = w["d2t"]
        self.d2t = torch.arange(d2t.shape[0]) if fault == "d2t_arange" else d2t
        if fault == "d2t_regenerated":  # another hot-token set, sorted, as a map built from other data lists it
            n = d2t.shape[0]
            hot = torch.randperm(self.V, generator=torch.Generator().manual_seed(77))[:n].sort().values
            self.d2t = hot - torch.arange(n)
        self.round = 0
        self.temperature, self.gen = 0.0, torch.Generator().manual_seed(0)

    def on(self, name: str) -> bool:
        return self.fault == name and self.round >= self.fault_from

    # -- target -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def target_forward(self, ids: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        out = self.target(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        return out.logits[0], tuple(h[0] for h in out.hidden_states)

    def capture(self, hs: tuple[torch.Tensor, ...]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """(per-tap stage tensors under the contract's labels, the aux the draft receives)."""
        taps = list(self.d.taps)
        if self.on("eagle2_wiring"):
            return {}, hs[self.L]  # transformers' last hidden state: after the final norm
        src = list(taps)
        if self.on("tap_plus_one"):
            src = [i + 1 for i in taps]
        elif self.on("tap_minus_one"):
            src = [i - 1 for i in taps]
        elif self.on("tap_wrong_layer"):
            src = taps[:-1] + [self.L - 1]
        elif self.on("tap_order"):
            src = taps[::-1]
        elif self.on("tap_embedding"):
            src = [0] + taps[1:]
        segs = []
        for i in src:
            x = hs[i]
            if self.on("tap_normed"):
                x = rms_norm(x, self.target.model.layers[i].input_layernorm.weight, self.target_eps)
            segs.append(x)
        return dict(zip(taps, segs)), torch.cat(segs, dim=-1)

    # -- draft ------------------------------------------------------------------------------------------------------
    def fc(self, feats: torch.Tensor) -> torch.Tensor:
        H = self.d.H
        if feats.shape[-1] == H:  # a width check some engines make: features already H wide skip fc
            return feats
        if self.on("fc_skipped"):
            return feats[:, -H:]
        w, d = self.d.w, self.d
        n = feats.shape[-1] // H
        ones = torch.ones(H, dtype=feats.dtype)

        def per_segment(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([rms_norm(x[:, i * H : (i + 1) * H], weights[i], self.eps) for i in range(n)], -1)

        if d.norm_before_fc and self.on("norm_before_fc_per_segment"):
            feats = per_segment(feats, list(w["input_norm.weight"].split(H)))
        elif d.norm_before_fc and not self.on("norm_before_fc_ignored"):
            feats = rms_norm(feats, w["input_norm.weight"], self.eps)
        elif not d.norm_before_fc and self.on("norm_before_fc_assumed"):
            feats = rms_norm(feats, ones.repeat(n), self.eps)
        if d.fc_norm and not self.on("fc_norm_ignored"):
            weights = [w[f"fc_norm.{i}.weight"] for i in range(n)]
            feats = (
                rms_norm(feats, torch.cat(weights), self.eps)
                if self.on("fc_norm_as_one")
                else per_segment(feats, weights)
            )
        elif not d.fc_norm and self.on("fc_norm_assumed"):
            feats = per_segment(feats, [ones] * n)
        return feats @ w["fc.weight"].T

    def embed(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding[target_ids]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.on("vocab_map_lost"):
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def layer_qkv(self, emb, hidden, positions):
        """The decoder layer up to attention: (q, k, v after RoPE, the residual) for rows embedding `emb`, features
        `hidden` at RoPE `positions`; the layer reads cat(input_layernorm(emb), hidden_norm(hidden)) [n, 2H]."""
        w, d = self.d.w, self.d
        normed_hidden = rms_norm(hidden, w["midlayer.hidden_norm.weight"], self.eps)
        normed_emb = rms_norm(emb, w["midlayer.input_layernorm.weight"], self.eps)
        residual = normed_hidden if d.norm_before_residual else hidden
        parts = [normed_hidden, normed_emb] if self.on("concat_order") else [normed_emb, normed_hidden]
        x = torch.cat(parts, dim=-1)
        n = x.shape[0]
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, d.n_heads, d.head_dim)
        k = (x @ self.k_w.T).view(n, d.n_kv, d.head_dim)
        v = (x @ self.v_w.T).view(n, d.n_kv, d.head_dim)
        inter = self.on("rope_interleaved")
        q, k = rope(q, positions, self.theta, inter), rope(k, positions, self.theta, inter)
        return q, k, v, residual

    def layer_out(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        w = self.d.w
        h = attn @ w["midlayer.self_attn.o_proj.weight"].T
        if not self.on("residual_dropped"):
            h = residual + h
        m = rms_norm(h, w["midlayer.post_attention_layernorm.weight"], self.eps)
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        return h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    def hands_normed(self) -> bool:
        """Does a step hand on (and record as hidden_out) its post-norm output? norm_output, as this engine reads it."""
        if self.on("norm_output_other_meaning") or self.on("norm_output_assumed"):
            return not self.d.norm_output
        return self.d.norm_output

    def step_out(self, h: torch.Tensor) -> torch.Tensor:
        """What a step hands on from the layer's output `h`: `h`, or with norm_output the final norm's output."""
        return rms_norm(h, self.d.w["norm.weight"], self.eps) if self.hands_normed() else h

    def logprobs(self, h: torch.Tensor) -> torch.Tensor:
        """Log-probs from what a step handed on: normed here unless the step already normed it."""
        w = self.d.w
        skip = self.on("final_norm_skipped") or self.hands_normed()
        x = h if skip else rms_norm(h, w["norm.weight"], self.eps)
        logits = (x @ w["lm_head.weight"].T).float()
        if not self.on("logit_scale_ignored"):
            logits = logits * self.d.logit_scale
        return torch.log_softmax(logits, dim=-1)

    # -- decoding ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        depth: int = 3,
        top_k: int = 3,
        total_tokens: int = 8,
        chain: bool = False,
        trace: str | Path | None = None,
        mode: str = "full",
        guide: list[int] | None = None,
        guide_len: int = 2,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> Result:
        """Speculative decoding, greedy or sampled at `temperature` (generator seeded with `seed`); `chain` means top_k
        1 and depth + 1 nodes. With `trace`, every canonical stage is recorded (`mode` "full" or "fingerprint").
        `guide`: the target's greedy sequence (prompt + continuation); each tree then also carries its next
        `guide_len` tokens and one wrong token after them."""
        if chain:
            top_k, total_tokens = 1, depth + 1
        self.temperature = float(temperature)
        self.gen = torch.Generator().manual_seed(int(seed))
        rec = rt.TraceRecorder(trace, mode=mode, producer="plain-eagle3 (tests/engines)") if trace else None
        if rec is not None:
            settings = {"chain": depth} if chain else {"tree": f"{depth},{top_k},{total_tokens}"}
            decoding = {"temperature": temperature, "top_k": None, "top_p": None, "max_new_tokens": max_new_tokens}
            decoding |= (
                {"chain": depth} if chain else {"tree": {"depth": depth, "topk": top_k, "total_tokens": total_tokens}}
            )
            meta = {"prompt_ids": list(prompt_ids), "taps": list(self.d.taps), "dtype": str(self.dtype)[6:]}
            meta |= {"tap_convention": "hf_output_hidden_states"}
            if self.meta_keys in ("both", "settings"):
                meta["settings"] = settings
            if self.meta_keys in ("both", "decoding"):
                meta["decoding"] = decoding
            rec.set_meta(**meta)
        try:
            res = self._decode(rec, list(prompt_ids), max_new_tokens, depth, top_k, total_tokens, guide, guide_len)
        except BaseException:
            if rec is not None:
                rec.abort()
            raise
        if rec is not None:
            rec.close()
        return res

    def _segments(self, feats: torch.Tensor) -> int:
        return feats.shape[-1] // self.d.H  # taps concatenated (1 for the EAGLE-2 wiring's H-wide state)

    # what a shallow trace records: the target's capture, the draft's proposals and the tree with its decision
    _SHALLOW = ("target.aux", "draft.topk", "verify.tokens", "verify.parents", "verify.accepted", "verify.bonus")

    def _rec(self, rec, stage, x, **kw) -> None:
        if rec is not None and (not self.shallow or rt.parse_stage(stage)[0] in self._SHALLOW):
            rec.record(stage, x, **kw, **({"full": True} if self.aux_full and stage == rt.TARGET_AUX else {}))

    def next_token(self, logits: torch.Tensor) -> int:
        """The target's token after a position: its argmax, or with a temperature a draw from its distribution."""
        if self.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def _decode(self, rec, prompt, max_new, depth, top_k, total, guide, guide_len) -> Result:
        d = self.d
        self.round = 0
        # ---- round 0: prefill
        logits, hs = self.target_forward(prompt)
        per_tap, aux = self.capture(hs)
        self._record_taps(rec, per_tap, hs)
        self._rec(rec, rt.TARGET_AUX, aux, segments=self._segments(aux))
        if rec is not None and self.record_layers != "none":
            self._record_layers(rec, hs)
        first = self.next_token(logits[-1])
        self._rec(rec, rt.VERIFY_BONUS, torch.tensor([first]))
        seq = prompt + [first]
        pending = aux  # target features of positions [0, len(prompt))
        pending_tokens = prompt[1:] + [first]
        if self.on("pairing_shift"):
            pending_tokens = prompt[:]
        self._rec(rec, rt.NEXT_HIDDEN_IN, pending, segments=self._segments(pending))
        ctx_k: list[torch.Tensor] = []  # committed step-0 keys [n_kv, d], one per draft cache slot
        ctx_v: list[torch.Tensor] = []
        result = Result([first])
        while len(result.token_ids) < max_new:
            self.round += 1
            if rec is not None:
                rec.next_round()
            root_pos = len(seq) - 1
            # ---- draft step 0: catch up over the pending positions
            m = pending.shape[0]
            hidden = self.fc(pending.to(self.dtype))
            self._rec(rec, rt.DRAFT_FC_OUT, hidden)
            emb = self.embed(torch.tensor(pending_tokens))
            self._rec(rec, rt.draft_embed_in(0), emb)
            self._rec(rec, rt.draft_hidden_in(0), hidden)
            pos = torch.arange(root_pos - m, root_pos) + (1 if self.on("rope_catchup_offset") else 0)
            q, k, v, res = self.layer_qkv(emb, hidden, pos)
            c = len(ctx_k)
            keys = torch.cat([torch.stack(ctx_k), k]) if c else k
            vals = torch.cat([torch.stack(ctx_v), v]) if c else v
            mask = torch.ones(m, c + m, dtype=torch.bool)
            mask[:, c:] = torch.ones(m, m, dtype=torch.bool).tril()
            out0 = self.step_out(self.layer_out(attention(q, keys, vals, mask, self.kv_of_head), res))
            self._rec(rec, rt.draft_hidden_out(0), out0)
            ctx_k += list(k)
            ctx_v += list(v)
            lp = self.logprobs(out0 if self.step0_topk_rows == "all" else out0[-1:])
            self._record_topk(rec, 0, lp, top_k)
            lp = lp[-1:]
            # ---- tree: nodes are dicts; node 0 is the root (the last emitted token)
            nodes = [{"tok": seq[-1], "parent": -1, "depth": 0, "score": 0.0, "out": out0[-1]}]
            new = self._children(nodes, [0], lp, top_k)
            frontier = self._select(nodes, new, top_k)
            processed_k: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            fc_root = hidden[-1] if self.on("feedback_target") else None  # fc(aux) of the root's feature row
            for level in range(1, depth):
                n = len(frontier)
                toks = torch.tensor([nodes[i]["tok"] for i in frontier])  # draft ids
                tgt = self.to_target(toks)
                parents_out = torch.stack([nodes[nodes[i]["parent"]]["out"] for i in frontier])
                hidden_in = parents_out
                if self.on("fc_repeated"):
                    pad = torch.zeros(n, d.H * (len(d.taps) - 1), dtype=parents_out.dtype)
                    hidden_in = torch.cat([parents_out, pad], -1) @ d.w["fc.weight"].T
                elif self.on("feedback_target"):
                    hidden_in = fc_root[None].expand(n, -1)
                elif self.on("feedback_postnorm"):
                    hidden_in = rms_norm(parents_out, d.w["norm.weight"], self.eps)
                emb = self.embed(tgt)
                self._rec(rec, rt.draft_embed_in(level), emb)
                self._rec(rec, rt.draft_hidden_in(level), hidden_in)
                p = root_pos + level - 1 + (1 if self.on("rope_tree_offset") else 0)
                q, k, v, res = self.layer_qkv(emb, hidden_in, torch.full((n,), p))
                # keys: every committed slot, the processed ancestors of each row, the row itself
                anc_ids = sorted(processed_k)
                keys = torch.cat([torch.stack(ctx_k)] + [processed_k[a][0][None] for a in anc_ids] + [k])
                vals = torch.cat([torch.stack(ctx_v)] + [processed_k[a][1][None] for a in anc_ids] + [v])
                mask = torch.zeros(n, keys.shape[0], dtype=torch.bool)
                mask[:, : len(ctx_k)] = True
                for r, i in enumerate(frontier):
                    lineage = self._ancestors(nodes, i)
                    for j, a in enumerate(anc_ids):
                        mask[r, len(ctx_k) + j] = a in lineage
                    mask[r, len(ctx_k) + len(anc_ids) + r] = True
                out = self.step_out(self.layer_out(attention(q, keys, vals, mask, self.kv_of_head), res))
                self._rec(rec, rt.draft_hidden_out(level), out)
                for r, i in enumerate(frontier):
                    nodes[i]["out"] = out[r]
                    processed_k[i] = (k[r], v[r])
                lp = self.logprobs(out)
                self._record_topk(rec, level, lp, top_k)
                new = self._children(nodes, frontier, lp, top_k)
                frontier = self._select(nodes, new, top_k)
            if self.on("draft_kv_leak"):  # the round's tree keys are never dropped
                for i in sorted(processed_k):
                    ctx_k.append(processed_k[i][0])
                    ctx_v.append(processed_k[i][1])
            kept, parents = self._finalize(nodes, total)
            tokens = [seq[-1]] + self.to_target(
                torch.tensor([nodes[i]["tok"] for i in kept[1:]], dtype=torch.long)
            ).tolist()
            if guide is not None:
                nxt = guide[len(seq) : len(seq) + guide_len]
                last = 0
                for t in nxt + ([(nxt[-1] + 1) % self.V] if nxt else []):
                    tokens.append(t)
                    parents.append(last)
                    last = len(tokens) - 1
            self._rec(rec, rt.VERIFY_TOKENS, torch.tensor(tokens))
            self._rec(rec, rt.VERIFY_PARENTS, torch.tensor(parents))
            # ---- verify: the target over prefix + each root-to-leaf path
            N = len(tokens)
            kids = [[] for _ in range(N)]
            for i in range(1, N):
                kids[parents[i]].append(i)
            rows_logits: list[torch.Tensor | None] = [None] * N
            rows_hs: list[tuple | None] = [None] * N
            for leaf in [i for i in range(N) if not kids[i]]:
                path = [leaf]
                while parents[path[-1]] >= 0:
                    path.append(parents[path[-1]])
                path = path[::-1]
                lg, h = self.target_forward(seq[:-1] + [tokens[i] for i in path])
                off = len(seq) - 1
                for j, node in enumerate(path):
                    if rows_logits[node] is None:
                        rows_logits[node] = lg[off + j]
                        rows_hs[node] = tuple(x[off + j] for x in h)
            hs_tree = tuple(torch.stack([rows_hs[i][layer] for i in range(N)]) for layer in range(self.L + 1))
            per_tap, aux = self.capture(hs_tree)
            self._record_taps(rec, per_tap, hs_tree)
            self._rec(rec, rt.TARGET_AUX, aux, segments=self._segments(aux))
            accepted, node = [], 0
            while True:
                want = self.next_token(rows_logits[node])
                nxt_node = next((c for c in kids[node] if tokens[c] == want), None)
                if nxt_node is None:
                    bonus = want
                    break
                accepted.append(nxt_node)
                node = nxt_node
            self._rec(rec, rt.VERIFY_ACCEPTED, torch.tensor(accepted, dtype=torch.long))
            self._rec(rec, rt.VERIFY_BONUS, torch.tensor([bonus]))
            path = [0] + accepted
            emitted = [tokens[i] for i in accepted] + [bonus]
            if self.on("stale_first_rows"):
                rows = list(range(len(path)))
            elif self.on("own_position_features"):
                after = next(iter(kids[path[-1]]), path[-1])  # the rejected child where the bonus token sits
                rows = accepted + [after]
            else:
                rows = path
            pending = aux[torch.tensor(rows)]
            pending_tokens = [seq[-1]] + emitted[:-1] if self.on("pairing_shift") else emitted
            self._rec(rec, rt.NEXT_HIDDEN_IN, pending, segments=self._segments(pending))
            seq += emitted
            result.token_ids += emitted
            result.rounds.append(RoundLog(tokens, parents, accepted, bonus))
        result.token_ids = result.token_ids[:max_new]
        return result

    def _record_taps(self, rec, per_tap: dict[int, torch.Tensor], hs: tuple[torch.Tensor, ...]) -> None:
        """target.tap.<i>: the contract's taps as captured (under the contract's labels, as an engine that believes it
        taps them records them); with record_taps "all" every other layer too, "none": no per-tap stage."""
        if self.record_taps == "none":
            return
        layers = range(self.L) if self.record_taps == "all" else per_tap
        for i in layers:
            self._rec(rec, rt.target_tap(i), per_tap[i] if i in per_tap else hs[i])

    def _record_layers(self, rec, hs: tuple[torch.Tensor, ...]) -> None:
        """target.layer.<i>: every state transformers returned for the prefill (hs[L] is its final normed state); with
        record_layers "all" also each layer's input_layernorm of its state, normed here with this file's rms_norm."""
        layers = self.target.model.layers
        normed = [rms_norm(hs[i], layers[i].input_layernorm.weight, self.target_eps) for i in range(self.L)]
        rec.record_layers(list(hs[: self.L]), hs[self.L], normed if self.record_layers == "all" else None)

    def _record_topk(self, rec, step: int, lp: torch.Tensor, top_k: int) -> None:
        if rec is None:
            return
        vals, ids = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
        rec.record(rt.draft_topk(step), {rt.TOPK_IDS: self.to_target(ids), rt.TOPK_LOGPROBS: vals})

    @staticmethod
    def _ancestors(nodes: list[dict], i: int) -> set[int]:
        out = set()
        while i >= 0:
            out.add(i)
            i = nodes[i]["parent"]
        return out

    @staticmethod
    def _children(nodes: list[dict], parents: list[int], lp: torch.Tensor, top_k: int) -> list[int]:
        """Add each parent row's top_k children as candidates (draft ids; cumulative log-prob); their node ids."""
        vals, ids = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
        new = []
        for r, p in enumerate(parents):
            for v, t in zip(vals[r].tolist(), ids[r].tolist()):
                nodes.append(
                    {"tok": t, "parent": p, "depth": nodes[p]["depth"] + 1, "score": nodes[p]["score"] + v, "out": None}
                )
                new.append(len(nodes) - 1)
        return new

    def _select(self, nodes: list[dict], new: list[int], top_k: int) -> list[int]:
        """EAGLE-2: the next frontier is the top_k new candidates by cumulative log-prob."""
        best = sorted(new, key=lambda i: (-nodes[i]["score"], i))[:top_k]
        return best if self.frontier == "best" else sorted(best)

    @staticmethod
    def _finalize(nodes: list[dict], total: int) -> tuple[list[int], list[int]]:
        """(kept node ids, their parents as tree indices): root + the best total-1 candidates (ties: shallower, then
        older), ordered by depth, then creation. A child never outscores its parent: the kept set is ancestor-closed."""
        cand = sorted(range(1, len(nodes)), key=lambda i: (-nodes[i]["score"], nodes[i]["depth"], i))
        kept = sorted([0] + cand[: total - 1], key=lambda i: (nodes[i]["depth"], i))
        index = {old: new for new, old in enumerate(kept)}
        return kept, [index.get(nodes[i]["parent"], -1) for i in kept]
