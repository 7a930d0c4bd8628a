"""`load_model`: a Hugging Face checkpoint folder, a .gguf file, a named model or `builtin:<preset>`."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch

from devices.profile import LINEARS

from ..errors import ModelLoadError
from ..paths import cache_dir
from . import gguf_file, gguf_weights
from .catalog import model_names, resolve_named
from .config import ModelConfig
from .gguf_file import MAX_TEMPLATE_BYTES, usable_template
from .gguf_tokenizer import tokenizer_folder
from .model import Decoder
from .presets import DEFAULT_SEED, materialize, preset_config
from .safetensors_mmap import read_safetensors

DEFAULT_BUILTIN_VOCAB = 100277  # cl100k_base, the default tokenizer of builtin models


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Where a model came from and what identifies its weights."""

    source: str
    weights_digest: str          # sha256: binds capsules to these exact weights
    tokenizer_path: str | None   # the folder's tokenizer.json, when it has one
    untrained: bool
    chat_template: str | None = None   # jinja2 source: tokenizer_config.json's or the GGUF's
    label: str = ""   # short human name for messages: "SmolLM2-135M-Instruct.Q4_1.gguf (llama, Q4_1)"
    linears: str = "dequantized"   # how the layers multiply: "dequantized", or "int4 (30 of 30 layers)"
    # the safetensors files the weights may be mapped from (a folder's, a builtin's, a GGUF's
    # dequantized cache): where a torch-free restore (capsule.lite) maps them from too
    weight_files: tuple[str, ...] = ()


def load_model(source: str | os.PathLike, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, vocab_size: int | None = None,
               seed: int = DEFAULT_SEED, own_tokenizer: bool = True,
               linears: str = "dequantized") -> tuple[Decoder, ModelInfo]:
    """Load a decoder. `source`: a checkpoint folder (config.json + *.safetensors), a .gguf file,
    a named model (catalog.model_names(), e.g. "smollm2-135m") or "builtin:<preset>".
    `vocab_size` and `seed` apply to builtin presets only. own_tokenizer: a GGUF's tokenizer is
    built from its metadata (ModelInfo.tokenizer_path); False skips that (a tokenizer is given).
    linears: "dequantized" (every weight in `dtype`) or "int4": a GGUF's Q4_0 / Q4_1 layers keep
    their 4-bit weights (int4_linear.py; CPU only, not parity-exact, deterministic).

    Raises ModelLoadError (missing files, unknown preset, bad tensors) or
    UnsupportedArchitecture (another architecture, sliding window, YaRN, a GGUF quant type, ...).
    """
    src = str(source)
    if linears not in LINEARS:
        raise ValueError(f"linears must be one of {LINEARS}, got {linears!r}")
    if linears == "int4" and torch.device(device).type != "cpu":
        raise ModelLoadError("runtime.linears='int4' runs on CPU only (torch's int4 weight-only kernel "
                             "for CUDA packs weights differently); use runtime.linears='dequantized' on GPU")
    header = None
    if src.startswith("builtin:"):
        name = src.split(":", 1)[1]
        vocab = DEFAULT_BUILTIN_VOCAB if vocab_size is None else int(vocab_size)
        cfg = preset_config(name, vocab)
        path = materialize(name, vocab, seed)
        weights = read_safetensors(path)
        digest = hashlib.sha256(f"builtin:{name}:v{vocab}:s{seed}:{cfg.fingerprint()}".encode()).hexdigest()
        info = ModelInfo(src, digest, None, untrained=True, label=src, weight_files=(str(path),))
    elif (path := resolve_named(src) or Path(src)).is_file():
        header = gguf_file.read_header(path)
        cfg, weights, info = _load_gguf(header, dtype, own_tokenizer)
        cache = gguf_weights.cache_path(info.weights_digest, dtype)
        info = dataclasses.replace(info, weight_files=(str(cache),) if cache.is_file() else ())
    else:
        folder = path
        cfg, files = _inspect_folder(folder)
        weights = {}
        for f in files:
            part = read_safetensors(f)
            twice = sorted(weights.keys() & part.keys())
            if twice:   # never let one file silently override another's tensors
                raise ModelLoadError(f"tensor {twice[0]!r} (and {len(twice) - 1} more) is in more than one "
                                     f"weight file of {folder} ({f.name} among them); keep one checkpoint "
                                     "per folder")
            weights.update(part)
        tok = folder / "tokenizer.json"
        info = ModelInfo(str(folder.resolve()), weights_digest(files),
                         str(tok) if tok.is_file() else None, untrained=False,
                         chat_template=folder_chat_template(folder), label=folder.name,
                         weight_files=tuple(str(f.resolve()) for f in files))
    weights = {n: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
               for n, t in weights.items()}
    decoder = Decoder(cfg, weights)
    if linears == "int4":
        if header is None:
            raise ModelLoadError(f"runtime.linears='int4' keeps a GGUF's Q4_0 / Q4_1 weights quantized; "
                                 f"{src} is no GGUF file (load a Q4_0 / Q4_1 GGUF, or use "
                                 "runtime.linears='dequantized')")
        from .int4_cache import entry_path, int4_model
        dense = [lw.dense() for lw in decoder.layers]
        head_weight = decoder.head_weight()
        layers, n, head = int4_model(cfg, dense, head_weight, info.weights_digest,
                                     lambda: gguf_weights.int4_linears(header, cfg, dense, head_weight))
        decoder.use_linears(layers, "int4", head=head)
        entry = entry_path(info.weights_digest)   # the packed tensors' file, for a restore kit
        files = info.weight_files + ((str(entry),) if entry.is_file() else ())
        info = dataclasses.replace(info, linears=f"int4 ({n} of {cfg.num_layers} layers)", weight_files=files)
    return decoder, info


def _load_gguf(header: gguf_file.GGUFHeader, dtype: torch.dtype, own_tokenizer: bool
               ) -> tuple[ModelConfig, dict[str, torch.Tensor], ModelInfo]:
    path = header.path
    cfg = gguf_file.gguf_config(header)
    digest = weights_digest([path])   # of the file as stored: another quantization is another model
    weights = gguf_weights.load_weights(header, cfg, digest, dtype)
    # a GGUF without tokenizer metadata (weights only) loads too: Session.open then needs tokenizer=
    tok = (tokenizer_folder(header.metadata, digest) / "tokenizer.json"
           if own_tokenizer and "tokenizer.ggml.model" in header.metadata else None)
    return cfg, weights, ModelInfo(str(path.resolve()), digest, None if tok is None else str(tok), untrained=False,
                                   chat_template=gguf_file.chat_template(header), label=gguf_file.label(header))


def _inspect_folder(folder: Path) -> tuple[ModelConfig, list[Path]]:
    if not folder.is_dir():
        raise ModelLoadError(f"model source {str(folder)!r} is neither a folder, a .gguf file, a named model "
                             f"({', '.join(model_names())}) nor 'builtin:<preset>' (give a Hugging Face "
                             "checkpoint folder with config.json and *.safetensors, or a GGUF file)")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; is it a Hugging Face checkpoint folder?")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_path} must hold a JSON object, not {type(raw).__name__}")
    cfg = ModelConfig.from_hf(raw)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is malformed: {exc}") from None
        bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s or s in ("", ".", "..")]
        if bad:   # the index is input: it must not reach files outside the folder
            raise ModelLoadError(f"{index} names weight files outside the folder: {bad[:3]}")
        files = [folder / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder} lacks weight files its index lists: {missing[:5]}")
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]   # as transformers: other .safetensors files are not weights
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no weights: no *.safetensors file (only safetensors "
                             "checkpoints are supported, not .bin)")
    return cfg, files


def folder_chat_template(folder: Path) -> str | None:
    """The chat template of a checkpoint folder: tokenizer_config.json's ``chat_template`` (a
    string, or the entry named "default" of a list), else a chat_template.jinja file; None when
    it has neither. An unreadable or oversized config only means no template."""
    jinja, config = folder / "chat_template.jinja", folder / "tokenizer_config.json"
    try:
        if config.stat().st_size > 4 * MAX_TEMPLATE_BYTES:
            raise ValueError("oversized")
        raw = json.loads(config.read_text("utf-8"))
        tpl = raw.get("chat_template") if isinstance(raw, dict) else None
    except (OSError, ValueError):
        tpl = None
    if isinstance(tpl, list):   # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if tpl is None and jinja.is_file() and jinja.stat().st_size <= MAX_TEMPLATE_BYTES:
        tpl = jinja.read_text("utf-8", errors="replace")
    return usable_template(tpl)


def weights_digest(files: list[Path]) -> str:
    """sha256 over the weight files, cached by (path, size, mtime, inode) so opens stay fast."""
    stats = [(str(f.resolve()), *(lambda s: (s.st_size, s.st_mtime_ns, s.st_ino))(f.stat())) for f in files]
    key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    memo = cache_dir() / "digests" / key
    if memo.is_file():
        cached = memo.read_text().strip()
        if len(cached) == 64:
            return cached
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        memo.write_text(digest)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return digest
