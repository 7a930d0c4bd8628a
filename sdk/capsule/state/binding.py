"""Binding: what a capsule's bytes are only valid against.

A restore into a session whose binding differs in any fingerprint is refused with
CapsuleMismatch naming each differing field, so a capsule is never read as something else.
The labels (model path or name, tokenizer name, layout settings) are what a person recognises:
they are saved and shown in a mismatch, never compared, so two folders holding identical
weights are the same model. Manifests written before labels existed read with none.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import CapsuleMismatch
from . import fields

FORMAT_VERSION = 1
FINGERPRINTS = ("format_version", "model", "tokenizer", "layout", "dtype", "device_class")
MAX_LABEL_CHARS = 4096
MAX_LAYOUT_LABELS = 32
RESTORE_HINT = ("To restore it, open with the same model, tokenizer, device and runtime settings; "
                "restore=False starts fresh and keeps the other setup's epochs. Retention (keep_epochs) "
                "counts every epoch, whichever setup wrote it: to keep both setups' capsules, name them "
                "with checkpoint(name=...); named epochs are never dropped.")


@dataclass(frozen=True)
class Binding:
    """Fingerprints of the model, tokenizer, buffer layout and device class of a session."""

    format_version: int
    model: str          # weights digest (sha256)
    tokenizer: str      # vocabulary fingerprint
    layout: str         # digest of region names, shapes, dtypes, page sizes + runtime shape settings
    dtype: str
    device_class: str   # "cpu" or "cuda"
    # informational: {"model": name or folder, "tokenizer": name, "layout": {setting: value}}
    labels: dict = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, *, model: str, tokenizer: str, layout: object, dtype: str, device_class: str,
           labels: dict | None = None) -> "Binding":
        blob = json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()
        return cls(FORMAT_VERSION, model, tokenizer, hashlib.sha256(blob).hexdigest(), dtype, device_class,
                   dict(labels or {}))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: object, where: str = "binding") -> "Binding":
        """Parse a capsule's binding (untrusted); FieldError naming the field if it is off."""
        d = fields.obj(d, where)
        known = set(FINGERPRINTS) | {"labels"}
        if set(FINGERPRINTS) - set(d) or set(d) - known:
            raise fields.FieldError(where, f"has fields {sorted(d)[:10]}, expected {sorted(known)}: "
                                           "written by another SDK format?")
        version = fields.integer(d["format_version"], f"{where}.format_version", 0, 1 << 31)
        if version != FORMAT_VERSION:
            raise fields.FieldError(f"{where}.format_version",
                                    f"is {version}; this SDK reads capsule format {FORMAT_VERSION} "
                                    "(restore it with the SDK version that wrote it)")
        values = {f: fields.text(d[f], f"{where}.{f}", MAX_LABEL_CHARS) for f in FINGERPRINTS[1:]}
        return cls(version, **values, labels=_labels(d.get("labels"), f"{where}.labels"))

    def differences(self, saved: "Binding") -> list[str]:
        """One line per fingerprint where `saved` (the capsule's) differs from self (the session's)."""
        return [self._describe(name, saved) for name in FINGERPRINTS
                if getattr(saved, name) != getattr(self, name)]

    def check_matches(self, saved: "Binding") -> None:
        """Raise CapsuleMismatch naming every field where `saved` (the capsule's) differs from self."""
        diffs = self.differences(saved)
        if diffs:
            raise CapsuleMismatch("capsule was taken against a different setup; " + "; ".join(diffs)
                                  + f". {RESTORE_HINT}")

    def _describe(self, name: str, saved: "Binding") -> str:
        mine, theirs = getattr(self, name), getattr(saved, name)
        if name in ("model", "tokenizer"):
            what = "weights" if name == "model" else "vocabulary"
            same = saved.labels.get(name) is not None and saved.labels.get(name) == self.labels.get(name)
            return (f"{name}: capsule {_named(saved.labels.get(name), what, theirs)} != "
                    f"session {_named(self.labels.get(name), what, mine)}"
                    + (" (same name, other contents: e.g. a builtin sized for another vocabulary)"
                       if same else ""))
        if name == "layout":
            a, b = saved.labels.get("layout") or {}, self.labels.get("layout") or {}
            keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            if a and b and keys:
                return ("layout: capsule " + ", ".join(f"{k}={a.get(k)}" for k in keys)
                        + " != session " + ", ".join(f"{k}={b.get(k)}" for k in keys))
            why = "settings not recorded in the capsule: an older SDK wrote it" if not a else \
                "the static buffers differ: another policy, vocabulary size, dtype or engine"
            return f"layout: capsule {theirs[:12]} != session {mine[:12]} ({why})"
        return f"{name}: capsule {theirs!r} != session {mine!r}"


def _named(label: object, what: str, digest: str) -> str:
    short = f"{what} {digest[:12]}"
    return f"{label!r} ({short})" if isinstance(label, str) else f"{short} (name not recorded)"


def _labels(value: object, where: str) -> dict:
    """Only the labels this SDK shows, each checked; unknown ones are left out."""
    if value is None:
        return {}
    value = fields.obj(value, where)
    out: dict[str, Any] = {}
    for key in ("model", "tokenizer"):
        if key in value:
            out[key] = fields.text(value[key], f"{where}.{key}", MAX_LABEL_CHARS)
    if "layout" in value:
        layout = fields.obj(value["layout"], f"{where}.layout")
        if len(layout) > MAX_LAYOUT_LABELS:
            raise fields.FieldError(f"{where}.layout", f"holds {len(layout)} settings; at most "
                                                       f"{MAX_LAYOUT_LABELS}")
        for k, v in layout.items():
            fields.text(k, f"{where}.layout key", 64)
            ok = isinstance(v, (str, int, float, bool)) or (
                isinstance(v, list) and len(v) <= 64 and all(type(x) is int for x in v))
            if not ok or (isinstance(v, str) and len(v) > MAX_LABEL_CHARS):
                raise fields.FieldError(f"{where}.layout.{k}", "is not a short setting value")
        out["layout"] = dict(layout)
    return out
