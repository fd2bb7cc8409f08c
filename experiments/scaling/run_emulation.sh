#!/usr/bin/env bash
# The emulated-cluster study (as root, on an otherwise idle machine), in two runs:
#
#   bash experiments/scaling/run_emulation.sh calibrate   # 1. the link and the transport, measured first
#   bash experiments/scaling/run_emulation.sh             # 2. every stage, predicted from run 1
#   # then read experiments/scaling/EMULATION.md
#
# calibrate: a2a_latency.py at delay 0 and DELAY (one device per node at 2, 4 and 8 nodes; LOCAL devices at
#   2 and 4) -> emulation/latency_<stamp>.jsonl; gloo_duplex.py at 2 and 4 nodes with the delay ->
#   emulation/transport_<stamp>.jsonl.
# stages (default): names the newest calibration files in its first lines, then runs every technique stage
#   (+ 2d_a2a with periodic averaging) on 1 node (no link), then NODE_COUNTS nodes x LOCAL devices, STEPS timed
#   steps per phase, links at RATE and DELAY -> emulation/run_<stamp>.jsonl; emulation_report.py writes
#   EMULATION.md from it. The raw files are left as written; notes go in emulation/NOTES.md.
# Environment: RATE (4mbit), DELAY (ms, 5), STEPS (32), LOCAL (2), STAGES (all), NODE_COUNTS ('4 2'), ONE_NODE
# (1: run the 1-node step; 0: skip it, e.g. for a second run of other node counts), PY.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"; ROOT="$(cd "$HERE/../.." && pwd)"
RATE=${RATE:-4mbit}; STEPS=${STEPS:-32}; STAGES=${STAGES:-all}; NODE_COUNTS=${NODE_COUNTS:-4 2}
export PY=${PY:-"$ROOT/.venv/bin/python"} LOCAL=${LOCAL:-2} DELAY=${DELAY:-5}
RAW="$HERE/emulation"
mkdir -p "$RAW"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
start=$(date +%s)
machine() { "$PY" -c 'import json, os, platform; print(json.dumps({"run": "machine", "platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}))'; }
finish() { "$PY" -c "import json, os; print(json.dumps({'run': 'end', 'loadavg_at_end': os.getloadavg(), 'seconds': $(date +%s) - $start}))"; }

if [ "${1:-stages}" = calibrate ]; then
  LAT="$RAW/latency_$STAMP.jsonl"; TRANSPORT="$RAW/transport_$STAMP.jsonl"
  machine | tee -a "$LAT" > "$TRANSPORT"
  for d in 0 "$DELAY"; do
    for n in 2 4 8; do MODE=latency NET=tun DELAY=$d LOCAL=1 bash "$HERE/emulate.sh" "$n" "$RATE" 0 none "$LAT"; done
    for n in 2 4; do MODE=latency NET=tun DELAY=$d bash "$HERE/emulate.sh" "$n" "$RATE" 0 none "$LAT"; done
  done
  for n in 2 4; do MODE=duplex NET=tun bash "$HERE/emulate.sh" "$n" "$RATE" 0 none "$TRANSPORT"; done
  finish | tee -a "$LAT" >> "$TRANSPORT"
  echo "calibration: $LAT $TRANSPORT"
  exit 0
fi

LAT="$(ls -t "$RAW"/latency_*.jsonl 2>/dev/null | head -1)"
TRANSPORT="$(ls -t "$RAW"/transport_*.jsonl 2>/dev/null | head -1)"
[ -n "$LAT" ] && [ -n "$TRANSPORT" ] || { echo "no calibration yet: run '$0 calibrate' first" >&2; exit 2; }
OUT="$RAW/run_$STAMP.jsonl"
machine > "$OUT"
echo "{\"run\": \"calibration\", \"latency\": \"$(basename "$LAT")\", \"transport\": \"$(basename "$TRANSPORT")\"}" >> "$OUT"
if [ "$STAGES" = all ]; then
  STAGES="$(PYTHONPATH="$ROOT" "$PY" -c 'from jaxscale.engine.techniques import STAGE_NAMES; print(" ".join(STAGE_NAMES))') 2d_a2a@periodic:dense:4"
fi
for stage in $( [ "${ONE_NODE:-1}" = 1 ] && echo "$STAGES" ); do  # 1 node: the same step in one process, no link
  rc=0
  PYTHONPATH="$ROOT" "$PY" "$HERE/bench_step.py" --stage "$stage" --nodes 1 --local "$LOCAL" --steps "$STEPS" \
    > /tmp/jaxscale_emulate_1node.out 2> /tmp/jaxscale_emulate_1node.err || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "{\"run\": \"$stage@1\", \"nodes\": 1, \"error\": \"exited $rc; see /tmp/jaxscale_emulate_1node.err\"}" >> "$OUT"
  fi
  grep '^{' /tmp/jaxscale_emulate_1node.out | tee -a "$OUT" || true
done
for n in $NODE_COUNTS; do bash "$HERE/emulate.sh" "$n" "$RATE" "$STEPS" "$STAGES" "$OUT"; done
finish >> "$OUT"
PYTHONPATH="$ROOT" "$PY" "$HERE/emulation_report.py" "$OUT"
