"""int4 linears are packed once per GGUF, torch version and code, then mapped from the cache:
the same logits as a fresh packing, and any entry that is off is ignored and written again."""
from __future__ import annotations

import os
import stat

import pytest
import torch

import capsule.llm.gguf_weights as gguf_weights
from capsule.llm import load_model
from capsule.llm.int4_linear import HalfHead, Int4Linears, Int4Matrix, Q4KernelMatrix, kernel_missing, torch_kernel_missing
from capsule.llm.q8_head import Q8Head
from capsule.paths import cache_dir
from gguf_checkpoints import checkpoint_gguf, logits

pytestmark = pytest.mark.skipif(kernel_missing() is not None, reason=str(kernel_missing()))


@pytest.fixture(params=["Q4_1", "Q8_0"])   # the logits head: fp16 copy / kept Q8_0 (q8_head.py)
def packs(monkeypatch, tmp_path, request):
    monkeypatch.setenv("CAPSULE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = gguf_weights.int4_linears
    monkeypatch.setattr(gguf_weights, "int4_linears", lambda *a: calls.append(1) or real(*a))
    # layer 1 keeps a Q8_0 projection: it stays dense, in the cache's layout too
    path, _ = checkpoint_gguf("llama", tmp_path, default_qtype="Q4_1",
                              qtypes={"blk.0.attn_q.weight": "Q4_0", "blk.1.ffn_down.weight": "Q8_0",
                                      "output.weight": request.param})
    return path, calls, Q8Head if request.param == "Q8_0" else HalfHead


def _entry() -> "os.PathLike":
    (entry,) = (cache_dir() / "gguf").glob("*-int4.safetensors")
    return entry


def test_the_second_open_maps_what_the_first_packed(packs):
    path, calls, head = packs
    ids = torch.arange(3, 40).view(1, -1)
    first, info = load_model(path, linears="int4")
    want = logits(first, ids)
    second, info2 = load_model(path, linears="int4")
    assert len(calls) == 1 and info2.linears == info.linears == "int4 (1 of 2 layers)"
    assert [isinstance(x, Int4Linears) for x in second.linears] == [True, False]
    assert all(isinstance(m, Q4KernelMatrix) for m in second.linears[0].matrices().values())
    assert isinstance(first.head, head) and isinstance(second.head, head)
    assert torch.equal(logits(second, ids), want)
    assert stat.S_IMODE(os.stat(_entry()).st_mode) == 0o600


@pytest.mark.parametrize("harm", ["truncate", "flip-metadata", "torch-version", "garbage", "head-shape",
                                  "matrix-shape"])
def test_an_entry_that_is_off_is_packed_again(packs, harm, monkeypatch):
    path, calls, _ = packs
    ids = torch.arange(3, 40).view(1, -1)
    want = logits(load_model(path, linears="int4")[0], ids)
    entry = _entry()
    data = entry.read_bytes()
    if harm == "truncate":
        entry.write_bytes(data[: len(data) // 2])
    elif harm == "flip-metadata":                      # the key no longer matches
        at = data.index(b"capsule-int4-")
        entry.write_bytes(data[:at] + b"X" + data[at + 1:])
    elif harm in ("head-shape", "matrix-shape"):       # key and names right, a tensor a row short
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file
        with safe_open(str(entry), "pt") as f:
            meta = f.metadata()
        tensors = load_file(str(entry))
        name = ("head.scales" if "head.scales" in tensors else "head") if harm == "head-shape" else "0.qkv.d"
        tensors[name] = tensors[name][:-1].clone()
        save_file(tensors, str(entry), metadata=meta)
    elif harm == "torch-version":                      # packed by another torch: its layout may differ
        monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    else:
        entry.write_bytes(b"\xff" * 64)
    got = logits(load_model(path, linears="int4")[0], ids)
    assert len(calls) == 2 and torch.equal(got, want)
    assert logits(load_model(path, linears="int4")[0], ids).equal(want) and len(calls) == 2   # rewritten


@pytest.mark.skipif(torch_kernel_missing() is not None, reason=str(torch_kernel_missing()))
def test_an_entry_packed_for_the_other_kernel_is_packed_again(packs, monkeypatch):
    # torch's packing (a build without the C kernels) is not the C kernel's, nor the reverse
    from edge_kernels import q4_linear_cpu
    path, calls, _ = packs
    ids = torch.arange(3, 40).view(1, -1)
    for off, want_type, n in ((True, Int4Matrix, 1), (False, Q4KernelMatrix, 2), (True, Int4Matrix, 3)):
        monkeypatch.setattr(q4_linear_cpu, "missing", (lambda: "not built") if off else (lambda: None))
        model = load_model(path, linears="int4")[0]
        assert len(calls) == n and all(isinstance(m, want_type) for m in model.linears[0].matrices().values())
        logits(model, ids)
