"""The peers suite's llama.cpp: `llama-cpp-python` in a venv of its own, built once and cached.

It is not a project dependency: it compiles llama.cpp from source (tens of minutes on 2 cores), so
the venv lives under ``$CAPSULE_PEERS_CACHE`` (default ``~/.cache/capsule/peers``) keyed by the
version and the build flags, and is reused by every later run. Built with AMX off: on a Xeon
here its AMX path died with an illegal instruction (``tilezero``) on Q4_1 weights (issue 19).
llama.cpp builds for the build machine (``-march=native``), which ignores its own GGML_AMX_*
options, so on x86 the compilers are also told ``-mno-amx-*`` (an explicit ``-mno-`` wins over
``-march``). ``CAPSULE_PEERS_BUILD=0`` uses a cached venv only, never builds. Failure never
raises: ``ensure`` returns the reason, and the suite prints its own figures without the peer.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"
CMAKE_ARGS = "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF"
X86 = ("x86_64", "amd64", "i386", "i686")
BUILD_TIMEOUT_S = 3 * 3600
STAMP = "capsule-build-flags.txt"   # in the venv: the flags it was built with (another set: rebuilt)


def compiler_flags() -> str:
    """CFLAGS / CXXFLAGS for llama.cpp's build: AMX off on x86 (gcc and clang take -mno-amx-*)."""
    return "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine().lower() in X86 else ""


def build_flags() -> str:
    """What a cached venv must have been built with to be reused."""
    return f"CMAKE_ARGS={CMAKE_ARGS}\nCFLAGS={compiler_flags()}\n"


@dataclass(frozen=True)
class PeerEnv:
    """python: the venv's interpreter (None when unavailable); why: the reason it is missing."""

    python: Path | None
    why: str = ""
    built_s: float = 0.0       # seconds this call spent building (0: reused from the cache)


def cache_dir() -> Path:
    return Path(os.environ.get("CAPSULE_PEERS_CACHE", Path.home() / ".cache" / "capsule" / "peers"))


def _ready(py: Path) -> bool:
    stamp = py.parent.parent / STAMP
    if not py.is_file() or not stamp.is_file() or stamp.read_text(encoding="utf-8") != build_flags():
        return False
    probe = subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True, timeout=120)
    return probe.returncode == 0 and probe.stdout.strip() == VERSION


def ensure(show: bool = True) -> PeerEnv:
    """The cached venv with llama-cpp-python VERSION, building it on first use."""
    root = cache_dir() / f"llama-cpp-python-{VERSION}"
    py = root / "bin" / "python"
    if _ready(py):
        return PeerEnv(py)
    if os.environ.get("CAPSULE_PEERS_BUILD", "1") == "0":
        return PeerEnv(None, f"no llama-cpp-python {VERSION} venv built with this suite's flags at {root}, "
                             f"and CAPSULE_PEERS_BUILD=0 forbids building one (unset it to build, tens of "
                             f"minutes)")
    if show:
        print(f"  building llama-cpp-python {VERSION} into {root} (once; tens of minutes on 2 cores; "
              f"log: {root}.log)", flush=True)
    t0 = time.perf_counter()
    flags = compiler_flags()
    env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1),
               CFLAGS=f"{os.environ.get('CFLAGS', '')} {flags}".strip(),
               CXXFLAGS=f"{os.environ.get('CXXFLAGS', '')} {flags}".strip())
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(f"{root}.log", "w") as log:
            for cmd in ([sys.executable, "-m", "venv", "--clear", str(root)],
                        [str(py), "-m", "pip", "install", "--no-cache-dir", f"llama-cpp-python=={VERSION}"]):
                done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      timeout=BUILD_TIMEOUT_S)
                if done.returncode != 0:
                    return PeerEnv(None, f"`{' '.join(cmd[-3:])}` failed (exit {done.returncode}); "
                                         f"see {root}.log")
    except (OSError, subprocess.SubprocessError) as exc:
        return PeerEnv(None, f"could not build llama-cpp-python {VERSION}: {exc}")
    (root / STAMP).write_text(build_flags(), encoding="utf-8")
    if not _ready(py):
        return PeerEnv(None, f"llama-cpp-python {VERSION} installed but does not import; see {root}.log")
    return PeerEnv(py, built_s=time.perf_counter() - t0)
