#!/usr/bin/env bash
# docs/watch-terminal.png: `eaglescope watch` in a terminal (tmux) on a real vLLM server serving a faulty config,
# captured with tmux capture-pane and rendered by scripts/render_terminal.py. Uses the models that
# tests/vllm/test_vllm_watch.py built under pytest's --basetemp BT (run it first with --basetemp BT).
# Run under `flock /tmp/eaglescope-engine.lock`.   usage: scripts/watch_screenshot.sh BT [OUT.png]
set -euo pipefail
BT=$1
OUT=${2:-docs/watch-terminal.png}
PY=${EAGLESCOPE_PYTHON:-/work/main/.venv/bin/python}
VPY=${EAGLESCOPE_VLLM_VENV:-/work/main/.venv-vllm}/bin/python
T=$BT/vllm-base0/target
PREP=$BT/vllm-base0/prep
D=$BT/vllm-watch0/train-d146
FAULT=$BT/vllm-watch0/sglang-ids
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT
LOG=$(mktemp)
SPEC="{\"method\": \"eagle3\", \"model\": \"$FAULT\", \"num_speculative_tokens\": 3}"
env -u PYTHONPATH HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 \
  setsid "$VPY" -m vllm.entrypoints.openai.api_server --model "$T" --host 127.0.0.1 --port "$PORT" --dtype float32 \
  --enforce-eager --max-model-len 128 --seed 0 --no-enable-prefix-caching --max-num-seqs 4 \
  --speculative-config "$SPEC" >"$LOG" 2>&1 &
SERVER=$!
cleanup() { kill -TERM -- -"$SERVER" 2>/dev/null || true; tmux kill-session -t eswatch 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 300); do curl -sf "$URL/health" >/dev/null && break; sleep 1; done
tmux new-session -d -s eswatch -x 150 -y 24 \
  "PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 $PY -m eaglescope watch --url $URL --draft $D --target $T --data $PREP \
   --interval 1 --window 6 --sustain 2 --min-rounds 30 --max-polls 90; sleep 600"
"$PY" - "$URL" "$T" <<'PYEOF'
import json, sys, time, urllib.request
url, target = sys.argv[1], sys.argv[2]
prompts = ["abcdefghab", "hgfedcbahg", "aabbccddee"]  # the target's alphabet (tests/vllm/test_vllm_serving.py)
for i in range(12):
    body = {"model": target, "prompt": prompts[i % 3], "max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=120).read()
    time.sleep(1)
PYEOF
for _ in $(seq 60); do tmux capture-pane -p -t eswatch | grep -q "next: eaglescope doctor" && break; sleep 1; done
tmux capture-pane -p -t eswatch >"${OUT%.png}.txt"
"$PY" scripts/render_terminal.py "${OUT%.png}.txt" "$OUT"
rm -f "${OUT%.png}.txt" "$LOG"
echo "wrote $OUT"
