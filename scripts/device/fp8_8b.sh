#!/usr/bin/env bash
# GPU: FP8 (--quantize fp8) end to end, in one detached chain longer than one device call allows.
#   setsid nohup scripts/device/fp8_8b.sh > /dev/null 2>&1 &     then poll:     scripts/device/fp8_8b.sh --poll
# Steps, each logged to /tmp/fp8/NAME.log:
#   kernels   tests/test_fp8.py compiled for the GPU: the small-M kernels on e4m3 operands, torch._scaled_mm and
#             the fused SwiGLU against the reference
#   toy       toy-greedy exported --quantize fp8 (tuned), then scripts/device/graphs_check.py: every width's
#             tokens against the designed ones with graphs on and off (beside the 8B's export: it is small)
#   export    llama-3.1-8b exported --quantize fp8 (tuned), --max-context 4096, to /tmp/fp8.pt2
#   sweep     bench sweep of decode widths and two wide steps, decodes at context 4,000, then the kernel
#             profile of T = 1, 32, 64
#   serving   scripts/device/http_overhead.sh: 64 x 512 / 128 in process and through serve-artifact
#             (needs the server's wheels in .whl/, see serving_8b.sh)
# FORWARD_SIZES narrows the 8B's static widths (fewer methods: a shorter export), SWEEP_TOKENS the sweep's rows.
# SKIP="step ..." leaves steps out. --poll prints each step's state and its log's tail and copies logs and JSON to $OUT.
set -uo pipefail
CHAIN=/tmp/fp8
STEPS=(kernels toy export sweep serving)

if [ "${1:-}" = "--poll" ]; then
  for step in "${STEPS[@]}"; do
    state=$(cat "$CHAIN/$step.state" 2>/dev/null || echo waiting)
    echo "== $step: $state"
    [ "$state" = waiting ] || tail -"${TAIL:-12}" "$CHAIN/$step.log" 2>/dev/null
  done
  # At most 8 files come back from a device call: the measurements, not every log.
  [ -n "${OUT:-}" ] && cp "$CHAIN"/*.json "$CHAIN"/sweep.log "$CHAIN"/serving.log "$OUT"/ 2>/dev/null
  exit 0
fi

mkdir -p "$CHAIN" && rm -rf "$CHAIN/repo" && cp -r "$PWD" "$CHAIN/repo" && cd "$CHAIN/repo" || exit 1
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ARTIFACT=/tmp/fp8.pt2

run() {  # NAME COMMAND...: one step, its output in $CHAIN/NAME.log; skipped if SKIP names it
  local name=$1 start; shift
  [[ " ${SKIP:-} " == *" $name "* ]] && { echo "skipped (SKIP)" > "$CHAIN/$name.state"; return; }
  echo "running since $(date +%T)" > "$CHAIN/$name.state"
  start=$(date +%s)
  "$@" > "$CHAIN/$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s" > "$CHAIN/$name.state"
}

toy() {
  python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset toy-greedy --quantize fp8 \
    --max-context 512 -o /tmp/toy-fp8.pt2 && python3 -m pt2serve.cli inspect /tmp/toy-fp8.pt2 | grep -i "quantiz\|matmul" \
    && timeout 400 python3 scripts/device/graphs_check.py /tmp/toy-fp8.pt2 toy-greedy
}

export_8b() {
  python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset llama-3.1-8b --quantize fp8 \
    --max-context 4096 --forward-sizes "${FORWARD_SIZES:-1,2,4,8,16,32,64}" -o "$ARTIFACT" \
    && python3 -m pt2serve.cli inspect "$ARTIFACT"
}

sweep() {
  python3 -m pt2serve.cli bench "$ARTIFACT" --mode sweep --tokens "${SWEEP_TOKENS:-1,2,4,8,16,32,64,1024,4096}" \
    --warmup 3 --iters 10 \
    --json "$CHAIN/sweep.json" 2>&1 | grep -v "Warning\|warn("
  python3 -m pt2serve.cli bench "$ARTIFACT" --mode sweep --tokens 1,32,64 --context 4000 --warmup 3 --iters 10 \
    --no-eager-peer --json "$CHAIN/sweep-4000.json" 2>&1 | grep -v "Warning\|warn("
  python3 scripts/device/profile_step.py "$ARTIFACT" 1 32 64 2>&1 | grep -v "USDT\|Warning"
}

run kernels timeout 300 python3 -m pytest -p no:cacheprovider -q -rA tests/test_fp8.py \
  -k "small_m or cuda or independent or swiglu"
run toy toy &
run export export_8b
wait
[ -f "$ARTIFACT" ] || exit 1
run sweep sweep
OUT=$CHAIN ARTIFACT=$ARTIFACT run serving timeout 400 scripts/device/http_overhead.sh
