#!/usr/bin/env bash
# GPU: the serving load of 64 requests x 512 prompt tokens -> 128 new tokens, all arriving at once, on the
# llama-3.1-8b preset (bf16): `bench --mode requests` in process at the runner's default step budget, then
# through `serve-artifact` on 127.0.0.1 (default budget) with `bench --url`, with the server's launch-to-ready
# time, and the same load at Poisson rates $RATES (the saturation table, printed by bench), then in process at
# a few fixed token budgets. One table last: output tok/s, TTFT and TPOT p50/p90/p99, steps and mean step width.
# Exports /tmp/model.pt2 first unless it is already there. After the export it keeps to RUN_LIMIT_S (530 s):
# a run that no longer fits is skipped and shown as such. JSON of every run and the server's log: $OUT.
# The server needs fastapi, starlette, uvicorn, pydantic(-core), annotated-types, typing-inspection and the
# client httpx where the image lacks them: carry their wheels in .whl/ (not typing_extensions: the image's
# anyio needs its own, newer one).
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.1-8b}
ARTIFACT=${ARTIFACT:-/tmp/model.pt2}
BUDGETS=${BUDGETS-512 1024 2048 4096}   # empty: none
PORT=${PORT:-8321}
RATES=${RATES-8,16,32,64}   # offered request rates (Poisson) for the saturation sweep through the server; empty: none
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
rm -f "$OUT"/in-process-*.json "$OUT/http-default.json" "$OUT/server.log"  # the table shows this run's only
REQUESTS=${REQUESTS:-64} PROMPT_TOKENS=${PROMPT_TOKENS:-512} NEW_TOKENS=${NEW_TOKENS:-128}
WORKLOAD=(--mode requests --requests "$REQUESTS" --prompt-tokens "$PROMPT_TOKENS" --max-new-tokens "$NEW_TOKENS")

source scripts/device/export_unless_present.sh
source scripts/device/server_wheels.sh
source scripts/device/serve_ready.sh
export PYTHONPATH=$PYTHONPATH${SERVER_SITE:+:$SERVER_SITE}

export_unless_present "$ARTIFACT" "${EXPORT_LIMIT_S:-480}" --backend cuda --use-offgraph-kv-cache --preset "$PRESET" --max-context 4096 || exit 1
python3 -m pt2serve.cli inspect "$ARTIFACT" | grep -i "methods\|built with\|dtype\|max context"
deadline=$(( $(date +%s) + ${RUN_LIMIT_S:-530} ))

left() { echo $(( deadline - $(date +%s) )); }

run_bench() {  # NAME ARGS...: one workload run, its JSON in $OUT/NAME.json, at most what is left of the time
  local name=$1 limit; shift
  limit=$(( $(left) < ${BENCH_LIMIT_S:-150} ? $(left) : ${BENCH_LIMIT_S:-150} ))
  if [ "$limit" -lt 30 ]; then echo "$name: skipped, ${limit} s left"; return; fi
  echo "== $name (at most $limit s)"
  timeout "$limit" python3 -m pt2serve.cli bench "${WORKLOAD[@]}" --timeout "$limit" --json "$OUT/$name.json" "$@" \
    || echo "$name: failed or timed out"
}

run_bench in-process-default "$ARTIFACT"

echo "== server on 127.0.0.1:$PORT"
start_server "$OUT/server.log" "$ARTIFACT" --host 127.0.0.1 --port "$PORT"
wait_ready "http://127.0.0.1:$PORT" $(( $(left) - 60 )) || echo "the server did not come up"
cat "$OUT/server.log"
if [ -n "$ready_s" ]; then
  echo "serve-artifact ready after $ready_s s (launch to the first 200 from /health: weights, pool, graphs)"
  run_bench http-default --url "http://127.0.0.1:$PORT"
  [ -n "$RATES" ] && run_bench http-rates --url "http://127.0.0.1:$PORT" --request-rates "$RATES"
fi
kill -INT "$server" 2>/dev/null; wait "$server" 2>/dev/null

for budget in $BUDGETS; do
  run_bench "in-process-$budget" "$ARTIFACT" --token-budget "$budget"
done

python3 - "$OUT" "$REQUESTS" "$PROMPT_TOKENS" "$NEW_TOKENS" $BUDGETS <<'EOF'
import json, re, sys
from pathlib import Path

out, (requests, prompt, new), budgets = Path(sys.argv[1]), sys.argv[2:5], sys.argv[5:]
server = re.search(r"steps of up to (\d+) tokens", (out / "server.log").read_text()) if (out / "server.log").exists() else None
ms = lambda d: " / ".join("-" if d[p] is None else f"{d[p] * 1e3:.3g}" for p in ("p50", "p90", "p99"))
print(f"\n{requests} requests x {prompt} prompt -> {new} new tokens, all at once ({out})")
print(f"| run | token budget | output tok/s | TTFT ms p50 / p90 / p99 | TPOT ms p50 / p90 / p99 | steps | mean width |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name in ["in-process-default", "http-default"] + [f"in-process-{b}" for b in budgets]:
    path = out / f"{name}.json"
    if not path.exists():
        print(f"| {name} | | not run | | | | |")
        continue
    doc = json.loads(path.read_text())
    s = doc["summary"]
    budget = doc["step_budget"]["token_budget"] if doc["step_budget"] else (server.group(1) if server else "?")
    width = "-" if doc["mean_step_width"] is None else f"{doc['mean_step_width']:.1f}"
    rate = "-" if s["output_tokens_per_second"] is None else f"{s['output_tokens_per_second']:,.0f}"
    print(f"| {name} | {budget} | {rate} | {ms(s['ttft_seconds'])} | "
          f"{ms(s['tpot_seconds'])} | {doc['num_steps'] if doc['num_steps'] is not None else '-'} | {width} |"
          + ("" if s["failed"] == 0 else f" {s['failed']} failed"))
EOF
