"""Tokenizers: reference adapters per family (the ids every faster path must reproduce)."""
from .disk_cache import clear_disk_cache
from .reference import FAMILIES, ReferenceTokenizer, clear_cache, load_reference

__all__ = ["FAMILIES", "ReferenceTokenizer", "clear_cache", "clear_disk_cache", "load_reference"]
