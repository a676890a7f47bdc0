"""The SGLang side of `eaglescope prepare --engine sglang`: runs in SGLang's own Python environment (the standard
library, sglang, torch and safetensors, and eaglescope's spool loop and capture plugin), started by
features/sglang_engine.py.

    python -m eaglescope.features.sglang_worker SPOOL

It starts `sglang.Engine` on the target, without a draft, in SGLang's capture-only mode
(`enable_return_aux_hidden_states`, `speculative_algorithm` "EAGLE3" naming the capture convention,
`return_aux_hidden_state_layer_ids` the ids eaglescope asks for): SGLang's scheduler configures its own EAGLE-3 capture
on the target, and eaglescope's capture plugin (switched on by the environment set here, loaded by SGLang in its
scheduler process: capture/sglang_features.py) writes every prefill's tap states and final state per request into
SPOOL/capture. Radix cache off (a cached prefix never runs, so it has no features), overlap scheduling off. The
engine's arguments (`--engine-args`) are passed to `sglang.Engine` as they are and override these.

Each conversation is rendered with the tokenizer SGLang loaded (its chat template), as SGLang's chat endpoint renders
one when no other template is given to it, and sent as token ids with one greedy token to generate: the prompt is
what runs; the token checks the final state. The chunks of a request's prefill are joined into one file with
hidden_states [T, n_taps + 1, H] (the taps, then the final state after the final norm) and token_ids [T].

The spool protocol is features/spool.py's; ready.json adds "ids_given" (the ids SGLang was given), "capture_on",
"radix_cache", "chunked_prefill_size", "dtype", "architecture" and "notes" (the capture plugin's lines).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from eaglescope.capture import (
    ENV_DIR,
    ENV_ENGINE,
    ENV_FEATURES,
    FEATURES_DIR,
    FEATURES_READY,
    FEATURES_REQUEST_PREFIX,
    NOTES,
    REFUSED,
)
from eaglescope.features.spool import serve


class Worker:
    def __init__(self, spool: str, cfg: dict) -> None:
        import sglang as sgl

        self.staging = Path(spool) / "capture"
        self.staging.mkdir(exist_ok=True)
        self.out = Path(spool) / "hs"
        self.out.mkdir(exist_ok=True)
        # the capture plugin's switch, inherited by the scheduler process SGLang spawns
        os.environ.update({ENV_DIR: str(self.staging), ENV_ENGINE: "sglang", ENV_FEATURES: "1"})
        args = {
            "model_path": cfg["target"],
            "dtype": cfg["dtype"],
            "random_seed": 0,
            "enable_return_aux_hidden_states": True,
            "speculative_algorithm": "EAGLE3",
            "return_aux_hidden_state_layer_ids": list(cfg["layer_ids"]),
            "disable_radix_cache": True,
            "disable_overlap_schedule": True,
            **cfg.get("engine_args", {}),
        }
        self.engine = sgl.Engine(**args)
        self.n = 0

    def notes(self) -> list[str]:
        path = self.staging / NOTES
        return path.read_text().splitlines() if path.is_file() else []

    def ready(self) -> dict:
        import sglang

        refused = self.staging / REFUSED
        if refused.is_file():
            raise RuntimeError(refused.read_text().strip())
        path = self.staging / FEATURES_READY
        hooks = json.loads(path.read_text()) if path.is_file() else {}
        sa = self.engine.server_args
        return {
            "version": sglang.__version__,
            "captured_layers": hooks.get("layers_to_capture"),
            "capture_on": hooks.get("capture_aux_hidden_states"),
            "architecture": hooks.get("architecture"),
            "dtype": hooks.get("dtype"),
            "latent_attention": hooks.get("latent_attention"),
            "attention_backend": hooks.get("attention_backend"),
            "ids_given": getattr(sa, "return_aux_hidden_state_layer_ids", None),
            "radix_cache": not bool(getattr(sa, "disable_radix_cache", False)),
            "chunked_prefill_size": getattr(sa, "chunked_prefill_size", None),
            "notes": self.notes(),
        }

    def _render(self, messages: list[dict]) -> list[int]:
        tok = self.engine.tokenizer_manager.tokenizer
        if tok is None:
            raise RuntimeError("SGLang was started without a tokenizer (skip_tokenizer_init): it cannot render chats")
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
        if hasattr(ids, "keys"):  # a BatchEncoding from newer transformers
            ids = ids["input_ids"]
        return [int(x) for x in ids]

    def run_batch(self, requests: list[dict]) -> list[dict]:
        prompts = [self._render(r["messages"]) if "messages" in r else [int(x) for x in r["prompt_ids"]]
                   for r in requests]  # fmt: skip
        rids = [f"{FEATURES_REQUEST_PREFIX}{os.getpid()}-{self.n + i}" for i in range(len(prompts))]
        self.n += len(prompts)
        params = {"max_new_tokens": 1, "temperature": 0.0}
        outs = self.engine.generate(input_ids=prompts, sampling_params=params, rid=rids)
        return [self._result(rid, ids, o) for rid, ids, o in zip(rids, prompts, outs, strict=True)]

    def _result(self, rid: str, prompt: list[int], out: dict) -> dict:
        import torch
        from safetensors.torch import load_file, save_file

        sampled = [int(x) for x in out.get("output_ids") or []]
        res: dict = {"file": None, "prompt_ids": prompt, "sampled": sampled}
        folder = self.staging / FEATURES_DIR
        chunks = sorted(folder.glob(f"{rid}.*.safetensors"), key=lambda p: int(p.name.split(".")[-2]))
        parts = [(int(p.name.split(".")[-2]), load_file(str(p))) for p in chunks]
        for p in chunks:
            p.unlink()
        if not parts:
            notes = [n for n in self.notes() if rid in n or "hook failed" in n]
            res["why"] = notes[-1] if notes else "the capture plugin wrote nothing for it: did it load in SGLang?"
            return res
        spans = [[start, int(t["final"].shape[0])] for start, t in parts]
        pos = 0
        for start, n in spans:
            if start != pos:
                res["chunks"] = spans
                res["mismatches"] = [_chunk_line(spans, len(prompt))]
                return res
            pos += n
        taps = torch.cat([t["taps"] for _, t in parts])  # [T, n_taps, H]
        final = torch.cat([t["final"] for _, t in parts])  # [T, H]
        states = torch.cat([taps, final[:, None]], dim=1)
        path = self.out / f"{rid}.safetensors"
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.cat([t["token_ids"] for _, t in parts])},
                  str(path))  # fmt: skip
        res["file"], res["chunks"] = str(path), spans
        return res


def _chunk_line(spans: list[list[int]], T: int) -> str:
    from eaglescope.features.contract import check_prefill_chunks

    return (check_prefill_chunks(spans, T) or [f"the engine's prefill chunks {spans} do not cover the prompt"])[0]


def _start(spool: str, cfg: dict):
    worker = Worker(spool, cfg)
    try:
        return worker, worker.ready()
    except Exception:
        worker.engine.shutdown()  # its scheduler process must not outlive the worker
        raise


def main(argv: list[str]) -> int:
    return serve(argv, "sglang_worker", _start, lambda w, reqs: w.run_batch(reqs), lambda w: w.engine.shutdown())


if __name__ == "__main__":  # SGLang spawns its scheduler: the main module is re-imported there, and must not run
    sys.exit(main(sys.argv))
