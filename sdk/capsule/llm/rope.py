"""Rotary position embeddings, rotate-half convention (Llama / Qwen2), with Llama-3 scaling."""
from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies, fp32, shape (head_dim // 2,)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "default":
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_tables(rope: RopeConfig, head_dim: int, n_positions: int,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, fp32, each (n_positions, head_dim), for positions 0..n_positions-1."""
    inv_freq = inv_frequencies(rope, head_dim).to(device)
    positions = torch.arange(n_positions, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)          # (P, hd/2), angles in fp32
    emb = torch.cat((freqs, freqs), dim=-1)           # (P, hd)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (N, heads, hd) by per-token cos/sin (N, hd), in x's dtype (as transformers does)."""
    cos = cos.to(x.dtype).unsqueeze(1)                # (N, 1, hd)
    sin = sin.to(x.dtype).unsqueeze(1)
    return x * cos + rotate_half(x) * sin
