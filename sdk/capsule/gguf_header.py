"""The bounded GGUF header reader: metadata as plain values, each tensor's extent checked.

A GGUF file is untrusted input. gguf.GGUFReader walks every count the header claims (a key count
or an array length of 2**60 loops for ever, allocating as it goes), so the header is read here,
with every count and length bounded by limits and by the bytes left in the file, and every
tensor's extent checked against the file's size. It is also fast: GGUFReader takes seconds on a
100k-token vocabulary (numpy views for every string); this takes ~0.1 s. The tests check that it
reads exactly what GGUFReader reads (fields and tensor offsets).

A bottom room: the model loader (``llm.gguf_file``) and the tokenizer families (a vocabulary
GGUF) both read through it.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelLoadError
from .paths import map_file

MAX_KV, MAX_TENSORS, MAX_ARRAY = 1 << 16, 1 << 16, 1 << 22   # a 262k vocabulary + its merges fit
MAX_STRING, MAX_KEY, MAX_DIMS = 1 << 24, 1 << 16, 4
# ggml type id -> (name, elements per block, bytes per block); the types the weight loader reads
SUPPORTED_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 8: ("Q8_0", 32, 34),
                   2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 12: ("Q4_K", 256, 144),
                   13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
# GGUF value type id -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header, checked against the file's size."""

    name: str
    type_id: int
    type_name: str
    dims: tuple[int, ...]   # GGUF (ne) order: dims[0] is the contiguous axis, the HF `in` features
    offset: int             # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The Hugging Face shape: ne reversed, so a (out, in) weight has dims (in, out)."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    size: int
    metadata: dict[str, object] = field(repr=False)
    tensors: tuple[TensorInfo, ...] = field(repr=False)


def read_metadata(path: str | os.PathLike) -> dict[str, object]:
    """The GGUF file's key/value metadata as plain Python values (str, int, float, bool, lists)."""
    return read_header(path).metadata


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and bound-check the header of a GGUF (v2/v3, little-endian) file. ModelLoadError
    when it is not one, is truncated, or claims more than the limits or the file allow."""
    path = Path(path)
    buf = map_file(path, 24, "GGUF")
    try:
        return _Parser(path, buf, len(buf)).header()
    finally:
        buf.close()


class _Parser:
    def __init__(self, path: Path, buf: mmap.mmap, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {what} (at byte {self.pos} of {self.size}); the GGUF file is "
                              "truncated or corrupt: download it again")

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"needs {n} more bytes than the file has")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str):
        return struct.unpack_from("<" + fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self, limit: int = MAX_STRING) -> str:
        n = self.scalar("Q")
        if n > limit:
            raise self.fail(f"a string of {n} bytes exceeds the limit of {limit}")
        start = self.take(n)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string is not valid UTF-8") from None

    def value(self, vtype: int, depth: int = 0) -> object:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype != 9 or depth > 1:
            raise self.fail(f"unknown or too deeply nested value type {vtype}")
        itype, count = self.scalar("I"), self.scalar("Q")
        if count > MAX_ARRAY:
            raise self.fail(f"an array of {count} items exceeds the limit of {MAX_ARRAY}")
        if itype in _SCALARS:   # one bounded read, not a Python loop
            fmt = f"<{count}{_SCALARS[itype]}"
            return list(struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt))))
        if count * 8 > self.size - self.pos:   # every string or array item takes >= 8 bytes
            raise self.fail(f"an array claims {count} items, more than the file can hold")
        if itype == 8:
            return self.strings(count)
        return [self.value(itype, depth + 1) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """``count`` strings, as ``string()`` reads them, in one tight loop: a vocabulary's
        ~100k tokens and merges were most of an open's header time. On a bad item, ``string()``
        reads it again to raise its own error."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        add = out.append
        for _ in range(count):
            if pos + 8 > size:
                break
            n = unpack(buf, pos)[0]
            if n > MAX_STRING or pos + 8 + n > size:
                break
            try:
                add(buf[pos + 8:pos + 8 + n].decode("utf-8"))
            except UnicodeDecodeError:
                break
            pos += 8 + n
        else:
            self.pos = pos
            return out
        self.pos = pos
        self.string()
        raise self.fail("a string array item could not be read")   # string() raised already

    def header(self) -> GGUFHeader:
        if self.buf[:4] != b"GGUF":
            raise ModelLoadError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self.scalar("I")
        if version & 0xFFFF == 0:
            raise ModelLoadError(f"{self.path} is a big-endian GGUF file; only little-endian ones are supported")
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path} is GGUF version {version}; versions 2 and 3 are supported")
        n_tensors, n_kv = self.scalar("Q"), self.scalar("Q")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise self.fail(f"{n_tensors} tensors / {n_kv} metadata keys exceed the limits "
                            f"({MAX_TENSORS} / {MAX_KV})")
        metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self.string(MAX_KEY)
            if key in metadata:
                raise self.fail(f"metadata key {key!r} appears twice")
            metadata[key] = self.value(self.scalar("I"))
        infos = [self.tensor_info() for _ in range(n_tensors)]
        align = metadata.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1) or align > 1 << 20:
            raise self.fail(f"general.alignment {align!r} is not a power of two")
        base = -(-self.pos // align) * align
        tensors, names = [], set()
        for name, dims, type_id, rel in infos:
            if name in names:
                raise self.fail(f"tensor {name!r} appears twice")
            names.add(name)
            tensors.append(self.place(name, dims, type_id, rel, base, align))
        return GGUFHeader(self.path, self.size, metadata, tuple(tensors))

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string(MAX_KEY)
        n_dims = self.scalar("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = tuple(self.scalar("Q") for _ in range(n_dims))
        return name, dims, self.scalar("I"), self.scalar("Q")

    def place(self, name: str, dims: tuple[int, ...], type_id: int, rel: int, base: int,
              align: int) -> TensorInfo:
        type_name, block, type_size = _type_traits(type_id)
        n = 1
        for d in dims:
            if not 1 <= d <= 1 << 40:
                raise self.fail(f"tensor {name!r} has dimension {d}")
            n *= d
        if n > 1 << 40 or dims[0] % block:
            raise self.fail(f"tensor {name!r} of type {type_name} has an impossible shape {list(dims)}")
        n_bytes = n // block * type_size
        if rel % align or base + rel + n_bytes > self.size:
            raise ModelLoadError(f"{self.path}: tensor {name!r} lies at bytes {base + rel}..{base + rel + n_bytes}"
                                 f", past the end of the file ({self.size} bytes) or misaligned; the GGUF "
                                 "file is truncated or corrupt: download it again")
        return TensorInfo(name, type_id, type_name, dims, base + rel, n_bytes)


def _type_traits(type_id: int) -> tuple[str, int, int]:
    if type_id in SUPPORTED_TYPES:
        return SUPPORTED_TYPES[type_id]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType   # every type ggml knows
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        return f"unknown type {type_id}", 1, 1   # refused by the weight loader, by name
    block, size = GGML_QUANT_SIZES[qtype]
    return qtype.name, block, size
