"""The compiled CPU kernels (csrc/, built by `pip install` as the optional extension
`_cpu_kernels`, setup.py), loaded once with ctypes, every entry point's C signature declared.

No Python API and no torch here: `paged_decode_cpu.py`, `q8_linear_cpu.py`, `q4_linear_cpu.py`
and `decode_step_cpu.py` check their arguments and call `library()`. Where the extension was not built (no C compiler at install),
`missing()` says why and callers keep their torch operators.

Threads: where torch is loaded when the library is first loaded (Linux), the kernels run their
workers on torch's own OpenMP team (csrc/parallel.c says why: threads of their own would compete
with its spinning workers); `shares_openmp()` tells. Elsewhere (a process without torch, another
OS) they start pthreads per call.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import re
import threading
from pathlib import Path

NAME = "_cpu_kernels"
MAX_HEADS = 256         # query heads the decode attention holds (csrc/paged_decode_cpu.c: MAX_HEADS)
LANES = 16              # the head size must be a multiple of it (csrc: LANES)
MAX_HEAD_DIM = 256      # and at most this (csrc/paged_decode_cpu.c: MAX_CHUNKS * LANES)
_P = ctypes.c_void_p
_I = ctypes.c_int64
_INT = ctypes.c_int
_F = ctypes.c_float
# every exported function: (return type, argument types), as csrc/ declares it
SIGNATURES = {
    "capsule_paged_decode": (_INT, [_P, _P, _P, _INT, _I, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I,
                                    _F, _P, _INT]),
    "capsule_decode_layer": (_INT, [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _INT, _I, _I, _I,
                                    _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _P, _INT]),
    "capsule_q8_linear": (_INT, [_P, _I, _P, _P, _I, _I, _P, _INT]),
    "capsule_q4_linear": (_INT, [_P, _I, _P, _P, _P, _I, _I, _P, _INT, _INT]),
    "capsule_f32_linear": (_INT, [_P, _I, _P, _I, _P, _INT]),
    "capsule_decode_step": (_INT, [_P, _P, _P, _P, _INT]),
    "capsule_q4_dequantize": (_INT, [_P, _P, _P, _I, _I, _P, _INT]),
    "capsule_use_openmp": (None, [_P, _P, _P]),
    "capsule_uses_openmp": (_INT, []),
}
_TORCH_CPU = re.compile(r"/libtorch_cpu[^/]*\.so[^/]*$")
_FIRST_LOAD = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str | None] | None = None


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """The library (or why not), loaded by whichever thread comes first; after that a read, no
    lock (callers are on the decode hot path: a few calls per step)."""
    global _loaded
    if _loaded is None:
        with _FIRST_LOAD:   # one load, one hand-over of the OpenMP runtime
            if _loaded is None:
                _loaded = _load_once()
    return _loaded


def _load_once() -> tuple[ctypes.CDLL | None, str | None]:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / (NAME + suffix)
        if path.is_file():
            try:
                lib = ctypes.CDLL(str(path))
                for name, (restype, argtypes) in SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = restype, argtypes
            except (OSError, AttributeError) as exc:
                return None, f"{path.name} did not load ({exc}); reinstall: pip install -e ."
            lib.capsule_use_openmp(*_openmp_entry_points())
            return lib, None
    return None, (f"the CPU kernels ({NAME}) were not built with the package (no C compiler at "
                  "install?): install gcc and reinstall (pip install -e .)")


def _openmp_entry_points() -> tuple[int | None, int | None, int | None]:
    """GOMP_parallel, omp_get_thread_num and omp_get_num_threads as torch's CPU library binds
    them (its own runtime: dlsym through libtorch_cpu's handle searches what it links), else
    Nones (torch not loaded, or not Linux). dlopen of a loaded library returns that instance."""
    try:
        with open("/proc/self/maps") as maps:   # address perms offset dev inode path
            paths = sorted({f[5] for f in (line.rstrip("\n").split(maxsplit=5) for line in maps)
                            if len(f) == 6 and _TORCH_CPU.search(f[5])})
    except OSError:
        return None, None, None
    for path in paths:
        try:
            torch_cpu = ctypes.CDLL(path)
            fns = (torch_cpu.GOMP_parallel, torch_cpu.omp_get_thread_num, torch_cpu.omp_get_num_threads)
        except (OSError, AttributeError):
            continue
        return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in fns)   # type: ignore[return-value]
    return None, None, None


def shares_openmp() -> bool:
    """True when the kernels run their workers on the process's OpenMP team (torch's)."""
    lib = _load()[0]
    return bool(lib is not None and lib.capsule_uses_openmp())


def missing() -> str | None:
    """Why the kernels cannot run here, or None."""
    return _load()[1]


def library() -> ctypes.CDLL:
    """The loaded library; RuntimeError (saying why) where it is missing."""
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"the CPU kernels cannot run: {why}")
    return lib
