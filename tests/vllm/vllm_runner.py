"""Serve eaglescope exports in a real vLLM and write what it did as JSON. Runs in the vLLM environment
(scripts/vllm_env.sh), never in eaglescope's: it imports vllm, torch, json and the standard library only.

    python vllm_runner.py SPEC.json OUT.json

SPEC: {"target": DIR, "prompts": [[ids]], "max_tokens": N, "num_speculative_tokens": K, "max_model_len": M,
       "runs": [{"name": str, "draft": DIR | null, "target": DIR (optional, default SPEC's),
                 "engine_args": {LLM keyword: value} (optional),
                 "speculative_args": {speculative_config key: value} (optional)}]}   (draft null = vanilla decoding)
OUT:  {"vllm_version", "import_seconds", "runs": {name: {"error", "message", "load_seconds", "generate_seconds",
       "outputs", "spec": [per prompt {num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_pos}] | null,
       "engine": {"aux_layers", "draft_id_to_target_id", "draft_shares_target_embedding", ...} | null}}}

Every run gets its own engine, one after the other in this one process (engine start-up is most of the cost, the
import of vllm a fixed ~5-8 s on top). SPEC may appear after the start: vllm is imported first, then the runner waits
up to SPEC_WAIT_S for the file, so the caller can build the models meanwhile. A run whose engine fails to load
records the error and the others go on. OUT is rewritten after every run, so a crash leaves the runs before it.
Exit codes: 0 done (errors are per run), 3 vLLM does not import (OUT holds {"import_error": ...}), 2 bad arguments or
no SPEC in time.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback

# In-process engine: no EngineCore/worker processes to start (seconds each on 2 cores), and collective_rpc can run
# the introspection function below without pickling it. The KV cache is sized explicitly: the default takes a share
# of RAM the tiny test models never need.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# One OpenMP thread (read when torch loads; the in-process engine binds none itself). With one per core, beside the
# test process (eaglescope decodes while vLLM serves) and anything else on 2 cores, every parallel region waits for a
# descheduled thread: the tiny DeepSeek-V3 target's matmuls took ~3 ms each, a 16-token request 3.3 s instead of 0.1 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")


from runner_common import wait_for_spec, write  # noqa: E402 - after the environment is set


def spec_counts(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (absent before the first verified draft)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] = int(m.value)
        elif name == "num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def delta(after: dict, before: dict, k: int) -> dict:
    def pad(v: list[int]) -> list[int]:
        return list(v) + [0] * (k - len(v))

    d = {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    d["accepted_per_pos"] = [a - b for a, b in zip(pad(after["accepted_per_pos"]), pad(before["accepted_per_pos"]))]
    return d


def engine_facts(worker) -> dict:
    """What the loaded engine actually wired (runs inside the worker: here the same process)."""
    runner = worker.model_runner
    target = runner.model
    facts = {
        "model_runner": f"{type(runner).__module__}.{type(runner).__name__}",
        "aux_layers": list(getattr(target.model, "aux_hidden_state_layers", ()) or ()),
    }
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        draft = drafter.model
        d2t = draft.draft_id_to_target_id
        inner = draft.model
        input_norm, fc_norm = getattr(inner, "input_norm", None), getattr(inner, "fc_norm", None)
        layer = inner.layers[0]
        facts |= {
            "draft_class": type(draft).__name__,
            "draft_id_to_target_id": None if d2t is None else [int(x) for x in d2t.detach().cpu()],
            "draft_shares_target_embedding": inner.embed_tokens is target.model.embed_tokens,
            "draft_shares_target_lm_head": draft.lm_head is getattr(target, "lm_head", None),
            "fc_input_size": int(inner.fc.input_size),
            # EAGLE 3.1: the modules vLLM built (None = not built) and the weights it loaded into them
            "norm_before_fc": getattr(inner, "norm_before_fc", None),
            "input_norm": None if input_norm is None else [float(x) for x in input_norm.weight.detach().cpu()],
            "fc_norm": None if fc_norm is None else [[float(x) for x in n.weight.detach().cpu()] for n in fc_norm],
            "norm_output": bool(inner.norm_output),
            "draft_layer_attention": type(layer.self_attn).__name__,
            # the softmax scale (MLA: with YaRN's mscale²) and the rotary embedding the draft's attention uses
            "draft_attention_scale": float(layer.self_attn.scaling),
            "draft_rotary": type(layer.self_attn.rotary_emb).__name__,
            "draft_attention_backends": sorted(
                {m.attn_backend.get_name() for m in draft.modules() if hasattr(m, "attn_backend")}
            ),
        }
    facts["target_attention_backends"] = sorted(
        {m.attn_backend.get_name() for m in target.modules() if hasattr(m, "attn_backend")}
    )
    return facts


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_runner.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    out_path = argv[2]
    t0 = time.perf_counter()
    try:
        # `import vllm` alone is lazy; LLM pulls in the engine and model code, where a broken install fails.
        import torch  # noqa: F401
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001 - any import failure means "no usable vLLM here"
        write(out_path, {"import_error": f"{type(e).__name__}: {e}".splitlines()[0]})
        return 3
    result: dict = {"vllm_version": vllm.__version__, "import_seconds": time.perf_counter() - t0, "runs": {}}
    spec = wait_for_spec(argv[1], "vllm_runner")
    if spec is None:
        return 2
    write(out_path, result)
    k = int(spec["num_speculative_tokens"])
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]))
    for run in spec["runs"]:
        rec: dict = {"error": None, "outputs": [], "spec": None, "engine": None}
        result["runs"][run["name"]] = rec
        kw = {}
        if run["draft"] is not None:
            kw["speculative_config"] = {"method": "eagle3", "model": run["draft"], "num_speculative_tokens": k,
                                        **run.get("speculative_args", {})}  # fmt: skip
        t = time.perf_counter()
        llm = None
        try:
            llm = LLM(
                model=run.get("target", spec["target"]),
                dtype="float32",
                enforce_eager=True,
                max_model_len=int(spec["max_model_len"]),
                seed=0,
                disable_log_stats=False,  # get_metrics() needs the stat loggers
                # A cached prefix skips the target (and so the draft catch-up) over those tokens; every prompt is
                # served from scratch, as eaglescope generate does.
                enable_prefix_caching=False,
                **kw,
                **run.get("engine_args", {}),
            )
            rec["load_seconds"] = time.perf_counter() - t
            try:
                rec["engine"] = llm.collective_rpc(engine_facts)[0]
            except Exception as e:  # noqa: BLE001 - vLLM internals moved: the tests that read these facts say so
                rec["engine"] = {"error": f"{type(e).__name__}: {e}"}
            t = time.perf_counter()
            if run["draft"] is not None:
                rec["spec"] = []
            for prompt in spec["prompts"]:
                before = spec_counts(llm)
                (o,) = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
                rec["outputs"].append([int(x) for x in o.outputs[0].token_ids])
                if run["draft"] is not None:
                    rec["spec"].append(delta(spec_counts(llm), before, k))
            rec["generate_seconds"] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge; the next run still goes
            lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
            rec["error"] = lines[0] if lines else type(e).__name__
            rec["message"] = f"{type(e).__name__}: {e}"[:4000]  # the first line of a pydantic error says little
            rec["traceback"] = traceback.format_exc()[-4000:]
        finally:
            del llm
            gc.collect()
        write(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
