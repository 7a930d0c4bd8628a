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
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-2's, as tiktoken spells it for r50k_base and p50k_base
R50K = r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"
# ... and as GPT-2 wrote it: what tokenizers' ByteLevel(use_regex=True) splits with
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CASED = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}|")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
# o200k_base / o200k_harmony, Llama 4, MiniMax: case-structured letter runs, a contraction suffix
O200K = (_CASED.replace("{c}", _CONTRACTION)
         + r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral tekken: o200k's shape without contractions, one digit per piece
TEKKEN = (_CASED.replace("{c}", "")
          + r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DIGITS = "<Digits(individual_digits=True)>"   # tokenizers' Digits stage: each \p{N} a piece
CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
DEEPSEEK_SPLITS = (r"\p{N}{1,3}", CJK,
                   "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
                   "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                   "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")


@dataclass(frozen=True)
class Verified:
    """One proven pipeline: its split stages and the run classes the proof uses."""
    splits: tuple[str, ...]     # pre-tokenizer stages in order: regexes (a tiktoken pattern is
    #                             one), DIGITS for a Digits(individual_digits) stage
    marks_are_letters: bool     # letter runs are [\p{L}\p{M}] (else \p{L}: marks are "other")
    cjk_stage: bool             # DeepSeek: CJK runs are isolated before the main split
    scheme: str = "runs"        # "runs": classes L N W O; "cased": o200k's (docs/TOKENIZATION.md)


VERIFIED = {
    "cl100k-pattern": Verified((CL100K,), False, False),
    "qwen2-pattern": Verified((QWEN2,), False, False),
    "qwen3.5-pattern": Verified((QWEN35,), True, False),
    "deepseek-splits": Verified(DEEPSEEK_SPLITS, True, True),
    "r50k-pattern": Verified((R50K,), False, False),
    "gpt2-pattern": Verified((GPT2,), False, False),
    "llama3-pattern": Verified((LLAMA3,), False, False),
    "digits-gpt2": Verified((DIGITS, GPT2), False, False),
    "o200k-pattern": Verified((O200K,), True, False, "cased"),
    "tekken-pattern": Verified((TEKKEN,), True, False, "cased"),
}
# Every char matches one of these single patterns' alternatives (tiktoken requires it), so a
# tokenizers Split with them drops no gap: Removed + invert equals Isolated.
COVER_ALL = frozenset(k for k, v in VERIFIED.items() if len(v.splits) == 1 and k != "deepseek-splits")


def verified_key(splits: tuple[str, ...]) -> str | None:
    """The key of the verified pipeline with exactly these split regexes, else None."""
    return next((k for k, v in VERIFIED.items() if v.splits == splits), None)
