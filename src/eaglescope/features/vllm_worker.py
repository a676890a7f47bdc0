"""The vLLM side of `eaglescope prepare --engine vllm`: runs in vLLM's own Python environment (the standard library,
vllm and safetensors, and eaglescope's standard-library spool loop), started by features/vllm_engine.py.

vLLM computes the features with its `extract_hidden_states` speculative method (vllm/v1/spec_decode/
extract_hidden_states.py: the target's aux hidden states of every scheduled token are cached in a cache-only
attention layer) and its `ExampleHiddenStatesConnector` (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py: when a request finishes, one safetensors file with hidden_states [T, n_ids, H]
and token_ids [T], written on a thread, complete once the file's `.lock` is released).

    python -m eaglescope.features.vllm_worker SPOOL

The spool protocol (config, ready, batches, stop) is features/spool.py's; ready.json adds "prefix_caching",
"chunked_prefill", "max_model_len", "dtype" and "connector" to it. vLLM's own log goes to this process's stdout and
stderr (eaglescope sends them to SPOOL/engine.log).
"""

from __future__ import annotations

import fcntl
import os
import sys
import time

from eaglescope.features.spool import serve


def _captured_layers(llm) -> list[int] | None:
    """The layer ids vLLM's target model was told to capture (`aux_hidden_state_layers`, set by the model runner from
    the speculative config): read back from the worker, not assumed from what was asked."""

    def read(worker):
        model = worker.model_runner.get_model()
        for module in model.modules():
            layers = getattr(module, "aux_hidden_state_layers", None)
            if layers is not None:
                return [int(i) for i in layers]
        return None

    try:
        return llm.collective_rpc(read)[0]
    except Exception:  # noqa: BLE001 - a multiprocess engine may refuse pickled callables: the log says it too
        return None


def _connector() -> dict:
    """vLLM's hidden-states connector; on vLLM's CPU platform eaglescope's subclass of it (vllm_cpu_connector.py:
    the stock one copies with CUDA streams and events)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return {"kv_connector": "CpuHiddenStatesConnector",
                "kv_connector_module_path": "eaglescope.features.vllm_cpu_connector"}  # fmt: skip
    return {"kv_connector": "ExampleHiddenStatesConnector"}


def _start(spool: str, cfg: dict):
    from vllm import LLM

    storage = os.path.join(spool, "hs")
    os.makedirs(storage, exist_ok=True)
    args = {
        "model": cfg["target"],
        "dtype": cfg["dtype"],
        "max_model_len": int(cfg["max_model_len"]),
        "seed": 0,
        # A cached prefix never runs: its tokens would get no features of this request.
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(cfg["layer_ids"])}},
        },
        "kv_transfer_config": {
            **_connector(),
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        },
        **cfg.get("engine_args", {}),
    }
    return LLM(**args)


def connector_file_written(path: str) -> bool:
    """The connector writes on a thread and holds an exclusive flock on PATH.lock until the file is complete."""
    if not os.path.exists(path):
        return False
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
    return True


def _drain(llm, files: list[str], timeout: float = 600.0) -> None:
    """Wait until every file is written. A request's file is only submitted for writing at the engine step after
    the request finished (the scheduler hands the connector its pending saves then), and LLM.chat returns at the
    finish: an engine in this process is stepped here until the connector has drained; a separate engine process
    keeps stepping by itself while the connector holds finished requests."""
    inproc = type(llm.llm_engine.engine_core).__name__ == "InprocClient"
    deadline = time.monotonic() + timeout
    while not all(connector_file_written(f) for f in files):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the hidden-states connector wrote no {files[0]} in {timeout:.0f} s")
        if inproc:
            llm.llm_engine.step()
        time.sleep(0.01)
    for f in files:
        if os.path.exists(f + ".lock"):
            os.remove(f + ".lock")


def _run_batch(llm, requests: list[dict]) -> list[dict]:
    from vllm import SamplingParams

    # One greedy token: the prompt is what runs (its features are cached); the token checks the final state.
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out: list[dict | None] = [None] * len(requests)
    chats = [i for i, r in enumerate(requests) if "messages" in r]
    ids = [i for i, r in enumerate(requests) if "messages" not in r]
    if chats:
        # The engine renders the conversation with its own chat template, as it does when it serves.
        res = llm.chat([requests[i]["messages"] for i in chats], params, use_tqdm=False, add_generation_prompt=False)
        for i, o in zip(chats, res):
            out[i] = _result(o)
    if ids:
        res = llm.generate([{"prompt_token_ids": requests[i]["prompt_ids"]} for i in ids], params, use_tqdm=False)
        for i, o in zip(ids, res):
            out[i] = _result(o)
    _drain(llm, [r["file"] for r in out if r["file"]])
    return out


def _result(o) -> dict:
    params = o.kv_transfer_params or {}
    return {
        "file": params.get("hidden_states_path"),
        "prompt_ids": [int(x) for x in o.prompt_token_ids],
        "sampled": [int(x) for x in o.outputs[0].token_ids],
    }


def _start_ready(spool: str, cfg: dict):
    import vllm

    llm = _start(spool, cfg)
    vc = llm.llm_engine.vllm_config
    ready = {
        "version": vllm.__version__,
        "vllm_version": vllm.__version__,
        "captured_layers": _captured_layers(llm),
        "prefix_caching": bool(vc.cache_config.enable_prefix_caching),
        "chunked_prefill": bool(getattr(vc.scheduler_config, "enable_chunked_prefill", False)),
        "max_model_len": int(vc.model_config.max_model_len),
        "dtype": str(vc.model_config.dtype).removeprefix("torch."),
        "connector": vc.kv_transfer_config.kv_connector,
    }
    return llm, ready


def main(argv: list[str]) -> int:
    return serve(argv, "vllm_worker", _start_ready, _run_batch)


if __name__ == "__main__":  # vLLM's engine processes re-import the main module when they are spawned
    sys.exit(main(sys.argv))
