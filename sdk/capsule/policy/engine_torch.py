"""torch engine: the builtin torch module over the static buffers; a CUDA graph on CUDA.

On CUDA the step (forward + copy_ into action/hidden) is captured once into a CUDA graph and
replayed on the current stream (the policy's own, made current by the runner): a step launches
one graph and allocates nothing. On CPU it runs eagerly over the
same buffers (small temporaries come from torch's CPU allocator; the buffers never move).
Not thread-safe: the runner serializes calls.
"""
from __future__ import annotations

import torch

from ..cudagraph import capture_graph
from ..errors import EngineUnavailable
from .buffers import PolicyBuffers
from .source import PolicySource


class TorchEngine:
    name = "torch"

    def __init__(self, source: PolicySource, buffers: PolicyBuffers):
        if source.module is None:
            raise EngineUnavailable(f"runs builtin torch policies only; {source.spec.name} is an ONNX file")
        dev = buffers.device
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise EngineUnavailable("device is CUDA but torch.cuda.is_available() is False")
        if dev.type not in ("cpu", "cuda"):
            raise EngineUnavailable(f"device type {dev.type!r} is not supported (cpu, cuda)")
        self.module = source.module.to(dev)
        self.buffers = buffers
        self.graph: torch.cuda.CUDAGraph | None = None
        if dev.type == "cuda":
            self._capture()
        self.detail = "CUDA graph" if self.graph is not None else "eager"

    def _body(self) -> None:
        b = self.buffers
        action, hidden = self.module(b.obs, b.hidden)   # (1, [T,] A), (1, H) or None
        b.action.copy_(action)                          # into the static buffers: storage never moves
        if hidden is not None:
            b.hidden.copy_(hidden)                      # in place: the checkpointed region

    def _capture(self) -> None:
        self.graph = capture_graph(self._body, self.buffers.device)

    @torch.inference_mode()
    def run(self) -> None:
        # hot path: a graph replay on CUDA (no allocation); eager forward on CPU
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
