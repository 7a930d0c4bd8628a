"""The C kernel's whole-layer decode call (DecodePlan.layer: RoPE on q and k, the new K/V written
into their slots, then attention) is bit-identical to what it replaces: rope.apply_rope +
paged_attention.write_kv + the attention kernel, for the output and for every byte of the pool;
and the Decoder's "cpu" decode step equals that unfused sequence bit for bit."""
from __future__ import annotations

import pytest
import torch

from capsule.llm import model as model_mod
from capsule.llm.paged_attention import write_kv
from capsule.llm.rope import apply_rope, rope_tables
from capsule.llm.config import RopeConfig
from capsule.session import Session
from edge_kernels.paged_decode_cpu import DecodePlan

from paged_cases import BS, H, HD, KV, NB, paged_case


def _projections(c: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, hd), k, v (B, KV, hd) as views of one fused projection, as int4's qkv gives them."""
    B, hd = c["q"].shape[0], c["q"].shape[-1]
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(B, 1, (H + 2 * KV) * hd, generator=g)
    q, k, v = y.split((H * hd, KV * hd, KV * hd), -1)
    return q.reshape(B, H, hd), k.reshape(B, KV, hd), v.reshape(B, KV, hd)


def _step(c: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's new token: the last of its length. (seq_lens, slots, cos, sin)."""
    lens = c["lens"].long()
    pos = lens - 1
    slots = c["tables"][torch.arange(len(lens)), pos // BS].long() * BS + pos % BS
    cos, sin = rope_tables(RopeConfig(theta=10000.0), c["q"].shape[-1], int(lens.max()))
    return lens, slots, cos[pos], sin[pos]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [HD, 48])
@pytest.mark.parametrize("holes", [False, True])
def test_layer_is_bit_identical_to_rope_write_then_attend(dtype, hd, holes):
    c = paged_case(pool_dtype=dtype, seed=5, hd=hd)
    q, k, v = _projections(c, seed=6)
    lens, slots, cos, sin = _step(c)
    valid = c["valid"] if holes else None
    want_pool, got_pool = c["pool"].clone(), c["pool"].clone()
    # the sequence it replaces
    kc, vc = want_pool[:, 1, 0], want_pool[:, 1, 1]
    write_kv(kc, vc, slots, apply_rope(k, cos, sin), v)
    want = DecodePlan(c["tables"], lens, valid, NB, BS)(apply_rope(q, cos, sin).contiguous(), kc, vc, hd ** -0.5)
    plan = DecodePlan(c["tables"], lens, valid, NB, BS, slots=slots, rope=(cos, sin))
    got = plan.layer(q, k, v, got_pool[:, 1, 0], got_pool[:, 1, 1], hd ** -0.5)
    assert torch.equal(got, want)
    assert torch.equal(got_pool.view(torch.uint8), want_pool.view(torch.uint8))   # every pool byte
    assert not torch.equal(got_pool, c["pool"])                                  # it did write


def test_a_bad_slot_or_plan_is_refused_before_anything_is_written():
    c = paged_case(seed=1)
    q, k, v = _projections(c, seed=2)
    lens, slots, cos, sin = _step(c)
    before = c["pool"].clone()
    bad = slots.clone()
    bad[1] = NB * BS                                      # one past the pool
    with pytest.raises(ValueError, match="slot ids in 0.."):
        DecodePlan(c["tables"], lens, None, NB, BS, slots=bad, rope=(cos, sin))
    with pytest.raises(ValueError, match="without slots"):
        DecodePlan(c["tables"], lens, None, NB, BS).layer(q, k, v, c["k"], c["v"], 0.1)
    plan = DecodePlan(c["tables"], lens, None, NB, BS, slots=slots, rope=(cos, sin))
    with pytest.raises(ValueError, match="contiguous heads"):
        plan.layer(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, c["k"], c["v"], 0.1)
    with pytest.raises(ValueError, match="fp32"):
        plan.layer(q, k.double(), v, c["k"], c["v"], 0.1)
    assert torch.equal(c["pool"], before)


def test_the_decoder_step_equals_the_unfused_sequence(tmp_path, monkeypatch):
    """A Session's "cpu" decode steps against the same Session's steps through the unfused
    sequence (patched in): equal greedy text, equal pool bytes, every step."""
    runs = {}
    for fused in (True, False):
        if not fused:
            def unfused(self, positions, slot_mapping, block_tables, kv_pool, slot_valid, cos, sin, _plan):
                plan = DecodePlan(block_tables, positions[:, 0] + 1, slot_valid, kv_pool.shape[0],
                                  kv_pool.shape[3])
                B, Hq, hd = positions.shape[0], self.cfg.num_heads, self.cfg.head_dim

                def kernel(q, k, v, k_cache, v_cache):
                    write_kv(k_cache, v_cache, slot_mapping, apply_rope(k, cos, sin), v)
                    return plan(apply_rope(q, cos, sin).reshape(B, Hq, hd).contiguous(), k_cache, v_cache,
                                self.scale).view(B, 1, Hq, hd)
                return kernel
            monkeypatch.setattr(model_mod.Decoder, "_decode_kernel", unfused)
        with Session.open(tmp_path / str(fused), device="cpu", model="builtin:tiny",
                          runtime={"kv_pool_mb": 16, "max_context": 1024, "decode_attention": "cpu"}) as s:
            s.append("user: " + "where is the charging bay? " * 6 + "\nassistant:", stream="a")
            s.append("user: hello\nassistant:", stream="b")
            texts = (s.generate(10, stream="a"), s.generate(6, stream=["a", "b"]))
            runs[fused] = (texts, s.tokens("a"), s.tokens("b"), _live_kv(s, "a"), _live_kv(s, "b"))
    assert runs[True][:3] == runs[False][:3]
    for got, want in zip(runs[True][3:], runs[False][3:]):   # every live K/V byte of each stream
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _live_kv(s: Session, stream: str) -> torch.Tensor:
    """The stream's cached K/V, slot by slot: (n, L, 2, KV, hd)."""
    pool, table = s.engine.pool, s.engine.streams[stream].table
    bs = pool.block_size
    slots = [(table.blocks[p // bs], p % bs) for p in range(table.num_cached)]
    return torch.stack([pool.tensor[b, :, :, o] for b, o in slots])
