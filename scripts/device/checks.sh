#!/usr/bin/env bash
# GPU: the checks a change to the runtime or the kernels needs, in one call (about 4 minutes):
#   1. the tests marked `cuda` (scripts/device/cuda_tests.sh), while toy-greedy exports with --quantize int4
#      (LM head and embedding too) beside them: both compile on the CPU cores
#   2. the quantized linear's kernels on the 8B's shapes (quant_kernels.py), on a quiet GPU
#   3. the int4 toy artifact: every compiled method against the eager quantized model, and the width check
#      with graphs on and off (the designed tokens)
# Logs in $OUT; a summary last.
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
TOY=/tmp/toy-int4.pt2

python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset toy-greedy --max-context 512 \
  --max-step-tokens 256 --quantize int4 --quantize-lm-head --quantize-embedding -o "$TOY" \
  > "$OUT/toy-int4-export.log" 2>&1 &
toy_export=$!
scripts/device/cuda_tests.sh > "$OUT/cuda-tests.log" 2>&1
cuda_tests=$?
wait $toy_export
toy=$?

timeout 240 python3 scripts/device/quant_kernels.py > "$OUT/quant-kernels.txt" 2>&1
kernels=$?
if [ $toy -eq 0 ]; then
  timeout 120 python3 scripts/device/method_check.py "$TOY" toy-greedy > "$OUT/toy-int4-methods.txt" 2>&1
  timeout 180 python3 scripts/device/graphs_check.py "$TOY" > "$OUT/toy-int4-widths.txt" 2>&1
  widths=$?
else
  tail -20 "$OUT/toy-int4-export.log"
fi

echo "== cuda tests (exit $cuda_tests)"; tail -15 "$OUT/cuda-tests.log"
echo "== quantized kernels (exit $kernels)"; cat "$OUT/quant-kernels.txt"
echo "== int4 toy-greedy (export exit $toy)"
[ $toy -eq 0 ] && { cat "$OUT/toy-int4-methods.txt"; tail -6 "$OUT/toy-int4-widths.txt"; echo "width check exit $widths"; }
