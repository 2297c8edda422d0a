#!/usr/bin/env bash
# GPU: the cell-attention operator's checks and speed table, then its launch-config sweep. Tables last.
set -euo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 scripts/device/attention_check.py
python3 scripts/device/attention_tune.py
