"""Extract a target's hidden states with vLLM's own `extract_hidden_states` speculative method and its
`ExampleHiddenStatesConnector`, the way speculators 0.9.0 generates its training data (its scripts/launch_vllm.py
starts `vllm serve` with exactly these two configs; `speculators generate-offline-data` sends each sample with
max_tokens=1 and moves the file the connector wrote to `hs_<i>.safetensors`). Here the engine runs in process (no
HTTP server: the request and the connector are the same). Runs in the vLLM environment: vllm, torch, safetensors and
the standard library only.

    python extract_runner.py SPEC.json OUT.json

SPEC: {"target": DIR, "max_model_len": M, "runs": [{"name": str, "layer_ids": [ids, final id last],
       "samples": [[token ids]], "out": DIR}]}
OUT:  {"vllm_version", "runs": {name: {"error", "seconds", "files": [paths]}}}
Every hs_<i>.safetensors holds hidden_states [T, len(layer_ids), H] and token_ids [T], as the connector wrote it.
"""

from __future__ import annotations

import fcntl
import gc
import os
import shutil
import sys
import tempfile
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm"))
from runner_common import wait_for_spec, write  # noqa: E402


def written(path: str) -> bool:
    """The connector writes on a thread and holds an exclusive lock on `<path>.lock` until the file is complete
    (what speculators' wait_for_lock and vLLM's load_hidden_states wait on)."""
    if not os.path.exists(path):
        return False
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        os.remove(lock)
    return True


def wait_written(llm, paths: list[str], timeout: float = 600.0) -> None:
    """The connector submits a finished request's write at the engine step after the finish, and LLM.generate
    returns at the finish: behind `vllm serve` (speculators' way) the engine keeps stepping by itself; in process it
    is stepped here until every file is written."""
    deadline = time.monotonic() + timeout
    while not all(written(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the hidden-states connector wrote no {paths[0]} in {timeout:.0f} s")
        llm.llm_engine.step()
        time.sleep(0.01)


def unpinned_copies(torch) -> None:
    """vLLM 0.32's ExampleHiddenStatesConnector stages each request's states in pinned host memory
    (`torch.empty_like(..., pin_memory=True)`, _submit_async_write) for an asynchronous device-to-host copy; without
    an accelerator torch has no pinned allocator and the write raises. On the CPU the states already are host memory:
    the same allocation, unpinned. This and cpu_events_complete are the changes to vLLM here, both the device's."""
    if torch.cuda.is_available():
        return
    empty_like = torch.empty_like

    def empty_like_unpinned(*args, pin_memory: bool = False, **kwargs):
        return empty_like(*args, **kwargs)

    torch.empty_like = empty_like_unpinned


def cpu_events_complete() -> None:
    """vLLM's CPU worker replaces torch.cuda.Event with a placeholder (vllm/v1/worker/cpu/shm.py) that has record,
    wait and synchronize but no query(), which the connector's get_finished asks of each request's copy event. On the
    CPU the copy is done when the call returns: the event has completed."""
    from vllm.v1.worker.cpu import shm

    if not hasattr(shm._EventPlaceholder, "query"):
        shm._EventPlaceholder.query = lambda self: True


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: extract_runner.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    import torch

    unpinned_copies(torch)
    if not torch.cuda.is_available():
        cpu_events_complete()
    import vllm
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = wait_for_spec(argv[1], "extract_runner")
    if spec is None:
        return 2
    result: dict = {"vllm_version": vllm.__version__, "runs": {}}
    for run in spec["runs"]:
        rec: dict = {"error": None, "files": []}
        result["runs"][run["name"]] = rec
        t = time.perf_counter()
        staging = tempfile.mkdtemp(prefix="hs-staging-")
        llm = None
        try:
            llm = LLM(
                model=spec["target"],
                dtype="float32",
                enforce_eager=True,
                max_model_len=int(spec["max_model_len"]),
                seed=0,
                enable_prefix_caching=False,
                speculative_config={
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": run["layer_ids"]}},
                },
                kv_transfer_config={
                    "kv_connector": "ExampleHiddenStatesConnector",
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"shared_storage_path": staging},
                },
            )
            os.makedirs(run["out"], exist_ok=True)
            prompts = [TokensPrompt(prompt_token_ids=list(s)) for s in run["samples"]]
            outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
            if None in paths:
                raise RuntimeError(f"request {paths.index(None)}: no hidden_states_path in its kv_transfer_params")
            wait_written(llm, paths)
            for i, (path, sample) in enumerate(zip(paths, run["samples"], strict=True)):
                dest = os.path.join(run["out"], f"hs_{i}.safetensors")
                shutil.move(path, dest)
                data = load_file(dest)  # speculators' check_hidden_states, in short
                if data["token_ids"].tolist() != list(sample):
                    raise RuntimeError(f"request {i}: token_ids differ from the sample")
                if data["hidden_states"].shape[:2] != (len(sample), len(run["layer_ids"])):
                    raise RuntimeError(f"request {i}: hidden_states {tuple(data['hidden_states'].shape)}")
                if not torch.isfinite(data["hidden_states"]).all():
                    raise RuntimeError(f"request {i}: non-finite hidden states")
                rec["files"].append(dest)
        except Exception as e:  # noqa: BLE001 - recorded for the caller to fail with
            rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            rec["traceback"] = traceback.format_exc()[-4000:]
        finally:
            del llm
            gc.collect()
            shutil.rmtree(staging, ignore_errors=True)
        rec["seconds"] = time.perf_counter() - t
        write(argv[2], result)
    write(argv[2], result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
