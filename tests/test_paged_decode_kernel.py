"""The Triton paged decode kernel equals capsule.llm.paged_attention (T=1) on its mask rules.

CPU tests run the kernel under Triton's interpreter (TRITON_INTERPRET=1, set per test: triton
reads it when the kernel is built, and the module caches one kernel per mode); triton is in the
test extra (a missing one fails). The cuda test runs the compiled kernel, also inside a CUDA graph.
"""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from capsule.llm.paged_attention import paged_attention
from edge_kernels import paged_decode
from edge_kernels.paged_decode import paged_decode_attention
from paged_cases import BS, HD, H, KV, NB, paged_case, paged_reference

# triton is in the test extra: a missing one fails these tests, it does not skip them
assert importlib.util.find_spec("triton") is not None, \
    "triton is not installed: pip install -e '.[test]' (the test extra lists it)"


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


_case, _reference = paged_case, paged_reference   # (device, pool dtype, q dtype, seed), (case, holes)


def _reference32(c: dict) -> torch.Tensor:
    """The reference in fp32 (q and pool upcast, holes on): what fp16 kernels are held to."""
    return _reference({**c, "q": c["q"].float(), "k": c["k"].float(), "v": c["v"].float()}, True)


def _kernel(c: dict, holes: bool, **kw) -> torch.Tensor:
    return paged_decode_attention(c["q"], c["k"], c["v"], c["tables"], c["lens"], HD ** -0.5,
                                  c["valid"] if holes else None, **kw)


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp32_equals_reference(interpret, holes, splits):
    c = _case()
    got = _kernel(c, holes, num_splits=splits)
    torch.testing.assert_close(got, _reference(c, holes), rtol=1e-5, atol=1e-5)


def test_fp16_pool_under_fp32_q_casts_on_read(interpret):
    c = _case(pool_dtype=torch.float16)
    got = _kernel(c, True, num_splits=2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(c, True), rtol=1e-5, atol=1e-5)


def test_fp16_q_and_pool(interpret):
    c = _case(pool_dtype=torch.float16, q_dtype=torch.float16)
    got = _kernel(c, True)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), _reference32(c), rtol=1e-3, atol=1e-3)


def test_reads_only_live_readable_slots(interpret):
    # NaN in every slot past a row's length and in every hole: the reference (on the clean pool)
    # is matched exactly, so the kernel never weights them (0 * NaN would show)
    c = _case(seed=1)
    want = _reference(c, True)
    k, v = c["k"].clone(), c["v"].clone()
    live = torch.zeros(NB, BS, dtype=torch.bool)
    for row, n in enumerate(c["lens"].tolist()):
        slots = torch.arange(n)
        live[c["tables"][row, slots // BS], slots % BS] = True
    dead = ~(live & c["valid"])
    k[dead], v[dead] = float("nan"), float("nan")
    got = _kernel({**c, "k": k, "v": v}, True, num_splits=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_four_dim_q_and_int64_tables(interpret):
    c = _case(seed=2)
    got = paged_decode_attention(c["q"].unsqueeze(1), c["k"], c["v"], c["tables"].long(),
                                 c["lens"].long(), HD ** -0.5)
    assert got.shape == (3, 1, H, HD)
    torch.testing.assert_close(got[:, 0], _reference(c, False), rtol=1e-5, atol=1e-5)


def test_shape_errors_before_any_launch():
    c = _case()
    with pytest.raises(ValueError, match="one query per row"):
        paged_decode_attention(c["q"].unsqueeze(1).expand(3, 2, H, HD), c["k"], c["v"],
                               c["tables"], c["lens"], 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(c["q"], c["k"], c["v"], c["tables"], c["lens"][:2], 1.0)
    with pytest.raises(ValueError, match="slot_valid"):
        paged_decode_attention(c["q"], c["k"], c["v"], c["tables"], c["lens"], 1.0,
                               c["valid"][:, :4])


def test_cpu_without_interpreter_says_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    c = _case()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _kernel(c, False)


def test_missing_triton_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)        # import triton -> ImportError
    monkeypatch.delitem(sys.modules, "edge_kernels.paged_decode_kernel", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ImportError, match="pip install triton"):
        _kernel(_case(), False)


@pytest.mark.cuda
@pytest.mark.parametrize("pool_dtype,q_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                    (torch.float16, torch.float32, 1e-5),
                                                    (torch.float16, torch.float16, 1e-3)])
def test_cuda_equals_reference_and_replays_in_a_graph(monkeypatch, pool_dtype, q_dtype, tol):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    c = _case("cuda", pool_dtype, q_dtype)
    want = _reference32(c)
    for splits in (None, 1, 4):
        got = _kernel(c, True, num_splits=splits).float()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # captured once with static buffers; new lengths copied in before a replay are followed
    lens = c["lens"].clone()
    _kernel({**c, "lens": lens}, True)                        # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _kernel({**c, "lens": lens}, True)
    for new in ([5, 16, 17], [96, 1, 40]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.testing.assert_close(out.float(), _reference32({**c, "lens": lens}), rtol=tol, atol=tol)


def test_odd_head_dim_small_blocks_no_gqa(interpret):
    # hd 80 pads to 128 lanes; bs 4 < the 16-slot tile, so one tile spans four blocks
    g = torch.Generator().manual_seed(3)
    bs, kv, hd = 4, 2, 80
    k, v = torch.randn(2, 12, bs, kv, hd, generator=g)                  # (NB, bs, KV, hd) each
    q = torch.randn(2, kv, hd, generator=g)
    tables = torch.tensor([[3, 1, 7, 5, 9], [2, 4, 6, 8, 10]])
    lens = torch.tensor([19, 6], dtype=torch.int32)
    got = paged_decode_attention(q, k, v, tables, lens, 0.1, block_n=16, num_splits=2)
    want = paged_attention(q.unsqueeze(1), k, v, tables, (lens.long() - 1).view(2, 1), 0.1)[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
