"""The foreign pipeline's drafts as vLLM serves them: a clean EAGLE-3 draft trained by speculators 0.9.0 on hidden
states vLLM 0.32 extracted, and the same pipeline with one fault each (pipeline.py). The clean draft must accept
clearly more than every faulty one, or the faults are not faults a diagnosis has to name.

The table this prints (stderr, and <tmp>/foreign/table.md) is the one in docs/foreign-drafts.md.
"""

from __future__ import annotations

import json
import sys

import pipeline as P
from safetensors.torch import load_file

MARGIN = 0.5  # τ the clean draft must lead every fault by


def table(p: P.Pipeline) -> str:
    rows = ["| case | extracted layer ids | served config ids | TTT | served τ (K=3) | α per position |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for case in P.TRAINED:
        cfg = json.loads((p.drafts[case] / "config.json").read_text())
        counts = p.served[case]["spec"]
        drafts = sum(c["num_drafts"] for c in counts)
        per_pos = [sum(c["accepted_per_pos"][k] for c in counts) / max(drafts, 1) for k in range(P.K)]
        extracted = p.extracted_ids[P.CLEAN if case in (P.UNSHIFTED, P.TTT_1) else case]
        ttt = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        rows.append(f"| {case} | {extracted} | {cfg.get('eagle_aux_hidden_state_layer_ids')} | {ttt} | "
                    f"{p.served[case]['tau']:.2f} | {', '.join(f'{a:.2f}' for a in per_pos)} |")  # fmt: skip
    return "\n".join(rows)


def test_vllm_extracted_the_layers_speculators_reads(foreign_pipeline):
    p = foreign_pipeline
    for case in (P.CLEAN, P.TAPS_OFF_BY_ONE):
        files = sorted(p.hidden[case].glob("hs_*.safetensors"))
        assert len(files) == len(p.samples)
        d = load_file(str(p.hidden[case] / "hs_0.safetensors"))
        assert d["token_ids"].tolist() == p.samples[0]
        assert tuple(d["hidden_states"].shape) == (len(p.samples[0]), 4, 64)
        assert d["hidden_states"].dtype.is_floating_point


def test_the_drafts_are_speculators_checkpoints(foreign_pipeline):
    p = foreign_pipeline
    for case in P.TRAINED:
        cfg = json.loads((p.drafts[case] / "config.json").read_text())
        assert cfg["speculators_model_type"] == "eagle3" and "transformer_layer_config" in cfg
        # speculators resolves "no ids" to the verifier's default and writes them: every draft declares [2, 4, 5]
        assert cfg["eagle_aux_hidden_state_layer_ids"] == P.DEFAULT_IDS
        assert cfg["draft_vocab_size"] == P.DRAFT_VOCAB
    ttt = {c: json.loads((p.drafts[c] / "config.json").read_text())["speculators_config"]["proposal_methods"][0]
           for c in (P.CLEAN, P.TTT_1)}  # fmt: skip
    assert ttt[P.CLEAN]["speculative_tokens"] == 3 and ttt[P.TTT_1]["speculative_tokens"] == 1


def test_vllm_serves_the_clean_draft_clearly_better_than_the_costly_faults(foreign_pipeline):
    p = foreign_pipeline
    text = table(p)
    (p.root / "table.md").write_text(text + "\n")
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in p.seconds.items())
    sys.stderr.write(f"\n{text}\n{secs}\n")
    for case in P.TRAINED:
        assert p.served[case]["engine"]["aux_layers"] == P.DEFAULT_IDS  # what vLLM feeds every draft
    clean = p.served[P.CLEAN]["tau"]
    assert clean > 2.0, f"the clean draft accepts too little to judge faults by: τ {clean:.2f}"
    # the faults that cost acceptance on this target; taps one layer up and a final state normed twice need not: its
    # adjacent layers' states have cosine 0.93-0.97, its final norm's weights nearly uniform (docs/foreign-drafts.md)
    for case in (P.UNSHIFTED, P.TTT_1):
        assert p.served[case]["tau"] < clean - MARGIN, (case, p.served[case]["tau"], clean)
