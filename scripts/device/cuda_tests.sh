#!/usr/bin/env bash
# GPU: the tests marked `cuda` (tests/test_cuda.py): graph replay against the methods on every static width,
# the runner through graphs and without them, KV pool sizing from free GPU memory, the architecture check;
# the export's matmul tuning on the GPU; then the small-M matmul, rope and quantized kernels' tests, compiled.
# Run on the GPU machine from the repo root. Needs pytest: where it is not installed, set WHEELS=DIR to a
# folder holding the pytest, pluggy, iniconfig and packaging wheels. Prints pytest's outcome table last.
set -euo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! python3 -c "import pytest" 2>/dev/null; then
  if [ -z "${WHEELS:-}" ]; then
    echo "pytest is not installed: set WHEELS=DIR to a folder with its wheels" >&2
    exit 1
  fi
  python3 -m pip install -q --no-index --find-links "$WHEELS" pytest
fi
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
# Only the GPU test file is collected: the other test files import server and test-only packages the
# GPU image may lack.
# PART=cuda runs only the first suite, PART=kernels only the second (each compiles minutes of kernels).
status=0
if [ "${PART:-all}" != kernels ]; then
  python3 -m pytest -m cuda -p no:cacheprovider -rA ${TESTS:-tests/test_cuda.py tests/test_small_m_linear.py} \
    || status=$?
fi
# The kernels' own tests, compiled for the GPU (without one they run in Triton's interpreter).
if [ "${PART:-all}" != cuda ]; then
  python3 -m pytest -p no:cacheprovider -rA ${KERNEL_TESTS:-tests/test_small_m_linear.py tests/test_rope_store.py
    tests/test_quant_kernels.py} || status=$?
fi
exit $status
