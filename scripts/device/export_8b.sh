#!/usr/bin/env bash
# GPU: export the llama-3.1-8b preset (bf16, all methods), then time decode steps. Table last.
set -euo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.1-8b}
start=$(date +%s)
python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset "$PRESET" \
  --max-context 4096 --graph-entries 8192 -o /tmp/model.pt2 ${EXPORT_FLAGS:-}
echo "export seconds: $(( $(date +%s) - start ))"
ls -la /tmp/model.pt2
python3 scripts/device/decode_timing.py /tmp/model.pt2 "$PRESET"
