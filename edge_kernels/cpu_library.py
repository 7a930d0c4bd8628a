"""The compiled CPU kernels (csrc/, built by `pip install` as the optional extension
`_cpu_kernels`, setup.py), loaded once with ctypes, every entry point's C signature declared.

No Python API and no torch here: `paged_decode_cpu.py` and `q8_linear_cpu.py` check their
arguments and call `library()`. Where the extension was not built (no C compiler at install),
`missing()` says why and callers keep their torch operators.

Threads: where the process has an OpenMP runtime loaded (torch's libgomp, or an LLVM / Intel
one) when the library is first loaded, the kernels run their workers on its team
(csrc/parallel.c says why: threads of their own would compete with its spinning workers);
`shares_openmp()` tells. Elsewhere (a process without torch) they start pthreads per call.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import re
from pathlib import Path

NAME = "_cpu_kernels"
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
    "capsule_use_openmp": (None, [_P, _P, _P]),
    "capsule_uses_openmp": (_INT, []),
}
_OPENMP = re.compile(r"/lib(gomp|omp|iomp5)[^/]*\.so[^/]*$")   # runtimes exporting GOMP_parallel


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
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
    """GOMP_parallel, omp_get_thread_num and omp_get_num_threads of the OpenMP runtime this
    process has loaded (the first mapped one that exports all three), else Nones. Linux:
    read from /proc/self/maps; dlopen of a loaded library returns that same instance."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if _OPENMP.search(line.rstrip())})
    except OSError:
        return None, None, None
    for path in paths:
        try:
            rt = ctypes.CDLL(path)
            fns = (rt.GOMP_parallel, rt.omp_get_thread_num, rt.omp_get_num_threads)
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
