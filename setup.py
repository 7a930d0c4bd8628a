"""The one compiled piece: the CPU paged decode kernel (edge_kernels/paged_decode_cpu.py).

Everything else is in pyproject.toml. The extension is optional: without a C compiler the
install still succeeds and the decoder keeps its torch attention (the kernel's `missing()`
says why). It has no Python API (ctypes loads it), so it needs no Python headers.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "edge_kernels._paged_decode_cpu", ["edge_kernels/csrc/paged_decode_cpu.c"],
    extra_compile_args=["-O3", "-std=c11", "-pthread", "-fno-math-errno", "-Wno-psabi"],
    extra_link_args=["-pthread"], libraries=["m"], optional=True)])
