"""The environment of a timed child process: Python's bytecode cache on, as an installed
package has it.

pip compiles a package's ``.pyc`` files when it installs it, and a source checkout gets them on
its first run, unless ``PYTHONDONTWRITEBYTECODE`` is set (some CI and sandbox images set it).
With it, every child compiles each of the SDK's modules again: ~90 ms of a ``capsule.lite``
restore measured here, more for a Session's. A suite that times process start to first token
measures the installed case, so its children run without that variable, after one warm-up run
that leaves the cache (``__pycache__``, git-ignored) behind.
"""
from __future__ import annotations

import os

__all__ = ["timed_child_env"]


def timed_child_env() -> dict[str, str]:
    """os.environ without PYTHONDONTWRITEBYTECODE (module docstring)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env
