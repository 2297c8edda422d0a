#!/usr/bin/env bash
# DFlash speculation at batch 1: output tokens/s against the accepted length (an oracle drafter that runs the real
# draft but proposes the known continuation, wrong at a chosen index), beside plain decoding and the weight-read
# floor. One markdown table last.
# GPU (default): the toy-greedy-8b preset (bf16; llama-3.1-8b's shapes with designed weights) with a random DFlash
# draft of the published shape (DRAFT_LAYERS=5 Qwen3 layers, block 16), exported to
# /tmp/dflash-PRESET-BACKEND.pt2 (reused when present) with two static widths (1 and 16) and one draft size, so
# the export stays short (about 5 minutes). Designed weights because the benchmark checks that speculation leaves
# the greedy tokens unchanged: random weights' logits in bf16 tie closely enough that the verify step's width
# alone flips some (llama-3.1-8b did, 2026-12-02). After the export it keeps to RUN_LIMIT_S (170 s);
# EXPORT_ONLY=1 stops after the export.
# CPU: PRESET=tiny-random BACKEND=cpu DRAFT_LAYERS=1 scripts/device/dflash.sh
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-toy-greedy-8b}
BACKEND=${BACKEND:-cuda}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
ARTIFACT=${ARTIFACT:-/tmp/dflash-$PRESET-$BACKEND.pt2}
DRAFT=${DRAFT:-/tmp/dflash-draft-$PRESET}
if [ "$BACKEND" = cuda ]; then
  EXPORT=(--backend cuda --max-context "${MAX_CONTEXT:-2048}" --forward-sizes 1,16 --draft-sizes 1)
else
  EXPORT=(--backend cpu --max-context "${MAX_CONTEXT:-512}" --forward-sizes 1,16 --draft-sizes 1)
fi

if [ -f "$ARTIFACT" ]; then
  "$PYTHON" -c "import sys; from pt2serve.runtime.artifact import read_metadata; \
sys.exit(0 if read_metadata(sys.argv[1]).draft is not None else 1)" "$ARTIFACT" \
    || { echo "$ARTIFACT holds no DFlash draft: unset ARTIFACT, or name one exported with --draft"; exit 1; }
  echo "reusing $ARTIFACT"
else
  # A random draft of the published shape for this target: DRAFT_LAYERS Qwen3 layers, block 16.
  "$PYTHON" -c "import sys; from pt2serve.model.dflash import write_random_draft; \
from pt2serve.model.presets import CONFIGS; \
write_random_draft(sys.argv[1], CONFIGS[sys.argv[2]], num_layers=int(sys.argv[3]), block_size=16)" \
    "$DRAFT" "$PRESET" "${DRAFT_LAYERS:-5}" || { echo "writing the draft failed"; exit 1; }
  start=$(date +%s)
  timeout "${EXPORT_LIMIT_S:-420}" "$PYTHON" -m pt2serve.cli export --use-offgraph-kv-cache --preset "$PRESET" \
    --draft "$DRAFT" "${EXPORT[@]}" -o "$ARTIFACT" ${EXPORT_FLAGS:-} || { echo "export failed or timed out"; exit 1; }
  echo "export seconds: $(( $(date +%s) - start ))"
fi

[ -n "${EXPORT_ONLY:-}" ] && exit 0
timeout $(( ${RUN_LIMIT_S:-170} + 60 )) "$PYTHON" scripts/device/dflash.py "$ARTIFACT" \
  --seconds "${RUN_LIMIT_S:-170}" --json "$OUT/dflash.json" \
  ${NUM_DRAFT_TOKENS:+--num-draft-tokens "$NUM_DRAFT_TOKENS"} \
  || echo "dflash.py failed or timed out"
