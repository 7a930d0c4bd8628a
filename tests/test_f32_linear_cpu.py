"""The CPU fp32 linear (edge_kernels/f32_linear_cpu.py, csrc/f32_linear_cpu.c) the one-call decode
step multiplies a dense model by: its products are float64's to fp32 rounding, summed in the one
order its C file states (checked against that order spelled out in numpy), the same bits whatever
the batch, a row's place, the thread count, or how the matrix is split into row blocks.

The kernel is built by the package install (setup.py); a missing build fails these tests."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_kernels import f32_linear_cpu
from edge_kernels.f32_linear_cpu import F32Matrix


def test_the_kernel_is_built():
    assert f32_linear_cpu.missing() is None, f32_linear_cpu.missing()


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0, 1, shape).astype(np.float32))


def _in_order(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The C file's order in float32: 16 lanes, chunk after chunk (the last zero-padded), then the
    tree l + l+8, + 4, + 2, + 1."""
    n, k = w.shape
    pad = -k % 16
    w = np.pad(w, ((0, 0), (0, pad))).reshape(n, -1, 16)
    x = np.pad(x, (0, pad)).reshape(-1, 16)
    lanes = np.zeros((n, 16), np.float32)
    for c in range(x.shape[0]):
        lanes = lanes + w[:, c] * x[c]
    width = 8
    while width:
        lanes = lanes[:, :width] + lanes[:, width:2 * width]
        width //= 2
    return lanes[:, 0]


@pytest.mark.parametrize("n, k, m", [(53, 96, 1), (64, 576, 4), (37, 100, 7), (16, 40, 3), (960, 576, 2),
                                     (40, 128, 131), (3, 7, 1)])
def test_the_products_are_float64s_in_the_stated_order(n, k, m):
    w, x = _rand(n, k), _rand(m, k, seed=1)
    y = F32Matrix([w])(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    want = x.double() @ w.double().T
    assert (y.double() - want).abs().max().item() < 1e-5 * k ** 0.5 * 4
    for r in (0, m - 1):                                   # bit for bit the documented order
        assert np.array_equal(y[r].numpy(), _in_order(w.numpy(), x[r].numpy()))


def test_a_rows_bits_do_not_depend_on_batch_place_threads_or_blocks():
    q, k, v = _rand(576, 576), _rand(192, 576, seed=1), _rand(192, 576, seed=2)
    whole, stacked = F32Matrix([torch.cat([q, k, v])]), F32Matrix([q, k, v])
    x = _rand(9, 576, seed=3)
    want = whole(x)
    assert torch.equal(stacked(x), want)
    for threads in (1, 2, 3, 16):
        assert torch.equal(stacked(x, threads=threads), want)
    for r in range(9):
        assert torch.equal(whole(x[r:r + 1]), want[r:r + 1])
        assert torch.equal(whole(x[r]), want[r])                                   # a 1-D x
    assert torch.equal(whole(x.view(3, 3, 576)), want.view(3, 3, -1))
    assert whole(x[:0]).shape == (0, 960)
    assert torch.equal(F32Matrix([v])(x), want[:, 768:])                        # a block's outputs are its rows'


def test_bad_arguments_are_refused():
    w = _rand(32, 64)
    with pytest.raises(ValueError, match="1 to 3 row blocks"):
        F32Matrix([])
    with pytest.raises(ValueError, match="1 to 3 row blocks"):
        F32Matrix([w] * 4)
    with pytest.raises(ValueError, match="row blocks must be"):
        F32Matrix([w, _rand(8, 32)])                                           # another K
    with pytest.raises(ValueError, match="row blocks must be"):
        F32Matrix([w.double()])
    with pytest.raises(ValueError, match="row blocks must be"):
        F32Matrix([w.t()])                                                      # not contiguous
    with pytest.raises(ValueError, match="row blocks must be"):
        F32Matrix([w[:0]])                                                      # no rows
    m = F32Matrix([w])
    with pytest.raises(ValueError, match="x must be"):
        m(_rand(2, 63))
    with pytest.raises(ValueError, match="x must be"):
        m(_rand(2, 64).double())


def test_the_doctor_checks_the_kernel(monkeypatch, tmp_path):
    from capsule.tools.doctor import FAILED, MISSING, OK, probe_f32_kernel
    check = probe_f32_kernel(tmp_path)
    assert check.status == OK and "the same bits" in check.reason, check
    monkeypatch.setattr(f32_linear_cpu, "missing", lambda: "no C compiler at install")
    check = probe_f32_kernel(tmp_path)
    assert check.status == MISSING and "no C compiler at install" in check.reason
    monkeypatch.undo()
    real = F32Matrix.__call__                     # a kernel that drops the second row block is caught
    monkeypatch.setattr(F32Matrix, "__call__", lambda self, x, threads=1: real(self, x, threads) * (
        torch.arange(self.n_out) < self.parts[0].shape[0]))
    assert probe_f32_kernel(tmp_path).status == FAILED
