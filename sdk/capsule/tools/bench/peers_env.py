"""The peers suite's llama.cpp: `llama-cpp-python` in a venv of its own, built once and cached.

It is not a project dependency: it compiles llama.cpp from source (tens of minutes on 2 cores), so
the venv lives under ``$CAPSULE_PEERS_CACHE`` (default ``~/.cache/capsule/peers``) keyed by the
version, and is reused by every later run. Built with AMX off: on a Xeon here its AMX path died
with an illegal instruction on Q4_1 weights (issue 19). ``CAPSULE_PEERS_BUILD=0`` uses a cached
venv only, never builds. Failure never raises: ``ensure`` returns the reason, and the suite
prints its own figures without the peer.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"
CMAKE_ARGS = "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF"
BUILD_TIMEOUT_S = 3 * 3600


@dataclass(frozen=True)
class PeerEnv:
    """python: the venv's interpreter (None when unavailable); why: the reason it is missing."""

    python: Path | None
    why: str = ""
    built_s: float = 0.0       # seconds this call spent building (0: reused from the cache)


def cache_dir() -> Path:
    return Path(os.environ.get("CAPSULE_PEERS_CACHE", Path.home() / ".cache" / "capsule" / "peers"))


def _ready(py: Path) -> bool:
    if not py.is_file():
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
        return PeerEnv(None, f"no llama-cpp-python {VERSION} venv at {root}, and CAPSULE_PEERS_BUILD=0 "
                             f"forbids building one (unset it to build, tens of minutes)")
    if show:
        print(f"  building llama-cpp-python {VERSION} into {root} (once; tens of minutes on 2 cores; "
              f"log: {root}.log)", flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
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
    if not _ready(py):
        return PeerEnv(None, f"llama-cpp-python {VERSION} installed but does not import; see {root}.log")
    return PeerEnv(py, built_s=time.perf_counter() - t0)
