"""Memory facts: pre-RoPE encoding, rotate + scatter injection, the FactKV byte format."""
from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch

from capsule.errors import UnsupportedArchitecture
from capsule.llm import BlockTable, KVPool, RopeConfig, load_model
from capsule.memory.encode import FactKV, encode_fact
from edge_kernels.rope import check_reinjectable, rotate_scatter, rotate_scatter_tokens
from hf_checkpoints import CHECKPOINT_KINDS, make_checkpoint

TOL = 1e-5
T_FACT = 12


@pytest.fixture(scope="module", params=CHECKPOINT_KINDS)
def model(request, tmp_path_factory):
    m, _ = load_model(make_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))
    m.prepare_rope(256)
    return m


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pool(model) -> KVPool:
    return KVPool(model.cfg, pool_bytes=1 << 20, block_size=16, dtype=torch.float32, device="cpu")


def _gather(pool_t: torch.Tensor, slots: list[int]) -> torch.Tensor:
    s = torch.tensor(slots)
    bs = pool_t.shape[3]
    return pool_t[s // bs, :, :, s % bs]                                # (T, L, 2, KV, hd)


def _prefill_alone(model, ids: list[int], p: int) -> tuple[KVPool, list[int]]:
    """Decoder.forward over the fact alone at positions p..p+T-1, fresh block table."""
    pool = _pool(model)
    table = BlockTable(pool)
    T = len(ids)
    table.ensure_capacity(p + T)
    slots = table.slots(p, p + T)
    table.set_valid(0, p, False)   # the fact alone: the slots before it are holes
    with torch.inference_mode():
        model(torch.tensor([ids]), torch.arange(p, p + T).view(1, T), torch.tensor(slots),
              torch.tensor([table.blocks]), pool.tensor, slot_valid=pool.slot_valid)
    return pool, slots


def _inject(model, fact: FactKV, pool_like: torch.Tensor, slots: list[int], p: int) -> torch.Tensor:
    target = torch.zeros_like(pool_like)
    rotate_scatter(target, fact.k_pre, fact.v, torch.arange(p, p + fact.n_tokens), torch.tensor(slots),
                   model.rope_cos, model.rope_sin)
    return target


@pytest.mark.parametrize("p", [0, 37])
def test_injected_fact_equals_prefill_at_serving_position(model, p):
    ids = _ids(T_FACT, seed=3)
    fact = encode_fact(model, ids)
    cfg = model.cfg
    assert fact.n_tokens == T_FACT and fact.k_pre.dtype == torch.float32
    assert tuple(fact.k_pre.shape) == (cfg.num_layers, T_FACT, cfg.num_kv_heads, cfg.head_dim)
    ref, slots = _prefill_alone(model, ids, p)
    want = _gather(ref.tensor, slots)                                    # (T, L, 2, KV, hd)
    got = _gather(_inject(model, fact, ref.tensor, slots, p), slots)
    for layer in range(cfg.num_layers):
        for kv in (0, 1):
            err = (got[:, layer, kv] - want[:, layer, kv]).abs().max().item()
            assert err < TOL, (p, layer, "KV"[kv], err)
    # a one-position slip must be caught by the same comparison
    slipped = _gather(_inject(model, fact, ref.tensor, slots, p + 1), slots)
    assert (slipped[:, :, 0] - want[:, :, 0]).abs().max().item() > 100 * TOL


def test_context_window_encoding_matches_full_prefill(model):
    ctx, ids = _ids(8, seed=4), _ids(T_FACT, seed=5)
    fact = encode_fact(model, ids, context_ids=ctx)
    pool = _pool(model)
    table = BlockTable(pool)
    n = len(ctx) + len(ids)
    table.ensure_capacity(n)
    slots = table.slots(0, n)
    capture: list = []
    with torch.inference_mode():
        model(torch.tensor([ctx + ids]), torch.arange(n).view(1, n), torch.tensor(slots),
              torch.tensor([table.blocks]), pool.tensor, capture=capture)
    assert len(capture) == model.cfg.num_layers
    k_want = torch.stack([k[len(ctx):] for k, _ in capture])             # (L, T, KV, hd)
    v_want = torch.stack([v[len(ctx):] for _, v in capture])
    assert (fact.k_pre - k_want).abs().max().item() < TOL
    assert (fact.v - v_want).abs().max().item() < TOL
    # injected at its own positions, the fact rebuilds exactly what the full prefill cached
    fact_slots = slots[len(ctx):]
    got = _gather(_inject(model, fact, pool.tensor, fact_slots, len(ctx)), fact_slots)
    assert (got - _gather(pool.tensor, fact_slots)).abs().max().item() < TOL
    # window 0 differs from window 8 past layer 0: the context really was attended to
    alone = encode_fact(model, ids)
    assert (alone.k_pre[0] - fact.k_pre[0]).abs().max().item() < TOL   # layer 0 sees no context
    assert (alone.v[-1] - fact.v[-1]).abs().max().item() > TOL


def test_encode_fact_validates_ids(model):
    with pytest.raises(ValueError, match="empty"):
        encode_fact(model, [])
    with pytest.raises(ValueError, match="vocabulary"):
        encode_fact(model, [1, 512])
    with pytest.raises(ValueError, match="vocabulary"):
        encode_fact(model, [3], context_ids=[-1])
    with pytest.raises(ValueError, match="ints"):
        encode_fact(model, ["a", "b"])


# -- the byte format ---------------------------------------------------------------------------
def _fact(dtype: torch.dtype, T: int = 5) -> FactKV:
    g = torch.Generator().manual_seed(7)
    return FactKV(torch.randn(2, T, 3, 8, generator=g).to(dtype), torch.randn(2, T, 3, 8, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_factkv_round_trip_is_exact(dtype):
    fact = _fact(dtype)
    back = FactKV.from_bytes(fact.to_bytes(), expect=(2, 3, 8, dtype))
    assert back.k_pre.dtype == dtype and back.n_tokens == 5
    assert torch.equal(back.k_pre, fact.k_pre) and torch.equal(back.v, fact.v)
    assert torch.equal(FactKV.from_bytes(bytearray(fact.to_bytes()), expect=(2, 3, 8, dtype)).v, fact.v)
    # one layer, one token: the token-major view of the bytes is already contiguous, and still
    # the parsed fact owns its memory (writable, not aliasing the input buffer)
    one = FactKV(torch.randn(1, 1, 3, 8).to(dtype), torch.randn(1, 1, 3, 8).to(dtype))
    for data in (bytearray(one.to_bytes()), one.to_bytes()):
        parsed = FactKV.from_bytes(data, expect=(1, 3, 8, dtype))
        parsed.kv.add_(1)                              # a read-only alias would raise / warn here
        assert torch.equal(FactKV.from_bytes(data, expect=(1, 3, 8, dtype)).kv, one.kv)


def test_factkv_from_bytes_rejects_bad_data():
    data = _fact(torch.float16).to_bytes()
    exp = (2, 3, 8, torch.float16)
    garbled = bytearray(data)
    garbled[-3] ^= 0x40
    longer_t = bytearray(data)
    struct.pack_into("<I", longer_t, 16, 6)                           # T field: 5 -> 6
    bad_code = bytearray(data)
    struct.pack_into("<H", bad_code, 10, 99)
    cases = [(data[:-1], "truncated"), (data[:20], "truncated"), (data + b"\0", "trailing"),
             (bytes(garbled), "crc"), (b"XXXXXXXX" + data[8:], "magic"), (bytes(longer_t), "implies"),
             (bytes(bad_code), "dtype code"), ("text", "bytes")]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            FactKV.from_bytes(bad, expect=exp)
    for wrong in [(3, 3, 8, torch.float16), (2, 2, 8, torch.float16), (2, 3, 16, torch.float16),
                  (2, 3, 8, torch.bfloat16)]:
        with pytest.raises(ValueError, match="another model"):
            FactKV.from_bytes(data, expect=wrong)
    with pytest.raises(ValueError, match="expect"):
        FactKV.from_bytes(data, expect=(2, 3, 8))
    with pytest.raises(ValueError):
        FactKV(torch.zeros(2, 0, 3, 8), torch.zeros(2, 0, 3, 8))


# -- rotate_scatter numerics and validation -----------------------------------------------------
@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.bfloat16])
def test_rotate_scatter_rounds_once(pool_dtype):
    from capsule.llm.rope import apply_rope, rope_tables
    L, T, KV, hd, bs = 2, 9, 3, 16, 8
    cos, sin = rope_tables(RopeConfig(theta=10000.0), hd, 200)
    g = torch.Generator().manual_seed(11)
    k = (4 * torch.randn(L, T, KV, hd, generator=g)).to(pool_dtype)
    v = torch.randn(L, T, KV, hd, generator=g).to(pool_dtype)
    pool = torch.zeros(4, L, 2, bs, KV, hd, dtype=pool_dtype)
    positions = torch.arange(150, 150 + T)
    slots = torch.tensor([1 * bs + 3 + i if i < 5 else 3 * bs + i - 5 for i in range(T)])
    rotate_scatter(pool, k, v, positions, slots, cos, sin)
    got = pool[slots // bs, :, :, slots % bs]                           # (T, L, 2, KV, hd)
    c, s = cos[positions].view(1, T, 1, hd), sin[positions].view(1, T, 1, hd)
    kf = k.float()
    want_k = (kf * c + torch.cat((-kf[..., hd // 2:], kf[..., :hd // 2]), -1) * s).to(pool_dtype)
    assert torch.equal(got[:, :, 0], want_k.transpose(0, 1))
    assert torch.equal(got[:, :, 1], v.transpose(0, 1))
    # rotating in the low precision (two roundings) would differ: the check has teeth
    low = torch.stack([apply_rope(k[i], cos[positions], sin[positions]) for i in range(L)])
    assert not torch.equal(low, want_k)
    untouched = torch.ones(4, bs, dtype=torch.bool)
    untouched[slots // bs, slots % bs] = False
    assert pool.permute(0, 3, 1, 2, 4, 5)[untouched].abs().sum() == 0


def test_rotate_scatter_validates():
    L, T, KV, hd = 2, 3, 2, 8
    pool = torch.zeros(2, L, 2, 4, KV, hd)
    k = v = torch.zeros(L, T, KV, hd)
    pos, slots = torch.arange(T), torch.arange(T)
    cos = sin = torch.ones(16, hd)
    bad = [((pool[:, 0], k, v, pos, slots, cos, sin), "kv_pool"),
           ((pool, k[:, :, :1], v, pos, slots, cos, sin), "k_pre"),
           ((pool, k, v[:, :2], pos, slots, cos, sin), "v must"),
           ((pool, k, v, pos.int(), slots, cos, sin), "positions"),
           ((pool, k, v, pos, slots[:2], cos, sin), "slots"),
           ((pool, k, v, pos, slots, cos[:, :4], sin[:, :4]), "tables"),
           ((pool, k, v, pos, slots, cos.half(), sin.half()), "fp32"),
           ((pool, k, v, pos + 14, slots, cos, sin), "positions must lie"),
           ((pool, k, v, pos, slots + 6, cos, sin), "slots must lie"),
           ((pool, k, v, pos, torch.tensor([1, 2, 1]), cos, sin), "distinct")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            rotate_scatter(*args)
    assert pool.abs().sum() == 0


def test_rotate_scatter_tokens_concatenates_parts_and_leaves_them_alone():
    from capsule.llm.rope import rope_tables
    L, KV, hd, bs = 2, 2, 16, 4
    cos, sin = rope_tables(RopeConfig(), hd, 64)
    facts = [_fact(torch.float32, T) for T in (3, 5, 2)]
    facts = [FactKV(f.k_pre[:, :, :KV].contiguous(), f.v[:, :, :KV].contiguous()) for f in facts]
    for f in facts:                                   # token-major view of the same numbers
        assert tuple(f.kv.shape) == (f.n_tokens, 2, 2, KV, 8)
        assert torch.equal(f.kv[:, :, 0], f.k_pre.transpose(0, 1))
    parts = [torch.randn(T, L, 2, KV, hd) for T in (3, 5, 2)]
    before = [p.clone() for p in parts]
    pos, slots = torch.arange(20, 30), torch.randperm(12)[:10] + 4
    got = torch.zeros(4, L, 2, bs, KV, hd)
    rotate_scatter_tokens(got, parts, pos, slots, cos, sin)
    assert all(torch.equal(p, b) for p, b in zip(parts, before))
    joined = torch.cat(parts)                                        # (T, L, 2, KV, hd)
    want = torch.zeros_like(got)
    rotate_scatter(want, joined[:, :, 0].transpose(0, 1), joined[:, :, 1].transpose(0, 1), pos, slots, cos, sin)
    assert torch.equal(got, want)
    c, s = cos[pos].view(10, 1, 1, hd), sin[pos].view(10, 1, 1, hd)
    k = joined[:, :, 0]
    ref = k * c + torch.cat((-k[..., hd // 2:], k[..., :hd // 2]), -1) * s   # Decoder's formula
    assert torch.equal(got[slots // bs, :, 0, slots % bs], ref)                # bit-identical in fp32
    for bad, msg in (([torch.zeros(3, L, 2, KV, hd + 1)], "parts\\[0\\]"),
                     ([torch.zeros(3, L, 2, KV, hd, dtype=torch.long)], "floating"),
                     ([torch.zeros(4, L, 2, KV, hd)], "positions")):
        with pytest.raises(ValueError, match=msg):
            rotate_scatter_tokens(got, bad, pos[:3], slots[:3], cos, sin)


@pytest.mark.parametrize("first,T", [(0, 32), (5, 40), (13, 3), (4, 1), (2, 14)])
def test_rotate_scatter_to_consecutive_slots_equals_the_scatter(first, T):
    from capsule.llm.rope import rope_tables
    L, KV, hd, bs = 2, 2, 16, 8
    cos, sin = rope_tables(RopeConfig(), hd, 128)
    g = torch.Generator().manual_seed(first + T)
    parts = [torch.randn(n, L, 2, KV, hd, generator=g) for n in (T // 2, T - T // 2) if n]
    pos = torch.arange(30, 30 + T)
    run = torch.zeros(9, L, 2, bs, KV, hd)
    rotate_scatter_tokens(run, parts, pos, torch.arange(first, first + T) + bs, cos, sin)
    # the same tokens through the per-token scatter: slots written in reverse are not a run
    ref = torch.zeros_like(run)
    rev = [p.flip(0) for p in reversed(parts)]
    rotate_scatter_tokens(ref, rev, pos.flip(0), (torch.arange(first, first + T) + bs).flip(0), cos, sin)
    assert torch.equal(run, ref)
    assert run[1:].abs().sum() > 0 and run[0].abs().sum() == 0     # nothing outside the slots


def test_check_reinjectable():
    check_reinjectable(RopeConfig())
    check_reinjectable(RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0))
    for kind in ("yarn", "dynamic", "linear"):
        with pytest.raises(UnsupportedArchitecture):
            RopeConfig(rope_type=kind)                                # the loader refuses it too
        rope = object.__new__(RopeConfig)                             # bypass __post_init__
        object.__setattr__(rope, "rope_type", kind)
        with pytest.raises(UnsupportedArchitecture, match=kind):
            check_reinjectable(rope)
        with pytest.raises(UnsupportedArchitecture, match="re-rotated"):
            check_reinjectable(SimpleNamespace(rope_type=kind))
    with pytest.raises(UnsupportedArchitecture):
        check_reinjectable(object())


@pytest.mark.cuda
def test_rotate_scatter_cuda_matches_cpu():
    L, T, KV, hd, bs = 2, 7, 2, 16, 8
    from capsule.llm.rope import rope_tables
    cos, sin = rope_tables(RopeConfig(), hd, 64)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(L, T, KV, hd, generator=g), torch.randn(L, T, KV, hd, generator=g)
    pos, slots = torch.arange(20, 20 + T), torch.arange(5, 5 + T)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        cpu = torch.zeros(3, L, 2, bs, KV, hd, dtype=dtype)
        gpu = cpu.cuda()
        rotate_scatter(cpu, k, v, pos, slots, cos, sin)
        rotate_scatter(gpu, k, v, pos.cuda(), slots.cuda(), cos.cuda(), sin.cuda())
        # same fp32 tables, elementwise IEEE ops, one correctly rounded cast: bit-identical
        assert torch.equal(gpu.cpu(), cpu), dtype


def test_rotate_scatter_tokens_per_token_key_scale():
    # a (T,) scale tensor scales each token's keys (values untouched), as scaling it alone would
    from capsule.llm.rope import rope_tables
    L, KV, hd, bs = 2, 2, 16, 4
    cos, sin = rope_tables(RopeConfig(), hd, 64)
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(T, L, 2, KV, hd, generator=g) for T in (3, 4)]
    pos, slots = torch.arange(10, 17), torch.arange(7) + 4
    scale = torch.tensor([2.0, 2.0, 2.0, 0.5, 0.5, 0.5, 0.5])
    got = torch.zeros(4, L, 2, bs, KV, hd)
    rotate_scatter_tokens(got, parts, pos, slots, cos, sin, scale)
    want = torch.zeros_like(got)
    rotate_scatter_tokens(want, parts[:1], pos[:3], slots[:3], cos, sin, 2.0)
    rotate_scatter_tokens(want, parts[1:], pos[3:], slots[3:], cos, sin, 0.5)
    assert torch.equal(got, want) and got[:, :, 0].abs().sum() > 0
    plain = torch.zeros_like(got)
    rotate_scatter_tokens(plain, parts, pos, slots, cos, sin)
    assert torch.equal(got[:, :, 1], plain[:, :, 1]) and not torch.equal(got[:, :, 0], plain[:, :, 0])
    for bad in (torch.ones(6), torch.ones(7, dtype=torch.float64), torch.ones(7, 1)):
        with pytest.raises(ValueError, match="key_scale"):
            rotate_scatter_tokens(got, parts, pos, slots, cos, sin, bad)
