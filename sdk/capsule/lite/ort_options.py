"""ONNX Runtime session options shared by the Session's onnxruntime engine and the lite restore.

Both must build their sessions alike for the lite restore to pick the Session's tokens bit for
bit. On CPU, graph optimizations are off: measured on SmolLM2-135M's decode step (one thread,
2,048 slots) a session builds in ~55 ms instead of ~140 ms, the step runs as fast (81 vs 79-85
ms, median of 30), and its hidden state is bit-identical to the optimized graph's here. A
restore to the first token builds one, so it is time before the robot's first word. Torch-free.
"""
from __future__ import annotations

from typing import Any


def session_options(ort: Any, threads: int, *, cpu: bool) -> Any:
    """SessionOptions with ``threads`` intra-op threads, one inter-op thread, no spinning (idle
    ORT threads would take the cores torch's own steps need: at 2 threads a builtin:small
    prefill took 46 ms with ORT not spinning, 102 ms with it spinning) and, on CPU, no graph
    optimizations."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if cpu:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so
