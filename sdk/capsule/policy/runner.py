"""PolicyRunner and load_policy: a policy bound to static buffers, run through one engine.

load_policy resolves the source (builtin module or ONNX file, validated at load), allocates
the static buffers once, then tries the requested engines in order and keeps the first that
builds here, logging one line on logger "capsule.policy" that says which engine runs and why
the others were skipped. A step validates the observation, copies it into the obs buffers,
runs the engine (obs + hidden -> action, hidden in place) and returns a fresh numpy copy of
the action. On CUDA all of it runs on the buffers' own stream (buffers.py) and the step waits
on one event for the action, so it never waits for another thread's GPU work (given a numpy
observation: a CUDA tensor is ordered after the caller's stream, which may hold such work).
Threading: a PolicyRunner is not thread-safe; the Session serializes step, reset_state and
checkpoint/restore of the buffers.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import EngineUnavailable, ModelLoadError
from ..state.regions import RegionRegistry
from .buffers import PolicyBuffers
from .observe import ObservationLoader
from .registry import select_engines
from .source import Engine, resolve_source
from .spec import PolicySpec

log = logging.getLogger("capsule.policy")


class PolicyRunner:
    """One policy on one engine over its static PolicyBuffers.

    Attributes: spec, buffers, engine_name ("torch" | "onnxruntime" | "tensorrt"),
    engine_detail (provider / graph mode), skipped (engine -> why it was not used).
    Not thread-safe: call step/reset_state from one thread at a time (the Session's lock).
    """

    def __init__(self, spec: PolicySpec, buffers: PolicyBuffers, engine: Engine, *,
                 skipped: Mapping[str, str] | None = None):
        self.spec = spec
        self.buffers = buffers
        self.engine = engine
        self.engine_name: str = engine.name
        self.engine_detail: str = engine.detail
        self.skipped: dict[str, str] = dict(skipped or {})
        self._obs = ObservationLoader(spec, buffers)
        action = buffers.action[0]                                   # ([T,] A) view, made once
        self._action_src = action
        # CPU: the buffer is its own host copy; CUDA: device -> pinned host, then a numpy copy
        self._action_host = action if buffers.device.type == "cpu" else torch.zeros(
            action.shape, dtype=action.dtype, pin_memory=True)
        self._action_np = self._action_host.numpy()
        # CUDA: the step waits for this event (recorded after the action's copy to the host on
        # the policy's stream), never for a whole stream or the device: other threads' GPU work
        # (the LLM's decode) is not in the policy stream's order
        self._stream = buffers.stream
        self._read = torch.cuda.Event() if self._stream is not None else None

    def step(self, observation: Mapping[str, Any]) -> np.ndarray:
        """One policy step: observation -> action shaped spec.action_shape (a new array).

        Raises ValueError naming the key on a missing/unknown/non-str key, a wrong shape/dtype
        or a non-finite value (NaN, inf: naming the first index); the buffers are untouched and
        the engine does not run then. Recurrent policies carry buffers.hidden to the next step.
        A CUDA tensor observation costs one extra host sync for its finiteness check.
        """
        if self._stream is None:
            self._obs.load(observation)      # validate, then copy into the static obs buffers
            self.engine.run()                # obs, hidden -> action, hidden (in place)
            return self._action_np.copy()    # the only allocation of a step: the caller's array
        if _has_device_tensor(observation):  # made on the caller's stream: the policy's waits for it
            self._stream.wait_stream(torch.cuda.current_stream(self.buffers.device))
        with torch.cuda.stream(self._stream):
            self._obs.load(observation)
            self.engine.run()                # graph replay / enqueue / ORT on the policy's stream
            self._action_host.copy_(self._action_src, non_blocking=True)
            self._read.record(self._stream)
        self._read.synchronize()
        return self._action_np.copy()

    def check_observation(self, observation: Mapping[str, Any]) -> None:
        """Validate an observation as step would (keys, shape, dtype, finite), changing nothing."""
        self._obs.check(observation)

    def reset_state(self) -> None:
        """Start a new episode: hidden <- zeros, in place (same storage; graphs stay valid)."""
        if self.buffers.hidden is not None:
            self.buffers.zero_(hidden_only=True)

    def __repr__(self) -> str:
        return (f"PolicyRunner({self.spec.name!r}, engine={self.engine_name!r} ({self.engine_detail}), "
                f"device={self.buffers.device})")


def _has_device_tensor(observation: Any) -> bool:
    return isinstance(observation, Mapping) and any(
        isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in observation.values())


def load_policy(source: str | os.PathLike, *, device: torch.device | str = "cpu",
                engines: Sequence[str] = ("onnxruntime", "torch"),
                registry: RegionRegistry | None = None, threads: int | None = None) -> PolicyRunner:
    """Load `source` ("builtin:mlp|mlp-chunk|gru" or an .onnx path) onto the first engine that works.

    Engines (names in policy/registry.py) are tried in order; one that cannot run here
    (missing package, provider or CUDA; the torch engine for an ONNX file) is skipped. Raises ModelLoadError (or its
    subclass UnsupportedArchitecture) when the source breaks the I/O convention, or when no
    engine works (the message lists each engine's reason). With `registry`, the buffers are
    registered: obs "policy.obs.<key>" (input), "policy.action" (output), "policy.hidden" (policy).
    threads: CPU intra-op threads for engines that take them (onnxruntime; its default, None,
    is one); torch's are process-wide and left to the caller (Session.open sets runtime.threads).
    """
    entries = select_engines(engines)      # ValueError on an empty list or an unknown name
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"policy device {dev} requested, but torch.cuda.is_available() is False; "
                             "use device='cpu'")
    src = resolve_source(source)
    buffers = PolicyBuffers(src.spec, dev)
    skipped: dict[str, str] = {}
    engine: Engine | None = None
    for entry in entries:
        try:
            extra = {"threads": threads} if entry.takes_threads and threads is not None else {}
            engine = entry.build(src, buffers, **extra)
            break
        except EngineUnavailable as exc:
            skipped[entry.name] = str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken backend must not hide the next one
            skipped[entry.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if engine is None:
        reasons = "; ".join(f"{n}: {r}" for n, r in skipped.items())
        raise ModelLoadError(f"no policy engine can run {src.spec.name} on {dev}: {reasons}")
    buffers.zero_()  # warm-up ran on zeros and moved hidden; start the episode clean
    note = "".join(f"; skipped {n} ({r})" for n, r in skipped.items())
    log.info("policy %s: engine %s (%s) on %s%s", src.spec.name, engine.name, engine.detail, dev, note)
    if registry is not None:
        buffers.register(registry)
    return PolicyRunner(src.spec, buffers, engine, skipped=skipped)
