#!/usr/bin/env bash
# Fresh machine to a served model: venv + install, export the embedded `tiny` preset for the CPU,
# generate from the compiled artifact, then run a short benchmark sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
PT2SERVE="$VENV/bin/pt2serve"
mkdir -p artifacts
ARTIFACT=artifacts/tiny-cpu.pt2
if [ ! -f "$ARTIFACT" ]; then
  "$PT2SERVE" export --backend cpu --use-offgraph-kv-cache --preset tiny --max-context 512 --max-step-tokens 256 \
    --max-cells 8192 -o "$ARTIFACT"
fi
"$PT2SERVE" inspect "$ARTIFACT"
"$PT2SERVE" generate "$ARTIFACT" --prompt "Hello, pt2serve!" --max-new-tokens 24
"$PT2SERVE" bench "$ARTIFACT" --mode sweep --tokens 1,4,16,64,256 --warmup 2 --iters 5
