"""Training features made by the serving engine (`eaglescope prepare --engine vllm|sglang`) instead of a target run
inside eaglescope's process: the engine with its own tensor and expert parallelism computes the tap states and the
final state, eaglescope checks them against the capture contract and stores them in its usual shards.

    contract.py      the run-time checks (layer ids, final-state norm, token ids, NaN / zeros / lengths)
    target.py        what eaglescope itself needs of the target then: tokenizer, fingerprint, head and final norm
    vllm_worker.py   runs in vLLM's environment: the extract_hidden_states method and its connector
    vllm_engine.py   eaglescope's side of it: starts the worker, sends the samples, checks what comes back
"""
