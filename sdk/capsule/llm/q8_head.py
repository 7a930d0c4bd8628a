"""The logits' matmul of a model with int4 layers: its GGUF Q8_0 matrix kept as Q8_0, else fp16.

With int4 layers the head (the tied embeddings: 49,152 x 576 for SmolLM2) was a decode step's
largest read. A Q8_0 GGUF head stays int8 codes + fp32 scales and multiplies in C
(edge_kernels.q8_linear_cpu): ~1.1 bytes a weight, every weight its exact dequantized value, so
the logits are the dequantized model's up to summation order; fp16 (HalfHead) rounds each
weight to 11 bits. Other head types, or no compiled kernel, keep HalfHead.

Threading: Q8Head runs edge_kernels.paged_decode_cpu.kernel_threads() workers: torch's
intra-op threads (the Session's runtime.threads) on torch's own OpenMP team where the kernels
found it (Linux), else 1. A row's logits do not depend on the batch or the thread count.
Capsules bind the head's kind (assembly.py): a Q8_0 head's capsule is not continued under an
fp16 head (a build without the kernel), nor the reverse.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from edge_kernels.paged_decode_cpu import kernel_threads
from edge_kernels.q8_linear_cpu import check_weights, missing, q8_0_blocks, q8_linear

from .int4_linear import HalfHead

Q8_0 = 8        # GGML type id


class Head(Protocol):
    """(..., D) hidden states -> (..., V) logits in the hidden states' dtype; `kind` names how
    the weights are held ("q8_0", "fp16"), what a capsule binds."""

    kind: str

    def __call__(self, h: torch.Tensor) -> torch.Tensor: ...


class Q8Head:
    """Logits over Q8_0 weights: codes (V, D) int8, scales (V, D/32) fp32 (q8_linear_cpu's
    layout, checked). Hot path: the logits are the one allocation."""

    kind = "q8_0"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        check_weights(codes, scales)
        self.codes, self.scales = codes, scales

    @classmethod
    def from_gguf(cls, raw: np.ndarray) -> "Q8Head":
        """From the GGUF tensor's bytes (V, D/32 * 34)."""
        codes, scales = q8_0_blocks(raw)
        return cls(torch.from_numpy(codes), torch.from_numpy(scales))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return q8_linear(h.float(), self.codes, self.scales, kernel_threads()).to(h.dtype)


def logits_head(weight: torch.Tensor, raw: np.ndarray | None, type_id: int | None) -> Head:
    """Q8Head when the GGUF's head tensor (bytes `raw`, GGML type `type_id`) is Q8_0 and the
    kernel is built, else HalfHead of the dequantized `weight` (V, D)."""
    if type_id == Q8_0 and raw is not None and weight.device.type == "cpu" and missing() is None:
        head = Q8Head.from_gguf(raw)
        if head.codes.shape == weight.shape:
            return head
    return HalfHead(weight)
