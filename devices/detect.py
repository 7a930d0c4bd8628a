"""Pick a device profile for the machine we are running on."""
from __future__ import annotations

import os
from pathlib import Path

from .profile import DeviceProfile, load_profile

# Jetson modules are told apart by RAM. MemTotal (GiB) sits a little under the nominal size
# (the carve-outs are reserved), so the cut-offs fall between the nominal 8, 16 and 32/64 GB.
# Smaller siblings (Orin Nano 4GB, Orin NX 8GB) map to the nearest profile at or above them.
_NANO_MAX_GB = 8.5
_NX_MAX_GB = 17.0

_NO_CUDA = ("device='cuda' but torch.cuda.is_available() is False; "
            "use device='cpu' or 'auto'")


def _torch_cuda_available() -> bool:
    try:
        import torch  # lazy: importing torch is slow and the SDK may be probed without it
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _meminfo_total_gb(path: str = "/proc/meminfo") -> float:
    """MemTotal from /proc/meminfo, in GiB."""
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace")
    except OSError as e:
        raise ValueError(f"cannot read total memory from {path!r} ({e}); "
                         "pass total_memory_gb= or name a profile") from None
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) / 2**20  # the value is in kB
    raise ValueError(f"no MemTotal line in {path!r}; pass total_memory_gb= or name a profile")


def jetson_profile_name(total_memory_gb: float) -> str:
    """The Jetson profile whose module size matches this much RAM."""
    if total_memory_gb <= _NANO_MAX_GB:
        return "jetson-orin-nano-8gb"
    if total_memory_gb <= _NX_MAX_GB:
        return "jetson-orin-nx-16gb"
    return "jetson-agx-orin-64gb"


def detect_profile(device: str | os.PathLike[str] = "auto", *,
                   cuda_available: bool | None = None,
                   tegra_release_path: str = "/etc/nv_tegra_release",
                   total_memory_gb: float | None = None) -> DeviceProfile:
    """Resolve `device` ("auto", "cpu", "cuda", a profile name or a YAML path) to a profile.

    "cpu" maps to the x86-cpu profile on any CPU-only host, aarch64 included: its values are
    generic CPU defaults. "cuda" on a Jetson (a tegra release file exists) picks the module
    by total RAM; elsewhere it picks cuda-desktop. `cuda_available=None` asks torch; the
    keyword arguments exist so tests can fake the machine.
    """
    cuda_known = cuda_available

    def has_cuda() -> bool:
        nonlocal cuda_known
        if cuda_known is None:
            cuda_known = _torch_cuda_available()
        return cuda_known

    if device == "auto":
        device = "cuda" if has_cuda() else "cpu"
    if device == "cpu":
        return load_profile("x86-cpu")
    if device == "cuda":
        if not has_cuda():
            raise ValueError(_NO_CUDA)
        if os.path.exists(tegra_release_path):
            mem = total_memory_gb if total_memory_gb is not None else _meminfo_total_gb()
            return load_profile(jetson_profile_name(mem))
        return load_profile("cuda-desktop")
    profile = load_profile(device)
    if profile.device == "cuda" and not has_cuda():
        raise ValueError(f"device profile {profile.name!r} needs CUDA but "
                         "torch.cuda.is_available() is False; use device='cpu' or 'auto'")
    return profile
