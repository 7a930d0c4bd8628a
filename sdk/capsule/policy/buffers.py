"""PolicyBuffers: the static device tensors a policy engine is bound to, allocated once.

Every engine reads `obs` and `hidden` and writes `action` (and `hidden`, in place). Their
storage never moves for the life of the runner, so a captured graph (CUDA graph, TensorRT
tensor addresses, ONNX Runtime IOBinding) stays valid, and the checkpointer can restore
`hidden` in place without re-binding anything.

On CUDA the buffers come with the policy's own stream (`stream`): high priority, non-blocking
(it never waits implicitly for the legacy default stream, where the LLM decodes), so a step
never queues behind another thread's GPU work. Everything that writes the buffers runs on it
(PolicyRunner.step, zero_) or finishes before a step starts (a restore synchronizes its copies).
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from ..state.regions import RegionRegistry
from .spec import PolicySpec


# torch maps a priority beyond its range to its highest (lower numbers run first)
HIGH_PRIORITY = -(2**10)


def torch_dtype(name: str) -> torch.dtype:
    """numpy dtype name -> torch dtype (names in spec.OBS_DTYPES / STATE_DTYPES)."""
    return getattr(torch, name)


class PolicyBuffers:
    """Static tensors of one policy: obs[key] (1, *shape), action (1, *action_shape), hidden.

    Not thread-safe: written by the runner's step and by the checkpointer's restore, which
    the Session serializes.
    """

    def __init__(self, spec: PolicySpec, device: torch.device | str = "cpu"):
        dev = torch.device(device)
        self.obs: dict[str, torch.Tensor] = {
            key: torch.zeros((1, *shape), dtype=torch_dtype(dtype), device=dev)
            for key, (shape, dtype) in spec.observation.items()}                  # (1, *obs_shape)
        self.action = torch.zeros((1, *spec.action_shape), dtype=torch_dtype(spec.action_dtype),
                                  device=dev)                                      # (1, [T,] A)
        self.hidden: torch.Tensor | None = None
        if spec.hidden_shape is not None:
            self.hidden = torch.zeros((1, *spec.hidden_shape), dtype=torch_dtype(spec.hidden_dtype),
                                      device=dev)                                  # (1, *H)
        self.device: torch.device = self.action.device  # with its index: "cuda" -> cuda:0
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device, priority=HIGH_PRIORITY)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))   # the zero fills above

    def on_stream(self) -> ContextManager:
        """Make the policy's stream current (CUDA); nothing on CPU."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Region name -> tensor, in registration order."""
        named = {f"policy.obs.{k}": t for k, t in self.obs.items()}
        named["policy.action"] = self.action
        if self.hidden is not None:
            named["policy.hidden"] = self.hidden
        return named

    def register(self, registry: RegionRegistry) -> None:
        """obs -> role "input", action -> "output", hidden -> "policy" (snapshotted, restored in place)."""
        for name, t in self.tensors().items():
            role = "output" if name == "policy.action" else "policy" if name == "policy.hidden" else "input"
            registry.register(name, t, role)

    def zero_(self, *, hidden_only: bool = False) -> None:
        """Zero every buffer (or only hidden) in place, on the policy's stream, and return when
        that is done: a checkpoint reads them next from another thread's stream."""
        with self.on_stream():
            for name, t in self.tensors().items():
                if not hidden_only or name == "policy.hidden":
                    t.zero_()
        if self.stream is not None:
            self.stream.synchronize()

    def data_ptrs(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self.tensors().items()}
