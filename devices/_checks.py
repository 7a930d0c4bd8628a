"""Value checkers for profile fields: each returns the (normalised) value or raises ValueError
naming the dotted key, the bad value and what is allowed."""
from __future__ import annotations

import math
from typing import Any


def bad(key: str, value: Any, problem: str) -> ValueError:
    return ValueError(f"{key}: {value!r} {problem}")


def wrong_type(key: str, value: Any, expected: str) -> ValueError:
    return bad(key, value, f"has type {type(value).__name__}, expected {expected}")


def check_int(key: str, v: Any, lo: int | None = None) -> int:
    # bool is a subclass of int; `block_size: true` is a typo, not 1.
    if isinstance(v, bool) or not isinstance(v, int):
        raise wrong_type(key, v, "int")
    if lo is not None and v < lo:
        raise bad(key, v, f"is not >= {lo}")
    return v


def check_num(key: str, v: Any, *, gt: float | None = None, ge: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise wrong_type(key, v, "number")
    if not math.isfinite(v):
        raise bad(key, v, "is not a finite number")
    if gt is not None and not v > gt:
        raise bad(key, v, f"is not > {gt:g}")
    if ge is not None and not v >= ge:
        raise bad(key, v, f"is not >= {ge:g}")
    return float(v)


def check_bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise wrong_type(key, v, "bool")
    return v


def check_str(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise wrong_type(key, v, "str")
    return v


def check_choice(key: str, v: Any, allowed: tuple[str, ...]) -> str:
    if check_str(key, v) not in allowed:
        raise bad(key, v, f"is not one of: {', '.join(allowed)}")
    return v


def check_int_list(key: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise wrong_type(key, v, "list of int")
    return tuple(check_int(f"{key}[{i}]", x) for i, x in enumerate(v))


def set_field(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclass: normalise in __post_init__
