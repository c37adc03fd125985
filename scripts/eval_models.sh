#!/usr/bin/env bash
# Test-set Recall / NDCG of the reference models of scripts/train_models.sh: top-20 by exact
# tree-attention beam search for every test user (the LLM preset: the first LLM_USERS test
# users, its decoding being ~100x slower here), cut at 5, 10 and 20. Writes
# OUT_DIR/<model>.test.jsonl and prints the metrics.
# Usage: scripts/eval_models.sh [MODELS_DIR] (default runs/models); BEAUTY_DIR overrides the data path.
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${1:-runs/models}
BEAUTY=${BEAUTY_DIR:-../shared/data/amazon-beauty}
RECSPEC=${RECSPEC:-.venv/bin/recspec}
LLM_USERS=${LLM_USERS:-256}

evaluate() {  # evaluate MODEL DATASET SPLIT [recommend options...]
    local model=$1 dataset=$2 split=$3; shift 3
    [ -f "$MODELS/$model/best/model.safetensors" ] || { echo "$model: not trained, skipped"; return; }
    local recs="$MODELS/$model.test.jsonl"
    [ -f "$recs" ] || $RECSPEC recommend --target "$MODELS/$model" --decoder tree-beam --k 20 --batch-size 32 \
        --out "$recs" "$@"
    echo "== $model (test users of $dataset, $split split)"
    $RECSPEC eval --recs "$recs" --dataset "$dataset" --split "$split" --k 5 --k 10 --k 20
}

if [ -d "$BEAUTY" ]; then
    for model in beauty-target beauty-target-small beauty-draft beauty-llm-draft; do evaluate "$model" "$BEAUTY" given; done
    evaluate beauty-llm "$BEAUTY" given --users "$LLM_USERS" --batch-size 8
fi
for model in ml-target ml-target-small ml-draft; do evaluate "$model" ml-100k loo; done
