"""Builtin presets: seeded random weights (UNTRAINED; they produce gibberish text).

They exist so the runtime, capsules and benchmarks can run anywhere without downloading
weights. A preset is materialized once per (preset, vocabulary size, seed) into the cache
folder as safetensors and memory-mapped on every later open, so opening stays fast.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import ModelLoadError
from ..paths import cache_dir
from .config import ModelConfig
from .layer_weights import expected_shapes

PRESETS: dict[str, dict] = {
    # a step in a few ms on 2 CPU cores: for tests
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16),
    # the shape of the llama.cpp peer in DESIGN.md (d=384, 6 layers, 2 KV heads): for benchmarks
    "small": dict(hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6, num_kv_heads=2,
                  head_dim=64),
}
DEFAULT_SEED = 0


def preset_config(name: str, vocab_size: int) -> ModelConfig:
    if name not in PRESETS:
        raise ModelLoadError(f"unknown builtin preset {name!r}; available: "
                             f"{', '.join('builtin:' + p for p in PRESETS)}")
    return ModelConfig(vocab_size=vocab_size, tie_embeddings=True, max_position=32768,
                       rms_norm_eps=1e-6, architecture="llama", **PRESETS[name])




def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights: norms at 1, matrices N(0, 0.02), names in sorted order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(expected_shapes(cfg).items()):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * 0.02
    return out


def materialize(name: str, vocab_size: int, seed: int = DEFAULT_SEED) -> Path:
    """Path of the preset's safetensors file, writing it atomically on first use."""
    cfg = preset_config(name, vocab_size)
    folder = cache_dir() / "builtin"
    path = folder / f"{name}-v{vocab_size}-s{seed}.safetensors"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    weights = random_weights(cfg, seed)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    os.close(fd)
    try:
        save_file(weights, tmp, metadata={"preset": name, "seed": str(seed), "untrained": "true"})
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)  # concurrent writers produce identical bytes; last rename wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
