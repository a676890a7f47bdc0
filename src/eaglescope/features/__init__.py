"""Training features made by the serving engine (`eaglescope prepare --engine vllm|sglang`) instead of a target run
inside eaglescope's process: the engine with its own tensor and expert parallelism computes the tap states and the
final state, eaglescope checks them against the capture contract and stores them in its usual shards.

    contract.py      the run-time checks (layer ids, final-state norm, token ids, NaN / zeros / lengths, chunks)
    target.py        what eaglescope itself needs of the target then: tokenizer, fingerprint, head and final norm
    engine.py        eaglescope's side for every engine: starts the worker, sends the samples, checks what comes back
    spool.py         the worker's side of the spool protocol (standard library only, runs in the engine's environment)
    vllm_worker.py   runs in vLLM's environment: the extract_hidden_states method and its connector
    vllm_engine.py   what is vLLM's own on eaglescope's side: the ids asked, what is checked at start
    sglang_worker.py runs in SGLang's environment: sglang.Engine in its capture-only mode, eaglescope's capture plugin
                     (capture/sglang_features.py) reading each prefill's states in SGLang's scheduler
    sglang_engine.py what is SGLang's own on eaglescope's side
"""
