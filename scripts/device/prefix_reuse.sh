#!/usr/bin/env bash
# GPU: prefix reuse on a multi-turn chat load, and the KV pool the default sizing gives.
# Exports the llama-3.2-1b preset (bf16, random weights, no tokenizer: the conversations are token ids) to
# $ARTIFACT unless it is there, prints the load line (the pool in tokens and GB, sized by
# --kv-memory-fraction of the memory free after the weights), then runs `bench --mode requests --workload
# chat` (32 conversations x 6 turns, a 1,024-token system prompt shared, 128-token user turns and replies)
# in process with the prefix cache and without it. One table last: prompt tokens computed and reused, TTFT
# of first and later turns (p50 / p90), output tok/s. JSON of both runs: $OUT.
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.2-1b}
ARTIFACT=${ARTIFACT:-/tmp/chat.pt2}
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
WORKLOAD=(--mode requests --workload chat --requests "${CONVERSATIONS:-32}" --turns "${TURNS:-6}"
          --system-tokens "${SYSTEM_TOKENS:-1024}" --prompt-tokens "${USER_TOKENS:-128}"
          --max-new-tokens "${REPLY_TOKENS:-128}" --stagger-ms "${STAGGER_MS:-20}")

source scripts/device/export_unless_present.sh
export_unless_present "$ARTIFACT" "${EXPORT_LIMIT_S:-400}" --backend cuda --use-offgraph-kv-cache --preset "$PRESET" --max-context 4096 --forward-sizes 1,16,64 || exit 1

python3 - "$ARTIFACT" <<'EOF'
import sys
from pt2serve.runtime.engine import describe_load, open_runner
runner = open_runner(sys.argv[1])
print(describe_load(runner))
runner.close()
EOF

for cache in prefix-cache no-prefix-cache; do
  echo "== $cache"
  timeout ${BENCH_LIMIT_S:-240} python3 -m pt2serve.cli bench "$ARTIFACT" "${WORKLOAD[@]}" "--$cache" \
    --timeout "${BENCH_LIMIT_S:-240}" --json "$OUT/chat-$cache.json" || echo "$cache: failed or timed out"
done

python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'run':<16} {'prompt tok':>10} {'computed':>9} {'reused':>9} {'TTFT 1st p50/p90 ms':>20} "
      f"{'TTFT later p50/p90 ms':>22} {'out tok/s':>9}")
for cache in ("prefix-cache", "no-prefix-cache"):
    path = out / f"chat-{cache}.json"
    if not path.exists():
        print(f"{cache:<16} (no result)")
        continue
    s = json.loads(path.read_text())["summary"]
    first, later = s["ttft_first_turns_seconds"], s["ttft_later_turns_seconds"]
    ms = lambda d: f"{d['p50'] * 1e3:.0f} / {d['p90'] * 1e3:.0f}" if d["p50"] is not None else "-"
    print(f"{cache:<16} {s['prompt_tokens']:>10,} {s['prompt_tokens_computed']:>9,} {s['prompt_tokens_reused']:>9,} "
          f"{ms(first):>20} {ms(later):>22} {s['output_tokens_per_second']:>9,.0f}")
EOF
