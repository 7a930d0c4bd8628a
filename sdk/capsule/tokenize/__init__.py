"""Tokenizers: reference adapters per family (the ids every faster path must reproduce), and the
exact incremental tokenizer that re-encodes only a window after an append."""
from .differential import run_differential
from .disk_cache import clear_disk_cache
from .incremental import IncrementalTokenizer, Splice
from .reference import ReferenceTokenizer, clear_cache, load_reference
from .registry import (Family, UnknownFamily, all_families, family_names, get_family,
                       register_family, unregister_family)

FAMILIES: tuple[str, ...] = family_names()
"""Every built-in family name (``register_family`` adds more: ``family_names()`` lists all)."""

__all__ = ["FAMILIES", "Family", "IncrementalTokenizer", "ReferenceTokenizer", "Splice", "UnknownFamily",
           "all_families", "clear_cache", "clear_disk_cache", "family_names", "get_family",
           "load_reference", "register_family", "run_differential", "unregister_family"]
