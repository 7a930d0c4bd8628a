"""The fp16 / bf16 memory-injection contract (docs/MEMORY.md, "Low-precision pools"), on CPU and,
CUDA-marked, on the GPU: what is bit-identical and what only equals a prefill to rounding."""
from __future__ import annotations

import pytest
import torch

from capsule.llm import BlockTable, KVPool, load_model
from capsule.llm.paged_attention import write_kv
from capsule.llm.rope import RopeConfig, apply_rope, rope_tables
from capsule.memory.encode import encode_fact
from edge_kernels.rope import rotate_scatter

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
LOW = [torch.float16, torch.bfloat16]
L, T, KV, HD, BS = 2, 9, 3, 16, 8


def _fp32_rotation(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference on the CPU: the fp32 rotation of k (L, T, KV, hd), not rounded."""
    kf, half = k.float().cpu(), k.shape[-1] // 2
    return kf * cos + torch.cat((-kf[..., half:], kf[..., :half]), -1) * sin


def _read(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return pool[slots // BS, :, :, slots % BS].transpose(0, 1).cpu()       # (L, T, 2, KV, hd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compute, pool_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.float16)])
def test_what_injection_writes_into_a_low_precision_pool(device, compute, pool_dtype):
    cos, sin = rope_tables(RopeConfig(theta=10000.0), HD, 4096, device)
    g = torch.Generator().manual_seed(7)
    k = (4 * torch.randn(L, T, KV, HD, generator=g)).to(compute)            # the same pre-RoPE keys
    v = torch.randn(L, T, KV, HD, generator=g).to(compute)
    positions = torch.arange(4000, 4000 + T, device=device)
    slots = torch.tensor([BS + 3 + i if i < 5 else 3 * BS + i - 5 for i in range(T)], device=device)
    injected = torch.zeros(4, L, 2, BS, KV, HD, dtype=pool_dtype, device=device)
    rotate_scatter(injected, k, v, positions, slots, cos, sin)
    prefilled = torch.zeros_like(injected)                                  # what Decoder.forward writes
    for layer in range(L):
        kd, vd = k[layer].to(device), v[layer].to(device)
        write_kv(prefilled[:, layer, 0], prefilled[:, layer, 1], slots,
                 apply_rope(kd, cos[positions], sin[positions]), vd)
    got, want = _read(injected, slots), _read(prefilled, slots)
    # bit-identical: the values (a copy, rounded to the pool as a prefill rounds them) ...
    assert torch.equal(got[:, :, 1], want[:, :, 1])
    # ... and the keys: the fp32 rotation rounded once, the same bytes on CPU and CUDA
    c, s = cos[positions].cpu().view(1, T, 1, HD), sin[positions].cpu().view(1, T, 1, HD)
    assert torch.equal(got[:, :, 0], _fp32_rotation(k, c, s).to(pool_dtype))
    if compute == torch.float32:   # fp32 compute, fp16 pool: a prefill rounds the same rotation once
        assert torch.equal(got[:, :, 0], want[:, :, 0])
        return
    # fp16 / bf16 compute: the prefill rotates in that dtype (rounded cos/sin, each product and
    # the sum rounded), so its keys differ, by at most ~2 units in the last place of |k|
    eps = torch.finfo(pool_dtype).eps
    scale = want[:, :, 0].float().abs().amax(dim=-1, keepdim=True)        # per head vector
    err = (got[:, :, 0].float() - want[:, :, 0].float()).abs()
    assert (err <= 2 * eps * scale).all(), (err / (eps * scale)).max()
    assert not torch.equal(got[:, :, 0], want[:, :, 0])                   # not bit-identical


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
def test_a_fact_in_a_low_precision_model_equals_its_prefill_to_rounding(device, dtype):
    model, _ = load_model("builtin:tiny", vocab_size=1000, dtype=dtype, device=device)
    model.prepare_rope(512)
    ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    fact = encode_fact(model, ids)                          # at positions 0..11, in the model dtype
    assert fact.k_pre.dtype == dtype
    p = 300
    pool = KVPool(model.cfg, pool_bytes=1 << 21, block_size=16, dtype=dtype, device=device)
    table = BlockTable(pool)
    table.ensure_capacity(p + len(ids))
    slots = table.slots(p, p + len(ids))
    table.set_valid(0, p, False)                            # the fact alone, at p..p+11
    with torch.inference_mode():
        model(torch.tensor([ids], device=device), torch.arange(p, p + len(ids), device=device).view(1, -1),
              torch.tensor(slots, device=device), torch.tensor([table.blocks], device=device), pool.tensor,
              slot_valid=pool.slot_valid)
    s = torch.tensor(slots, device=device)
    want = pool.tensor[s // 16, :, :, s % 16].float().cpu()                  # (T, L, 2, KV, hd)

    def inject(at: int) -> torch.Tensor:
        target = torch.zeros_like(pool.tensor)
        rotate_scatter(target, fact.k_pre, fact.v, torch.arange(at, at + len(ids), device=device), s,
                       model.rope_cos, model.rope_sin)
        return target[s // 16, :, :, s % 16]

    got = inject(p)
    assert torch.equal(got[:, :, 1].cpu(), fact.v.transpose(0, 1))           # the stored values, bit for bit
    eps = torch.finfo(dtype).eps
    tol = 4 * eps * want.abs().max().item()
    err = (got.float().cpu() - want).abs().max().item()
    assert err <= tol, (err, tol)                           # equal to the prefill to rounding only
    slipped = (inject(p + 1)[:, :, 0].float().cpu() - want[:, :, 0]).abs().max().item()
    assert slipped > 5 * tol                                # the tolerance still sees a wrong position
