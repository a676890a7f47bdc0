"""`prepare --engine vllm --engine-url URL`: the features from a vLLM server someone else started and keeps running
(the target that lives only in the serving cluster), reached over its OpenAI-compatible HTTP API.

The server must extract hidden states as the worker's in-process engine does (features/vllm_worker.py): the
`extract_hidden_states` speculative method with `eagle_aux_hidden_state_layer_ids` = the taps in vLLM's convention
and L, prefix caching off, and the hidden-states connector writing to a directory this machine can read. vLLM 0.32
answers each completion with `kv_transfer_params.hidden_states_path`, the connector's file for that request, and with
the prompt's token ids when asked (`return_token_ids`); the file is complete once its `.lock` is released
(vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py). One prompt per request: the
completion API returns the first prompt's `kv_transfer_params` only (vllm/entrypoints/openai/completion/serving.py).

What the server says of itself is checked where it can say it: `/server_info` (served only with
VLLM_SERVER_DEV_MODE=1) holds its speculative method, prefix caching and dtype; the layer ids it captures are in its
log only (`--engine-log`). What cannot be read is named in one warning, and every sample is still checked: the token
ids it processed, the states' shape, NaN and all-zero layers, and the final state against the token it sampled.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglescope.errors import EagleScopeError
from eaglescope.features.contract import check_captured_ids, engine_layer_ids
from eaglescope.features.engine import Mismatches
from eaglescope.features.target import EngineTarget
from eaglescope.features.vllm_engine import VllmFeatures, aux_layers_from_log
from eaglescope.features.vllm_worker import connector_file_written
from eaglescope.taps import TapContract

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 600.0
WRITE_TIMEOUT_S = 600.0
POLL_S = 0.02


class VllmServerFeatures(VllmFeatures):
    """A running vLLM server that extracts the target's features; `concurrency` requests in flight at once (the
    server batches them)."""

    no_file_why = "does the server run the extract_hidden_states method with the hidden-states connector?"

    def __init__(self, target: EngineTarget, taps: TapContract, url: str, engine_log: str | None = None,
                 concurrency: int = 8) -> None:  # fmt: skip
        super().__init__(target, taps, python="")
        self.url = url.rstrip("/")
        self.engine_log = Path(engine_log) if engine_log else None
        self.concurrency = max(1, int(concurrency))
        self.model = ""

    # -- HTTP -------------------------------------------------------------------------------------------------------
    def _call(self, path: str, body: dict | None = None, missing_ok: bool = False) -> dict | None:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if missing_ok and e.code == 404:
                return None
            try:
                why = json.loads(e.read()).get("error", {}).get("message", "")
            except (ValueError, AttributeError):
                why = ""
            raise EagleScopeError(f"vLLM at {self.url} answered {path} with {e.code}: {why or e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise EagleScopeError(f"cannot reach vLLM at {self.url}: {reason}") from None
        except ValueError:
            raise EagleScopeError(f"{self.url}{path} did not answer JSON: is it a vLLM server?") from None

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def start(self) -> dict:
        version = (self._call("/version") or {}).get("version", "")
        models = (self._call("/v1/models") or {}).get("data") or []
        if not models:
            raise EagleScopeError(f"vLLM at {self.url} serves no model (/v1/models is empty).")
        self.model = str(models[0]["id"])
        info = self._call("/server_info?config_format=json", missing_ok=True)
        cfg = (info or {}).get("vllm_config") or {}
        spec = cfg.get("speculative_config") or {}
        kv = cfg.get("kv_transfer_config") or {}
        self.ready = {
            "version": version,
            "url": self.url,
            "model": self.model,
            "max_model_len": models[0].get("max_model_len") or cfg.get("model_config", {}).get("max_model_len"),
            "server_info": info is not None,
            "method": spec.get("method") if info is not None else None,
            "prefix_caching": (cfg.get("cache_config") or {}).get("enable_prefix_caching"),
            "chunked_prefill": (cfg.get("scheduler_config") or {}).get("enable_chunked_prefill"),
            "dtype": str((cfg.get("model_config") or {}).get("dtype") or "").removeprefix("torch.") or None,
            "connector": kv.get("kv_connector"),
            "captured_layers": aux_layers_from_log(self.engine_log) if self.engine_log else None,
        }
        if self.ready["max_model_len"]:
            self.max_model_len = int(self.ready["max_model_len"])
        found = Mismatches()
        self.check_ready(found)
        found.raise_if_any(f"vLLM {version} at {self.url}")
        ids = self.ready["captured_layers"]
        log.info("vLLM %s at %s serves %s: captures %s", version, self.url, self.model, ids or "(not read)")
        return self.ready

    def check_ready(self, found: Mismatches) -> None:
        r, unread = self.ready, []
        ids = engine_layer_ids(self.taps)
        if r["server_info"] and r["method"] != "extract_hidden_states":
            found.add(None, [f"the server does not extract hidden states (its speculative method is {r['method']}): "
                             f"start it with the extract_hidden_states method, ids {ids}, and the hidden-states "
                             "connector (docs/engine-features.md)"])  # fmt: skip
        if r["prefix_caching"]:
            found.add(None, ["the server has prefix caching on: a cached prefix never runs, so it has no features"])
        if r["dtype"] and r["dtype"] != str(self.target.dtype).removeprefix("torch."):
            found.add(None, [f"the server runs in {r['dtype']}, eaglescope asked for {self.target.dtype}"])
        if not r["server_info"]:
            unread.append("its speculative method, prefix caching and dtype (start it with VLLM_SERVER_DEV_MODE=1)")
        if self.engine_log is None:
            unread.append(f"the layer ids it captures (give its log with --engine-log; they must be {ids})")
        elif r["captured_layers"] is None:
            found.add(None, [f"{self.engine_log} does not say which layers the server captures (no 'Using auxiliary "
                             "layers' line: is it this server's log?)"])  # fmt: skip
        else:
            found.add(None, check_captured_ids(r["captured_layers"], self.taps))
        if unread:
            log.warning("vLLM at %s: not checked: %s; every sample is still checked.", self.url, "; ".join(unread))

    def close(self) -> None:
        """The server is not ours to stop."""

    # -- features ---------------------------------------------------------------------------------------------------
    def _compute(self, reqs: list[dict]) -> dict:
        t = time.perf_counter()
        with ThreadPoolExecutor(self.concurrency) as pool:
            results = list(pool.map(self._request, reqs))
        for r in results:
            if r["file"]:
                self._wait_written(r["file"])
        return {"results": results, "seconds": time.perf_counter() - t}

    def _request(self, req: dict) -> dict:
        common = {"model": self.model, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
        if "messages" in req:
            # The server renders the conversation with its own chat template, as it does when it serves.
            out = self._call("/v1/chat/completions", {**common, "messages": req["messages"],
                                                      "add_generation_prompt": False})  # fmt: skip
            prompt_ids = out.get("prompt_token_ids")
        else:
            out = self._call("/v1/completions", {**common, "prompt": req["prompt_ids"]})
            prompt_ids = (out.get("choices") or [{}])[0].get("prompt_token_ids")
        if prompt_ids is None:
            raise EagleScopeError(
                f"vLLM at {self.url} did not return the prompt's token ids (`return_token_ids`): a vLLM older than "
                "this mode needs (0.32 is tested)."
            )
        choice = (out.get("choices") or [{}])[0]
        path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path and not (os.path.exists(path) or os.path.exists(path + ".lock")):
            # the connector makes PATH.lock before it answers: absent here, the server's disk is not this one's
            raise EagleScopeError(
                f"vLLM at {self.url} wrote its hidden states to {path}, which this machine cannot read: give the "
                "connector a shared_storage_path on a file system both reach."
            )
        return {"file": path, "prompt_ids": [int(x) for x in prompt_ids],
                "sampled": [int(x) for x in choice.get("token_ids") or []]}  # fmt: skip

    def _wait_written(self, path: str) -> None:
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while not connector_file_written(path):
            if time.monotonic() > deadline:
                raise EagleScopeError(f"vLLM at {self.url} did not finish writing {path} in {WRITE_TIMEOUT_S:.0f} s.")
            time.sleep(POLL_S)
        Path(path + ".lock").unlink(missing_ok=True)

    def stats(self) -> dict:
        return {**super().stats(), "url": self.url, "model": self.model}
