#!/usr/bin/env bash
# GPU: export a preset with forward_1 and forward_64 only, then show where a decode step's GPU time goes
# (scripts/device/profile_step.py, graphs off so each kernel is seen). Tables last.
set -euo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.2-1b}
start=$(date +%s)
python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset "$PRESET" --forward-sizes 1,64 \
  --max-context 4096 --graph-entries 8192 -o /tmp/profile.pt2 2>&1 | grep -v "Warning\|warn(\|__new__"
echo "export seconds: $(( $(date +%s) - start ))"
python3 scripts/device/profile_step.py /tmp/profile.pt2 1 64 2>&1 | grep -v "USDT\|Warning"
