"""The policy-engine registry: every engine a policy can run on, in one table.

An entry names the engine (the word device profiles list under `engines:`), builds it lazily
(its module, and the heavy backend that module imports, load only when the engine is asked
for) and names its doctor probe (a real tiny inference on the backend). Who reads it:
load_policy picks entries in the order its caller gives (the device profile's list);
`capsule doctor` runs every probe; `capsule bench --suite control` times every engine.

Adding an engine: write policy/engine_<x>.py (a class following the Engine protocol of
source.py, raising EngineUnavailable when it cannot run here, and a probe), add one entry to
ENTRIES below, and test it. Device profiles name engines by these names; Session.open checks a
profile's list against this table (check_profile_engines): the devices package keeps no list.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from .buffers import PolicyBuffers
    from .probe import Probe
    from .source import Engine, PolicySource

EngineFactory = Callable[..., "Engine"]   # (source, buffers[, threads=n]) -> Engine


@dataclass(frozen=True)
class EngineEntry:
    """One engine: `build(source, buffers)` returns a ready Engine or raises EngineUnavailable;
    with `takes_threads`, load_policy passes `threads=n` too when runtime.threads is set."""

    name: str
    summary: str                  # what runs and where, one line for reports
    build: EngineFactory
    probe: Probe | None           # None: the backend is checked by doctor's own torch probes
    cuda_only: bool = False       # a profile of device "cpu" may not list it
    takes_threads: bool = False   # build accepts threads= (CPU intra-op threads of its backend)


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    """A stand-in for policy/<module>.py's `attr` that imports the module on its first call."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(f"{__package__}.{module}"), attr)(*args, **kwargs)
    call.__qualname__ = call.__name__ = f"{module}.{attr}"
    return call


# the order is the usual preference (fastest first); a profile's own list decides at load time
ENTRIES: tuple[EngineEntry, ...] = (
    EngineEntry("tensorrt", "a TensorRT plan built from the ONNX file, replayed in a CUDA graph (CUDA only)",
                _lazy("engine_trt", "TensorRTEngine"), _lazy("engine_trt", "probe_tensorrt"), cuda_only=True),
    EngineEntry("onnxruntime", "ONNX Runtime, IOBinding onto the static buffers (CPU, CUDA, TensorRT providers)",
                _lazy("engine_ort", "OrtEngine"), _lazy("engine_ort", "probe_onnxruntime"), takes_threads=True),
    # torch's intra-op threads are process-wide: Session.open sets them (assembly.set_threads)
    EngineEntry("torch", "the builtin policy's torch module (builtins only), in a CUDA graph on CUDA",
                _lazy("engine_torch", "TorchEngine"), None),
)


def engine_names() -> tuple[str, ...]:
    """Every registered engine name, in registry order."""
    return tuple(e.name for e in ENTRIES)


def select_engines(engines: Sequence[str]) -> tuple[EngineEntry, ...]:
    """The entries for `engines`, in the given order; ValueError if it is empty or names an unknown one."""
    known, names = engine_names(), tuple(engines)
    if not names or any(n not in known for n in names):
        raise ValueError(f"engines must be a non-empty sequence of {', '.join(known)}; got {list(names)}")
    return tuple(ENTRIES[known.index(n)] for n in names)


def check_profile_engines(engines: Sequence[str], device: str, source: str) -> None:
    """ValueError naming `source` (a profile) when its engine list names an unregistered engine
    or, on a "cpu" profile, a CUDA-only one."""
    known = engine_names()
    for i, name in enumerate(engines):
        if name not in known:
            raise ValueError(f"engines[{i}]: {name!r} is not a policy engine (registered: "
                             f"{', '.join(known)}) (profile {source})")
        if device == "cpu" and ENTRIES[known.index(name)].cuda_only:
            raise ValueError(f"engines: {list(engines)} includes {name!r}, which needs device 'cuda' "
                             f"(profile {source})")
