#!/usr/bin/env python3
"""The GPU check: `python packaging/gpu_check.py --device cpu|cuda --out DIR [--quick] [--only a,b]`.

Runs the steps of capsule/tools/gpu_check (environment, pytest -m cuda, LLM graphs vs eager,
restore in place, policy engines, act while a chat thread generates, tensor BPE), each alone
with its own timeout (all together at most 300 s), and writes DIR/gpu_check.json,
DIR/gpu_check.md and DIR/gpu_check.log. Works from a checkout without installing: the
repository's sdk/ and root go on the path. On a lent GPU machine use packaging/gpu_check.sh.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO / "sdk", REPO):          # capsule, then devices and edge_kernels, from this checkout
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from capsule.tools.gpu_check.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
