"""Tokenizers: reference adapters per family (the ids every faster path must reproduce), and the
exact incremental tokenizer that re-encodes only a window after an append.

The public names are imported on first use (PEP 562): a process that only reads a capsule's
token ids (``capsule.lite``, through ``incremental_state``) does not load the families, the
splice rules and the reference adapters (~85 ms of a torch-free restore).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .differential import run_differential
    from .disk_cache import clear_disk_cache
    from .incremental import IncrementalTokenizer, Splice
    from .reference import ReferenceTokenizer, clear_cache, load_reference
    from .registry import (Family, UnknownFamily, all_families, family_names, get_family,
                           register_family, unregister_family)

    FAMILIES: tuple[str, ...]

_LAZY = {"clear_disk_cache": ".disk_cache", "IncrementalTokenizer": ".incremental", "Splice": ".incremental",
         "ReferenceTokenizer": ".reference", "clear_cache": ".reference", "load_reference": ".reference",
         "Family": ".registry", "UnknownFamily": ".registry", "all_families": ".registry",
         "family_names": ".registry", "get_family": ".registry", "register_family": ".registry",
         "unregister_family": ".registry", "run_differential": ".differential"}

__all__ = ["FAMILIES", "Family", "IncrementalTokenizer", "ReferenceTokenizer", "Splice", "UnknownFamily",
           "all_families", "clear_cache", "clear_disk_cache", "family_names", "get_family",
           "load_reference", "register_family", "run_differential", "unregister_family"]


def __getattr__(name: str) -> Any:
    """The public names on first use, then module attributes like any other. ``FAMILIES``: every
    built-in family name (``register_family`` adds more: ``family_names()`` lists all)."""
    if name == "FAMILIES":
        value: Any = importlib.import_module(".registry", __name__).family_names()
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        raise AttributeError(f"module 'capsule.tokenize' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
