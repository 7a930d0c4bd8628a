"""The compiled CPU kernels (csrc/, built by `pip install` as the optional extension
`_cpu_kernels`, setup.py), loaded once with ctypes, every entry point's C signature declared.

No Python API and no torch here: `paged_decode_cpu.py` and `q8_linear_cpu.py` check their
arguments and call `library()`. Where the extension was not built (no C compiler at install),
`missing()` says why and callers keep their torch operators.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
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
}


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
            return lib, None
    return None, (f"the CPU kernels ({NAME}) were not built with the package (no C compiler at "
                  "install?): install gcc and reinstall (pip install -e .)")


def missing() -> str | None:
    """Why the kernels cannot run here, or None."""
    return _load()[1]


def library() -> ctypes.CDLL:
    """The loaded library; RuntimeError (saying why) where it is missing."""
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"the CPU kernels cannot run: {why}")
    return lib
