#!/usr/bin/env bash
# Install the TorchRec CPU baseline (torch 2.13 CPU + fbgemm-gpu-cpu 1.8 + torchrec 1.8) into the
# active Python environment, without touching the JAX stack.
#
#   . .venv/bin/activate && bash experiments/baselines/install_torchrec.sh
#
# Idempotent: exits early when the pinned versions already import. Safe for CI.
# Pairing facts (verified): fbgemm-gpu-cpu 1.9.0 needs torch 2.14 and fails at import with torch 2.13;
# torchrec 1.8.0 declares a dependency on the CUDA `fbgemm-gpu` package, so it is installed with
# --no-deps (fbgemm-gpu-cpu provides the same `fbgemm_gpu` module).
set -euo pipefail

PY=${PYTHON:-python}
TORCH_VER=2.13.0
FBGEMM_VER=1.8.0
TORCHREC_VER=1.8.0
DEPS=("torch==${TORCH_VER}" "fbgemm-gpu-cpu==${FBGEMM_VER}" "tensordict==0.15.3" "torchmetrics==1.0.3" "tqdm" "pyre-extensions")
PROTECTED=(jax jaxlib numpy flax optax orbax-checkpoint ml_dtypes)

if [[ -z "${VIRTUAL_ENV:-}" && -z "${CI:-}" && -z "${ALLOW_SYSTEM_PYTHON:-}" ]]; then
  echo "install_torchrec.sh: activate the venv first (or set ALLOW_SYSTEM_PYTHON=1)" >&2
  exit 2
fi

already_ok() {
  "$PY" - "$TORCH_VER" "$FBGEMM_VER" "$TORCHREC_VER" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
t, f, r = sys.argv[1:]
assert version("torch").split("+")[0] == t, "torch"
assert version("fbgemm-gpu-cpu") == f, "fbgemm"
assert version("torchrec") == r, "torchrec"
import torch, fbgemm_gpu, torchrec  # noqa: F401  (import check: catches ABI mismatches)
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
PYEOF
}

if already_ok; then
  echo "install_torchrec.sh: torch ${TORCH_VER} / fbgemm-gpu-cpu ${FBGEMM_VER} / torchrec ${TORCHREC_VER} already installed"
  exit 0
fi

# Pin the JAX stack at its current versions so nothing below can move it.
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
"$PY" - "${PROTECTED[@]}" >"$CONSTRAINTS" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
PYEOF
echo "install_torchrec.sh: pinning:"; sed 's/^/  /' "$CONSTRAINTS"

# Dry run first: refuse if any protected package would change.
REPORT=$(mktemp)
trap 'rm -f "$CONSTRAINTS" "$REPORT"' EXIT
"$PY" -m pip install --dry-run --quiet --report "$REPORT" -c "$CONSTRAINTS" "${DEPS[@]}"
"$PY" - "$REPORT" "${PROTECTED[@]}" <<'PYEOF'
import json, re, sys
report, protected = sys.argv[1], {re.sub(r"[-_.]+", "-", p).lower() for p in sys.argv[2:]}
moved = [i["metadata"]["name"] + "==" + i["metadata"]["version"] for i in json.load(open(report))["install"]
         if re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower() in protected]
if moved:
    sys.exit(f"install_torchrec.sh: refusing, the install would change: {moved}")
PYEOF

"$PY" -m pip install -c "$CONSTRAINTS" "${DEPS[@]}"
"$PY" -m pip install --no-deps "torchrec==${TORCHREC_VER}"

if ! already_ok; then
  echo "install_torchrec.sh: install finished but the import check failed:" >&2
  "$PY" -c "import torch, fbgemm_gpu, torchrec; from torchrec.distributed.model_parallel import DistributedModelParallel"
  exit 1
fi
echo "install_torchrec.sh: OK ($("$PY" -c 'import torch, torchrec; print("torch", torch.__version__, "torchrec", torchrec.__version__)' 2>/dev/null))"
