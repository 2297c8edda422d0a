#!/usr/bin/env bash
# GPU: every 8B check that shares one export, in one detached chain, longer than one device call allows.
#   setsid nohup scripts/device/chain_8b.sh > /dev/null 2>&1 &     then poll:     scripts/device/chain_8b.sh --poll
# It copies the repo to /tmp/chain/repo (later calls may rewrite the working tree under it), exports the
# llama-3.1-8b preset once to /tmp/model.pt2, then runs, each logged to /tmp/chain/NAME.log:
#   quant-kernels  the int8/int4 linear kernels on the 8B shapes (quiet GPU: timings)
#   serving        scripts/device/serving_8b.sh (in process, HTTP, request rates, token budgets)
#   prefix         scripts/device/prefix_reuse.sh on the 8B (multi-turn chat, prefix cache on and off)
#   speculate      scripts/device/speculate.sh (verify cost for k = 3, 7, 15; n-gram against none)
#   soak           scripts/device/soak_8b.sh (10 minutes), and beside it the checks whose timings do not count:
#   api            scripts/device/api_check.sh (tiny, fp32: device logprobs, penalties, n, grammar)
#   quant-toy      toy-greedy int8 / int4 method and width checks (quant_8b.sh step 2)
# Serving needs the wheels in .whl/ (see serving_8b.sh). --poll prints each step's state and its log's tail and
# packs /tmp/chain into $OUT/chain.tar.gz.
set -uo pipefail
CHAIN=/tmp/chain
STEPS=(export quant-kernels serving prefix speculate soak api quant-toy)

if [ "${1:-}" = "--poll" ]; then
  for step in "${STEPS[@]}"; do
    state=$(cat "$CHAIN/$step.state" 2>/dev/null || echo waiting)
    echo "== $step: $state"
    [ "$state" = waiting ] || tail -${TAIL:-15} "$CHAIN/$step.log" 2>/dev/null
  done
  [ -n "${OUT:-}" ] && tar czf "$OUT/chain.tar.gz" -C /tmp --exclude chain/repo chain 2>/dev/null
  exit 0
fi

mkdir -p "$CHAIN" && rm -rf "$CHAIN/repo" && cp -r "$PWD" "$CHAIN/repo" && cd "$CHAIN/repo" || exit 1
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PRESET=llama-3.1-8b ARTIFACT=/tmp/model.pt2
source scripts/device/server_wheels.sh
export PYTHONPATH=$PYTHONPATH${SERVER_SITE:+:$SERVER_SITE}

run() {  # NAME COMMAND...: one step, its output in $CHAIN/NAME.log and its own $OUT
  local name=$1 start; shift
  echo "running since $(date +%T)" > "$CHAIN/$name.state"
  start=$(date +%s)
  OUT=$CHAIN/$name "$@" > "$CHAIN/$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s" > "$CHAIN/$name.state"
}

export_8b() {
  mkdir -p "$OUT"
  python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset "$PRESET" --max-context 4096 \
    -o "$ARTIFACT"
}

run export export_8b
[ -f "$ARTIFACT" ] || exit 1
run quant-kernels env STEPS=1 scripts/device/quant_8b.sh
run serving scripts/device/serving_8b.sh
run prefix scripts/device/prefix_reuse.sh
run speculate scripts/device/speculate.sh
run soak scripts/device/soak_8b.sh &
soak=$!
sleep 120   # the soak's server is up and past its warm-up before the side checks start
run api scripts/device/api_check.sh
run quant-toy env STEPS=2 scripts/device/quant_8b.sh
wait $soak
