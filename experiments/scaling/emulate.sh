#!/usr/bin/env bash
# Emulated cluster: N network namespaces ("nodes") joined by rate-limited links, one JAX process each.
#
#   bash experiments/scaling/emulate.sh [NODES=2] [RATE=4mbit] [STEPS=32] [STAGES=all] [OUT=-]   # as root
#   MODE=duplex bash experiments/scaling/emulate.sh [NODES] [RATE]        # gloo_duplex.py instead of stages
#   MODE=latency DELAY=5 LOCAL=1 bash experiments/scaling/emulate.sh [NODES]  # a2a_latency.py (no rate limit)
#
# STAGES: space-separated names of jaxscale.engine.techniques stages or '<stage>@periodic:<strategy>:<k>'
# variants; 'all' = every stage plus 2d_a2a with periodic dense averaging every 4 steps. OUT: a file the
# JSON lines are appended to ('-': stdout only). LOCAL (default 2) devices per node, PORT (23456) base port.
# DELAY (ms, default 0): one-way delay on every cross-node packet. These kernels have no netem, so with
# DELAY set (or NET=tun) the nodes are joined by TUN devices jtun<i> and delay_link.py holds each packet
# DELAY ms in user space; the rate limit is still tc tbf, on jtun<i>.
#
# Nodes are namespaces js0..js<N-1> with addresses 10.200.0.<i+1>/24 (only that range is used). Two nodes
# share one veth pair; more hang off a bridge in namespace jsbr, one veth per node. Each namespace gets
# /etc/netns/js<i>/hosts mapping this host's name to its own address: gloo advertises the address the
# hostname resolves to, and `ip netns exec` bind-mounts that file over /etc/hosts. Each process limits
# its own node's egress with tc tbf (bench_step.py / gloo_duplex.py). Everything is torn down on exit, also
# on error or Ctrl-C.
set -euo pipefail
NODES=${1:-2}; RATE=${2:-4mbit}; STEPS=${3:-32}; STAGES=${4:-all}; OUT=${5:--}
MODE=${MODE:-stages}
DELAY=${DELAY:-0}
NET=${NET:-$( [ "$DELAY" = 0 ] && echo veth || echo tun )}
LOCAL=${LOCAL:-2}
HERE="$(cd "$(dirname "$0")" && pwd)"; ROOT="$(cd "$HERE/../.." && pwd)"
PY=${PY:-"$ROOT/.venv/bin/python"}
HOST="$(hostname)"
PORT=${PORT:-23456}
TIMEOUT=${TIMEOUT:-1800}
LOGDIR=${LOGDIR:-/tmp/jaxscale_emulate}
if [ "$STAGES" = all ]; then
  STAGES="$(PYTHONPATH="$ROOT" "$PY" -c 'from jaxscale.engine.techniques import STAGE_NAMES; print(" ".join(STAGE_NAMES))') 2d_a2a@periodic:dense:4"
fi
[ "$NODES" -ge 2 ] || { echo "NODES must be >= 2" >&2; exit 2; }
[ "$NODES" -le 250 ] || { echo "NODES must be <= 250 (one /24)" >&2; exit 2; }

exec 9> /run/jaxscale_emulate.lock  # one emulated cluster at a time: namespaces js* are shared names
flock -n 9 || { echo "another emulate.sh run holds /run/jaxscale_emulate.lock" >&2; exit 3; }

cleanup() {
  [ -n "${LINK_PID:-}" ] && { kill "$LINK_PID" 2>/dev/null || true; wait "$LINK_PID" 2>/dev/null || true; }
  for i in $(seq 0 $((NODES - 1))); do
    for pid in $(ip netns pids "js$i" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
    ip netns del "js$i" 2>/dev/null || true
    rm -rf "/etc/netns/js$i"
  done
  ip netns del jsbr 2>/dev/null || true
}
trap cleanup EXIT INT TERM
cleanup
mkdir -p "$LOGDIR"

for i in $(seq 0 $((NODES - 1))); do
  ip netns add "js$i"
  ip -n "js$i" link set lo up
  mkdir -p "/etc/netns/js$i"
  printf '127.0.0.1 localhost\n10.200.0.%d %s\n' $((i + 1)) "$HOST" > "/etc/netns/js$i/hosts"
done
if [ "$NET" = tun ]; then
  rm -f "$LOGDIR/link.ready"
  PYTHONPATH="$ROOT" "$PY" "$HERE/delay_link.py" --nodes "$NODES" --delay-ms "$DELAY" --ready "$LOGDIR/link.ready" \
    2> "$LOGDIR/link.err" &
  LINK_PID=$!
  for _ in $(seq 100); do [ -e "$LOGDIR/link.ready" ] && break; sleep 0.1; done
  [ -e "$LOGDIR/link.ready" ] || { echo "delay_link.py did not come up; see $LOGDIR/link.err" >&2; exit 4; }
  DEVPREFIX=jtun
else
  if [ "$NODES" -eq 2 ]; then
    ip link add veth0 netns js0 type veth peer name veth1 netns js1
  else
    ip netns add jsbr
    ip -n jsbr link set lo up
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
  DEVPREFIX=veth
fi

run_all() {  # $1 = tag, rest = the script and its arguments (minus the per-process ones)
  local tag=$1; shift
  local pids=() rc=0
  for i in $(seq 0 $((NODES - 1))); do
    ip netns exec "js$i" timeout -k 5 "$TIMEOUT" env PYTHONPATH="$ROOT" XLA_FLAGS="" "$PY" "$@" \
      --nodes "$NODES" --process-id "$i" --coordinator "10.200.0.1:$PORT" --dev "$DEVPREFIX$i" \
      > "$LOGDIR/${tag}_$i.out" 2> "$LOGDIR/${tag}_$i.err" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  PORT=$((PORT + 1))
  if [ "$rc" -ne 0 ]; then
    echo "{\"run\": \"$tag\", \"nodes\": $NODES, \"error\": \"a process exited $rc; see $LOGDIR/${tag}_*.err\"}" | emit
  fi
  grep '^{' "$LOGDIR/${tag}_0.out" | emit || true
}

emit() { if [ "$OUT" = - ]; then cat; else tee -a "$OUT"; fi; }

if [ "$MODE" = duplex ]; then
  run_all "duplex_${NODES}" "$HERE/gloo_duplex.py" --local "$LOCAL" --rate "$RATE"
elif [ "$MODE" = latency ]; then
  run_all "latency_${NODES}" "$HERE/a2a_latency.py" --local "$LOCAL" --repeats "${REPEATS:-40}" --delay-ms "$DELAY" --bytes "${BYTES:-64}"
else
  for stage in $STAGES; do
    tag="$(echo "${stage}_${NODES}" | tr -c 'A-Za-z0-9_\n' '_')"
    run_all "$tag" "$HERE/bench_step.py" --stage "$stage" --local "$LOCAL" --rate "$RATE" --steps "$STEPS" --delay-ms "$DELAY"
  done
fi
