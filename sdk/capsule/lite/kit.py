"""What a restore kit describes, read back and checked (torch-free).

A kit is written by a Session that runs the onnxruntime LLM engine or the one-call C decode step
(``Session.write_lite_kit``) and is valid for every capsule of that setup: the capsule binding it
was written under, the KV pool's layout, the decode step's ONNX graphs (one per block-table
width) and the LM head's, or the C step's model shape, and where each weight they take comes
from: a tensor of a safetensors file the model's
weights are mapped from (checked bit for bit when the kit was written, and by size, mtime and
header when it is read), or the kit itself (the RoPE tables; a model with no weights file).
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..errors import CapsuleCorrupt, CapsuleMismatch, ModelLoadError
from ..safetensors_header import header_bytes, parse_header
from ..state import fields
from ..state.binding import Binding
from .kitfile import KitFile

FORMAT = "capsule.lite-kit/1"      # onnxruntime graphs
FORMAT_2 = "capsule.lite-kit/2"    # "engine" named: the C step of an all-int4 or a dense fp32 model
C_ENGINES = ("int4-c", "f32-c")
ENGINES = {FORMAT: ("onnxruntime",), FORMAT_2: C_ENGINES}
DTYPES = {"F32": "float32", "U8": "uint8", "I8": "int8"}   # a weight's dtype: safetensors' name -> numpy's
MAX_POOL_BYTES = 1 << 36          # 64 GiB: more than any edge device's pool
MAX_DIM = 1 << 31
MAX_WEIGHTS = 1 << 16


@dataclass(frozen=True)
class WeightSource:
    """Where one weight comes from: ``file`` (an index into Kit.files) and ``tensor`` (its name
    there), or file -1: the kit's blob ``weight/<name>``; ``dtype`` one of DTYPES (F32 in a /1 kit)."""
    name: str
    shape: tuple[int, ...]
    file: int
    tensor: str
    dtype: str = "F32"


@dataclass(frozen=True)
class ModelShape:
    """A C-step kit's model (its "model" entry, checked)."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float
    qkv_bias: bool
    o_bias: bool


@dataclass(frozen=True)
class WeightFile:
    path: str
    size: int
    mtime_ns: int
    header_xxh3: int


@dataclass(frozen=True)
class Kit:
    """A kit's description, every field checked (``Kit.read``)."""
    file: KitFile
    binding: Binding
    max_context: int
    max_blocks: int
    max_page_bytes: int
    max_manifest_bytes: int
    pool: tuple[int, int, int, int, int, int]      # (NB, L, 2, bs, KV, hd)
    scratch_block: int
    decode_rows: int                 # the runner's smallest batch bucket: a lone stream's decode
    table_buckets: tuple[int, ...]   # [nb - 1]: the block-table width a step over nb blocks runs at
    vocab_name: str
    vocab_fingerprint: str
    max_id: int                      # the largest id the Session can emit (model and tokenizer)
    gaps: tuple[int, ...]            # ids below it the tokenizer cannot decode: never picked
    vocab_size: int
    hidden_size: int
    eos_ids: tuple[int, ...]
    threads: int
    onnxruntime: str                 # the version that wrote it (another may round differently)
    weights: tuple[WeightSource, ...]
    files: tuple[WeightFile, ...]
    engine: str = "onnxruntime"      # what runs the steps: ENGINES
    model: ModelShape | None = None  # a C-step kit's (C_ENGINES)

    @classmethod
    def read(cls, path: Path) -> "Kit":
        kit = KitFile.open(path)
        m = kit.meta
        try:
            if m.get("format") not in ENGINES:
                raise fields.FieldError("format", f"is {str(m.get('format'))[:40]!r}, not one of {sorted(ENGINES)} "
                                        "(another SDK version wrote it); write it again")
            engine = m.get("engine", "onnxruntime")
            if engine not in ENGINES[m["format"]]:
                raise fields.FieldError("engine", f"{str(engine)[:40]!r} is not one of {ENGINES[m['format']]}")
            model = _model_shape(m.get("model")) if engine in C_ENGINES else None
            pool = tuple(fields.integer(v, f"pool[{i}]", 1, MAX_DIM)
                         for i, v in enumerate(fields.seq(m.get("pool"), "pool", 6)))
            if len(pool) != 6 or pool[2] != 2:
                raise fields.FieldError("pool", f"{list(pool)} is not (blocks, layers, 2, block size, "
                                        "kv heads, head dim)")
            if int(np.prod(pool, dtype=np.int64)) * 4 > MAX_POOL_BYTES:
                raise fields.FieldError("pool", f"{list(pool)} is over {MAX_POOL_BYTES} bytes")
            max_blocks = fields.integer(m.get("max_blocks"), "max_blocks", 1, pool[0])
            buckets = tuple(fields.integer(v, f"table_buckets[{i}]", i + 1, max_blocks) for i, v in
                            enumerate(fields.seq(m.get("table_buckets"), "table_buckets", max_blocks)))
            if len(buckets) != max_blocks:
                raise fields.FieldError("table_buckets", f"holds {len(buckets)} widths, not {max_blocks}")
            vocab = fields.obj(m.get("vocab"), "vocab")
            vocab_size = fields.integer(vocab.get("size"), "vocab.size", 1, MAX_DIM)
            files = tuple(_weight_file(f, i) for i, f in enumerate(fields.seq(m.get("files"), "files", 64)))
            weights = tuple(_weight(w, i, len(files)) for i, w in
                            enumerate(fields.seq(m.get("weights"), "weights", MAX_WEIGHTS)))
            return cls(
                kit, Binding.from_dict(m.get("binding")),
                max_context=fields.integer(m.get("max_context"), "max_context", 1, MAX_DIM),
                max_blocks=max_blocks,
                max_page_bytes=fields.integer(m.get("max_page_bytes"), "max_page_bytes", 1, 1 << 30),
                max_manifest_bytes=fields.integer(m.get("max_manifest_bytes"), "max_manifest_bytes", 1, 1 << 30),
                pool=pool,                                                    # type: ignore[arg-type]
                scratch_block=fields.integer(m.get("scratch_block"), "scratch_block", 0, pool[0] - 1),
                decode_rows=fields.integer(m.get("decode_rows"), "decode_rows", 1, 4096),
                table_buckets=buckets,
                vocab_name=fields.text(vocab.get("name"), "vocab.name", 256),
                vocab_fingerprint=fields.text(vocab.get("fingerprint"), "vocab.fingerprint", 256),
                max_id=fields.integer(vocab.get("max_id"), "vocab.max_id", 0, vocab_size - 1),
                gaps=tuple(fields.integer(v, "vocab.gaps[]", 0, vocab_size - 1)
                           for v in fields.seq(vocab.get("gaps"), "vocab.gaps", vocab_size)),
                vocab_size=vocab_size,
                hidden_size=fields.integer(m.get("hidden_size"), "hidden_size", 1, MAX_DIM),
                eos_ids=tuple(fields.integer(v, "eos_ids[]", 0, vocab_size - 1)
                              for v in fields.seq(m.get("eos_ids"), "eos_ids", 64)),
                threads=fields.integer(m.get("threads"), "threads", 1, 1024),
                onnxruntime=fields.text(m.get("onnxruntime"), "onnxruntime", 64),
                weights=weights, files=files, engine=engine, model=model)
        except fields.FieldError as exc:
            raise CapsuleCorrupt(f"restore kit {path}: {exc}; write it again (Session.write_lite_kit)") from None

    def pieces(self) -> "Pieces":
        """Each id's bytes, as the Session's tokenizer decodes it (the kit's ``vocab/pieces``)."""
        return Pieces(self.file.blob("vocab/pieces"), self.max_id, self.file.path)

    def map_weights(self) -> dict[str, np.ndarray]:
        """Every weight, of its dtype, by name: views of the mapped weight files (their identity
        checked first) or of the kit. CapsuleMismatch when a weights file changed."""
        maps = [_map_checked(f) for f in self.files]
        out: dict[str, np.ndarray] = {}
        for w in self.weights:
            if w.file < 0:
                raw = self.file.blob(f"weight/{w.name}")
            else:
                mapped, entries = maps[w.file]
                e = entries.get(w.tensor)
                if e is None or e.dtype != w.dtype or e.shape != w.shape:
                    raise CapsuleMismatch(f"weights file {self.files[w.file].path}: no {w.dtype} tensor "
                                          f"{w.tensor!r} of shape {list(w.shape)}; write the kit again")
                raw = memoryview(mapped)[e.start:e.end]
            arr = np.frombuffer(raw, dtype=np.dtype(DTYPES[w.dtype]).newbyteorder("<"))
            if arr.size != int(np.prod(w.shape, dtype=np.int64)):
                raise CapsuleCorrupt(f"restore kit {self.file.path}: weight {w.name!r} holds {arr.size} "
                                     f"values, its shape {list(w.shape)} needs another number")
            out[w.name] = arr.reshape(w.shape)
        return out


class Pieces:
    """ids -> bytes through a kit's piece table: u32 LE offsets (max_id + 2), then the bytes."""

    def __init__(self, blob: memoryview, max_id: int, where: Path):
        n = max_id + 2
        offsets = np.frombuffer(blob[:4 * n], dtype="<u4") if len(blob) >= 4 * n else np.zeros(0, "<u4")
        data = blob[4 * n:]
        if len(offsets) != n or offsets[0] != 0 or offsets[-1] != len(data) or np.any(np.diff(offsets.astype(np.int64)) < 0):
            raise CapsuleCorrupt(f"restore kit {where}: its piece table does not hold {max_id + 1} ids' bytes; "
                                 "write it again (Session.write_lite_kit)")
        self._offsets, self._data = offsets.tolist(), bytes(data)

    def __call__(self, ids: list[int]) -> bytes:
        o, d = self._offsets, self._data
        return b"".join(d[o[i]:o[i + 1]] for i in ids)


def _weight_file(value: object, i: int) -> WeightFile:
    f = fields.obj(value, f"files[{i}]")
    return WeightFile(fields.text(f.get("path"), f"files[{i}].path", 4096),
                      fields.integer(f.get("size"), f"files[{i}].size", 0, 1 << 50),
                      fields.integer(f.get("mtime_ns"), f"files[{i}].mtime_ns", 0, 1 << 63),
                      fields.integer(f.get("header_xxh3"), f"files[{i}].header_xxh3", 0, (1 << 64) - 1))


def _weight(value: object, i: int, n_files: int) -> WeightSource:
    w = fields.obj(value, f"weights[{i}]")
    shape = tuple(fields.integer(d, f"weights[{i}].shape[]", 0, MAX_DIM)
                  for d in fields.seq(w.get("shape"), f"weights[{i}].shape", 8))
    dtype = w.get("dtype", "F32")
    if dtype not in DTYPES:
        raise fields.FieldError(f"weights[{i}].dtype", f"{str(dtype)[:16]!r} is not one of {sorted(DTYPES)}")
    return WeightSource(fields.text(w.get("name"), f"weights[{i}].name", 512), shape,
                        fields.integer(w.get("file"), f"weights[{i}].file", -1, n_files - 1),
                        fields.text(w.get("tensor"), f"weights[{i}].tensor", 512), dtype)


def _model_shape(value: object) -> ModelShape:
    m = fields.obj(value, "model")
    ints = {k: fields.integer(m.get(k), f"model.{k}", 1, MAX_DIM)
            for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim")}
    floats = {}
    for k in ("eps", "scale"):
        v = m.get(k)
        if type(v) not in (int, float) or not 0 < v < 1e6:
            raise fields.FieldError(f"model.{k}", f"{str(v)[:24]!r} is not a positive number")
        floats[k] = float(v)
    flags = {}
    for k in ("qkv_bias", "o_bias"):
        if type(m.get(k)) is not bool:
            raise fields.FieldError(f"model.{k}", "is not true or false")
        flags[k] = m[k]
    if ints["heads"] % ints["kv_heads"] or ints["layers"] > 4096:
        raise fields.FieldError("model", f"heads {ints['heads']} / kv heads {ints['kv_heads']} / layers "
                                f"{ints['layers']} do not describe a decoder")
    return ModelShape(**ints, **floats, **flags)


def kit_path(store: str | os.PathLike) -> Path:
    """Where a store's restore kit lives by default: beside the store folder, ``<store>.kit``."""
    p = Path(store)
    return p.with_name(p.name + ".kit")


def file_identity(path: Path) -> WeightFile:
    """What a kit records of a weights file: its size, mtime and header's digest."""
    head, size = header_bytes(path)
    return WeightFile(str(path), size, os.stat(path).st_mtime_ns, xxhash.xxh3_64_intdigest(head))


def _map_checked(f: WeightFile) -> tuple[mmap.mmap, dict]:
    path = Path(f.path)
    try:
        now = file_identity(path)
    except (OSError, ModelLoadError) as exc:
        raise CapsuleMismatch(f"the restore kit's weights file cannot be read ({exc}); open the Session "
                              "(it rebuilds its cache) and write the kit again") from None
    if now != f:
        raise CapsuleMismatch(f"the restore kit's weights file {path} changed since the kit was written "
                              f"(size, mtime or header); open the Session and write the kit again")
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return mapped, parse_header(memoryview(mapped), len(mapped), path)
