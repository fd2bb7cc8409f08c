#!/usr/bin/env bash
# The whole emulated-cluster study in one command (as root, on an otherwise idle machine):
#
#   bash experiments/scaling/run_emulation.sh            # then read experiments/scaling/EMULATION.md
#
# 1. gloo_duplex.py at 2 and 4 nodes: does the CPU transport overlap the two directions of an exchange?
# 2. every technique stage (+ 2d_a2a with periodic averaging) at 4 nodes x LOCAL devices, then at 2 nodes,
#    STEPS timed steps per phase, the link limited to RATE per node;
# 3. emulation_report.py writes EMULATION.md from the raw JSON lines (kept in experiments/scaling/emulation/).
# Environment: RATE (4mbit), STEPS (32), LOCAL (2), STAGES (all), PY (python of the venv).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"; ROOT="$(cd "$HERE/../.." && pwd)"
RATE=${RATE:-4mbit}; STEPS=${STEPS:-32}; STAGES=${STAGES:-all}
export PY=${PY:-"$ROOT/.venv/bin/python"} LOCAL=${LOCAL:-2}
RAW="$HERE/emulation"
mkdir -p "$RAW"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="$RAW/run_$STAMP.jsonl"
start=$(date +%s)
"$PY" -c 'import json, os, platform; print(json.dumps({"run": "machine", "platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}))' >> "$OUT"
for n in 2 4; do MODE=duplex bash "$HERE/emulate.sh" "$n" "$RATE" 0 none "$OUT"; done
for n in 4 2; do bash "$HERE/emulate.sh" "$n" "$RATE" "$STEPS" "$STAGES" "$OUT"; done
"$PY" -c "import json, os; print(json.dumps({'run': 'end', 'loadavg_at_end': os.getloadavg(), 'seconds': $(date +%s) - $start}))" >> "$OUT"
PYTHONPATH="$ROOT" "$PY" "$HERE/emulation_report.py" "$OUT"
