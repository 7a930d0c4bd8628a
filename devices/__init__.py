"""Device profiles (Jetson Orin Nano/NX/AGX, x86 CPU, desktop CUDA GPU) as YAML, plus a loader."""
from .detect import detect_profile
from .profile import (
    CheckpointDefaults,
    DeviceProfile,
    RuntimeDefaults,
    list_profiles,
    load_profile,
)

__all__ = [
    "CheckpointDefaults",
    "DeviceProfile",
    "RuntimeDefaults",
    "detect_profile",
    "list_profiles",
    "load_profile",
]
