#!/usr/bin/env bash
# GPU: export the llama-3.1-8b preset (bf16, all methods, timed), run the bench sweep on it (with its eager
# PyTorch peer per row), then a few widths without CUDA graphs. Everything in one call: the machine keeps
# /tmp only while warm. Tables last.
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.1-8b}
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
start=$(date +%s)
timeout ${EXPORT_LIMIT_S:-430} python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset "$PRESET" \
  --max-context 4096 --graph-entries 8192 -o /tmp/model.pt2 || { echo "export failed or timed out"; exit 1; }
echo "export seconds: $(( $(date +%s) - start ))"
python3 -m pt2serve.cli inspect /tmp/model.pt2 | grep -i "methods\|built with\|dtype"
ls -la /tmp/model.pt2
timeout ${BENCH_LIMIT_S:-200} python3 -m pt2serve.cli bench /tmp/model.pt2 --mode sweep \
  --tokens ${TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096} --warmup 3 --iters 10 \
  --json "$OUT/sweep.json" --plot "$OUT/sweep.png"
# The same artifact without CUDA graphs, where every step runs forward_others: per width, which costs less.
timeout ${NO_GRAPHS_LIMIT_S:-60} python3 -m pt2serve.cli bench /tmp/model.pt2 --mode sweep --no-cuda-graphs \
  --tokens ${NO_GRAPHS_TOKENS:-1,8,64} --warmup 3 --iters 10 --no-eager-peer --json "$OUT/sweep_no_graphs.json"
