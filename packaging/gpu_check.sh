#!/usr/bin/env bash
# The GPU check on a lent GPU machine as it is: the image's python3 (its CUDA torch; a venv would
# hide it), no network. The project's missing pure-Python packages come as carried wheels
# (wheelhouse/, built here with `make wheelhouse`), installed with --no-index --target.
# Then packaging/gpu_check.py runs each step alone with its own timeout (300 s in all): a step
# that fails or hangs is reported and the next one runs. Figures: $OUT/gpu_check.{json,md,log}.
# Usage: packaging/gpu_check.sh [--quick] [--only step,step]
#   env: OUT (default gpu-check-out), PYTHON (default python3), DEVICE (default cuda)
# Exit status: 0 when every step is ok.
set -uo pipefail                    # no -e: a failed install or step must not hide the report
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/capsule-gpu-check-site}
PATHS=".:sdk"
if compgen -G "wheelhouse/*.whl" >/dev/null; then
  echo "== installing $(ls wheelhouse/*.whl | wc -l) carried wheels into $SITE"
  if "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" wheelhouse/*.whl; then
    PATHS="$SITE:$PATHS"
  else
    echo "gpu_check.sh: installing wheelhouse/*.whl failed; the env step names what is missing" >&2
  fi
else
  echo "gpu_check.sh: no wheelhouse/*.whl here (make wheelhouse, then carry wheelhouse); using what $PY has" >&2
fi
export PYTHONPATH="$PATHS${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" packaging/gpu_check.py --device "${DEVICE:-cuda}" --out "${OUT:-gpu-check-out}" "$@"
