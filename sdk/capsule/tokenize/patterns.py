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
DIGIT_RUNS = "<Digits(individual_digits=False)>"   # ... each run of numeric chars a piece
PUNCT = "<Punctuation(contiguous)>"   # each run of punctuation chars a piece
CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
DEEPSEEK_SPLITS = (r"\p{N}{1,3}", CJK,
                   "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
                   "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                   "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")

# DeepSeek LLM / V2 (and Coder): newlines and digits isolated, letter, punctuation and CJK stages
_DS_LETTERS = ("A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370"
               "-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-"
               "\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
               "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18"
               "-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-"
               "\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-"
               "\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124"
               "\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183"
               "\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
               "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21"
               "-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
               "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
DEEPSEEK_LLM_SPLITS = ("[\r\n]", "\\s?[" + _DS_LETTERS + "]+",
                       "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", "\\s+$",
                       "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", DIGITS)
# Falcon: punctuation runs, GPT-2's regex (inside ByteLevel), digit runs, 3-digit groups
FALCON_SPLITS = (PUNCT, GPT2, DIGIT_RUNS, "[0-9][0-9][0-9]")
DEEPSEEK_CODER_SPLITS = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+",
                         "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", DIGITS)

@dataclass(frozen=True)
class Verified:
    """One proven pipeline: its split stages and the run classes the proof uses."""
    splits: tuple[str, ...]     # pre-tokenizer stages in order: regexes (a tiktoken pattern is
    #                             one), DIGITS for a Digits(individual_digits) stage
    marks_are_letters: bool     # letter runs are [\p{L}\p{M}] (else \p{L}: marks are "other")
    cjk_stage: bool             # DeepSeek: CJK runs are isolated before the main split
    digit_step: int = 0         # digit pieces: 1 (\p{N}, Digits), 3 (\p{N}{1,3}), 0 (one per run)
    scheme: str = "runs"        # "runs": classes L N W O; "cased": o200k's; "isolated": only
    #                             the pieces that newlines and digits make; "punct": only the
    #                             edges of ASCII punctuation and digit runs (docs/TOKENIZATION.md)
    space_runs: bool = False    # long space / tab runs may be cut short before pre-tokenizing
    #                             (space_runs.py; docs/TOKENIZATION.md "Space runs" proves it)
    digit_runs: bool = False    # a long trailing ASCII digit run too (GPT-2's ' ?\p{N}+' only)


VERIFIED = {
    "cl100k-pattern": Verified((CL100K,), False, False, 3, space_runs=True),
    "qwen2-pattern": Verified((QWEN2,), False, False, 1, space_runs=True),
    "qwen3.5-pattern": Verified((QWEN35,), True, False, 1, space_runs=True),
    "deepseek-splits": Verified(DEEPSEEK_SPLITS, True, True, 3, space_runs=True),
    "r50k-pattern": Verified((R50K,), False, False, space_runs=True, digit_runs=True),
    "gpt2-pattern": Verified((GPT2,), False, False, space_runs=True, digit_runs=True),
    "llama3-pattern": Verified((LLAMA3,), False, False, 3, space_runs=True),
    "digits-gpt2": Verified((DIGITS, GPT2), False, False, 1, space_runs=True),
    "o200k-pattern": Verified((O200K,), True, False, 3, "cased", space_runs=True),
    "tekken-pattern": Verified((TEKKEN,), True, False, 1, "cased", space_runs=True),
    "deepseek-llm-splits": Verified(DEEPSEEK_LLM_SPLITS, False, False, 1, "isolated", space_runs=True),
    "deepseek-coder-splits": Verified(DEEPSEEK_CODER_SPLITS, False, False, 1, "isolated", space_runs=True),
    "falcon-splits": Verified(FALCON_SPLITS, False, False, 3, "punct", space_runs=True),
}
# Every char matches one of these single patterns' alternatives (tiktoken requires it), so a
# tokenizers Split with them drops no gap: Removed + invert equals Isolated.
COVER_ALL = frozenset(k for k, v in VERIFIED.items() if len(v.splits) == 1)


def verified_key(splits: tuple[str, ...]) -> str | None:
    """The key of the verified pipeline with exactly these split regexes, else None."""
    return next((k for k, v in VERIFIED.items() if v.splits == splits), None)
