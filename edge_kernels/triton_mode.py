"""Where a Triton kernel of this package may run: CUDA tensors, or CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, read by triton when it is first imported, so set it first)."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_runnable(device: torch.device, kernel: str) -> None:
    """Raises RuntimeError unless ``kernel`` can run on tensors of ``device``."""
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"the Triton {kernel} runs CPU tensors only under its interpreter: "
                           "set TRITON_INTERPRET=1 before the first call")
