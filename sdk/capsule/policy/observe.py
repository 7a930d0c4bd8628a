"""Observation intake: validate a step's observation and copy it into the static obs buffers.

Accepts, per key, a numpy array or a torch tensor (any device) of exactly the spec's dtype,
shaped either `shape` or `(1, *shape)`, every value finite (float dtypes: no NaN, no +-inf; a
failed sensor must not pass for a reading). Everything is validated before anything is copied,
so a bad observation leaves the buffers (which are checkpointed) untouched and no engine runs.

Finiteness cost: a numpy array or a CPU tensor is checked on the host into a preallocated bool
buffer (no allocation). A CUDA tensor is checked on its device with one host sync per step
(``torch.isfinite(x).all()`` read back) before the engine is launched, and the policy's stream
first waits for the caller's stream, where the tensor was made (and where another thread's GPU
work may be queued). To avoid both, pass observations from the host.

On CPU a numpy observation is copied straight into a numpy view of the buffer; on CUDA through
a pinned host staging buffer allocated once. Not thread-safe: the runner serializes calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from .buffers import PolicyBuffers, torch_dtype
from .spec import PolicySpec


@dataclass(frozen=True)
class _Slot:
    key: str
    shape: tuple[int, ...]       # without batch
    batched: tuple[int, ...]     # (1, *shape)
    np_dtype: np.dtype
    torch_dtype: torch.dtype
    dst: torch.Tensor            # the static buffer (1, *shape)
    host: torch.Tensor           # dst itself on CPU, else a pinned staging twin
    host_np: np.ndarray          # numpy view of host
    finite: np.ndarray | None    # (1, *shape) bool scratch for float dtypes, None for int dtypes

    def check(self, value: Any) -> None:
        if isinstance(value, np.ndarray):
            dtype, shape = value.dtype, value.shape
            ok_dtype = dtype == self.np_dtype
        elif isinstance(value, torch.Tensor):
            dtype, shape = value.dtype, tuple(value.shape)
            ok_dtype = dtype == self.torch_dtype
        else:
            raise ValueError(f"observation {self.key!r} must be a numpy array or a torch tensor of "
                             f"shape {self.shape} {self.np_dtype}, got {type(value).__name__}")
        if not ok_dtype:
            raise ValueError(f"observation {self.key!r}: expected dtype {self.np_dtype}, got {dtype} "
                             f"(convert it, e.g. .astype(np.{self.np_dtype}))")
        if shape != self.shape and shape != self.batched:
            raise ValueError(f"observation {self.key!r}: expected shape {self.shape} or {self.batched}, "
                             f"got {tuple(shape)}")

    def check_finite(self, value: Any) -> None:
        """Raise ValueError naming the key and the first non-finite index (value passed check)."""
        if self.finite is None:
            return                                   # integer dtypes are always finite
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                if bool(torch.isfinite(value).all()):   # one host sync (see the module docstring)
                    return
                value = value.cpu()
            value = (value.detach() if value.requires_grad else value).numpy()   # a view: no copy
        # hot path: no allocation; (shape) broadcasts into the (1, *shape) scratch
        if np.isfinite(value, out=self.finite).all():
            return
        bad = ~np.isfinite(value)
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        where = first[0] if len(first) == 1 else first
        raise ValueError(f"observation {self.key!r} has a non-finite value ({value[first]}) at index "
                         f"{where} ({int(bad.sum())} of {value.size} values are NaN or inf); nothing was "
                         f"changed (no policy step ran): fix or drop the reading (e.g. a failed sensor) "
                         f"and pass finite values")

    def put(self, value: Any) -> None:
        # hot path: no allocation. (shape) broadcasts into (1, *shape).
        if isinstance(value, np.ndarray):
            np.copyto(self.host_np, value)
            if self.host is not self.dst:
                self.dst.copy_(self.host, non_blocking=True)  # staging is reused only after the
                # step's action readback synchronized, so the upload has finished by then
        else:
            self.dst.copy_(value)


def _keys(observation: Mapping[Any, Any]) -> str:
    """The given keys for an error message, sorted even when they are not all str."""
    keys = sorted(observation, key=lambda k: (not isinstance(k, str), repr(k)))
    note = "" if all(isinstance(k, str) for k in keys) else "; keys must be str"
    return f"[{', '.join(map(repr, keys))}]{note}"


class ObservationLoader:
    """Validates observations against a spec and writes them into PolicyBuffers.obs."""

    def __init__(self, spec: PolicySpec, buffers: PolicyBuffers):
        on_cpu = buffers.device.type == "cpu"
        self._slots: list[_Slot] = []
        for key, (shape, dtype) in spec.observation.items():
            dst = buffers.obs[key]
            host = dst if on_cpu else torch.zeros(dst.shape, dtype=dst.dtype, pin_memory=True)
            floating = np.issubdtype(np.dtype(dtype), np.floating)
            finite = np.zeros((1, *shape), dtype=bool) if floating else None
            self._slots.append(_Slot(key, shape, (1, *shape), np.dtype(dtype), torch_dtype(dtype), dst,
                                     host, host.numpy(), finite))
        self._keys = frozenset(spec.observation)

    def expected(self) -> str:
        return ", ".join(f"{s.key!r} {s.shape} {s.np_dtype}" for s in self._slots)

    def check(self, observation: Mapping[str, Any]) -> None:
        """Raise ValueError (naming the key) unless `observation` fits the spec, all values finite."""
        if not isinstance(observation, Mapping):
            raise ValueError(f"observation must be a mapping of key -> array, got "
                             f"{type(observation).__name__}; expected {self.expected()}")
        for slot in self._slots:
            if slot.key not in observation:
                raise ValueError(f"observation is missing {slot.key!r}; allowed keys: {self.expected()} "
                                 f"(got keys {_keys(observation)})")
            slot.check(observation[slot.key])
        if len(observation) != len(self._slots):
            extra = {k: None for k in observation if k not in self._keys}
            raise ValueError(f"observation has unknown key(s) {_keys(extra)}; allowed keys: {self.expected()}")
        for slot in self._slots:
            slot.check_finite(observation[slot.key])

    def load(self, observation: Mapping[str, Any]) -> None:
        """check(observation), then copy it into the obs buffers."""
        self.check(observation)
        for slot in self._slots:
            slot.put(observation[slot.key])
