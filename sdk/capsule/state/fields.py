"""Typed readers for untrusted JSON fields (a capsule manifest read back from disk).

Each reader returns the value when it has the expected type and range and raises FieldError
naming the field's path (``host.streams[2].n_ids``) otherwise, so the caller can say exactly
what is wrong with a capsule instead of failing later with an AttributeError or a TypeError.
"""
from __future__ import annotations

from typing import Any


class FieldError(ValueError):
    """A field of untrusted JSON has the wrong type or range."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def obj(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise FieldError(field, f"is {type(value).__name__} {_shown(value)}, expected an object")
    return value


def seq(value: Any, field: str, max_len: int) -> list:
    if not isinstance(value, list):
        raise FieldError(field, f"is {type(value).__name__} {_shown(value)}, expected a list")
    if len(value) > max_len:
        raise FieldError(field, f"holds {len(value)} entries; at most {max_len} are possible")
    return value


def integer(value: Any, field: str, lo: int, hi: int) -> int:
    # bool is an int to Python, never to a manifest
    if type(value) is not int:
        raise FieldError(field, f"is {type(value).__name__} {_shown(value)}, expected an int")
    if not lo <= value <= hi:
        raise FieldError(field, f"is {value}, outside {lo}..{hi}")
    return value


def text(value: Any, field: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise FieldError(field, f"is {type(value).__name__} {_shown(value)}, expected a str")
    if len(value) > max_chars:
        raise FieldError(field, f"is {len(value)} characters long; at most {max_chars}")
    return value


def optional(value: Any, field: str, kind: type) -> Any:
    """None, or a value of `kind` (its contents are checked by whoever uses it)."""
    if value is not None and not isinstance(value, kind):
        raise FieldError(field, f"is {type(value).__name__} {_shown(value)}, expected "
                                f"{kind.__name__} or null")
    return value
