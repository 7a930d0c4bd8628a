"""capsule: execution-state capsules for edge robots.

Quick use::

    from capsule import Session
    with Session.open("robot.capsules", model="builtin:tiny") as s:
        s.append("user: bring me the red cup\\n")
        print(s.generate(16))

``import capsule`` loads only the errors: ``Session`` (torch, the store, the tokenizers) and
``ControlLoop`` are imported on first use, so a process that restores a capsule pays for what
its restore needs and a CLI call for nothing else.
"""
from __future__ import annotations

import gc
import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (CapacityError, CapsuleCorrupt, CapsuleError, CapsuleMismatch, ContextFull,
                     ModelLoadError, StoreError, TokenizerError, UnknownStream, UnsupportedArchitecture,
                     VocabMismatch)

if TYPE_CHECKING:
    from .control import ControlLoop
    from .session import Session
    from .store.errors import UnsafeStore

_LAZY = {"Session": ".session", "ControlLoop": ".control", "UnsafeStore": ".store.errors"}

__all__ = ["__version__", "ControlLoop", "Session", "CapsuleError", "CapacityError", "CapsuleCorrupt",
           "CapsuleMismatch", "ContextFull", "ModelLoadError", "StoreError", "UnsafeStore", "TokenizerError",
           "UnknownStream", "UnsupportedArchitecture", "VocabMismatch"]


def __getattr__(name: str) -> Any:
    """The lazy public names (PEP 562): imported once, then module attributes like any other."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'capsule' has no attribute {name!r}")
    value = getattr(_import_without_gc(where), name)
    globals()[name] = value
    return value


def _import_without_gc(where: str) -> Any:
    """Import with the cyclic GC paused, then restore the caller's GC state. Importing torch and
    the Session graph allocates ~10^6 container objects; each full collection on the way walks
    them all and frees nothing (~0.2 s of a 1.4 s import, measured in fresh processes): on a
    restore from a cold start that is time before the robot's first token."""
    was = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(where, __name__)
    finally:
        if was:
            gc.enable()


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
