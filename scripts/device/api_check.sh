#!/usr/bin/env bash
# GPU check of the API features computed on the device (logprobs, penalties, n > 1, grammar masks) under
# CUDA graphs and one step in flight, and their cost per decode step. Run on the GPU machine from the repo
# root; the grammar check needs xgrammar and its dependencies (carry their wheels: the machine has no network).
set -euo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ARTIFACT=/tmp/tiny-random-fp32.pt2
python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset tiny-random --dtype fp32 \
  --max-context 256 --max-step-tokens 128 --max-cells 8192 --jobs 8 -o "$ARTIFACT"
python3 scripts/device/api_check.py "$ARTIFACT"
