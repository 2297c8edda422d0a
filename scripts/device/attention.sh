#!/usr/bin/env bash
# GPU: the Triton cell-attention operator. Exports toy-greedy for cuda (attention kernel, the cuda default),
# checks every method against eager PyTorch and the graph replay of every width, then runs the operator's
# own checks and speed table (scripts/device/attention_check.py). Tables last.
set -euo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
DTYPE=${DTYPE:-bf16}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset toy-greedy --dtype "$DTYPE" \
  --max-context 256 --max-step-tokens 128 --max-cells 8192 --jobs 8 --forward-sizes "${FORWARD_SIZES:-1,2,4,8,16,32,64}" \
  -o /tmp/toy-$DTYPE.pt2
echo "export seconds: $(( $(date +%s) - start ))"
python3 scripts/device/method_check.py /tmp/toy-$DTYPE.pt2 toy-greedy
python3 scripts/device/graphs_check.py /tmp/toy-$DTYPE.pt2
python3 scripts/device/runner_check.py /tmp/toy-$DTYPE.pt2
python3 scripts/device/attention_check.py ${ATTENTION_CHECK_FLAGS:-}
