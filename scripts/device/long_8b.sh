#!/usr/bin/env bash
# GPU: long context (decode at 512 / 4,000 / 16,000, prefill of 8,192- and 32,000-token prompts) on the 8B at
# its own max context (131,072), in one detached chain longer than one device call allows.
#   setsid nohup scripts/device/long_8b.sh > /dev/null 2>&1 &     then poll:     scripts/device/long_8b.sh --poll
# Steps, each logged to /tmp/long/NAME.log:
#   cuda      tests/test_cuda.py (graphs at context 16k and at the max context among them)
#   export    llama-3.1-8b bf16 at its default max context, to /tmp/long.pt2
#   host      scripts/host_overhead.py: packing 64 decodes at context 4,000 and 32,000 on this host
#   sweep     bench sweep: T = 1, 32, 64 at context 512 and 4,000; T = 1, 8 at 16,000
#   prefill   bench requests: 4 x 8,192 and 1 x 32,000 prompts, one output token each, each run twice
#   fp8kv     llama-3.1-8b --quantize fp8 --kv-dtype fp8 at --max-context 8192, decode at 4,000 (issue 30's row)
# FORWARD_SIZES narrows the 8B's static widths (fewer methods: a shorter export). SKIP="step ..." leaves steps
# out. --poll prints each step's state and its log's tail and copies logs and JSON to $OUT.
set -uo pipefail
CHAIN=/tmp/long
STEPS=(cuda export host sweep prefill fp8kv)

if [ "${1:-}" = "--poll" ]; then
  for step in "${STEPS[@]}"; do
    state=$(cat "$CHAIN/$step.state" 2>/dev/null || echo waiting)
    echo "== $step: $state"
    [ "$state" = waiting ] || tail -"${TAIL:-12}" "$CHAIN/$step.log" 2>/dev/null
  done
  [ -n "${OUT:-}" ] && cp "$CHAIN"/*.json "$CHAIN"/*.log "$OUT"/ 2>/dev/null
  exit 0
fi

mkdir -p "$CHAIN" && rm -rf "$CHAIN/repo" && cp -r "$PWD" "$CHAIN/repo" && cd "$CHAIN/repo" || exit 1
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ARTIFACT=/tmp/long.pt2
QUIET="Warning\|warn(\|__new__"

run() {  # NAME COMMAND...: one step, its output in $CHAIN/NAME.log; skipped if SKIP names it
  local name=$1 start; shift
  [[ " ${SKIP:-} " == *" $name "* ]] && { echo "skipped (SKIP)" > "$CHAIN/$name.state"; return; }
  echo "running since $(date +%T)" > "$CHAIN/$name.state"
  start=$(date +%s)
  "$@" > "$CHAIN/$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s" > "$CHAIN/$name.state"
}

export_8b() {
  python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset llama-3.1-8b \
    --forward-sizes "${FORWARD_SIZES:-1,32,64}" -o "$ARTIFACT" 2>&1 | grep -v "$QUIET" \
    && python3 -m pt2serve.cli inspect "$ARTIFACT"
}

sweep() {
  python3 -m pt2serve.cli bench "$ARTIFACT" --mode sweep --tokens 1,32,64 --context 512,4000 --warmup 3 --iters 10 \
    --no-eager-peer --json "$CHAIN/sweep.json" 2>&1 | grep -v "$QUIET"
  python3 -m pt2serve.cli bench "$ARTIFACT" --mode sweep --tokens 1,8 --context 16000 --warmup 3 --iters 10 \
    --no-eager-peer --json "$CHAIN/sweep-16000.json" 2>&1 | grep -v "$QUIET"
}

prefill() {
  local run
  for run in 1 2; do  # the second run of each is the one to read (the first meets a cold allocator)
    python3 -m pt2serve.cli bench "$ARTIFACT" --mode requests --requests 4 --prompt-tokens 8192 --max-new-tokens 1 --token-budget 4096 \
      --json "$CHAIN/prefill-4x8192-$run.json" 2>&1 | grep -v "$QUIET"
    python3 -m pt2serve.cli bench "$ARTIFACT" --mode requests --requests 1 --prompt-tokens 32000 --max-new-tokens 1 --token-budget 4096 \
      --json "$CHAIN/prefill-1x32000-$run.json" 2>&1 | grep -v "$QUIET"
  done
}

fp8kv() {
  python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset llama-3.1-8b --quantize fp8 \
    --kv-dtype fp8 --max-context 8192 --forward-sizes 1,32,64 -o /tmp/fp8kv.pt2 2>&1 | grep -v "$QUIET" \
    && python3 -m pt2serve.cli bench /tmp/fp8kv.pt2 --mode sweep --tokens 1,32,64 --context 4000 --warmup 3 \
      --iters 10 --no-eager-peer --json "$CHAIN/fp8kv-4000.json" 2>&1 | grep -v "$QUIET"
}

# The cuda tests start once the export has timed its matmul kernels (their GPU work would skew the timings).
(sleep 90; run cuda timeout 900 python3 -m pytest -p no:cacheprovider -q -rA -m cuda tests/test_cuda.py) &
run export export_8b
wait
[ -f "$ARTIFACT" ] || exit 1
run host python3 scripts/host_overhead.py
run sweep sweep
run prefill prefill
run fp8kv fp8kv
