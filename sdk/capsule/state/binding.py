"""Binding: what a capsule's bytes are only valid against.

A restore into a session whose binding differs in any field is refused with
CapsuleMismatch naming each differing field, so a capsule is never read as something else.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from ..errors import CapsuleMismatch

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Binding:
    """Fingerprints of the model, tokenizer, buffer layout and device class of a session."""

    format_version: int
    model: str          # weights digest (sha256)
    tokenizer: str      # vocabulary fingerprint
    layout: str         # digest of region names, shapes, dtypes, page sizes + runtime shape settings
    dtype: str
    device_class: str   # "cpu" or "cuda"

    @classmethod
    def of(cls, *, model: str, tokenizer: str, layout: object, dtype: str, device_class: str) -> "Binding":
        blob = json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()
        return cls(FORMAT_VERSION, model, tokenizer, hashlib.sha256(blob).hexdigest(), dtype, device_class)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Binding":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise CapsuleMismatch(f"capsule binding has fields {sorted(d) if isinstance(d, dict) else d!r}, "
                                  f"expected {sorted(names)}: written by another SDK format?")
        return cls(**d)

    def check_matches(self, saved: "Binding") -> None:
        """Raise CapsuleMismatch naming every field where `saved` (the capsule's) differs from self."""
        diffs = [f"{f.name}: capsule {getattr(saved, f.name)!r} != session {getattr(self, f.name)!r}"
                 for f in dataclasses.fields(self) if getattr(saved, f.name) != getattr(self, f.name)]
        if diffs:
            raise CapsuleMismatch("capsule was taken against a different setup; " + "; ".join(diffs)
                                  + " (open with the same model, tokenizer, device and runtime settings, "
                                    "or restore=False to start fresh)")
