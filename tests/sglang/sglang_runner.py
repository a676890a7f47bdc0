"""Serve eaglescope exports in a real SGLang 0.5.23 and write what it did as JSON. Runs in the SGLang environment
(scripts/sglang_env.sh) with tests/sglang/stand_ins on the path (sglang_support.sglang_env), never in eaglescope's;
usually under `eaglescope capture --engine sglang`, so that the same engines give outputs, meta_info, log and traces.

    python sglang_runner.py SPEC.json OUT.json [FIRST]

SPEC: {"prompts": [[ids]], "max_tokens": N, "num_steps": K, "complete": bool,
       "runs": [{"name": str, "target": DIR, "draft": DIR, optional "topk": int (a tree: speculative_eagle_topk,
                 with "num_draft_tokens" and "num_steps"), optional "switches": [str]}]}
OUT:  {"sglang_version", "pid", "runs": {name: {"error", "load_seconds", "generate_seconds",
       "outputs": [[ids]], "meta": [per prompt: meta_info's spec_* keys (spec_verify_ct, ...)], "request_ids",
       with "switches": {switch: {"error", "outputs", "meta", "request_ids"}} instead of the last three}}}

A run with "switches" is one engine serving every prompt once per switch, in turn: before each, the runner writes the
switch's name to the file EAGLESCOPE_SGLANG_FAULT_FILE names (read by the faults patched into a private copy of
SGLang, tests/sglang/sglang_faults.py); the first switch is written before the engine loads, for faults that act
while it loads.

SPEC may grow while the runner serves (the caller trains the next draft meanwhile): the runner serves runs[FIRST:] in
order as they appear, and ends once SPEC is "complete" and every run is served. Every run gets its own `sgl.Engine`,
one after the other, in this one process (SGLang imports once; each engine still spawns its own scheduler). SGLang
ends its whole process tree, this runner included, when a scheduler dies: the caller then starts another runner from
the run after the one that died (FIRST). SGLang serves EAGLE-3 as a chain of K draft tokens
(`speculative_eagle_topk=1`, K + 1 verified tokens), greedy, float32, with the `intel_amx` attention backend: its
Python side runs, with this project's plain-torch stand-ins for the kernels it calls. This CPU has no AMX, for which
SGLang would swap `intel_amx` for `torch_native`, which EAGLE refuses (srt/arg_groups/overrides.py,
srt/speculative/draft_utils.py); `override_platform(has_amx=True)` keeps it. Each run's SGLang log (stderr: the
`accept len` decode lines) lies between `=== sglang_runner: run NAME` and `=== sglang_runner: end NAME`. A run whose
engine fails records the error and the others go on. OUT is rewritten after every run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

SPEC_WAIT_S = 1800  # the longest the caller may take to train the next draft

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def write(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def set_switch(name: str) -> None:
    path = os.environ.get("EAGLESCOPE_SGLANG_FAULT_FILE")
    if path:
        with open(f"{path}.tmp", "w") as f:
            f.write(name)
        os.replace(f"{path}.tmp", path)


def generate(engine, spec: dict, rec: dict) -> None:
    params = {"temperature": 0.0, "max_new_tokens": int(spec["max_tokens"])}
    for prompt in spec["prompts"]:
        (out,) = engine.generate(input_ids=[list(prompt)], sampling_params=params)
        rec["outputs"].append([int(x) for x in out["output_ids"]])
        rec["meta"].append({key: v for key, v in out["meta_info"].items() if key.startswith("spec_")})
        rec.setdefault("request_ids", []).append(str(out["meta_info"].get("id")))


def serve(run: dict, spec: dict, save=lambda rec: None) -> dict:
    import sglang as sgl
    from sglang.srt.runtime_context import override_platform

    k = int(run.get("num_steps", spec["num_steps"]))
    topk = int(run.get("topk", 1))
    switches = run.get("switches")
    rec: dict = {"error": None, "outputs": [], "meta": []}
    if switches:
        rec["switches"] = {}
        set_switch(switches[0])
    t = time.perf_counter()
    engine = None
    try:
        with override_platform(has_amx=True):
            engine = sgl.Engine(
                model_path=run["target"],
                device="cpu",
                attention_backend="intel_amx",
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=run["draft"],
                speculative_num_steps=k,
                speculative_eagle_topk=topk,
                speculative_num_draft_tokens=int(run.get("num_draft_tokens", k + 1)),
                disable_overlap_schedule=True,
                disable_radix_cache=True,  # every prompt from scratch, as eaglescope generate decodes it
                dtype="float32",
                # On a CPU SGLang profiles the machine's free memory around the weight load and refuses to start when
                # the fraction is below what the load appeared to take, which other processes' allocations on a shared
                # machine inflate: a generous fraction, and the KV pool capped at what the tests need.
                mem_fraction_static=0.5,
                max_total_tokens=8192,
                skip_tokenizer_init=True,  # prompts are ids: no tokenizer process work
                decode_log_interval=1,
                random_seed=0,
                log_level="info",
            )
        rec["load_seconds"] = time.perf_counter() - t
        t = time.perf_counter()
        for name in switches or [None]:
            if name is None:
                generate(engine, spec, rec)
                continue
            set_switch(name)
            part = rec["switches"][name] = {"error": "unfinished", "outputs": [], "meta": []}
            save(rec)  # SGLang ends this process when a switched fault kills its scheduler: what was served stays
            generate(engine, spec, part)
            part["error"] = None
        rec["generate_seconds"] = time.perf_counter() - t
        # A round trip through the scheduler before shutting it down: it sends a request's last response before it
        # prints that step's decode line (batch_result_processor: stream_output, then report_decode_stats), so a
        # shutdown right after the last response could lose the line (seen once: 53 lines for 54 verify rounds).
        engine.flush_cache()
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge; the next run still goes
        lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
        rec["error"] = lines[0] if lines else type(e).__name__
        rec["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if engine is not None:
            engine.shutdown()
    return rec


def read_spec(path: str, have: int) -> dict | None:
    """The spec once it names more than `have` runs or is complete (the caller writes it atomically); None after
    SPEC_WAIT_S."""
    deadline = time.monotonic() + SPEC_WAIT_S
    while time.monotonic() < deadline:
        if os.path.exists(path):
            spec = json.loads(open(path).read())
            if len(spec["runs"]) > have or spec.get("complete"):
                return spec
        time.sleep(0.2)
    return None


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print("usage: sglang_runner.py SPEC.json OUT.json [FIRST]", file=sys.stderr)
        return 2
    import sglang

    result: dict = {"sglang_version": sglang.__version__, "pid": os.getpid(), "runs": {}}
    i = int(argv[3]) if len(argv) == 4 else 0
    while (spec := read_spec(argv[1], i)) is not None and i < len(spec["runs"]):
        run = spec["runs"][i]
        print(f"=== sglang_runner: run {run['name']}", file=sys.stderr, flush=True)

        def save(rec: dict, name: str = run["name"]) -> None:
            result["runs"][name] = rec
            write(argv[2], result)

        result["runs"][run["name"]] = serve(run, spec, save)
        print(f"=== sglang_runner: end {run['name']}", file=sys.stderr, flush=True)
        write(argv[2], result)
        i += 1
    write(argv[2], result)
    return 0 if spec is not None else 2


if __name__ == "__main__":  # SGLang starts its scheduler with multiprocessing's spawn: this module is re-imported
    sys.exit(main(sys.argv))
