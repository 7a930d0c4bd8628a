"""The CPU Q4 linear (edge_kernels/q4_linear_cpu.py, csrc/q4_linear_cpu.c): its nibbles are the
GGUF's own bytes; its products are the dequantized weights' to ~1e-5 (activations rounded to
int16 per block, ~100x closer than torch's bf16 int4 kernel); a row's output is the same bits
whatever the batch, its place, the thread count or the SIMD path.

The kernel is built by the package install (setup.py); a missing build fails these tests."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from capsule.llm.int4_linear import q4_blocks
from edge_kernels import q4_linear_cpu
from edge_kernels.q4_linear_cpu import PATHS, Q4Matrix, pack, q4_linear

Q4 = {"Q4_0": 2, "Q4_1": 3}


def test_the_kernel_is_built():
    assert q4_linear_cpu.missing() is None, q4_linear_cpu.missing()


def _matrix(qname: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, list[torch.Tensor], torch.Tensor]:
    """A random Q4 matrix: (its GGUF bytes, the kernel's weights, gguf's dequantized float32 weights)."""
    import gguf
    w = np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[qname]
    raw = gguf.quants.quantize(w, qtype)
    deq = gguf.quants.dequantize(raw, qtype).reshape(n, k)
    return raw, [torch.from_numpy(a) for a in pack(*q4_blocks(raw, Q4[qname]))], torch.from_numpy(deq)


def _paths() -> list[str]:
    """Every path this CPU can run (at least "fastest" and "portable")."""
    x, (nib, d, mt) = torch.ones(1, 32), (torch.zeros(16, 16, dtype=torch.uint8), torch.ones(16, 1),
                                          torch.zeros(1, 16))
    ok = []
    for p in PATHS:
        try:
            q4_linear(x, nib, d, mt, path=p)
            ok.append(p)
        except ValueError:
            pass
    return ok


@pytest.mark.parametrize("qname", sorted(Q4))
def test_the_nibbles_are_the_ggufs_own_bytes(qname):
    raw, (nib, d, mt), _ = _matrix(qname, 24, 96)
    head = 4 if qname == "Q4_1" else 2                      # fp16 d [, fp16 m] before 16 nibble bytes
    qs = raw.reshape(24, 3, head + 16)[..., head:].reshape(24, 48)
    assert np.array_equal(nib.numpy(), qs)
    assert d.shape == (24, 3) and mt.shape == (3, 24) and mt.is_contiguous()


@pytest.mark.parametrize("qname", sorted(Q4))
@pytest.mark.parametrize("n, k, m", [(53, 96, 1), (64, 576, 4), (37, 160, 7), (16, 32, 3), (48, 224, 2),
                                     (40, 128, 131)])
def test_the_products_are_the_dequantized_weights(qname, n, k, m):
    # k / 32 = 3, 18, 5, 1, 7 blocks: every size of last quad; n not a multiple of 16: tail rows;
    # m = 7: a pass of 4 x rows and one of 3; m = 131: tiles of 64 x rows and a last one of 3
    _, w, deq = _matrix(qname, n, k, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = q4_linear(x, *w)
    want = x.double() @ deq.double().t()
    assert got.shape == (m, n) and got.dtype == torch.float32
    # int16 activations: within ~1e-5 of the exact products (torch's bf16 kernel: ~1e-2); a
    # wrong nibble, scale, offset or lane is off by a whole term
    bound = (x.abs().double() @ deq.abs().double().t()).max().item()
    assert (got.double() - want).abs().max().item() < 2e-5 * bound


def test_a_rows_output_is_the_same_bits_whatever_the_batch_threads_or_path():
    _, w, _ = _matrix("Q4_1", 100, 544, seed=3)             # 17 blocks: a last quad of one
    x = torch.randn(70, 544, generator=torch.Generator().manual_seed(5))   # two tiles of x rows
    whole = q4_linear(x, *w)
    for i in (0, 5, 63, 64, 69):
        assert torch.equal(q4_linear(x[i:i + 1], *w), whole[i:i + 1])
    assert torch.equal(q4_linear(x.flip(0), *w).flip(0), whole)
    for threads in (2, 3, 16):
        assert torch.equal(q4_linear(x, *w, threads=threads), whole)
    paths = _paths()
    assert "portable" in paths and "fastest" in paths
    for p in paths:
        assert torch.equal(q4_linear(x, *w, threads=2, path=p), whole), p
    # leading dims are kept; an empty batch is an empty result
    assert torch.equal(q4_linear(x.view(2, 35, 544), *w), whole.view(2, 35, 100))
    assert q4_linear(x[:0], *w).shape == (0, 100)


@pytest.mark.parametrize("qname", sorted(Q4))
def test_dequantized_weights_are_ggufs_bit_for_bit(qname):
    _, w, deq = _matrix(qname, 40, 160, seed=7)
    mat = Q4Matrix(*w)
    assert torch.equal(mat.dequantized(), deq) and torch.equal(mat.dequantized(threads=3), deq)


def test_a_prefill_sized_batch_multiplies_the_dequantized_weights():
    # from DENSE_ROWS rows on: torch's fp32 matmul over the exact weights; below: the int16 kernel
    from edge_kernels.q4_linear_cpu import DENSE_ROWS
    _, w, deq = _matrix("Q4_1", 48, 192, seed=8)
    mat = Q4Matrix(*w)
    x = torch.randn(DENSE_ROWS + 5, 192, generator=torch.Generator().manual_seed(9))
    big = mat(x)
    assert torch.equal(big, torch.nn.functional.linear(x, deq))
    small = mat(x[:DENSE_ROWS - 1])
    assert torch.equal(small, q4_linear(x[:DENSE_ROWS - 1], *w))
    assert (small - big[:DENSE_ROWS - 1]).abs().max().item() < 1e-4 * big.abs().max().item()


def test_a_matrix_object_gives_the_functions_bits():
    _, w, _ = _matrix("Q4_0", 64, 192, seed=4)
    mat = Q4Matrix(*w)
    x = torch.randn(3, 192)
    assert (mat.n_in, mat.n_out) == (192, 64)
    assert torch.equal(mat(x), q4_linear(x, *w)) and torch.equal(mat(x, threads=2), q4_linear(x, *w))
    assert torch.equal(mat(x.t().contiguous().t()), mat(x))      # a non-contiguous x is copied
    with pytest.raises(ValueError):
        mat(torch.randn(3, 96))
    with pytest.raises(ValueError):
        mat(x.double())


def test_zero_and_non_finite_activations():
    _, w, deq = _matrix("Q4_1", 32, 128, seed=6)
    x = torch.randn(3, 128)
    x[0] = 0.0
    x[1, 40:72] = 0.0                                       # one block of zeros beside live ones
    x[2, 100] = float("nan")
    got = q4_linear(x, *w)
    assert torch.equal(got[0], torch.zeros(32))
    want = x[1].double() @ deq.double().t()
    assert (got[1].double() - want).abs().max().item() < 1e-4
    assert torch.isnan(got[2]).all() and torch.isfinite(got[:2]).all()


@pytest.mark.parametrize("harm", ["nib-dtype", "d-shape", "mt-not-transposed", "k-not-32", "strided", "x-width",
                                  "x-dtype", "path"])
def test_bad_arguments_are_refused(harm):
    _, (nib, d, mt), _ = _matrix("Q4_0", 32, 64)
    x = torch.randn(2, 64)
    kw = {}
    if harm == "nib-dtype":
        nib = nib.to(torch.int8)
    elif harm == "d-shape":
        d = d[:, :1].contiguous()
    elif harm == "mt-not-transposed":
        mt = mt.t().contiguous()
    elif harm == "k-not-32":
        nib = nib[:, :24].contiguous()
    elif harm == "strided":
        nib = torch.cat([nib, nib], 1)[:, ::2]
    elif harm == "x-width":
        x = torch.randn(2, 32)
    elif harm == "x-dtype":
        x = x.half()
    else:
        kw["path"] = "sse9"
    with pytest.raises(ValueError):
        q4_linear(x, nib, d, mt, **kw)


def test_the_doctor_checks_the_kernel(monkeypatch, tmp_path):
    from capsule.tools.doctor import FAILED, MISSING, OK, probe_int4_kernel
    check = probe_int4_kernel(tmp_path)
    assert check.status == OK and q4_linear_cpu.fastest_path() in check.reason, check
    monkeypatch.setattr(q4_linear_cpu, "missing", lambda: "no C compiler at install")
    check = probe_int4_kernel(tmp_path)
    assert check.status == MISSING and "no C compiler at install" in check.reason
    monkeypatch.undo()
    real = q4_linear_cpu.q4_linear             # a kernel that drops the offsets is caught
    monkeypatch.setattr(q4_linear_cpu, "q4_linear", lambda x, nib, d, mt, **kw: real(x, nib, d, mt * 0, **kw))
    assert probe_int4_kernel(tmp_path).status == FAILED
