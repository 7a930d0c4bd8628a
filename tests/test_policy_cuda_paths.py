"""The policies' CUDA paths, checked on CPU with fakes (issue 14): the ONNX Runtime provider
options built for a CUDA device."""
from __future__ import annotations

import types

import torch

from capsule.policy.engine_ort import CPU_EP, CUDA_EP, TRT_EP, choose_providers


def _ort(*offered: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(get_available_providers=lambda: list(offered))


def test_the_cuda_provider_computes_fp32_in_fp32():
    chosen = choose_providers(_ort(TRT_EP, CUDA_EP, CPU_EP), torch.device("cuda", 1))
    assert [p if isinstance(p, str) else p[0] for p in chosen] == [TRT_EP, CUDA_EP, CPU_EP]
    cuda = chosen[1][1]
    # ORT's CUDA provider defaults to TF32 GEMMs (microsoft/onnxruntime#19357): off, for 1e-4 parity
    assert cuda["use_tf32"] == 0 and cuda["device_id"] == 1
    assert chosen[0][1]["device_id"] == 1
    assert choose_providers(_ort(CUDA_EP, CPU_EP), torch.device("cpu")) == [CPU_EP]
