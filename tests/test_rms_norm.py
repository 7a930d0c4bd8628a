"""The decoder's RMSNorm: torch's F.rms_norm where it is bit-identical to the spelled-out
operators (CPU fp32), those operators elsewhere; either way transformers' LlamaRMSNorm math."""
from __future__ import annotations

import pytest
import torch

from capsule.llm import model as model_mod
from capsule.llm.model import rms_norm


def _spelled_out(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


SHAPES = [(1, 1, 576), (4, 1, 576), (1, 37, 576), (2, 256, 576), (3, 9, 64), (5, 16, 128),
          (7, 1, 2048), (1, 1, 4096), (3, 1, 960), (2, 3, 48)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_identical_to_the_spelled_out_operators_on_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        for eps in (1e-5, 1e-6):
            x = (torch.randn(*shape, generator=g) * 3).to(dtype)
            w = torch.randn(shape[-1], generator=g).to(dtype)
            got, want = rms_norm(x, w, eps), _spelled_out(x, w, eps)
            assert got.dtype == want.dtype and torch.equal(got, want), (shape, eps)


def test_cpu_fp32_takes_the_one_call_path(monkeypatch):
    """Guards the speed-up itself: a spelled-out fallback would pass the test above."""
    if not model_mod._FUSED_RMS_NORM:
        pytest.skip("torch < 2.4 has no F.rms_norm: the spelled-out operators are the only path")
    calls = []
    real = torch.nn.functional.rms_norm
    monkeypatch.setattr(torch.nn.functional, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = torch.randn(2, 1, 64), torch.randn(64)
    rms_norm(x, w, 1e-6)
    rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    assert len(calls) == 1
