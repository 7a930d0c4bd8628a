"""A decoder layer's four projections behind one seam: dense weights, or kept-quantized ones.

`Decoder.forward` calls `qkv`, `o` and `mlp` and never sees how the weights are held: dense
(float tensors, one `F.linear` each: the default, parity-exact with transformers) or int4
(int4_linear.py: a GGUF's 4-bit codes, q/k/v and gate/up fused into one matmul each).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerLinears(Protocol):
    """What a layer's attention and MLP multiply by. Hot path: no host sync, no allocation
    besides the outputs."""

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (B, T, D) -> q (B, T, H*hd), k and v (B, T, KV*hd), biases added."""
        ...

    def o(self, a: torch.Tensor) -> torch.Tensor:
        """Attention output (B, T, H*hd) -> (B, T, D)."""
        ...

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(h)) * up(h)): (B, T, D) -> (B, T, D)."""
        ...


class DenseLinears:
    """Float weights (out, in) as the checkpoint names them; one F.linear per projection."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 q_bias: torch.Tensor | None = None, k_bias: torch.Tensor | None = None,
                 v_bias: torch.Tensor | None = None, o_bias: torch.Tensor | None = None):
        self.q, self.k, self.v, self.o_w, self.gate, self.up, self.down = q, k, v, o, gate, up, down
        self.q_bias, self.k_bias, self.v_bias, self.o_bias = q_bias, k_bias, v_bias, o_bias

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (F.linear(h, self.q, self.q_bias), F.linear(h, self.k, self.k_bias),
                F.linear(h, self.v, self.v_bias))

    def o(self, a: torch.Tensor) -> torch.Tensor:
        return F.linear(a, self.o_w, self.o_bias)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(h, self.gate)) * F.linear(h, self.up), self.down)
