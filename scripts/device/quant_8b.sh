#!/usr/bin/env bash
# GPU: weight-only int8 / int4 on the H200. Run it detached (setsid nohup ... &) and poll: it takes longer
# than one call. Steps, each logged to $OUT:
#   1. the quantized linear's kernel tests, compiled, then its kernels on the 8B shapes against bf16 torch.mm,
#      every small-M config at M = 1, 16, 64 (scripts/device/quant_kernels.py --configs)
#   2. toy-greedy exported with --quantize int8 and int4 (+ LM head and embedding): the method check (every
#      compiled method against the eager quantized model) and the width check (graphs on/off, designed tokens)
#   3. the llama-3.1-8b preset exported bf16, int8 and int4 (group 128; FORMATS picks), one after another (never in
#      parallel: each export's workers hold the weights), with sizes and load times; EXPORT_FLAGS adds flags;
#      the method check of those METHOD_CHECK names (bf16: the tuned bf16 kernels at the 8B's shapes)
#   4. bench sweep at T=1,32,64,1024 on each, and bench --mode quality of int8 and int4 against bf16
# The table comes last.
set -uo pipefail
export CXX=/usr/bin/g++   # the image's default g++ carries its own libstdc++, and loading then segfaults
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-llama-3.1-8b}
OUT=${OUT:-/tmp/pt2serve-out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/quant}; mkdir -p "$WORK"
SIZES=${SIZES:-1,32,64}   # the static widths the sweep needs (forward_others covers 1024)
TOKENS=${TOKENS:-1,32,64,1024}
STEPS=${STEPS:-1 2 3 4}   # a subset runs alone, e.g. STEPS="1 2" for the kernels and the toy checks
step() { [[ " $STEPS " == *" $1 "* ]]; }
pt2serve() { python3 -m pt2serve.cli "$@"; }

if step 1; then
echo "== 1. kernels: their tests compiled for the GPU, then timed (every config at M = 1, 16, 64)"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py 2>&1 | tail -5
timeout 300 python3 scripts/device/quant_kernels.py --configs --widths 1,16,64 2>&1 | tee "$OUT/kernels.txt"

fi

if step 2; then
echo "== 2. toy-greedy int8 / int4: method and width checks"
for q in int8 int4; do
  flags="--quantize $q"
  [ "$q" = int4 ] && flags="$flags --quantize-lm-head --quantize-embedding"
  timeout 600 python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset toy-greedy \
    --max-context 512 --max-step-tokens 256 $flags -o "$WORK/toy-$q.pt2" > "$OUT/toy-$q-export.log" 2>&1 \
    || { echo "toy $q export failed"; tail -20 "$OUT/toy-$q-export.log"; continue; }
  timeout 300 python3 scripts/device/method_check.py "$WORK/toy-$q.pt2" toy-greedy 2>&1 | tee "$OUT/toy-$q-methods.txt"
  timeout 600 python3 scripts/device/graphs_check.py "$WORK/toy-$q.pt2" 2>&1 | tail -15 | tee "$OUT/toy-$q-widths.txt"
done

fi

if step 3; then
echo "== 3. $PRESET bf16 / int8 / int4"
: > "$OUT/exports.tsv"
for q in ${FORMATS:-bf16 int8 int4}; do
  flags="${EXPORT_FLAGS:-}"
  [ "$q" != bf16 ] && flags="$flags --quantize $q"
  start=$(date +%s)
  timeout ${EXPORT_LIMIT_S:-900} python3 -m pt2serve.cli export --backend cuda --use-offgraph-kv-cache --preset "$PRESET" \
    --max-context 4096 --graph-entries 8192 --forward-sizes "$SIZES" $flags -o "$WORK/$q.pt2" > "$OUT/$q-export.log" 2>&1 \
    || { echo "$q export failed or timed out"; tail -20 "$OUT/$q-export.log"; continue; }
  seconds=$(( $(date +%s) - start ))
  load=$(python3 -c "
import time, torch
from pt2serve.runtime.artifact import load_artifact
started = time.perf_counter(); load_artifact('$WORK/$q.pt2'); torch.cuda.synchronize()
print(f'{time.perf_counter() - started:.1f}')")
  printf "%s\t%s\t%s\t%s\n" "$q" "$(stat -c %s "$WORK/$q.pt2")" "$seconds" "$load" >> "$OUT/exports.tsv"
  pt2serve inspect "$WORK/$q.pt2" | grep -i "quantization\|weights\|matmul"
  if [[ " ${METHOD_CHECK:-bf16} " == *" $q "* ]]; then
    timeout 300 python3 scripts/device/method_check.py "$WORK/$q.pt2" "$PRESET" 2>&1 | tee "$OUT/$q-methods.txt"
  fi
done

fi

if step 4; then
echo "== 4. sweeps and quality"
for q in bf16 int8 int4; do
  [ -f "$WORK/$q.pt2" ] || continue
  timeout ${BENCH_LIMIT_S:-300} python3 -m pt2serve.cli bench "$WORK/$q.pt2" --mode sweep --tokens "$TOKENS" \
    --warmup 3 --iters 10 --json "$OUT/sweep-$q.json" > "$OUT/sweep-$q.txt" 2>&1 || echo "$q sweep failed"
done
for q in int8 int4; do
  [ -f "$WORK/$q.pt2" ] && [ -f "$WORK/bf16.pt2" ] || continue
  timeout 300 python3 -m pt2serve.cli bench "$WORK/$q.pt2" --mode quality --reference "$WORK/bf16.pt2" \
    --requests 8 --prompt-tokens 64 --max-new-tokens 32 --json "$OUT/quality-$q.json" | tail -6
done

fi

[ -f "$OUT/exports.tsv" ] || exit 0   # no 8B exports this run: no table
echo "== table"
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
exports = {}
for line in (out / "exports.tsv").read_text().splitlines():
    name, size, seconds, load = line.split("\t")
    exports[name] = (int(size) / 1e9, seconds, load)
sweeps = {}
for name in ("bf16", "int8", "int4"):
    path = out / f"sweep-{name}.json"
    if path.exists():
        sweeps[name] = {row["tokens"]: row for row in json.loads(path.read_text())["rows"]}
quality = {}
for name in ("int8", "int4"):
    path = out / f"quality-{name}.json"
    if path.exists():
        quality[name] = json.loads(path.read_text())["result"]
widths = sorted({t for rows in sweeps.values() for t in rows})
head = f"{'artifact':>8} {'GB':>6} {'export s':>8} {'load s':>6}"
for t in widths:
    head += f" {'T=' + str(t) + ' ms':>10} {'floor':>7} {'x floor':>7} {'x bf16':>6}"
head += f" {'top-1':>7} {'mean KL':>8}"
print(head)
for name in ("bf16", "int8", "int4"):
    size, seconds, load = exports.get(name, (float("nan"), "-", "-"))
    line = f"{name:>8} {size:6.2f} {seconds:>8} {load:>6}"
    for t in widths:
        row, base = sweeps.get(name, {}).get(t), sweeps.get("bf16", {}).get(t)
        if row is None or row["interval_seconds"] is None:
            line += f" {'-':>10} {'-':>7} {'-':>7} {'-':>6}"
            continue
        ms, floor = row["interval_seconds"] * 1e3, row["limit_seconds"] * 1e3
        vs = ms / (base["interval_seconds"] * 1e3) if base and base["interval_seconds"] else float("nan")
        line += f" {ms:10.3f} {floor:7.3f} {ms / floor:7.2f} {vs:6.2f}"
    q = quality.get(name)
    line += f" {q['top1_agreement'] * 100:6.2f}% {q['mean_kl']:8.2e}" if q else f" {'-':>7} {'-':>8}"
    print(line)
EOF
