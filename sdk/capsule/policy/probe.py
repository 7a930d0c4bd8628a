"""What a doctor probe is: a real tiny inference on one backend, reported as Check lines.

Each engine in the registry names its probe (`capsule doctor` runs them all); this module is
the vocabulary they share: the Check line, its three statuses, NeedsPackage, and the probe
model (a Linear(16 -> 8) whose output is exact in any precision) with its ONNX export.
Probes import their backend lazily, so importing this module costs nothing extra.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import numpy as np
    import torch

OK, MISSING, FAILED = "OK", "MISSING", "FAILED"
TOLERANCE = 1e-5
ONNX_EXTRA = "pip install 'exec-capsules[onnx]'"


@dataclass(frozen=True)
class Check:
    """One line of the report: status is OK, MISSING (not installed / no hardware) or FAILED."""

    name: str
    status: str
    version: str
    reason: str


class NeedsPackage(Exception):
    """A probe cannot run because a helper package (not the backend itself) is missing."""


# a probe gets a scratch folder of its own and returns one line, or one per variant (providers)
Probe = Callable[[Path], "Check | list[Check]"]


def exact_probe_tensors() -> tuple[torch.nn.Linear, torch.Tensor]:
    """Linear(16 -> 8) weights and input made of multiples of 1/4.

    Their products and sums are exact in fp32, TF32 and fp16 alike, so any correct backend
    matches torch to well within 1e-5 whatever math mode it picks.
    """
    import torch

    gen = torch.Generator().manual_seed(0)

    def q(*shape: int) -> torch.Tensor:
        return torch.randint(-4, 5, shape, generator=gen).float() / 4

    linear = torch.nn.Linear(16, 8)
    with torch.no_grad():
        linear.weight.copy_(q(8, 16))
        linear.bias.copy_(q(8))
    return linear, q(2, 16)


def export_probe(work: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """Export the probe Linear to work/probe.onnx; return (path, input array, torch output array)."""
    import torch

    try:
        import onnx  # noqa: F401  - torch.onnx.export serializes through it
    except ImportError:
        raise NeedsPackage(f"the `onnx` package (needed to export the probe model) is not installed: "
                           f"{ONNX_EXTRA}") from None
    linear, x = exact_probe_tensors()
    path = work / "probe.onnx"
    if not path.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation chatter is not the user's concern
            try:  # the TorchScript exporter needs only `onnx`; the dynamo one also needs onnxscript
                torch.onnx.export(linear, (x,), str(path), input_names=["x"], output_names=["y"],
                                  opset_version=17, dynamo=False)
            except TypeError:
                torch.onnx.export(linear, (x,), str(path), input_names=["x"], output_names=["y"])
    with torch.no_grad():
        want = linear(x)
    return path, x.numpy(), want.numpy()


def max_diff(got: Any, want: np.ndarray) -> float:
    """Largest absolute difference, in float64."""
    import numpy as np

    return float(np.abs(np.asarray(got, dtype=np.float64) - want).max())
