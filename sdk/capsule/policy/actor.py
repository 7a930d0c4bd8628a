"""Actor: a policy plus its action queue, LeRobot-style ``select_action`` semantics.

A policy that emits a chunk (T, A) is run only when the queue is empty; its actions are then
served one per ``act`` call, in order (observations given meanwhile are not used, as in
LeRobot, but still validated: a bad or non-finite one raises before the queue moves). The
queued actions live in a static buffer registered with role "policy", like the policy's hidden
state, and the queue's cursor is host state (``state`` / ``load_state``, range checked on
restore), so a capsule taken mid-episode carries all of it and a restore continues the same
action sequence.

Threading: not thread-safe; the Session serializes calls.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import torch

from ..state.regions import RegionRegistry

if TYPE_CHECKING:
    from .runner import PolicyRunner


class Actor:
    """Serves one action per call from a policy (see the module docstring)."""

    def __init__(self, runner: "PolicyRunner", registry: RegionRegistry | None = None) -> None:
        self.runner = runner
        shape = tuple(runner.spec.action_shape)
        self.chunked = len(shape) == 2
        self.chunk_len = shape[0] if self.chunked else 1
        self.action_dim = shape[-1]
        # (T, A) queued actions: a host tensor (read on the host every call), registered so
        # capsules carry it; n actions were queued and `served` of them handed out
        self.queue = torch.zeros(self.chunk_len, self.action_dim, dtype=runner.buffers.action.dtype)
        self.n = self.served = 0
        if registry is not None:
            registry.register("policy.queue", self.queue, "policy")

    @property
    def queued(self) -> int:
        """Actions left in the queue."""
        return self.n - self.served

    def act(self, observation: Mapping[str, Any]) -> np.ndarray:
        """The next action (A,): from the queue, or from one policy step when it is empty.

        Every call validates the observation first (ValueError on a bad key, shape, dtype or a
        non-finite value), so a rejected one changes neither the queue nor the hidden state.
        """
        if self.served < self.n:
            self.runner.check_observation(observation)   # not used, but a failed sensor must show
        else:
            out = self.runner.step(observation)                         # (T, A) or (A,)
            chunk = out.reshape(self.chunk_len, self.action_dim)
            self.queue.copy_(torch.from_numpy(np.ascontiguousarray(chunk)))
            self.n, self.served = self.chunk_len, 0
        action = self.queue[self.served].numpy().copy()
        self.served += 1
        return action

    def reset(self) -> None:
        """A new episode: the queue empties and the policy's hidden state is zeroed."""
        self.n = self.served = 0
        self.queue.zero_()
        self.runner.reset_state()

    def state(self) -> dict:
        """The queue cursor, for a capsule's host state."""
        return {"queued": self.n, "served": self.served}

    def load_state(self, saved: object) -> Callable[[], None]:
        """Check a capsule's cursor (untrusted) and return the step that installs it."""
        n = saved.get("queued") if isinstance(saved, dict) else None
        served = saved.get("served") if isinstance(saved, dict) else None
        if type(n) is not int or type(served) is not int or not 0 <= served <= n <= self.chunk_len:
            raise ValueError(f"action queue cursor {saved!r} is out of range 0..{self.chunk_len}")

        def install() -> None:
            self.n, self.served = n, served
        return install
