"""Bounded JSON for bytes read from disk (manifests, index metadata): untrusted input.

`json.loads` on hostile bytes can take the whole memory (a huge document), recurse until
RecursionError (200k nested lists), or hand back NaN / Infinity (which Python's encoder wrote
happily but our checks never expect). `loads` bounds the size before parsing, refuses the
non-standard constants, turns recursion into a ValueError, and checks the depth and the total
number of containers and items of what came back. Every refusal is a ValueError naming `what`;
callers turn it into their typed error (CapsuleCorrupt, IndexCorrupt).
"""
from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(data: bytes | bytearray | memoryview | str, *, what: str, max_bytes: int,
          max_depth: int = MAX_DEPTH, max_items: int | None = None) -> Any:
    """Parse `data` as strict JSON within the bounds; ValueError (naming `what`) otherwise.
    max_items: at most this many values in all (containers, their items and scalars);
    default: one per two bytes, which a real document never reaches."""
    size = len(data)
    if size > max_bytes:
        raise ValueError(f"{what} is {size} bytes; at most {max_bytes} are allowed")
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        doc = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:   # json.JSONDecodeError is a ValueError
        raise ValueError(f"{what} is not valid JSON ({exc})") from None
    _check_shape(doc, what, max_depth, max_items if max_items is not None else max(64, size // 2))
    return doc


def _check_shape(doc: Any, what: str, max_depth: int, max_items: int) -> None:
    """Depth and item count, walked without recursion (the document may be ~1000 deep)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    items = 0
    while stack:
        value, depth = stack.pop()
        items += 1
        if items > max_items:
            raise ValueError(f"{what} holds more than {max_items} values")
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise ValueError(f"{what} is nested deeper than {max_depth} levels")
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)


def dumps(doc: Any) -> bytes:
    """Compact strict JSON as UTF-8 (NaN / Infinity refused: `loads` would refuse them back)."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")
