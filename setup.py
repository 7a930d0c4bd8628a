"""The one compiled piece: the CPU kernels (edge_kernels/cpu_library.py loads them): paged decode
attention (paged_decode_cpu.py), the Q8_0 linear (q8_linear_cpu.py), the Q4 linear
(q4_linear_cpu.py), the fp32 linear (f32_linear_cpu.py) and a decoder's one-call decode step
(decode_step_cpu.py).

Everything else is in pyproject.toml. The extension is optional: without a C compiler the
install still succeeds and the decoder keeps its torch operators (`cpu_library.missing()`
says why). It has no Python API (ctypes loads it), so it needs no Python headers.
CAPSULE_CPU_KERNEL=0 leaves it out: `make wheel` builds the pure-Python wheel the Jetson image
installs (a CUDA device decodes with torch's or Triton's attention, never these kernels).
"""
import os

from setuptools import Extension, setup

SOURCES = ("paged_decode_cpu", "decode_layer_cpu", "q8_linear_cpu", "q4_linear_cpu", "q4_dequant_cpu",
           "f32_linear_cpu", "decode_step_cpu", "parallel")
HEADERS = ("vec16", "parallel", "paged_decode_cpu", "q4_linear_cpu", "f32_linear_cpu")
KERNEL = Extension(
    "edge_kernels._cpu_kernels", [f"edge_kernels/csrc/{name}.c" for name in SOURCES],
    depends=[f"edge_kernels/csrc/{name}.h" for name in HEADERS],
    # -ffp-contract=off: no implicit fused multiply-add (GCC's -std=c11 default; Clang fuses unless told)
    extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-pthread", "-fno-math-errno", "-Wno-psabi"],
    extra_link_args=["-pthread"], libraries=["m"], optional=True)

setup(ext_modules=[] if os.environ.get("CAPSULE_CPU_KERNEL", "1") == "0" else [KERNEL])
