"""The EAGLE-3 draft model, its contract, and checkpoint I/O.

    step 0:  h = fc(aux)                      aux = cat(taps low→high)  [T, nH] → [T, H]
             (EAGLE 3.1: norm_before_fc = one RMSNorm over aux first; fc_norm = one RMSNorm per tap segment)
    step k:  h = what step k-1 handed on (fc is never applied again): its pre-norm output, or with norm_output
             its post-norm output
    out    = layer(embed(token), h)           models/drafts/llama.py (Llama attention) or models/drafts/mla.py (MLA)
    logits = lm_head(norm(out)) · logit_scale over the draft vocabulary; target id = draft id + d2t[draft id]

Training (TTT), decoding (both backends) and replay all call `project`, `step` and `logits`; only the attention
mask and the cache slots differ. That shared forward is what makes the train/decode equality test possible.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from eaglescope.errors import EagleScopeError
from eaglescope.models.drafts import DraftConfig, build_layer
from eaglescope.models.drafts.config import LLAMA_ARCHITECTURE
from eaglescope.models.drafts.formats import Declaration, DraftFiles, declare, read_draft_files
from eaglescope.models.targets.base import TargetFingerprint
from eaglescope.models.targets.llama import KVCache, RMSNorm
from eaglescope.models.targets.loading import check_finite
from eaglescope.models.vocab import validate_vocab_map
from eaglescope.outputs import read_json, staged_dir
from eaglescope.taps import TapContract, engine_capture

log = logging.getLogger(__name__)

ARCHITECTURE = LLAMA_ARCHITECTURE  # the draft format engines know by this name (MLA drafts: models/drafts/config.py)


@dataclass
class DraftContract:
    """What the draft was trained under; saved as the `eaglescope` section of config.json."""

    taps: TapContract
    target: TargetFingerprint | None = None
    ttt_length: int | None = None
    loss_mask_shift: str | None = None  # "shifted" | "unshifted"
    draft_vocab_source: str | None = None
    inferred: bool = False  # True when loaded from a checkpoint without an eaglescope section
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "format_version": 1,
            "taps": self.taps.to_dict(),
            "target": self.target.to_dict() if self.target else None,
            "ttt_length": self.ttt_length,
            "loss_mask_shift": self.loss_mask_shift,
            "draft_vocab_source": self.draft_vocab_source,
            # an inferred contract written out (export) stays labelled as one, never becomes a record of training
            **({"inferred": True} if self.inferred else {}),
            **self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict) -> DraftContract:
        known = {"format_version", "taps", "target", "ttt_length", "loss_mask_shift", "draft_vocab_source", "inferred"}
        return cls(
            taps=TapContract.from_dict(d["taps"]),
            target=TargetFingerprint.from_dict(d["target"]) if d.get("target") else None,
            ttt_length=d.get("ttt_length"),
            loss_mask_shift=d.get("loss_mask_shift"),
            draft_vocab_source=d.get("draft_vocab_source"),
            inferred=bool(d.get("inferred", False)),
            extra={k: v for k, v in d.items() if k not in known},
        )


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig, embedding_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        c = self.config = config
        # A frozen copy of the target's embedding; engines swap in the target's own at load time. `embedding_dtype`:
        # built zeroed in the dtype it is loaded in (a 163840 x 7168 table is 4.7 GB in float32, 2.35 GB in bf16).
        if embedding_dtype is None:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        else:
            table = torch.zeros(c.vocab_size, c.hidden_size, dtype=embedding_dtype)
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=table)
        self.embed_tokens.weight.requires_grad_(False)
        nH = c.num_aux * c.target_hidden_size
        # EAGLE 3.1's norms before fc, under the weight names vLLM loads (input_norm, fc_norm.<i>)
        self.input_norm = RMSNorm(nH, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(c.num_aux))
            if c.fc_norm
            else None
        )
        self.fc = nn.Linear(nH, c.hidden_size, bias=False)
        self.midlayer = build_layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # -- the shared forward ------------------------------------------------------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc: the target's concatenated taps [.., nH] → draft features [.., H]. Step 0 only."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm(part) for norm, part in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(aux)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.fc.weight
        return self.midlayer.new_cache(self.config, batch, max_len, p.dtype, p.device)

    def step(
        self,
        embeds: torch.Tensor,  # [B, T, H] target embeddings of the tokens paired with `hidden`
        hidden: torch.Tensor,  # [B, T, H] fc(aux) at step 0, own pre-norm output afterwards
        positions: torch.Tensor,  # [B, T] RoPE positions
        cache: KVCache,  # keys/values of every earlier query this one may see
        start: int,  # cache slot where this call's keys go
        mask: torch.Tensor | None,  # [B|1, 1, T, start+T] bool, True = attend; None where the attention impl knows it
    ) -> torch.Tensor:
        """One draft layer application → what the next step receives [B, T, H]: the pre-norm output, or the
        post-norm one with EAGLE 3.1's norm_output."""
        cos, sin = self.midlayer.rotary(positions, hidden.dtype)
        out = self.midlayer(embeds.to(hidden.dtype), hidden, cos, sin, mask, cache, start)
        return self.norm(out) if self.config.norm_output else out

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits from what `step` returned (normed here unless norm_output already did)."""
        return self.head(hidden_out if self.config.norm_output else self.norm(hidden_out))

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits from the final norm's output (the lm_head and its logit_scale)."""
        y = self.lm_head(normed)
        return y * self.config.logit_scale if self.config.logit_scale != 1.0 else y

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- vocabulary map ----------------------------------------------------------------
    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        validate_vocab_map(d2t, t2d, self.config.vocab_size, self.config.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def load_target_embedding(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise EagleScopeError(
                f"target embedding has shape {tuple(weight.shape)}, "
                f"draft expects {tuple(self.embed_tokens.weight.shape)}"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)


# -- checkpoint I/O --------------------------------------------------------------------------
# The tensors of a plain EAGLE-3 Llama draft, in the checkpoint's names; `weight_names` gives any draft's.
WEIGHT_NAMES = (
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


def weight_names(model: Eagle3Draft) -> list[str]:
    """Every tensor a checkpoint of `model` holds (its architecture's and EAGLE 3.1 options' weights, d2t, t2d),
    the target's embedding excepted (saved only on request)."""
    return [k for k in model.state_dict() if k != "embed_tokens.weight"]


@dataclass
class LoadedDraft:
    model: Eagle3Draft
    contract: DraftContract
    has_embedding: bool
    path: Path
    hf_config: dict  # config.json in the flat LlamaForCausalLMEagle3 layout (models/drafts/formats.py)
    format: str = "eaglescope"  # models/drafts/formats.py FORMATS
    raw_config: dict | None = None  # config.json as written
    declared: Declaration | None = None  # what the files declare about training, and how to measure the rest
    notes: list[str] = field(default_factory=list)  # what the reader had to decide where the files are silent


def eaglescope_section(path: Path) -> dict | None:
    """The `eaglescope` section of a checkpoint directory's config.json, or None."""
    cfg = read_json(Path(path) / "config.json")
    section = None if cfg is None else cfg.get("eaglescope")
    return section if isinstance(section, dict) else None


def save_draft(
    model: Eagle3Draft,
    contract: DraftContract,
    out: Path | str,
    save_embedding: bool = False,
    tap_ids: list[int] | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Save in the LlamaForCausalLMEagle3 format + `eaglescope` section.

    Layer ids: default taps ([2, L//2, L-3]) are left unwritten, which every engine reads correctly (legacy
    SGLang adds +1 to explicit ids); other taps are written in vLLM's convention (= HF indices) unless
    `tap_ids` says otherwise. `eaglescope export --to sglang|vllm` writes each engine's own convention."""
    out = Path(out)
    if tap_ids is None and not contract.taps.is_default:
        tap_ids = list(contract.taps.layers)
    with staged_dir(out) as tmp:
        cfg = model.config.to_hf_config(tap_ids)
        cfg["eaglescope"] = contract.to_dict()
        names = set(weight_names(model))
        sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k in names}
        if save_embedding:
            sd["embed_tokens.weight"] = model.embed_tokens.weight.detach().contiguous().cpu()
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return out


def infer_contract(
    cfg: dict, num_layers: int | None, source: str, convention: str | None = None, said_by: str | None = None
) -> DraftContract:
    """A contract for a checkpoint without an eaglescope section (official EAGLE, SpecForge, speculators, ...).
    `convention`: the engine convention its ids are in (default: SpecForge's when there are ids); `said_by`: what
    declared them, in words."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if num_layers is None:
        raise EagleScopeError(
            "this draft has no eaglescope section, so the target's layer count is unknown: pass --target"
        )
    # SpecForge writes "output of layer i" ids; without an eaglescope section assume that convention
    # when ids are present (what SGLang-era checkpoints mean), otherwise the engines' shared default.
    engine = convention or ("specforge" if ids is not None else "vllm")
    taps = TapContract(tuple(engine_capture(ids, engine, num_layers)), num_layers)
    return DraftContract(
        taps=taps,
        inferred=True,
        draft_vocab_source=source,
        extra={"inferred_from": said_by or (f"{engine} convention" if ids is not None else "engine default")},
    )


def contract_of(files: DraftFiles, num_layers: int | None) -> DraftContract:
    """The contract a draft directory states (its eaglescope section) or the one its files imply, labelled inferred."""
    if files.format == "eaglescope":
        section = files.raw_config["eaglescope"]
        try:
            if not isinstance(section, dict):
                raise TypeError(f"it is a {type(section).__name__}, not an object")
            return DraftContract.from_dict(section)
        except (KeyError, TypeError, ValueError, AttributeError, EagleScopeError) as e:
            raise EagleScopeError(f"the eaglescope section of {files.path}/config.json is malformed ({e})") from None
    said_by = None
    if files.format == "speculators":
        said_by = (
            "speculators config's eagle_aux_hidden_state_layer_ids (vLLM convention)"
            if files.tap_ids is not None
            else "speculators' default (no ids in its config)"
        )
    return infer_contract(files.config, num_layers, "checkpoint", files.tap_convention, said_by)


def load_draft(
    path: Path | str,
    target_num_layers: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedDraft:
    """Any supported draft directory (models/drafts/formats.py: eaglescope's, official EAGLE-3, SpecForge's, MLA,
    speculators') as eaglescope's draft, with its contract and a record of what its files declare. Every command
    that reads a draft comes through here."""
    files = read_draft_files(path)
    path, cfg, sd = files.path, files.config, files.state_dict
    check_finite(sd, path)
    config = DraftConfig.from_hf_config(cfg, fc_in=sd["fc.weight"].shape[1])
    contract = contract_of(files, target_num_layers)
    if files.format == "eaglescope":
        if target_num_layers is not None and contract.taps.num_layers != target_num_layers:
            raise EagleScopeError(
                f"the draft was trained for a {contract.taps.num_layers}-layer target; this target has "
                f"{target_num_layers} layers"
            )
    else:
        warnings.warn(
            f"{path} has no eaglescope section: contract inferred (taps {list(contract.taps.layers)}, "
            f"{contract.extra['inferred_from']})",
            stacklevel=2,
        )
    if contract.taps.count != config.num_aux:
        raise EagleScopeError(
            f"fc reads {config.num_aux} hidden states of width {config.target_hidden_size} but the contract names "
            f"{contract.taps.count} taps"
        )
    # Built where it will live and in the weights' dtype (a float32 build of a Kimi-K2-sized draft is 3.6 GB beside its
    # embedding, only to be cast down); the RoPE frequencies are computed in float32 explicitly whatever the default.
    with torch.device(device), _default_dtype(dtype):
        model = Eagle3Draft(config, embedding_dtype=dtype)
    has_embedding = "embed_tokens.weight" in sd
    declared = declare(files, contract, has_embedding)  # before the defaults below fill in what the files lack
    missing = [k for k in weight_names(model) if k not in sd and k not in ("d2t", "t2d")]
    if missing:
        raise EagleScopeError(f"draft checkpoint {path} lacks {missing[0]!r}")
    expected = model.state_dict()
    unplaced = [k for k in sd if k not in expected and not k.endswith("rotary_emb.inv_freq")]
    # An EAGLE 3.1 norm's weight whose flag the config lacks: the engines build no such norm and skip the weight, so
    # the draft computes what they compute (doctor's static check names the lost flag: EAGLE31_IGNORED).
    flagless = [k for k in unplaced if k == "input_norm.weight" or k.startswith("fc_norm.")]
    if flagless:
        log.warning("%s holds %s but its config does not turn that EAGLE 3.1 norm on: read as engines read it, "
                    "without the norm", path, ", ".join(flagless))  # fmt: skip
        unplaced = [k for k in unplaced if k not in flagless]
    if unplaced:
        # never skipped: a tensor the file holds may be part of the function it was trained to compute
        raise EagleScopeError(
            f"draft checkpoint {path} holds {unplaced[0]!r}, which eaglescope's draft has no place for"
        )
    if "d2t" not in sd or "t2d" not in sd:
        if config.draft_vocab_size != config.vocab_size:
            raise EagleScopeError(
                f"draft vocabulary ({config.draft_vocab_size}) is smaller than the target's ({config.vocab_size}) but "
                "the checkpoint has no d2t/t2d map: engines would map draft ids to the first target ids"
            )
        sd.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        sd.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
    for k, t in sd.items():
        if k in expected and tuple(t.shape) != tuple(expected[k].shape):
            raise EagleScopeError(
                f"draft weight {k!r} has shape {tuple(t.shape)}, config implies {tuple(expected[k].shape)}"
            )
    t2d = sd["t2d"]
    sd["t2d"] = t2d.bool() if t2d.dtype != torch.bool else t2d
    validate_vocab_map(sd["d2t"], sd["t2d"], config.vocab_size, config.draft_vocab_size)
    model.load_state_dict({k: v for k, v in sd.items() if k in expected}, strict=False)
    model = model.to(device=device, dtype=dtype)
    model.d2t = model.d2t.long()
    model.t2d = model.t2d.bool()
    for name, buf in model.named_buffers():  # RoPE frequencies stay float32 in any weight dtype
        if "inv_freq" in name:
            buf.data = buf.data.float()
    return LoadedDraft(model.eval(), contract, has_embedding, path, cfg, files.format, files.raw_config, declared,
                       files.notes)  # fmt: skip


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else previous)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def check_draft_matches_target(contract: DraftContract, target_fp: TargetFingerprint) -> None:
    """Refuse a draft trained for a different target (the fingerprint it recorded)."""
    fp = contract.target
    if contract.taps.num_layers != target_fp.num_layers:
        raise EagleScopeError(
            f"draft taps are for a {contract.taps.num_layers}-layer target; this target has {target_fp.num_layers}"
        )
    if fp is None:
        return
    for name in ("vocab_size", "hidden_size", "num_layers"):
        if getattr(fp, name) != getattr(target_fp, name):
            raise EagleScopeError(
                f"draft was trained for a target with {name}={getattr(fp, name)}; this target has "
                f"{getattr(target_fp, name)}"
            )
    if fp.tokenizer_sha256 and target_fp.tokenizer_sha256 and fp.tokenizer_sha256 != target_fp.tokenizer_sha256:
        raise EagleScopeError("draft was trained with a different tokenizer than this target's (sha256 differs)")
