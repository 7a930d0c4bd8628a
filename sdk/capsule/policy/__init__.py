"""capsule.policy: robot policies run through engines bound to static buffers.

    runner = load_policy("builtin:gru", device="cpu", engines=("onnxruntime", "torch"),
                         registry=registry)
    action = runner.step({"observation.state": q})   # q: (14,) or (1, 14) float32
    runner.reset_state()                              # new episode: hidden <- 0, in place

Sources: an .onnx file following the LeRobot-like convention (inputs `observation.state`,
optional `observation.environment_state` / `observation.images.<cam>` / `hidden_in`; outputs
`action`, optional `hidden_out`; batch 1), or a builtin ("builtin:mlp", "builtin:mlp-chunk",
"builtin:gru": UNTRAINED, seeded random weights, for examples and tests). Engines (one
table: policy/registry.py): torch (builtins only; CUDA graph on CUDA), onnxruntime
(IOBinding), tensorrt (CUDA graph).
Nothing here is thread-safe: the Session serializes calls.
"""
from ..errors import EngineUnavailable
from .buffers import PolicyBuffers
from .builtin import builtin_policy
from .export import export_onnx
from .registry import EngineEntry, engine_names
from .runner import PolicyRunner, load_policy
from .spec import PolicySpec

ENGINES: tuple[str, ...] = engine_names()   # the registry's names (kept for callers of capsule.policy.ENGINES)

__all__ = ["ENGINES", "EngineEntry", "EngineUnavailable", "PolicyBuffers", "PolicyRunner", "PolicySpec",
           "builtin_policy", "engine_names", "export_onnx", "load_policy"]
