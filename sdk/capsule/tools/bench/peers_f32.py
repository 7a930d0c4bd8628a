"""The F32 GGUF that llama.cpp runs in the peers suite: every tensor of a quantized GGUF dequantized
by ``gguf.quants.dequantize`` — the function capsule's loader dequantizes with
(``llm.gguf_weights.dequantize_tensor``), so both sides multiply the same fp32 numbers.

Tensors stay in the file's own layout (llama.cpp's permuted q/k rows: it un-permutes nothing);
every metadata field is copied, ``general.file_type`` becomes (or is added as) ALL_F32. Written to ``*.part`` and
renamed, so a killed run leaves no half file under the final name.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_f32_copy(src: Path, dst: Path) -> Path:
    """dst, written from src unless it exists already (it is only ever renamed into place whole)."""
    if dst.is_file():
        return dst
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize
    reader = GGUFReader(src)
    part = dst.with_name(dst.name + ".part")
    writer = GGUFWriter(part, reader.fields["general.architecture"].contents())
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue   # the writer adds these itself
        value = LlamaFileType.ALL_F32 if f.name == "general.file_type" else f.contents()
        writer.add_key_value(f.name, value, f.types[0],
                             sub_type=f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    if "general.file_type" not in reader.fields:
        writer.add_file_type(LlamaFileType.ALL_F32)
    for t in reader.tensors:
        arr = dequantize(t.data, GGMLQuantizationType(t.tensor_type)).astype(np.float32, copy=False)
        writer.add_tensor(t.name, np.ascontiguousarray(arr), raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    part.replace(dst)
    return dst
