#!/usr/bin/env bash
# GPU: what serving through HTTP costs next to the same load in process. One artifact ($ARTIFACT, exported
# from $PRESET unless it is there), 64 requests x 512 prompt tokens -> 128 new, all at once: `bench --mode
# requests` in process, then through `serve-artifact` with `bench --url`. With BASELINE=DIR (another
# checkout's root, e.g. `git archive REV pt2serve | tar -x -C DIR`) the same two runs with that code follow,
# on the same artifact. Table last: output tok/s, TTFT and TPOT p50, and HTTP / in process.
# The server needs the wheels in .whl/ (see serving_8b.sh). On the CPU: BACKEND=cpu PRESET=tiny-random.
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.2-1b}
ARTIFACT=${ARTIFACT:-/tmp/http.pt2}
PORT=${PORT:-8331}
OUT=$(mkdir -p "${OUT:-/tmp/pt2serve-out}" && cd "${OUT:-/tmp/pt2serve-out}" && pwd)
WORKLOAD=(--mode requests --requests "${REQUESTS:-64}" --prompt-tokens "${PROMPT_TOKENS:-512}"
          --max-new-tokens "${NEW_TOKENS:-128}" --timeout 120)
source scripts/device/server_wheels.sh

if [ ! -f "$ARTIFACT" ]; then
  PYTHONPATH=$PWD python3 -m pt2serve.cli export --backend "${BACKEND:-cuda}" --use-offgraph-kv-cache --preset "$PRESET" \
    --max-context "${MAX_CONTEXT:-4096}" --forward-sizes "${SIZES:-1,8,32,64}" -o "$ARTIFACT" || { echo "export failed"; exit 1; }
fi

runs() (  # LABEL ROOT: in process, then through a server, with the code under ROOT (python -m puts the
  local label=$1 server   # working directory first on the path, so run from ROOT)
  cd "$2" && export PYTHONPATH=$2${SERVER_SITE:+:$SERVER_SITE}
  python3 -m pt2serve.cli bench "$ARTIFACT" "${WORKLOAD[@]}" --json "$OUT/$label-in-process.json" | tail -4
  python3 -m pt2serve.cli serve-artifact "$ARTIFACT" --host 127.0.0.1 --port "$PORT" > "$OUT/$label-server.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do grep -q "(ready)" "$OUT/$label-server.log" && break; sleep 1; done
  python3 -m pt2serve.cli bench "${WORKLOAD[@]}" --url "http://127.0.0.1:$PORT" --json "$OUT/$label-http.json" | tail -4
  kill -INT "$server"; wait "$server"
)

runs current "$PWD"
[ -n "${BASELINE:-}" ] && runs baseline "$(cd "$BASELINE" && pwd)"

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"\n| code | run | output tok/s | TTFT p50 ms | TPOT p50 ms | HTTP / in process |")
print("|---|---|---:|---:|---:|---:|")
for label in ("current", "baseline"):
    runs = {}
    for where in ("in-process", "http"):
        path = out / f"{label}-{where}.json"
        if path.exists():
            runs[where] = json.loads(path.read_text())["summary"]
    for where, s in runs.items():
        ratio = ""
        if where == "http" and "in-process" in runs:
            ratio = f"{s['output_tokens_per_second'] / runs['in-process']['output_tokens_per_second']:.2f}"
        print(f"| {label} | {where} | {s['output_tokens_per_second']:,.0f} | {s['ttft_seconds']['p50'] * 1e3:.0f} | "
              f"{s['tpot_seconds']['p50'] * 1e3:.2f} | {ratio} |")
EOF
