#!/usr/bin/env bash
# GPU: every 8B check that shares one export, in one detached chain, longer than one device call allows.
#   setsid nohup scripts/device/chain_8b.sh > /dev/null 2>&1 &     then poll:     scripts/device/chain_8b.sh --poll
# It copies the repo to /tmp/chain/repo (later calls may rewrite the working tree under it), exports PRESET
# (llama-3.1-8b, or toy-greedy-8b: the same shapes and cost, with designed output) once to /tmp/model.pt2
# (matmul kernels tuned; if that export fails, once more without tuning), then runs each step logged to
# /tmp/chain/NAME.log, the timed ones alone:
#   sweep       bench sweep of decode widths and two wide steps, then the kernel profile of T = 1, 32, 64
#   matmuls     scripts/device/matmul_floor.py: a step's weight matmuls, cuBLAS vs the chosen kernels vs floor
#   speculate   scripts/device/speculate.sh (verify cost for k = 3, 7, 15; n-gram against none)
#   soak        scripts/device/soak_8b.sh (10 minutes; its server's load line gives launch to ready): with
#               exports and tuning beside it (16 cores busy) its server answered too late and the soak failed
# then the untimed checks side by side (compiles on 16 cores, small models on the GPU):
#   width-check with PRESET=toy-greedy-8b: scripts/device/graphs_check.py, every width's tokens against the
#               designed ones with graphs on and off, in bf16 at the 8B's size
#   cuda-tests  the tests marked cuda (scripts/device/cuda_tests.sh PART=cuda)
#   kernel-tests  the Triton kernels' own tests, compiled (cuda_tests.sh PART=kernels)
#   tuned-small llama-3.2-1b exported in fp32 with tuned kernels: the method check
#   dflash-export  scripts/device/dflash.sh EXPORT_ONLY=1: toy-greedy-8b with a random draft of the published
#               shape (designed weights: with random ones, bf16 logits tie often enough that a verify step's
#               width alone flips greedy tokens, and the benchmark's check of unchanged output fails)
#   quant-toy   toy-greedy int8 / int4: the method and width checks (quant_8b.sh's step 2)
# and last, alone again:
#   dflash      scripts/device/dflash.sh on that export: tokens/s against the oracle's accepted length
#   quant-kernels  the quantized kernels timed on the 8B shapes, the bytes they read streamed alone (--probe),
#               and torch's own weight-only kernels beside them (quant_kernels.py; about 2 minutes)
#   quant-8b    llama-3.1-8b exported bf16, int8 and int4, swept and compared (quant_8b.sh's steps 3 and 4;
#               about 15 minutes; QUANT_STEPS, FORMATS and METHOD_CHECK narrow it, e.g. QUANT_STEPS=3
#               FORMATS="bf16 int4" METHOD_CHECK="bf16 int4" for the method checks alone, about 9 minutes)
# Everything runs longer than one session's device time: SKIP="step ..." leaves steps out, e.g.
# SKIP="quant-toy quant-kernels quant-8b" for the 8B's own checks, or SKIP="export sweep matmuls speculate soak
# width-check tuned-small" for DFlash and quantization (with export skipped, no step may need /tmp/model.pt2).
# Serving needs the wheels in .whl/ (see serving_8b.sh). --poll prints each step's state and its log's tail and
# packs /tmp/chain into $OUT/chain.tar.gz.
set -uo pipefail
CHAIN=/tmp/chain
CHAIN_STEPS=(export sweep matmuls speculate soak width-check cuda-tests kernel-tests tuned-small dflash-export
             quant-toy dflash quant-kernels quant-8b)

if [ "${1:-}" = "--poll" ]; then
  for step in "${CHAIN_STEPS[@]}"; do
    state=$(cat "$CHAIN/$step.state" 2>/dev/null || echo waiting)
    echo "== $step: $state"
    [ "$state" = waiting ] || tail -${TAIL:-15} "$CHAIN/$step.log" 2>/dev/null
  done
  [ -n "${OUT:-}" ] && tar czf "$OUT/chain.tar.gz" -C /tmp --exclude chain/repo chain 2>/dev/null
  exit 0
fi

mkdir -p "$CHAIN" && rm -rf "$CHAIN/repo" && cp -r "$PWD" "$CHAIN/repo" && cd "$CHAIN/repo" || exit 1
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PRESET=${PRESET:-llama-3.1-8b} ARTIFACT=/tmp/model.pt2
source scripts/device/server_wheels.sh
export PYTHONPATH=$PYTHONPATH${SERVER_SITE:+:$SERVER_SITE}

run() {  # NAME COMMAND...: one step, its output in $CHAIN/NAME.log and its own $OUT; skipped if SKIP names it
  local name=$1 start; shift
  [[ " ${SKIP:-} " == *" $name "* ]] && { echo "skipped (SKIP)" > "$CHAIN/$name.state"; return; }
  echo "running since $(date +%T)" > "$CHAIN/$name.state"
  start=$(date +%s)
  OUT=$CHAIN/$name "$@" > "$CHAIN/$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s" > "$CHAIN/$name.state"
}

export_8b() {
  mkdir -p "$OUT"
  python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset "$PRESET" --max-context 4096 \
    -o "$ARTIFACT" || { echo "== the tuned export failed: once more without tuning"; python3 -m pt2serve.cli export \
    --backend cuda --use-offgraph-kv-cache --preset "$PRESET" --max-context 4096 --no-tune-matmuls -o "$ARTIFACT"; }
  python3 -m pt2serve.cli inspect "$ARTIFACT"
}

sweep() {
  python3 -m pt2serve.cli bench "$ARTIFACT" --mode sweep --tokens 1,2,4,8,16,32,64,1024,4096 --warmup 3 --iters 10 \
    --json "$OUT/sweep.json" 2>&1 | grep -v "Warning\|warn("
  python3 scripts/device/profile_step.py "$ARTIFACT" 1 32 64 2>&1 | grep -v "USDT\|Warning"
}

tuned_small() {  # the method check (every compiled method against the eager model) of a tuned fp32 export
  python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset llama-3.2-1b --dtype fp32 \
    --max-context 1024 --forward-sizes 1,4,16,64 -o /tmp/1b-fp32.pt2 \
    && python3 -m pt2serve.cli inspect /tmp/1b-fp32.pt2 | grep -i matmul \
    && timeout 180 python3 scripts/device/method_check.py /tmp/1b-fp32.pt2 llama-3.2-1b
}

run export export_8b
[ -f "$ARTIFACT" ] || [[ " ${SKIP:-} " == *" export "* ]] || exit 1
run sweep sweep
run matmuls timeout 180 python3 scripts/device/matmul_floor.py "$ARTIFACT" "$PRESET"
RUN_LIMIT_S=120 run speculate scripts/device/speculate.sh
run soak scripts/device/soak_8b.sh
[ "$PRESET" = toy-greedy-8b ] && run width-check timeout 400 python3 scripts/device/graphs_check.py "$ARTIFACT" "$PRESET" &
# Bounded: the step after waits for them, and once a tuning test ran until the session's device time was gone.
PART=cuda run cuda-tests timeout 600 scripts/device/cuda_tests.sh &
PART=kernels run kernel-tests timeout 600 scripts/device/cuda_tests.sh &
run tuned-small tuned_small &
# ARTIFACT names the 8B here: the DFlash steps take their own export.
ARTIFACT= PRESET=toy-greedy-8b EXPORT_ONLY=1 run dflash-export scripts/device/dflash.sh &
STEPS=2 WORK=/tmp/quant run quant-toy scripts/device/quant_8b.sh &
wait
ARTIFACT= PRESET=toy-greedy-8b RUN_LIMIT_S=120 run dflash scripts/device/dflash.sh
rm -f "$ARTIFACT" /tmp/dflash-*.pt2   # no step below reads them; three 8B exports (30 GB) need the disk (64 GB)
run quant-kernels timeout 300 python3 scripts/device/quant_kernels.py --widths 1,16,64 --probe
PRESET=llama-3.1-8b STEPS="${QUANT_STEPS:-3 4}" WORK=/tmp/quant run quant-8b scripts/device/quant_8b.sh
