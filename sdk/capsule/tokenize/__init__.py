"""Tokenizers: reference adapters per family (the ids every faster path must reproduce), and the
exact incremental tokenizer that re-encodes only a window after an append."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .disk_cache import clear_disk_cache
from .incremental import IncrementalTokenizer, Splice
from .reference import ReferenceTokenizer, clear_cache, load_reference
from .registry import (Family, UnknownFamily, all_families, family_names, get_family,
                       register_family, unregister_family)

if TYPE_CHECKING:
    from .differential import run_differential

FAMILIES: tuple[str, ...] = family_names()
"""Every built-in family name (``register_family`` adds more: ``family_names()`` lists all)."""

__all__ = ["FAMILIES", "Family", "IncrementalTokenizer", "ReferenceTokenizer", "Splice", "UnknownFamily",
           "all_families", "clear_cache", "clear_disk_cache", "family_names", "get_family",
           "load_reference", "register_family", "run_differential", "unregister_family"]


def __getattr__(name: str) -> Any:
    """``run_differential`` on first use: the campaign (corpus files, hazards) is a test and
    bench tool, not something a restore needs."""
    if name == "run_differential":
        from .differential import run_differential
        globals()[name] = run_differential
        return run_differential
    raise AttributeError(f"module 'capsule.tokenize' has no attribute {name!r}")
