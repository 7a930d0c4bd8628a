"""Actor: a policy plus its action queue, LeRobot-style ``select_action`` semantics.

A policy that emits a chunk (T, A) is run only when the queue is empty; its actions are then
served one per ``act`` call, in order (observations given meanwhile are not used, as in
LeRobot). The queue lives in static buffers registered with role "policy", like the policy's
hidden state, so a capsule taken mid-episode carries both and a restore continues the same
action sequence.

Threading: not thread-safe; the Session serializes calls.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from ..state.regions import RegionRegistry


class Actor:
    """Serves one action per call from a policy (see the module docstring)."""

    def __init__(self, runner: Any, registry: RegionRegistry | None = None) -> None:
        self.runner = runner
        shape = tuple(runner.spec.action_shape)
        self.chunked = len(shape) == 2
        self.chunk_len = shape[0] if self.chunked else 1
        self.action_dim = shape[-1]
        # (T, A) queued actions and [queued, served]: host tensors (the queue is read on the
        # host every call), registered so capsules carry them
        self.queue = torch.zeros(self.chunk_len, self.action_dim, dtype=runner.buffers.action.dtype)
        self.cursor = torch.zeros(2, dtype=torch.int64)
        if registry is not None:
            registry.register("policy.queue", self.queue, "policy")
            registry.register("policy.queue_cursor", self.cursor, "policy")

    @property
    def queued(self) -> int:
        """Actions left in the queue."""
        n, served = (int(x) for x in self.cursor)
        return max(0, n - served)

    def act(self, observation: Mapping[str, Any]) -> np.ndarray:
        """The next action (A,): from the queue, or from one policy step when it is empty."""
        n, served = (int(x) for x in self.cursor)
        if not 0 <= served <= n <= self.chunk_len:
            raise ValueError(f"action queue cursor {n}/{served} is out of range")  # damaged state
        if served >= n:
            out = self.runner.step(observation)                         # (T, A) or (A,)
            chunk = out.reshape(self.chunk_len, self.action_dim)
            self.queue.copy_(torch.from_numpy(np.ascontiguousarray(chunk)))
            n, served = self.chunk_len, 0
        action = self.queue[served].numpy().copy()
        self.cursor[0], self.cursor[1] = n, served + 1
        return action

    def reset(self) -> None:
        """A new episode: the queue empties and the policy's hidden state is zeroed."""
        self.cursor.zero_()
        self.queue.zero_()
        self.runner.reset_state()
