#!/usr/bin/env bash
# GPU: the llama-3.1-8b preset end to end with the attention kernel and one step in flight. Exports once
# (bf16, all methods, --max-context 4096, a pool and graph index big enough for 64 sequences at 4k), then:
#   1. bench sweep at the default short context (with the eager peer per row);
#   2. bench sweep of decode rows at 4,096 context (long-context decode; KV read counted in the limit);
#   3. bench requests: 64 requests x 512 prompt x 128 new, all at once, for a few step budgets;
#   4. the kernel profile of a T=32 step at context 64 (attention's share).
# Made to run in the background (setsid) and be polled: every stage appends to $OUT_DIR/log, tables last.
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT_DIR=${OUT_DIR:-/tmp/pt2serve-8b}; mkdir -p "$OUT_DIR"
MODEL=/tmp/model.pt2
stage() { echo "=== $* ($(date +%T))"; }
if [ ! -f "$MODEL" ]; then
  stage export
  start=$(date +%s)
  timeout 480 python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset llama-3.1-8b \
    --max-context 4096 --max-cells 300000 --graph-entries 262144 -o "$MODEL" 2>&1 | grep -v "compiling methods\|Warning\|warn("
  echo "export seconds: $(( $(date +%s) - start ))"
fi
stage sweep
timeout 300 python3 -m pt2serve.cli bench "$MODEL" --mode sweep --tokens ${TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096} \
  --warmup 3 --iters 10 --num-cells 300001 --json "$OUT_DIR/sweep.json" --plot "$OUT_DIR/sweep.png"
stage sweep at 4k context
timeout 240 python3 -m pt2serve.cli bench "$MODEL" --mode sweep --tokens 1,8,32,64 --context 4000 --no-eager-peer \
  --warmup 3 --iters 10 --num-cells 300001 --json "$OUT_DIR/sweep_4k.json"
for budget in ${BUDGETS:-2048 1024 4096}; do
  stage requests budget $budget
  timeout 120 python3 -m pt2serve.cli bench "$MODEL" --mode requests --requests 64 --prompt-tokens 512 \
    --max-new-tokens 128 --token-budget "$budget" --num-cells 300001 --json "$OUT_DIR/requests_$budget.json"
done
stage profile
timeout 120 python3 scripts/device/profile_step.py "$MODEL" 32 2>&1 | grep -v "USDT\|Warning"
stage done
