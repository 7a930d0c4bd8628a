"""The C decode step's argument structs (csrc/decode_step_cpu.c's mat_t, layer_t, step_t;
csrc/f32_linear_cpu.h's f32_parts_t) as ctypes Structures, and the call: torch-free, so both the Session's
(decode_step_cpu.py, over torch tensors) and capsule.lite's (over numpy arrays) fill them.
Pointers are plain addresses; the callers check every array first."""
from __future__ import annotations

import ctypes

from . import cpu_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
MATRICES = ("qkv", "o", "gate_up", "down")     # a layer's matrices, by name (q|k|v, gate|up fused)
F32_PARTS = 3                                   # csrc/f32_linear_cpu.h: row blocks of an fp32 matrix


def matrix_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
                  ) -> dict[str, tuple[int, int]]:
    """name (MATRICES) -> (outputs, inputs) of a layer's matrices."""
    q = heads * head_dim
    return {"qkv": (q + 2 * kv_heads * head_dim, hidden), "o": (hidden, q),
            "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}


def f32_blocks(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
               ) -> dict[str, tuple[tuple[str, int], ...]]:
    """name (MATRICES) -> the row blocks a dense fp32 layer's matrix stacks: (projection, rows)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"qkv": (("q", q), ("k", kv), ("v", kv)), "o": (("o", hidden),),
            "gate_up": (("gate", intermediate), ("up", intermediate)), "down": (("down", hidden),)}


class F32Parts(ctypes.Structure):   # csrc: f32_parts_t, an fp32 (N, K) as row blocks stacked
    _fields_ = [("part", _P * F32_PARTS), ("rows", _I * F32_PARTS), ("n", ctypes.c_int32)]


class Mat(ctypes.Structure):        # csrc: mat_t; an int4 one (nib, d, mt), or fp32 (nib NULL, f32)
    _fields_ = [("nib", _P), ("d", _P), ("mt", _P), ("f32", F32Parts), ("bias", _P)]


def q4_mat(nib: int, d: int, mt: int, bias: int | None) -> Mat:
    """An int4 matrix (q4_linear_cpu.c's arrays, by address)."""
    return Mat(nib=nib, d=d, mt=mt, bias=bias)


def f32_mat(parts: "list[tuple[int, int]]", bias: int | None) -> Mat:
    """An fp32 matrix of (address, rows) row blocks stacked (1 .. F32_PARTS of them)."""
    if not 1 <= len(parts) <= F32_PARTS:
        raise ValueError(f"an fp32 matrix has 1 to {F32_PARTS} row blocks, got {len(parts)}")
    f = F32Parts(n=len(parts))
    for i, (address, rows) in enumerate(parts):
        f.part[i], f.rows[i] = address, rows
    return Mat(f32=f, bias=bias)


class Layer(ctypes.Structure):      # csrc: layer_t
    _fields_ = [("in_norm", _P), ("post_norm", _P), ("qkv", Mat), ("o", Mat), ("gate_up", Mat), ("down", Mat)]


class Step(ctypes.Structure):       # csrc: step_t
    _fields_ = [("L", _I), ("D", _I), ("I", _I), ("H", _I), ("KV", _I), ("hd", _I),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("final_norm", _P),
                ("pool", _P), ("kv_bf16", ctypes.c_int), ("blk_stride", _I), ("layer_stride", _I),
                ("kv_stride", _I), ("bs", _I), ("B", _I), ("nb", _I), ("cos", _P), ("sin", _P),
                ("slots", _P), ("tables", _P), ("seq_lens", _P), ("valid", _P)]


def run(layers: "ctypes.Array[Layer]", step: Step, x: int, out: int, threads: int) -> None:
    """capsule_decode_step over checked arguments (x, out: addresses of (B, D) fp32 rows; x is
    overwritten). RuntimeError when the kernels are missing or it could not get memory or threads."""
    rc = cpu_library.library().capsule_decode_step(ctypes.addressof(layers), ctypes.addressof(step), x, out,
                                                   max(1, threads))
    if rc != 0:
        raise RuntimeError("the CPU decode step could not get memory or start its threads")
