"""The CPU Q8_0 linear (edge_kernels/q8_linear_cpu.py, csrc/q8_linear_cpu.c): the codes and
scales are gguf's Q8_0 dequantization exactly; the products are those weights' in fp32 up to
summation order; a row's output does not depend on the batch, its place or the thread count.

The kernel is built by the package install (setup.py); a missing build fails these tests."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_kernels import q8_linear_cpu
from edge_kernels.q8_linear_cpu import q8_0_blocks, q8_linear


def test_the_kernel_is_built():
    assert q8_linear_cpu.missing() is None, q8_linear_cpu.missing()


def _matrix(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random Q8_0 matrix: (its GGUF bytes, codes, scales, gguf's dequantized float32 weights)."""
    import gguf
    w = np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(n, k)
    codes, scales = q8_0_blocks(raw)
    return raw, torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(deq)


def test_codes_and_scales_are_ggufs_dequantization_exactly():
    _, codes, scales, deq = _matrix(40, 96)
    assert codes.dtype == torch.int8 and codes.shape == (40, 96) and scales.shape == (40, 3)
    assert int(codes.min()) >= -127 and int(codes.max()) == 127 and len(codes.unique()) > 100
    assert torch.equal((codes.float().view(40, 3, 32) * scales.unsqueeze(-1)).view(40, 96), deq)


@pytest.mark.parametrize("n, k, m", [(53, 96, 1), (64, 576, 4), (37, 64, 7), (16, 32, 3)])
def test_the_products_are_the_dequantized_weights(n, k, m):
    # n not a multiple of 16: the tail rows; m = 7: a pass of 4 x rows and one of 3
    _, codes, scales, deq = _matrix(n, k, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = q8_linear(x, codes, scales)
    want = (x.double() @ deq.double().t())
    assert got.shape == (m, n) and got.dtype == torch.float32
    # fp32 sums of k products: within a few ulps of the exact float64 result; a wrong code,
    # scale or lane is off by a whole term
    assert (got.double() - want).abs().max().item() < 1e-5 * (x.abs().double() @ deq.abs().double().t()).max().item()


def test_a_rows_output_does_not_depend_on_the_batch_its_place_or_the_threads():
    _, codes, scales, _ = _matrix(100, 128, seed=3)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(5))
    whole = q8_linear(x, codes, scales)
    for i in range(6):
        assert torch.equal(q8_linear(x[i:i + 1], codes, scales), whole[i:i + 1])
    assert torch.equal(q8_linear(x.flip(0), codes, scales).flip(0), whole)
    for threads in (2, 3, 16):
        assert torch.equal(q8_linear(x, codes, scales, threads), whole)
    # leading dims are kept; an empty batch is an empty result
    assert torch.equal(q8_linear(x.view(2, 3, 128), codes, scales), whole.view(2, 3, 100))
    assert q8_linear(x[:0], codes, scales).shape == (0, 100)


def test_bad_arguments_are_refused_before_the_kernel_runs():
    raw, codes, scales, _ = _matrix(16, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x must be fp32"):
        q8_linear(x[:, :32], codes, scales)
    with pytest.raises(ValueError, match="x must be fp32"):
        q8_linear(x.double(), codes, scales)
    for bad_codes, bad_scales in [(codes.to(torch.int16), scales), (codes, scales.half()),
                                  (codes[:, :48], scales), (codes, scales[:8]),
                                  (codes.t().contiguous().t(), scales), (codes[:, :0], scales[:, :0])]:
        with pytest.raises(ValueError, match="Q8_0 weights must be"):
            q8_linear(x, bad_codes, bad_scales)
    with pytest.raises(ValueError, match="Q8_0 bytes"):
        q8_0_blocks(raw[:, :-1])
