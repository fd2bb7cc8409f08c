#!/usr/bin/env bash
# Emulated cluster: N network namespaces ("nodes") joined by rate-limited veth links, one JAX process each.
#
#   sudo experiments/scaling/emulate.sh [NODES=2] [RATE=50mbit] [STEPS=8] [STAGES="baseline +fp8 ..."]
#
# 2 nodes: one veth pair between js0 and js1. More: a bridge in namespace jsbr with one veth per node.
# Each namespace gets /etc/netns/<ns>/hosts mapping this host's name to the namespace's own 10.200.0.x
# address (gloo advertises what the hostname resolves to; JAX_ON_CPU.md item 10). tc tbf limits each
# node's egress (no netem on these kernels, so no added latency). Only 10.200.0.0/24 is used.
# For each stage, bench_step.py times the real train step unlimited, then limited, and prints the
# measured medians beside the alpha-beta prediction for the same rate. Everything is torn down on exit.
set -euo pipefail
NODES=${1:-2}; RATE=${2:-50mbit}; STEPS=${3:-8}
STAGES=${4:-"baseline +fp8 +half_dim 2d_ar 2d_a2a"}
LOCAL=${LOCAL:-2}
HERE="$(cd "$(dirname "$0")" && pwd)"; ROOT="$(cd "$HERE/../.." && pwd)"
PY=${PY:-"$ROOT/.venv/bin/python"}
HOST="$(hostname)"
PORT=${PORT:-23456}

cleanup() {
  for i in $(seq 0 $((NODES - 1))); do
    ip netns pids "js$i" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "js$i" 2>/dev/null || true
    rm -rf "/etc/netns/js$i"
  done
  ip netns del jsbr 2>/dev/null || true
}
trap cleanup EXIT INT TERM
cleanup

for i in $(seq 0 $((NODES - 1))); do
  ip netns add "js$i"
  ip -n "js$i" link set lo up
  mkdir -p "/etc/netns/js$i"
  printf '127.0.0.1 localhost\n10.200.0.%d %s\n' $((i + 1)) "$HOST" > "/etc/netns/js$i/hosts"
done
if [ "$NODES" -eq 2 ]; then
  ip link add veth0 netns js0 type veth peer name veth1 netns js1
else
  ip netns add jsbr
  ip -n jsbr link add br0 type bridge
  ip -n jsbr link set br0 up
  for i in $(seq 0 $((NODES - 1))); do
    ip link add "veth$i" netns "js$i" type veth peer name "port$i" netns jsbr
    ip -n jsbr link set "port$i" master br0
    ip -n jsbr link set "port$i" up
  done
fi
for i in $(seq 0 $((NODES - 1))); do
  ip -n "js$i" addr add "10.200.0.$((i + 1))/24" dev "veth$i"
  ip -n "js$i" link set "veth$i" up
done

for stage in $STAGES; do
  pids=()
  for i in $(seq 0 $((NODES - 1))); do
    ip netns exec "js$i" timeout -k 5 900 env PYTHONPATH="$ROOT" XLA_FLAGS="" "$PY" "$HERE/bench_step.py" \
      --stage "$stage" --nodes "$NODES" --local "$LOCAL" --process-id "$i" --coordinator "10.200.0.1:$PORT" \
      --dev "veth$i" --rate "$RATE" --steps "$STEPS" 2> "/tmp/emulate_${stage//+/p}_$i.err" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || echo "{\"stage\": \"$stage\", \"error\": \"process exited $?; see /tmp/emulate_*.err\"}"; done
  PORT=$((PORT + 1))
done
