"""Tokenizers: reference adapters per family (the ids every faster path must reproduce), and the
exact incremental tokenizer that re-encodes only a window after an append."""
from .differential import run_differential
from .disk_cache import clear_disk_cache
from .incremental import IncrementalTokenizer, Splice
from .reference import FAMILIES, ReferenceTokenizer, clear_cache, load_reference

__all__ = ["FAMILIES", "IncrementalTokenizer", "ReferenceTokenizer", "Splice", "clear_cache",
           "clear_disk_cache", "load_reference", "run_differential"]
