#!/usr/bin/env bash
# GPU readiness check of jaxscale (issue 12, item 4): one script, at most ~8 minutes on one H200.
#
#   bash experiments/gpu/check.sh            # on the GPU machine; writes experiments/results/gpu_check_<time>.txt
#   bash experiments/gpu/check.sh --quick    # small shapes, any backend (CPU: how the script itself is tested)
#
# Prints:
#   (a) lookup + update throughput (jaxscale.engine.native ops; on GPU they lower to the pure-JAX kernels) against
#       the HBM limit: the data-sheet peak and a measured on-device copy;
#   (b) a duplicate-heavy f32 scatter-add / segment-sum timed without and with the LLVM option
#       -nvptx-allow-ftz-atomics (XLA_FLAGS=--xla_backend_extra_options=-nvptx-allow-ftz-atomics, read once
#       when the backend starts, hence two processes; jaxlib 0.10.2-0.11 otherwise compiles f32 scatter-add
#       to a compare-and-swap loop: openxla/xla#46225, jax-ml/jax#38806), beside a sort-based version with
#       no atomics, and the atomic instructions found in the PTX of each run;
#   (c) jax.lax.ragged_all_to_all inside shard_map over the visible GPUs (one GPU: a self-exchange);
#   (d) the smoke training step on one GPU: python -m jaxscale.train --steps 20 mesh.nodes=1 mesh.local=1.
#
# Installs nothing (the GPU machine has no network): run `pip install -e ".[cuda12]"` (jax with its CUDA 12
# plugin and jaxscale's dependencies) in the Python environment beforehand; PYTHON selects the interpreter.
set -uo pipefail

cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
QUICK=""
if [[ "${1:-}" == "--quick" ]]; then QUICK="--quick"; fi
STAMP=$(date +%Y%m%d-%H%M%S)
OUT=${GPU_CHECK_OUT:-experiments/results/gpu_check_${STAMP}.txt}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$(dirname "$OUT")"
exec > >(tee "$OUT") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset XLA_FLAGS
FTZ_FLAGS="--xla_backend_extra_options=-nvptx-allow-ftz-atomics"
FAILED=()

section() { echo; echo "=== $1 ($(date +%H:%M:%S), ${SECONDS}s elapsed)"; }

# run NAME TIMEOUT_S CMD...: runs a part with a time limit, unless the overall budget is spent.
run() {
  local name=$1 limit=$2
  shift 2
  if (( SECONDS + 10 > BUDGET_S )); then
    echo "SKIPPED $name: the ${BUDGET_S}s budget is spent"
    FAILED+=("$name (skipped)")
    return
  fi
  if (( SECONDS + limit > BUDGET_S )); then limit=$(( BUDGET_S - SECONDS )); fi
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if (( rc == 124 || rc == 137 )); then
    echo "TIMED OUT $name after ${limit}s"
    FAILED+=("$name (timeout)")
  elif (( rc != 0 )); then
    echo "FAILED $name (exit $rc)"
    FAILED+=("$name (exit $rc)")
  fi
}

# ptx_atomics DIR: counts of float atomic adds and compare-and-swap loops in the PTX XLA dumped.
ptx_atomics() {
  local add cas
  add=$(cat "$1"/*.ptx 2>/dev/null | grep -c -E '(atom|red)(\.[a-z]+)*\.add\.f32' || true)
  cas=$(cat "$1"/*.ptx 2>/dev/null | grep -c -E 'atom(\.[a-z]+)*\.cas\.b32' || true)
  echo "    PTX of this run: ${add:-0} native f32 atomic adds (atom|red .add.f32), ${cas:-0} atom.cas.b32 (0/0: no PTX dumped on this backend)"
}

section "environment"
echo "jaxscale GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv
else
  echo "nvidia-smi: not found"
fi
$PY - "$QUICK" <<'EOF'
import sys
try:
    import jax, jaxlib
except ImportError as e:
    sys.exit(f"JAX is not installed in this environment ({e}): run `pip install -e .[cuda12]` beforehand")
print(f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")
print(f"backend {jax.default_backend()}: {jax.devices()}")
from jaxscale.training import registry
if "foundation" not in registry.kinds():
    sys.exit("jaxscale's model kinds are not registered in this environment (the source tree on PYTHONPATH is not "
             "enough): run `pip install --no-deps --no-build-isolation -e .` beforehand")
if jax.default_backend() != "gpu" and sys.argv[1] != "--quick":
    sys.exit("no GPU visible to JAX: install jax with its CUDA plugin (`pip install -e .[cuda12]`) beforehand, "
             "check nvidia-smi and CUDA_VISIBLE_DEVICES; or pass --quick to test this script on CPU")
EOF
PRE=$?
if (( PRE != 0 )); then echo "preflight failed (exit $PRE)"; exit 2; fi

section "(a) lookup + update throughput vs HBM bandwidth (run with $FTZ_FLAGS)"
run lookup 110 env XLA_FLAGS="$FTZ_FLAGS" "$PY" experiments/gpu/check.py --part lookup $QUICK --json-out "$TMP/lookup.json"

section "(b) duplicate-heavy f32 scatter-add / segment-sum: without the LLVM option"
run scatter-off 80 env XLA_FLAGS="--xla_dump_to=$TMP/ptx_off" \
  "$PY" experiments/gpu/check.py --part scatter $QUICK --json-out "$TMP/scatter_off.json"
ptx_atomics "$TMP/ptx_off"
section "(b) the same with -nvptx-allow-ftz-atomics"
run scatter-on 80 env XLA_FLAGS="$FTZ_FLAGS --xla_dump_to=$TMP/ptx_on" \
  "$PY" experiments/gpu/check.py --part scatter $QUICK --json-out "$TMP/scatter_on.json"
ptx_atomics "$TMP/ptx_on"
if [[ -s "$TMP/scatter_off.json" && -s "$TMP/scatter_on.json" ]]; then
  "$PY" experiments/gpu/check.py --part compare-scatter "$TMP/scatter_off.json" "$TMP/scatter_on.json"
fi

section "(c) ragged all-to-all"
run ragged 50 env XLA_FLAGS="$FTZ_FLAGS" "$PY" experiments/gpu/check.py --part ragged $QUICK --json-out "$TMP/ragged.json"

section "(d) smoke train step on one device (foundation smoke config, mesh 1x1, 20 steps, with $FTZ_FLAGS)"
if [[ -n "$QUICK" ]]; then
  echo "skipped in --quick mode (run it alone: python -m jaxscale.train --steps 20 mesh.nodes=1 mesh.local=1)"
else
  run train 170 env XLA_FLAGS="$FTZ_FLAGS" "$PY" -m jaxscale.train --steps 20 mesh.nodes=1 mesh.local=1 \
    --workdir "$TMP/train" --no-progress
fi

section "summary"
if (( ${#FAILED[@]} )); then
  echo "problems: ${FAILED[*]}"
else
  echo "all parts ran"
fi
echo "total ${SECONDS}s; output in $OUT"
(( ${#FAILED[@]} == 0 ))
