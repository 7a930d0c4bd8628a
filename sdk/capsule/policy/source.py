"""Where a policy comes from (builtin module or ONNX file), and the engine contract.

An engine is built over a PolicySource and the runner's PolicyBuffers. Its `run()` reads
buffers.obs and buffers.hidden and writes buffers.action and, in place, buffers.hidden; it
allocates nothing per call after its warm-up. Engines are not thread-safe: the runner (and
above it the Session) calls them from one thread at a time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import ModelLoadError
from .builtin import BUILTIN_PREFIX, BuiltinPolicy, builtin_names, builtin_policy
from .spec import PolicySpec, spec_from_onnx


class Engine(Protocol):
    name: str    # its name in policy/registry.py: "torch" | "onnxruntime" | "tensorrt"
    detail: str  # how it runs, for the log line: "eager", "CUDA graph", "CPUExecutionProvider", ...

    def run(self) -> None:
        """obs, hidden -> action, hidden (in place). No allocation after warm-up."""


@dataclass
class PolicySource:
    """A resolved policy: its spec, the torch module (builtins only) and its ONNX file."""

    spec: PolicySpec
    module: BuiltinPolicy | None = None
    path: Path | None = None
    _exported: Path | None = field(default=None, repr=False)

    def onnx_path(self) -> Path:
        """The ONNX file: the source itself, or the builtin exported once into the cache."""
        if self.path is not None:
            return self.path
        if self._exported is None:
            from .export import builtin_onnx_path  # needs `onnx`; only ONNX engines ask

            assert self.module is not None
            self._exported = builtin_onnx_path(self.module, self.spec.digest)
        return self._exported


def resolve_source(source: str | os.PathLike) -> PolicySource:
    """"builtin:<name>" (or a bare builtin name that is not a file) or a path to an .onnx file."""
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"policy source must be a path or 'builtin:<name>', got {type(source).__name__}")
    text = os.fspath(source)
    if isinstance(text, str) and (text.startswith(BUILTIN_PREFIX) or
                                  (text in builtin_names() and not os.path.exists(text))):
        try:
            module = builtin_policy(text)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        return PolicySource(module.spec(), module=module)
    path = Path(text)
    return PolicySource(spec_from_onnx(path), path=path)
