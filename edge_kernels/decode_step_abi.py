"""The C decode step's argument structs (csrc/decode_step_cpu.c's q4_mat_t, q4_layer_t,
q4_step_t) as ctypes Structures, and the call: torch-free, so both the Session's
(decode_step_cpu.py, over torch tensors) and capsule.lite's (over numpy arrays) fill them.
Pointers are plain addresses; the callers check every array first."""
from __future__ import annotations

import ctypes

from . import cpu_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
MATRICES = ("qkv", "o", "gate_up", "down")     # a layer's int4 matrices, by name (q|k|v, gate|up fused)


def matrix_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
                  ) -> dict[str, tuple[int, int]]:
    """name (MATRICES) -> (outputs, inputs) of a layer's int4 matrices."""
    q = heads * head_dim
    return {"qkv": (q + 2 * kv_heads * head_dim, hidden), "o": (hidden, q),
            "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}


class Mat(ctypes.Structure):        # csrc: q4_mat_t
    _fields_ = [("nib", _P), ("d", _P), ("mt", _P), ("bias", _P)]


class Layer(ctypes.Structure):      # csrc: q4_layer_t
    _fields_ = [("in_norm", _P), ("post_norm", _P), ("qkv", Mat), ("o", Mat), ("gate_up", Mat), ("down", Mat)]


class Step(ctypes.Structure):       # csrc: q4_step_t
    _fields_ = [("L", _I), ("D", _I), ("I", _I), ("H", _I), ("KV", _I), ("hd", _I),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("final_norm", _P),
                ("pool", _P), ("kv_bf16", ctypes.c_int), ("blk_stride", _I), ("layer_stride", _I),
                ("kv_stride", _I), ("bs", _I), ("B", _I), ("nb", _I), ("cos", _P), ("sin", _P),
                ("slots", _P), ("tables", _P), ("seq_lens", _P), ("valid", _P)]


def run(layers: "ctypes.Array[Layer]", step: Step, x: int, out: int, threads: int) -> None:
    """capsule_decode_step_q4 over checked arguments (x, out: addresses of (B, D) fp32 rows; x is
    overwritten). RuntimeError when the kernels are missing or it could not get memory or threads."""
    rc = cpu_library.library().capsule_decode_step_q4(ctypes.addressof(layers), ctypes.addressof(step), x, out,
                                                      max(1, threads))
    if rc != 0:
        raise RuntimeError("the CPU int4 decode step could not get memory or start its threads")
