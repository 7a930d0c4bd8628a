"""Torch-free restore: continue a store's newest capsule greedily through onnxruntime.

    from capsule.lite import LiteResume
    with LiteResume.open("robot.capsules", stream="main") as r:   # numpy + onnxruntime only
        ids = r.generate(16)      # the ids Session.generate(16) would return after its restore

Needs the store's restore kit (``Session.write_lite_kit()``, onnxruntime LLM engine). See
``resume.py`` for what it does and what it refuses.
"""
from __future__ import annotations

from .resume import LiteResume

__all__ = ["LiteResume"]
