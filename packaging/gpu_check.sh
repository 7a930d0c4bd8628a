#!/usr/bin/env bash
# GPU check for a machine with a CUDA GPU, in under 5 minutes: the CUDA-marked tests (paged decode
# graphs, tensor BPE, RoPE scatter, policy engines: torch graph, ORT CUDA EP, TensorRT), the decode
# bench (capture seconds per bucket, step latency with graphs on and off), policy step latency per
# engine, the tensor BPE kernel on 1M characters, and `capsule doctor`.
# Usage: packaging/gpu_check.sh   (from anywhere; OUT=dir to choose where the bench writes)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
if [[ ! -x $PY ]]; then
  echo "== creating .venv and installing the package (as make would)"
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
fi
# a checkout that is not installed yet still imports capsule, devices and edge_kernels from here
export PYTHONPATH=".:sdk${PYTHONPATH:+:$PYTHONPATH}"
if [[ -x .venv/bin/capsule ]]; then CAPSULE=(.venv/bin/capsule); else CAPSULE=("$PY" -m capsule.cli); fi

"$PY" - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"no CUDA GPU visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
             "this check needs one")
print(f"GPU {torch.cuda.get_device_name(0)} | torch {torch.__version__} | CUDA {torch.version.cuda}")
PYEOF

echo "== pytest -m cuda"
rc=0
timeout 120 "$PY" -m pytest -m cuda -q || rc=$?
if [[ $rc -eq 5 ]]; then
  echo "(no tests are marked cuda yet)"
elif [[ $rc -ne 0 ]]; then
  echo "pytest -m cuda failed (exit $rc)" >&2
  exit "$rc"
fi

echo "== capsule bench --suite decode --quick  (graph capture per bucket; step latency graphs on vs off)"
timeout 100 "${CAPSULE[@]}" bench --suite decode --quick --out "${OUT:-bench-results}/gpu-check-decode-$(date +%Y%m%d-%H%M%S)"

echo "== restore with graphs kept (in-place rollback) vs re-captured (fresh open)"
timeout 90 "$PY" - <<'PYEOF'
import tempfile, time
import torch
from capsule import Session
rt = {"kv_pool_mb": 256, "max_context": 4096, "cuda_graphs": True}
with tempfile.TemporaryDirectory() as d:
    with Session.open(d + "/s", model="builtin:small", device="cuda", runtime=rt) as s:
        s.append("robot log line with joint angles 0.1 0.2 0.3\n" * 250)
        s.generate(2)
        epoch = s.checkpoint()
        s.generate(8)
        torch.cuda.synchronize(); t = time.perf_counter()
        s.rollback(epoch); s.generate(1)
        torch.cuda.synchronize(); kept = time.perf_counter() - t
        cap = s._engine.runner.capture_seconds
    torch.cuda.synchronize(); t = time.perf_counter()
    with Session.open(d + "/s", model="builtin:small", device="cuda", runtime=rt) as s:
        s.generate(1)
        torch.cuda.synchronize(); fresh = time.perf_counter() - t
    print("capture s per bucket:", {b: round(v, 3) for b, v in cap.items()})
    print(f"rollback + first token, graphs kept: {kept * 1e3:.1f} ms; "
          f"fresh open + restore + re-capture + first token: {fresh * 1e3:.1f} ms")
PYEOF

echo "== policy engines: step latency per engine (ORT CUDA EP, TensorRT plan + CUDA graph when present)"
timeout 120 "${CAPSULE[@]}" bench --suite control --quick --out "${OUT:-bench-results}/gpu-check-control-$(date +%Y%m%d-%H%M%S)"

echo "== tensor BPE: 1M characters merged on the GPU (target: well under 10 ms)"
timeout 240 "${CAPSULE[@]}" bench --suite tokenize-bpe --out "${OUT:-bench-results}/gpu-check-bpe-$(date +%Y%m%d-%H%M%S)"

echo "== capsule doctor"
timeout 60 "${CAPSULE[@]}" doctor
