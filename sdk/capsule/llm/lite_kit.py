"""Write a restore kit: what a process without torch needs to continue this setup's capsules.

``write_kit`` (``Session.write_lite_kit``) describes the Session's setup to
``capsule.lite``: the capsule binding, the KV pool's layout, the onnxruntime engine's decode
step graphs (one per block-table width a step can run at, for the one-row shape and the
smallest batch bucket) and its LM head graphs, and where each weight those graphs take lives;
or, for a model decoding in the one-call C step (format /2, ``lite_kit_c.py``: all int4, or dense
fp32 under runtime.decode_step "fused"), the C step's tensors and shape.
A weight that is bit for bit a tensor of a safetensors file the model was mapped from
(``ModelInfo.weight_files``: a builtin's, a folder's, a GGUF's dequantized cache) is referenced
by that file's path, size, mtime and header digest; any other (the RoPE tables) is copied into
the kit. One kit serves every capsule of the setup; write it again after a change of model,
tokenizer, runtime settings or SDK version (the lite restore refuses capsules of another setup
with CapsuleMismatch).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import LiteUnsupported, ModelLoadError
from ..lite.kit import DTYPES as KIT_DTYPES
from ..lite.kit import FORMAT, FORMAT_2, file_identity
from ..lite.kitfile import pack
from ..paths import write_private
from ..safetensors_header import header_bytes, parse_header
from .kv_pool import SCRATCH_BLOCK
from .lite_kit_c import c_kit_parts
from .onnx_step import StepShape, build_head, build_step
from .step_io import table_bucket

if TYPE_CHECKING:
    from ..state.checkpointer import Checkpointer
    from ..tokenize.reference import ReferenceTokenizer
    from .engine import Engine
    from .loader import ModelInfo

log = logging.getLogger("capsule")
# a kit tensor's safetensors dtype name, by torch dtype
DTYPES = {getattr(torch, name): st for st, name in KIT_DTYPES.items()}


def write_kit(out: Path, engine: "Engine", tok: "ReferenceTokenizer", info: "ModelInfo | None",
              ckpt: "Checkpointer") -> Path:
    """Write a Session's restore kit to ``out`` (its LLM engine, tokenizer, model info and
    checkpointer), atomically, mode 0600; returns ``out``. LiteUnsupported unless the LLM runs
    the one-call C step or the onnxruntime engine, on CPU."""
    t0 = time.perf_counter()
    runner, pool = engine.runner, engine.pool
    model = runner.model
    NB, L, two, bs, KV, hd = pool.tensor.shape
    widths = [table_bucket(n) for n in range(1, runner.max_blocks + 1)]
    blobs: dict[str, bytes | memoryview] = {}
    weights: dict[str, torch.Tensor] = {}
    extra: dict[str, object] = {"format": FORMAT, "onnxruntime": ""}
    if pool.tensor.device.type == "cpu" and runner.engine_name == "torch" \
            and (model.linears_kind == "int4" or model.fused_step is not None):
        weights, extra["model"], extra["engine"] = c_kit_parts(runner)       # the C step: no graphs
        extra["format"] = FORMAT_2
    elif runner.engine_name != "onnxruntime" or pool.tensor.device.type != "cpu":
        raise LiteUnsupported(f"a restore kit runs the one-call C decode step or the onnxruntime LLM engine's "
                              f"graphs, on CPU; this Session runs '{runner.engine_name}' on {pool.tensor.device} "
                              f"with decode_step {model.decode_step!r}: open it with device='cpu' and the default "
                              "runtime (an fp32 model, or runtime={'linears': 'int4'}), or "
                              "runtime={'llm_engines': ['onnxruntime']}")
    else:
        extra["onnxruntime"] = runner.step.ort_version
        for rows in sorted({1, runner.buckets[0]}):
            for nb in sorted(set(widths)):
                blob, w = build_step(model, StepShape(rows, 1, nb, NB, bs))
                blobs[f"step/{rows}/{nb}"] = blob
                weights.update(w)
            blob, w = build_head(model, rows)
            blobs[f"head/{rows}"] = blob
            weights.update(w)
    max_id = min(model.cfg.vocab_size - 1, tok.max_id)
    gaps, blobs["vocab/pieces"] = _pieces(tok, max_id)
    files, sources = _match_files(weights, [Path(f) for f in (info.weight_files if info else ())])
    for name, t in weights.items():
        if name not in sources:
            blobs[f"weight/{name}"] = memoryview(t.contiguous().numpy()).cast("B")
    meta = {
        **extra, "binding": ckpt.binding.to_dict(),
        "max_context": runner.max_context, "max_blocks": runner.max_blocks,
        "max_page_bytes": ckpt.snap.max_page_bytes(), "max_manifest_bytes": ckpt.limits.max_manifest_bytes,
        "pool": [NB, L, two, bs, KV, hd], "scratch_block": SCRATCH_BLOCK,
        "decode_rows": runner.buckets[0], "table_buckets": widths,
        "vocab": {"name": tok.name, "fingerprint": tok.fingerprint, "size": model.cfg.vocab_size,
                  "max_id": max_id, "gaps": gaps},
        "hidden_size": model.cfg.hidden_size, "eos_ids": list(tok.eos_ids),
        "threads": runner.step.threads if runner.engine_name == "onnxruntime" else torch.get_num_threads(),
        "files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns, "header_xxh3": f.header_xxh3}
                  for f in files],
        "weights": [{"name": n, "shape": list(t.shape), "dtype": DTYPES[t.dtype], "file": sources.get(n, (-1, ""))[0],
                     "tensor": sources.get(n, (-1, ""))[1]} for n, t in weights.items()],
    }
    write_private(out, b"".join(pack(meta, blobs)))
    log.info("restore kit %s (%s): %d graphs, %d of %d weights mapped from %d file(s), %.2f s", out,
             extra.get("engine", "onnxruntime"),
             sum(k.startswith(("step/", "head/")) for k in blobs), len(sources), len(weights), len(files),
             time.perf_counter() - t0)
    return out


def _pieces(tok: "ReferenceTokenizer", max_id: int) -> tuple[list[int], bytes]:
    """(the ids up to max_id the tokenizer cannot decode, cl100k's holes: the Session's sampler
    never picks them, ``sampler.sample_decodable``, so neither may the lite one; every id's bytes
    as u32 LE offsets (max_id + 2 of them) then the bytes, holes empty: what lite's replies are
    decoded with)."""
    gaps, parts = [], []
    for i in range(max_id + 1):
        try:
            parts.append(tok.decode_bytes([i]))
        except ValueError:
            gaps.append(i)
            parts.append(b"")
    offsets = np.cumsum([0] + [len(p) for p in parts], dtype=np.int64)
    if offsets[-1] >= 1 << 32:
        raise LiteUnsupported(f"the tokenizer's {max_id + 1} pieces take {offsets[-1]} bytes; a kit holds under 4 GiB")
    return gaps, offsets.astype("<u4").tobytes() + b"".join(parts)


def _match_files(weights: dict[str, torch.Tensor], candidates: list[Path]) -> tuple[list, dict[str, tuple[int, str]]]:
    """(the files used, weight name -> (file index, tensor name)) for every weight that is bit for
    bit a tensor of its dtype in a candidate file: the same name first, else one of its shape
    (a tied head is the embeddings; an int4 cache entry names its tensors its own way)."""
    used, sources = [], {}
    for path in candidates:
        try:
            head, size = header_bytes(path)
            entries = parse_header(head, size, path)
            mapped = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError, ModelLoadError) as exc:
            log.info("restore kit: weights file %s not used (%s)", path, exc)
            continue
        identity = file_identity(path)
        found = False
        for name, t in weights.items():
            if name in sources:
                continue
            want = t.detach().contiguous().numpy().reshape(-1).view(np.uint8)
            names = [name] + [n for n, e in entries.items() if n != name and e.shape == tuple(t.shape)]
            for n in names:
                e = entries.get(n)
                if e is None or e.dtype != DTYPES[t.dtype] or e.shape != tuple(t.shape):
                    continue
                if np.array_equal(mapped[e.start:e.end], want):
                    sources[name] = (len(used), n)
                    found = True
                    break
        if found:
            used.append(identity)
    return used, sources
