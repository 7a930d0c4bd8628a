"""Session methods for the robot policy: act, reset, episode (LeRobot-like select_action).

Mixed into Session: they take only its policy lock, so a control loop's act never waits for an
LLM call on another thread (capsules take both locks). The policy's hidden state and action queue
are static buffers in the region registry, so every capsule carries them.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping

import numpy as np

from .policy.actor import Actor


class PolicyMethods:
    _policy_lock: threading.RLock
    _actor: Actor | None

    def _check_open(self) -> None:   # provided by Session
        raise NotImplementedError

    def act(self, observation: Mapping[str, Any]) -> np.ndarray:
        """One action (A,) for this tick: served from the action queue when the policy emitted
        a chunk, else from one policy step (``observation.state`` and any other inputs the
        policy declares, numpy or torch, with or without the batch dimension).

        Raises ValueError, before anything changes (no engine call, no hidden-state update, no
        queue move; the same on every engine), when the observation is not a mapping of str keys
        to the declared inputs, has a wrong shape or dtype, or holds a non-finite value (NaN or
        +-inf: the message names the key and the first bad index). Observations served from the
        queue are checked too. Cost: host arrays (numpy, CPU tensors) are checked without
        allocating; a CUDA tensor is checked on its device with one extra host sync per step."""
        with self._policy_lock:
            return self._policy().act(observation)

    def reset(self) -> None:
        """Start a new episode: the action queue empties and the policy's hidden state is zeroed."""
        with self._policy_lock:
            self._policy().reset()

    @contextlib.contextmanager
    def episode(self) -> Iterator["PolicyMethods"]:
        """``with session.episode():`` runs one episode from a fresh policy state."""
        self.reset()
        yield self

    @property
    def policy_engine(self) -> str:
        """Which engine runs the policy ("torch", "onnxruntime" or "tensorrt")."""
        return self._policy().runner.engine_name

    def _policy(self) -> Actor:
        self._check_open()
        if self._actor is None:
            raise ValueError("this Session has no policy; open it with policy=<.onnx path or "
                             "builtin:mlp | builtin:mlp-chunk | builtin:gru>")
        return self._actor
