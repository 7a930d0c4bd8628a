"""A family's regex pre-tokenization on tensors (``edge_kernels.regex_split``), GPU or CPU.

``DeviceSplitter(ref, device)`` splits like the family's own pre-tokenizer for the GPT-family
patterns (``SPECS``: GPT-2's, r50k's, cl100k's, Qwen2's, Llama 3's), from UTF-8 bytes on the
device. The class table is built once per process from the ``regex`` engine's own classes
(``\\p{L}``, ``\\p{N}``, ``\\s``), the ones the splice rules and the tests use.
"""
from __future__ import annotations

import functools

import torch

from edge_kernels.regex_split import APOS, L, N, NL, SP, SPECS, W, Spec, split_utf8

from ..errors import TokenizerError
from .patterns import VERIFIED
from .rules import pipeline_key, python_pattern

try:
    import regex
except ImportError:   # an optional dependency: the splitter then says what to install
    regex = None

# the verified single-regex pipelines the tensor splitter runs, by their pattern
PATTERN_SPECS = {VERIFIED[key].splits[0]: key for key in SPECS}
MAX_CODE_POINT = 0x110000


@functools.lru_cache(maxsize=None)
def class_table() -> torch.Tensor:
    """(0x110000,) uint8: the class bits of every code point (surrogates: none)."""
    if regex is None:
        raise TokenizerError("the device splitter needs the regex package (pip install regex)")
    chars = "".join(chr(c) if not 0xD800 <= c < 0xE000 else "\x00"
                    for c in range(MAX_CODE_POINT))
    table = torch.zeros(MAX_CODE_POINT, dtype=torch.uint8)
    for bit, cls in ((L, r"\p{L}"), (N, r"\p{N}"), (W, r"\s"), (NL, r"[\r\n]")):
        at = [m.start() for m in regex.finditer(cls, chars)]
        table[torch.tensor(at, dtype=torch.int64)] |= bit
    table[0xD800:0xE000] = 0
    table[ord(" ")] |= SP
    table[ord("'")] |= APOS
    return table


def spec_of(ref: object) -> Spec | None:
    """The Spec of a tokenizer's pre-tokenizer when it is a verified GPT-family pattern (a
    tiktoken pattern, or a tokenizer.json's one Split or ByteLevel regex), else None."""
    key = pipeline_key(ref)
    return SPECS.get(key) if key is not None else None


def reference_spans(ref: object, text: str) -> list[tuple[int, int]]:
    """The pieces the family's own pre-tokenizer cuts ``text`` into (no special-token split):
    its pattern run by the regex engine (``$`` as Rust's end of text), or its tokenizer.json
    pre-tokenizer."""
    pattern = getattr(ref, "pattern", None)
    if pattern is not None:
        if regex is None:
            raise TokenizerError("reference_spans needs the regex package (pip install regex)")
        return [m.span() for m in regex.finditer(python_pattern(pattern), text)]
    spans = ref.piece_spans(text)   # type: ignore[attr-defined]
    if spans is None:
        raise TokenizerError(f"{getattr(ref, 'name', ref)}: no pre-tokenizer pieces to compare")
    return spans


class DeviceSplitter:
    """Splits text into the family's pre-tokenizer pieces with tensor ops on ``device``."""

    def __init__(self, ref: object, device: torch.device | str = "cpu") -> None:
        spec = spec_of(ref)
        if spec is None:
            raise TokenizerError(f"{getattr(ref, 'name', ref)}: the device splitter supports the "
                                 f"GPT-family patterns only ({', '.join(SPECS)})")
        self.spec = spec
        self.table = class_table().to(device)

    @property
    def device(self) -> torch.device:
        return self.table.device

    def starts(self, data: bytes) -> torch.Tensor:
        """Byte offset of every piece start of the UTF-8 text ``data``, on the device."""
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
            torch.zeros(0, dtype=torch.uint8)
        return split_utf8(raw.to(self.device), self.table, self.spec)

    def spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character offsets of every piece of ``text`` (for tests and checks)."""
        data = text.encode("utf-8")
        starts = self.starts(data).tolist()
        # byte offsets -> character offsets (lead bytes counted)
        lead = [i for i, b in enumerate(data) if b & 0xC0 != 0x80]
        char_at = {b: c for c, b in enumerate(lead)}
        chars = [char_at[s] for s in starts] + [len(text)]
        return list(zip(chars[:-1], chars[1:]))
