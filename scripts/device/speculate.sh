#!/usr/bin/env bash
# Speculative decoding: the cost of verifying steps (1 + k tokens per sequence, k = 3, 7, 15, at batch 1 and 32)
# as a ratio to a plain decode step, and n-gram drafts on the model's own greedy text (tokens/s against no
# speculation at batch 1 and 32, with the tokens each verifying step emitted). One markdown table last.
# GPU (default): reuses /tmp/model.pt2 if it has the acceptance methods, else exports the llama-3.1-8b preset
# there (bf16, --max-context 4096, as export_8b.sh). After the export it keeps to RUN_LIMIT_S (170 s).
# CPU: PRESET=toy-greedy BACKEND=cpu scripts/device/speculate.sh (exports to /tmp/speculate-PRESET-cpu.pt2).
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.1-8b}
BACKEND=${BACKEND:-cuda}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
if [ "$BACKEND" = cuda ]; then
  ARTIFACT=${ARTIFACT:-/tmp/model.pt2}
  EXPORT=(--backend cuda --max-context "${MAX_CONTEXT:-4096}" --graph-entries 8192)
else
  ARTIFACT=${ARTIFACT:-/tmp/speculate-$PRESET-cpu.pt2}
  EXPORT=(--backend cpu --max-context "${MAX_CONTEXT:-512}")
fi

has_acceptance() {
  [ -f "$ARTIFACT" ] && "$PYTHON" -c "import sys; from pt2serve.runtime.artifact import read_metadata; \
sys.exit(0 if 'accept_drafts' in read_metadata(sys.argv[1]).method_names else 1)" "$ARTIFACT"
}

if has_acceptance; then
  echo "reusing $ARTIFACT"
else
  start=$(date +%s)
  timeout "${EXPORT_LIMIT_S:-420}" "$PYTHON" -m pt2serve.cli export --use-offgraph-kv-cache --preset "$PRESET" \
    "${EXPORT[@]}" -o "$ARTIFACT" ${EXPORT_FLAGS:-} || { echo "export failed or timed out"; exit 1; }
  echo "export seconds: $(( $(date +%s) - start ))"
fi

timeout $(( ${RUN_LIMIT_S:-170} + 30 )) "$PYTHON" scripts/device/speculate.py "$ARTIFACT" \
  --seconds "${RUN_LIMIT_S:-170}" --num-draft-tokens "${NUM_DRAFT_TOKENS:-4}" --json "$OUT/speculate.json" \
  || echo "speculate.py failed or timed out"
