"""Serve chat prompts in a real vLLM, one engine per run, and keep what vLLM itself reports. Runs in the vLLM
environment (scripts/vllm_env.sh), usually under `eaglescope capture`; imports vllm, prometheus_client, json and the
standard library only.

    python capture_runner.py SPEC.json OUT_DIR

SPEC: {"max_tokens": N, "num_speculative_tokens": K, "max_model_len": M,
       "runs": [{"name": str, "target": DIR, "draft": DIR, "conversations": [[{role, content}, ...], ...],
                 "engine_args": {LLM keyword: value} (optional), "speculative_args": {...} (optional),
                 "env": {variable: value} (optional: set for this run only)}]}
OUT_DIR/result.json: {"vllm_version", "vllm_file", "pid",
                      "runs": {name: {"error", "outputs", "prompt_ids", "seconds"}}};
OUT_DIR/<name>.prom: the Prometheus text vLLM serves on /metrics, after the run;
OUT_DIR/<name>.metrics.json: [dataclasses.asdict(m) for m in llm.get_metrics()], after the run.
stdout/stderr: vLLM's own log; each run's part sits between the lines `capture_runner: begin NAME` and
`capture_runner: end NAME` (stats are logged every step here, and flushed with do_log_stats() at the end).

Each run's requests go in one llm.chat call, so vLLM batches them. SPEC may appear after the start: vLLM is imported
first (seconds), then the runner waits up to SPEC_WAIT_S for the file, so the caller can build the models meanwhile.
Exit codes: 0 done (errors are per run), 2 bad arguments or no SPEC in time, 3 vLLM does not import.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# One OpenMP thread for the in-process engine, as in vllm_runner.py (the tiny models gain nothing from a second, and on
# a busy 2-core machine every parallel region waits for it). vLLM's worker processes bind their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "0.001")  # vLLM's periodic "SpecDecoding metrics" line, each step


from runner_common import wait_for_spec, write  # noqa: E402 - after the environment is set


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: capture_runner.py SPEC.json OUT_DIR", file=sys.stderr)
        return 2
    out_dir = argv[2]
    try:
        import prometheus_client
        import vllm
        from vllm import LLM, SamplingParams
    except Exception as e:  # noqa: BLE001 - any import failure means "no usable vLLM here"
        write(os.path.join(out_dir, "result.json"), {"import_error": f"{type(e).__name__}: {e}".splitlines()[0]})
        return 3
    spec = wait_for_spec(argv[1], "capture_runner")
    if spec is None:
        return 2
    result: dict = {"vllm_version": vllm.__version__, "vllm_file": vllm.__file__, "pid": os.getpid(), "runs": {}}
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]))
    for run in spec["runs"]:
        name = run["name"]
        rec: dict = {"error": None, "outputs": [], "prompt_ids": []}
        result["runs"][name] = rec
        print(f"capture_runner: begin {name}", flush=True)
        t = time.perf_counter()
        llm = None
        os.environ.update(run.get("env", {}))  # e.g. the fault a patched vLLM copy serves (tests/vllm/vllm_faults.py)
        try:
            llm = LLM(
                model=run["target"],
                dtype="float32",
                enforce_eager=True,
                max_model_len=int(spec["max_model_len"]),
                seed=0,
                disable_log_stats=False,
                enable_prefix_caching=False,  # a cached prefix never runs: its features could not be traced
                speculative_config={
                    "method": "eagle3",
                    "model": run["draft"],
                    "num_speculative_tokens": int(spec["num_speculative_tokens"]),
                    **run.get("speculative_args", {}),
                },
                **run.get("engine_args", {}),
            )
            outs = llm.chat(run["conversations"], params, use_tqdm=False)
            rec["outputs"] = [[int(x) for x in o.outputs[0].token_ids] for o in outs]
            rec["prompt_ids"] = [[int(x) for x in o.prompt_token_ids] for o in outs]
            llm.llm_engine.do_log_stats()  # the interval's remainder, as a server's next periodic line would
            with open(os.path.join(out_dir, f"{name}.prom"), "wb") as f:
                f.write(prometheus_client.generate_latest())
            write(os.path.join(out_dir, f"{name}.metrics.json"), [dataclasses.asdict(m) for m in llm.get_metrics()])
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge; the next run still goes
            lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
            rec["error"] = lines[0] if lines else type(e).__name__
        finally:
            rec["seconds"] = time.perf_counter() - t
            del llm
            gc.collect()
            for key in run.get("env", {}):
                os.environ.pop(key, None)
        print(f"capture_runner: end {name}", flush=True)
        write(os.path.join(out_dir, "result.json"), result)
    return 0


if __name__ == "__main__":  # vLLM's engine processes re-import this file when they are spawned
    sys.exit(main(sys.argv))
