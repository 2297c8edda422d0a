#!/usr/bin/env bash
# GPU smoke run: export toy-greedy for cuda, then check graphs on/off give identical, designed tokens.
# Run on the GPU machine from the repo root. Prints a short table last.
set -euo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
DTYPE=${DTYPE:-bf16}
ARTIFACT=/tmp/toy-$DTYPE.pt2
start=$(date +%s)
python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset toy-greedy --dtype "$DTYPE" \
  --max-context 256 --max-step-tokens 128 --max-cells 8192 --jobs 8 -o "$ARTIFACT"
echo "export seconds: $(( $(date +%s) - start ))"
python3 -m pt2serve.cli inspect "$ARTIFACT"
python3 scripts/device/method_check.py "$ARTIFACT" toy-greedy
python3 scripts/device/graphs_check.py "$ARTIFACT"
