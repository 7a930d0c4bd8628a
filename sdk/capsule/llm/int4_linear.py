"""Weight-only int4 linears for a GGUF's Q4_0 / Q4_1 tensors: the 4-bit codes stay 4-bit.

A Q4_0 / Q4_1 block holds 32 weights of one row: w = d * q + m, q in 0..15 (Q4_0: m = -8 d).
A decode step then reads ~4.6 bits per weight instead of 32. Two kernels multiply by them:

- Q4KernelMatrix (where the package's C kernels are built: edge_kernels.q4_linear_cpu): the
  GGUF's own nibbles, each 32-block of activations rounded to int16 on its own scale, exact
  int32 dot products, fp32 scales: ~1e-5 of the dequantized weights' products.
- Int4Matrix (else): torch's `_weight_int4pack_mm_for_cpu` (what gpt-fast's int4 path runs),
  with w = (q - 8) * scale + zero per group of 32, so (scale, zero) = (d, m + 8 d). Its fast
  path is bfloat16 (its float32 path was ~30x slower here): activations, scales, zeros and
  outputs rounded to bf16, ~1e-2 of the products.

Neither is parity-exact with the dequantized float32 model (`capsule bench --suite decode`
reports the logit deviation), but each is deterministic: the same tokens give the same K/V and
logits, so a continuation after a restore is bit-exact. Capsules bind `runtime.linears` and the
activations' rounding (`activations`: "int16" / "bf16"), so one never continues under another.

A layer is kept quantized only when all seven of its projections can be (Q4_0 / Q4_1, outputs
a multiple of 16, the kernel's packing unit); other layers stay dense. q/k/v and gate/up are
fused into one matmul each (fewer operator calls per layer). The logits multiply by the GGUF's
Q8_0 output matrix kept as Q8_0 (q8_head.py), or else by an fp16 copy of it (HalfHead).
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from edge_kernels import q4_linear_cpu
from edge_kernels.decode_step_abi import matrix_shapes as abi_matrix_shapes
from edge_kernels.paged_decode_cpu import kernel_threads

from ..errors import ModelLoadError
from .config import ModelConfig
from .linears import DenseLinears, LayerLinears

GROUP = 32                      # weights per Q4 block, and the kernel's group size
Q4_TYPES = {2: "Q4_0", 3: "Q4_1"}
_BLOCK_BYTES = {2: 18, 3: 20}   # fp16 d [, fp16 m], 16 bytes of nibbles
_N_MULTIPLE = 16                # _convert_weight_to_int4pack_for_cpu packs outputs by 16
# HF suffixes (after model.layers.N.) of a layer's projections, in fused order
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
PROJECTIONS = QKV + ("self_attn.o_proj",) + GATE_UP + ("mlp.down_proj",)


def torch_kernel_missing() -> str | None:
    """Why this torch cannot run Int4Matrix, or None when it can."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") \
            or not hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        return f"torch {torch.__version__} has no CPU int4 weight-only matmul (_weight_int4pack_mm_for_cpu)"
    return None


def kernel_missing() -> str | None:
    """Why no int4 linears can run here (neither kernel), or None when one can."""
    torch_why = torch_kernel_missing()
    if torch_why is None or q4_linear_cpu.missing() is None:
        return None
    return f"{torch_why}, and {q4_linear_cpu.missing()}"


def q4_blocks(raw: np.ndarray, type_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 matrix's bytes (N, K/32 * block bytes) -> (codes (N, K) uint8 in 0..15,
    d (N, K/32) float32, m (N, K/32) float32) with weight[n, 32 g + j] = d[n, g] * codes[n, 32 g + j]
    + m[n, g]: element j of a block is the low nibble of byte j, element j + 16 its high nibble."""
    if type_id not in Q4_TYPES:
        raise ValueError(f"GGUF type {type_id} is not one of {sorted(Q4_TYPES.values())}")
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, _BLOCK_BYTES[type_id])       # (N, K/32, bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)        # (N, K/32)
    if type_id == 3:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:
        m = -8.0 * d
        qs = blocks[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)            # (N, K)
    return codes, d, m


class Int4Matrix:
    """y = x @ W^T for W (N, K) held as packed int4 codes with bf16 (scale, zero) per group:
    torch's kernel, bf16 activations."""

    activations = "bf16"
    TENSORS = ("packed", "sz")     # tensors(): what int4_cache keeps

    def __init__(self, codes: np.ndarray, d: np.ndarray, m: np.ndarray):
        n, k = codes.shape
        if n % _N_MULTIPLE or k % GROUP:
            raise ValueError(f"int4 matrix ({n}, {k}) needs N % {_N_MULTIPLE} == 0 and K % {GROUP} == 0")
        self.n_out, self.n_in = n, k
        self.packed = torch._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(codes.astype(np.int32)), 2)                               # (N, K/2) uint8
        zero = m + 8.0 * d                                                              # (q - 8) d + zero
        self.scales_zeros = torch.from_numpy(np.stack([d, zero], -1)).transpose(0, 1) \
            .contiguous().to(torch.bfloat16)                                            # (K/32, N, 2)

    @classmethod
    def from_tensors(cls, t: Mapping[str, torch.Tensor]) -> "Int4Matrix | None":
        """A matrix from what an earlier one's tensors() held (int4_cache), None where they are
        not as __init__ makes them: packed (N, K/2) uint8, sz (K/32, N, 2) bf16, N % 16 == 0."""
        packed, sz = t["packed"], t["sz"]
        if packed.dtype != torch.uint8 or sz.dtype != torch.bfloat16 or packed.dim() != 2 \
                or sz.dim() != 3 or sz.shape[2] != 2:
            return None
        n, k = sz.shape[1], sz.shape[0] * GROUP
        if tuple(packed.shape) != (n, k // 2) or n % _N_MULTIPLE:
            return None
        self = cls.__new__(cls)
        self.n_in, self.n_out = k, n
        self.packed, self.scales_zeros = packed, sz
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "sz": self.scales_zeros}

    @classmethod
    def fused(cls, parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> "Int4Matrix":
        """One matrix whose outputs are the parts' outputs, in order (q|k|v, gate|up)."""
        return cls(*(np.concatenate([p[i] for p in parts]) for i in range(3)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (..., K) -> (..., N); bf16 in and out (see the module docstring), back to x's dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.n_in).to(torch.bfloat16), self.packed, GROUP, self.scales_zeros)
        return y.to(x.dtype).view(*x.shape[:-1], self.n_out)


class Q4KernelMatrix:
    """y = x @ W^T for W (N, K) held as the GGUF's Q4 nibbles with fp32 (d, m) per block: the
    package's C kernel (edge_kernels.q4_linear_cpu), int16 activations, fp32 in and out.
    Threading: kernel_threads() workers per call (torch's intra-op count on its OpenMP team)."""

    activations = "int16"
    TENSORS = ("nib", "d", "mt")

    def __init__(self, codes: np.ndarray, d: np.ndarray, m: np.ndarray):
        self.matrix = q4_linear_cpu.Q4Matrix(*(torch.from_numpy(a) for a in q4_linear_cpu.pack(codes, d, m)))
        self.n_out, self.n_in = self.matrix.n_out, self.matrix.n_in

    @classmethod
    def fused(cls, parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> "Q4KernelMatrix":
        """One matrix whose outputs are the parts' outputs, in order (q|k|v, gate|up)."""
        return cls(*(np.concatenate([p[i] for p in parts]) for i in range(3)))

    @classmethod
    def from_tensors(cls, t: Mapping[str, torch.Tensor]) -> "Q4KernelMatrix | None":
        """A matrix from what an earlier one's tensors() held (int4_cache), None where they are
        not the kernel's layout (q4_linear_cpu.check_weights)."""
        try:
            inner = q4_linear_cpu.Q4Matrix(t["nib"], t["d"], t["mt"])
        except ValueError:
            return None
        self = cls.__new__(cls)
        self.matrix, self.n_out, self.n_in = inner, inner.n_out, inner.n_in
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"nib": self.matrix.nib, "d": self.matrix.d, "mt": self.matrix.mt}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (..., K) -> (..., N) in fp32; another dtype goes through fp32
        if x.dtype != torch.float32:
            return self.matrix(x.float(), kernel_threads()).to(x.dtype)
        return self.matrix(x, kernel_threads())


class Matrix(Protocol):
    """An int4 matrix: Int4Matrix or Q4KernelMatrix."""

    activations: str        # how activations are rounded going in: a capsule binds it
    TENSORS: tuple[str, ...]
    n_in: int
    n_out: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def tensors(self) -> dict[str, torch.Tensor]: ...


def matrix_type() -> type:
    """The int4 matrix this install multiplies with: Q4KernelMatrix where the C kernels are built
    and have a SIMD path for this CPU (AVX2 or AVX-512), else torch's Int4Matrix; the C kernel's
    portable path (~10x slower) only where torch's kernel is missing too (kernel_missing() says
    when neither can run)."""
    if q4_linear_cpu.missing() is not None:
        return Int4Matrix
    if q4_linear_cpu.fastest_path() == "portable" and torch_kernel_missing() is None:
        return Int4Matrix
    return Q4KernelMatrix


class Int4Linears:
    """A layer's projections as int4 matrices: q|k|v and gate|up fused."""

    def __init__(self, qkv: Matrix, o: Matrix, gate_up: Matrix, down: Matrix,
                 qkv_widths: tuple[int, int, int], qkv_bias: torch.Tensor | None,
                 o_bias: torch.Tensor | None):
        self.qkv_m, self.o_m, self.gate_up, self.down = qkv, o, gate_up, down
        self.widths, self.qkv_bias, self.o_bias = list(qkv_widths), qkv_bias, o_bias
        self.inter = gate_up.n_out // 2

    @property
    def activations(self) -> str:
        """How the matrices round activations ("int16": Q4KernelMatrix, "bf16": Int4Matrix)."""
        return self.qkv_m.activations

    def matrices(self) -> dict[str, Matrix]:
        """name (decode_step_abi.MATRICES) -> matrix: what int4_cache keeps."""
        return {"qkv": self.qkv_m, "o": self.o_m, "gate_up": self.gate_up, "down": self.down}

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.qkv_m(h)                                                   # (B, T, (H + 2 KV) hd)
        if self.qkv_bias is not None:
            y = y + self.qkv_bias
        q, k, v = y.split(self.widths, -1)
        return q, k, v

    def o(self, a: torch.Tensor) -> torch.Tensor:
        y = self.o_m(a)
        return y if self.o_bias is None else y + self.o_bias

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(h).split(self.inter, -1)                        # (B, T, I) each
        return self.down(F.silu(g) * u)


class HalfHead:
    """The logits' matmul in fp16 (V, D): with int4 layers the step's largest read was the fp32
    lm_head (113 MB for SmolLM2's 49,152 x 576). fp16 halves it; it beat bf16 here at batch 1
    (3.5 vs 6.0 ms, fp32 9.4) and keeps 3 more mantissa bits. Post-norm activations and
    logits sit far inside fp16's range."""

    kind = "fp16"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.to(torch.float16).contiguous()                # (V, D)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h.to(torch.float16), self.weight).to(h.dtype)


def matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """name (decode_step_abi.MATRICES) -> (outputs, inputs) of a layer's int4 matrices."""
    return abi_matrix_shapes(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


def int4_layer(cfg: ModelConfig, lin: DenseLinears, mats: Mapping[str, Matrix]) -> "Int4Linears":
    """One layer's Int4Linears from its matrices (by decode_step_abi.MATRICES name) and its dense
    linears' biases."""
    bias = None
    if lin.q_bias is not None:
        bias = torch.cat([lin.q_bias, lin.k_bias, lin.v_bias])
    widths = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    return Int4Linears(mats["qkv"], mats["o"], mats["gate_up"], mats["down"], widths, bias, lin.o_bias)


def int4_layers(cfg: ModelConfig, dense: Sequence[DenseLinears], raw: Mapping[str, np.ndarray],
                types: Mapping[str, int], unpermute) -> tuple[list[LayerLinears], int]:
    """Each layer's linears: int4 where all seven projections are Q4_0 / Q4_1 with outputs a
    multiple of 16, else the layer's dense ones. raw / types: HF weight name -> the GGUF tensor's
    bytes / type id; unpermute(array, n_heads) undoes llama's q/k row order (None: not permuted).
    Returns (linears per layer, how many layers are int4)."""
    missing = kernel_missing()
    if missing:
        raise ModelLoadError(f"runtime.linears='int4' needs the package's C kernels or torch's int4 kernel: "
                             f"{missing}; use runtime.linears='dequantized'")
    mat = matrix_type()
    out: list[LayerLinears] = []
    for i, lin in enumerate(dense):
        p = f"model.layers.{i}."
        names = [p + s + ".weight" for s in PROJECTIONS]
        if not all(types.get(n) in Q4_TYPES and raw[n].shape[0] % _N_MULTIPLE == 0 for n in names):
            out.append(lin)
            continue
        parts = {}
        for s, n in zip(PROJECTIONS, names):
            codes, d, m = q4_blocks(raw[n], types[n])
            heads = {QKV[0]: cfg.num_heads, QKV[1]: cfg.num_kv_heads}.get(s)
            if unpermute is not None and heads is not None:   # rows only: groups run along K
                codes, d, m = (unpermute(a, heads) for a in (codes, d, m))
            parts[s] = (codes, d, m)
        out.append(int4_layer(cfg, lin, {"qkv": mat.fused([parts[s] for s in QKV]),
                                         "o": mat(*parts[PROJECTIONS[3]]),
                                         "gate_up": mat.fused([parts[s] for s in GATE_UP]),
                                         "down": mat(*parts[PROJECTIONS[6]])}))
    return out, sum(isinstance(x, Int4Linears) for x in out)
