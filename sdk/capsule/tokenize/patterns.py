"""The verified set: pre-tokenizer pipelines whose splice rule docs/TOKENIZATION.md proves.

Each entry is a key a family's record names (``Family.splice``); ``rules.rules_for`` uses an
entry only when the loaded pipeline's regexes equal its ``splits`` string for string.
"""
from __future__ import annotations

from dataclasses import dataclass

CL100K = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"
          r"[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
         r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}"
          r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
DEEPSEEK_SPLITS = (r"\p{N}{1,3}", CJK,
                   "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
                   "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                   "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")


@dataclass(frozen=True)
class Verified:
    """One proven pipeline: its split regexes and the run classes the proof uses."""
    splits: tuple[str, ...]     # pre-tokenizer regexes in order (a tiktoken pattern is one)
    marks_are_letters: bool     # letter runs are [\p{L}\p{M}] (else \p{L}: marks are "other")
    cjk_stage: bool             # DeepSeek: CJK runs are isolated before the main split


VERIFIED = {
    "cl100k-pattern": Verified((CL100K,), False, False),
    "qwen2-pattern": Verified((QWEN2,), False, False),
    "qwen3.5-pattern": Verified((QWEN35,), True, False),
    "deepseek-splits": Verified(DEEPSEEK_SPLITS, True, True),
}


def verified_key(splits: tuple[str, ...]) -> str | None:
    """The key of the verified pipeline with exactly these split regexes, else None."""
    return next((k for k, v in VERIFIED.items() if v.splits == splits), None)
