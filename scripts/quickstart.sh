#!/usr/bin/env bash
# Fresh machine to a served model: venv + install, export the built-in `tiny` preset for the CPU,
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
# tiny was trained on Shakespeare's plays, so it continues the prompt as a scene. Sampled at 0.7 with a seed:
# greedy decoding of so small a model soon repeats itself, and the seed keeps the output as the README shows it.
"$PT2SERVE" generate "$ARTIFACT" --prompt "Hello, pt2serve!" --max-new-tokens 40 --temperature 0.7 --seed 0
"$PT2SERVE" bench "$ARTIFACT" --mode sweep --tokens 1,4,16,64,256 --warmup 2 --iters 5
