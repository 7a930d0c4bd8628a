"""capsule: execution-state capsules for edge robots.

Quick use::

    from capsule import Session
    with Session.open("robot.capsules", model="builtin:tiny") as s:
        s.append("user: bring me the red cup\\n")
        print(s.generate(16))
"""
from ._version import __version__
from .errors import (CapacityError, CapsuleCorrupt, CapsuleError, CapsuleMismatch, ContextFull,
                     ModelLoadError, StoreError, TokenizerError, UnknownStream, UnsupportedArchitecture,
                     VocabMismatch)
from .control import ControlLoop
from .session import Session
from .store.errors import UnsafeStore

__all__ = ["__version__", "ControlLoop", "Session", "CapsuleError", "CapacityError", "CapsuleCorrupt",
           "CapsuleMismatch", "ContextFull", "ModelLoadError", "StoreError", "UnsafeStore", "TokenizerError",
           "UnknownStream", "UnsupportedArchitecture", "VocabMismatch"]
