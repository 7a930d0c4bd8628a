"""Device profiles (Jetson Orin Nano/NX/AGX, x86 CPU, desktop CUDA GPU) as YAML, plus a loader."""
from .detect import detect_profile
from .profile import (
    CheckpointDefaults,
    DeviceProfile,
    GpuSpec,
    RuntimeDefaults,
    StorageSpec,
    list_profiles,
    load_profile,
)

__all__ = [
    "CheckpointDefaults",
    "DeviceProfile",
    "GpuSpec",
    "RuntimeDefaults",
    "StorageSpec",
    "detect_profile",
    "list_profiles",
    "load_profile",
]
