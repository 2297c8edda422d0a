#!/usr/bin/env bash
# GPU: how long `serve-artifact` of the llama-3.1-8b preset (bf16, 16 GB of weights, 10 methods) takes from
# launch to the first 200 from /health, and where the time goes: RUNS launches (default 2; the first may read
# the file from disk, later ones from the page cache), each stopped once ready. Exports /tmp/model.pt2 first
# unless it is there. Prints each server's load line, then the weights alone in process (scripts/load_time.py:
# the serial loader that came before against the thread pool), then one table: launch to 200, the server's own
# launch-to-ready, and its load breakdown (weights, methods beside them, binding, KV pool, graph capture).
# Needs the server's carried wheels where the image lacks them (see serving_8b.sh). Logs: $OUT.
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.1-8b}
ARTIFACT=${ARTIFACT:-/tmp/model.pt2}
PORT=${PORT:-8321}
RUNS=${RUNS:-2}
READY_LIMIT_S=${READY_LIMIT_S:-120}
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
rm -f "$OUT"/startup-*.log

source scripts/device/export_unless_present.sh
source scripts/device/server_wheels.sh
source scripts/device/serve_ready.sh
export PYTHONPATH=$PYTHONPATH${SERVER_SITE:+:$SERVER_SITE}

export_unless_present "$ARTIFACT" "${EXPORT_LIMIT_S:-480}" --backend cuda --use-offgraph-kv-cache --preset "$PRESET" --max-context 4096 || exit 1
ls -l "$ARTIFACT"

for run in $(seq 1 "$RUNS"); do
  log="$OUT/startup-$run.log"
  start_server "$log" "$ARTIFACT" --host 127.0.0.1 --port "$PORT"
  wait_ready "http://127.0.0.1:$PORT" "$READY_LIMIT_S" || echo "run $run: the server did not come up"
  echo "${ready_s:-none}" > "$OUT/startup-$run.ready"
  kill -INT "$server" 2>/dev/null; wait "$server" 2>/dev/null
  echo "== run $run: launch to 200 in ${ready_s:-(never)} s"; grep -v "^INFO" "$log" | tail -5
done

# The weights alone, in process: the serial loader that came before against the thread pool (GB/s of each).
timeout ${LOAD_LIMIT_S:-240} python3 scripts/load_time.py --artifact "$ARTIFACT" --device cuda --repeats 1 \
  || echo "load_time.py failed or timed out"

python3 - "$OUT" "$RUNS" <<'PY'
import re, sys
from pathlib import Path

out, runs = Path(sys.argv[1]), int(sys.argv[2])
line = re.compile(r"loaded in (\S+) s on \S+ \(weights (\S+) s at (\S+) GB/s, methods (\S+) s beside them, "
                  r"binding (\S+) s, KV pool (\S+) s, graph capture (\S+) s\).*?(?:ready (\S+) s after launch)?$")
print("\n| run | launch to 200 s | server: ready after launch s | load total s | weights s | GB/s | methods s "
      "(beside) | binding s | KV pool s | graph capture s |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for run in range(1, runs + 1):
    ready = (out / f"startup-{run}.ready").read_text().strip()
    found = next((m for m in map(line.search, (out / f"startup-{run}.log").read_text().splitlines()) if m), None)
    if found is None:
        print(f"| {run} | {ready} | no load line | | | | | | | |")
        continue
    total, weights, rate, methods, binding, pool, capture, launch = found.groups()
    print(f"| {run} | {ready} | {launch or '-'} | {total} | {weights} | {rate} | {methods} | {binding} | {pool} | "
          f"{capture} |")
PY
