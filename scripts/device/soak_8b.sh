#!/usr/bin/env bash
# GPU: a 10-minute soak of the 8B (PRESET: llama-3.1-8b, or toy-greedy-8b or toy-recall-8b, whose greedy
# answers are then checked against their designed ids). Export it (skipped when /tmp/model.pt2 exists), serve it with a KV
# pool small enough to preempt, drive it with scripts/soak.py (token-id prompts: neither preset has a
# tokenizer), then stop the server with SIGTERM, which must drain and exit 0. Tables last.
#
# Export plus soak run longer than one device call: start it in the background and poll the log, e.g.
#   setsid nohup scripts/device/soak_8b.sh > /tmp/soak_8b.log 2>&1 &      then      tail -40 /tmp/soak_8b.log
# Serving needs fastapi, uvicorn, pydantic, prometheus-client and the openai client; where the image lacks
# them, carry their wheels in .whl/ (not typing_extensions: the image's anyio needs its newer one).
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.1-8b}
ARTIFACT=${ARTIFACT:-/tmp/model.pt2}
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
PORT=${PORT:-8000}
DURATION=${DURATION:-600}
NUM_CELLS=${NUM_CELLS:-4097}   # one max-context sequence: concurrent long requests must preempt
MAX_QUEUED=${MAX_QUEUED:-64}
WARMUP=${WARMUP:-60}   # seconds of traffic before the memory baselines
DESIGNED=$(case "$PRESET" in toy-*) echo "$PRESET";; esac)

if ! python3 -c "import fastapi, uvicorn, pydantic, prometheus_client, openai" 2>/dev/null; then
  wheels=$(ls .whl/*.whl 2>/dev/null | grep -v typing_extensions)
  if [ -z "$wheels" ]; then
    echo "serving needs fastapi, uvicorn, pydantic, prometheus-client and openai: carry their wheels in .whl/"; exit 1
  fi
  python3 -m pip install -q --no-deps --target /tmp/pt2serve-py $wheels || exit 1
  export PYTHONPATH=/tmp/pt2serve-py:$PYTHONPATH
fi

source scripts/device/export_unless_present.sh
export_unless_present "$ARTIFACT" "${EXPORT_LIMIT_S:-600}" --backend cuda --use-offgraph-kv-cache --preset "$PRESET" \
  --max-context 4096 --graph-entries 8192 || exit 1

python3 -m pt2serve.cli serve-artifact "$ARTIFACT" --port "$PORT" --num-cells "$NUM_CELLS" \
  --max-queued "$MAX_QUEUED" --max-sessions 32 --drain-timeout 30 \
  > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 600); do
  grep -q "(ready)" "$OUT/server.log" && break
  kill -0 $server 2>/dev/null || { echo "the server exited while loading:"; tail -20 "$OUT/server.log"; exit 1; }
  sleep 1
done
head -2 "$OUT/server.log"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader || true

python3 scripts/soak.py --url "http://127.0.0.1:$PORT" --duration "$DURATION" --seed 0 --concurrency 32 \
  --max-queued "$MAX_QUEUED" --warmup "$WARMUP" --expect-preemption ${DESIGNED:+--designed "$DESIGNED"} \
  --json "$OUT/soak.json" > "$OUT/soak.txt" 2>&1
soak=$?

kill -TERM $server
wait $server
server_exit=$?
echo "soak exit code: $soak; server exit code after SIGTERM: $server_exit (0 expected)"
grep -c "Traceback" "$OUT/server.log" | xargs echo "tracebacks in the server log:"
cat "$OUT/soak.txt"
