"""runtime.kv_dtype: a K/V cache in another dtype than the weights'.

Exactness: fp32 K/V under fp32 weights keeps the 1e-4 logit parity with transformers
(test_llm_parity.py, unchanged); fp16/bf16 K/V rounds each element once on write, so it is
not parity-exact, but deterministic: a continuation after checkpoint -> restore is bit-exact.
"""
from __future__ import annotations

import pytest
import torch

from capsule import CapsuleMismatch, Session

RT = {"kv_pool_mb": 4, "max_context": 512}
PROMPT = "user: the red cup is on the table, the blue one in bay 2. bring the red one.\nrobot:"
HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
FACTS = ["The red cup is fragile.", "The charger is in bay 2.", "Alice likes green tea."]


def _open(path, kv_dtype=None, **kw):
    rt = dict(RT) if kv_dtype is None else {**RT, "kv_dtype": kv_dtype}
    return Session.open(path, model="builtin:tiny", device="cpu", runtime=rt, **kw)


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_pool_holds_kv_in_its_dtype_at_half_the_bytes_per_block(tmp_path, kv):
    with _open(tmp_path / "a") as full, _open(tmp_path / "b", kv) as half:
        assert full.engine.pool.tensor.dtype == torch.float32
        assert half.engine.pool.tensor.dtype == HALF[kv]
        assert half.engine.runner.model.dtype == torch.float32          # the weights stay fp32
        assert half.engine.pool.block_bytes * 2 == full.engine.pool.block_bytes
        assert half.engine.pool.num_blocks == 2 * full.engine.pool.num_blocks   # same kv_pool_mb
        assert half.checkpointer.binding.labels["layout"]["kv_dtype"] == kv
        for s in (full, half):
            s.append(PROMPT)
            s.generate(1)                                  # prefills the prompt's K/V
        n = len(full.tokens()) - 1
        a, b = _prompt_kv(full, n), _prompt_kv(half, n)   # (n, L, 2, KV, hd)
        assert n > 16 and b.dtype == HALF[kv]
        # layer 0's K/V depend on the embeddings only: the half pool holds them rounded once
        assert torch.equal(b[:, 0], a[:, 0].to(HALF[kv]))
        # deeper layers read rounded K/V: close, not equal
        deep = (b[:, 1].float() - a[:, 1]).abs().max().item()
        assert 0 < deep < 0.05 * a[:, 1].abs().max().item()


def _prompt_kv(s, n):
    table, pool = s.engine.streams["main"].table, s.engine.pool
    assert table.num_cached >= n
    slots = torch.tensor(table.slots_at(list(range(n))))
    bs = pool.block_size
    return pool.tensor[slots // bs, :, :, slots % bs]


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_greedy_generation_works_and_logits_stay_close(tmp_path, kv):
    with _open(tmp_path / "a") as full, _open(tmp_path / "b", kv) as half:
        for s in (full, half):
            s.append(PROMPT)
        n = len(full.tokens())
        half.generate(16)
        got = half.tokens()[n:]
        assert len(got) == 16 and all(0 <= t < half.tokenizer.vocab_size for t in got)
        # the next-token logits of the same prefix, fp32 K/V vs rounded K/V
        full.append(half.tokenizer.decode(got))
        ids = full.tokens()
        a, b = _last_logits(full, ids), _last_logits(half, ids)
        assert (a - b).abs().max().item() < 0.02 * a.abs().max().item()


def _last_logits(s, ids):
    from capsule.llm import BlockTable
    table = BlockTable(s.engine.pool)
    try:
        return s.engine.runner.prefill(ids, table).float()
    finally:
        table.truncate(0)


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_continuation_after_restore_is_bit_exact(tmp_path, kv, temperature):
    seed = 7 if temperature else None
    with _open(tmp_path / "twin", kv) as twin:
        twin.append(PROMPT)
        twin.generate(6, temperature=temperature, seed=seed)
        twin.generate(20, temperature=temperature)
        want = twin.tokens()
    with _open(tmp_path / "s", kv) as s:
        s.append(PROMPT)
        s.generate(6, temperature=temperature, seed=seed)
        epoch = s.checkpoint()
    with _open(tmp_path / "s", kv) as s:
        assert s.restored_epoch == epoch and s.engine.pool.tensor.dtype == HALF[kv]
        s.generate(20, temperature=temperature)
        assert s.tokens() == want


def test_memory_facts_are_rounded_once_into_a_half_pool(tmp_path):
    def region_kv(s):
        st = s.engine.streams["main"]
        bs = s.engine.pool.block_size
        rows = [s.engine.pool.tensor[st.table.blocks[p // bs], :, :, p % bs]
                for _, pos, n in st.region.facts for p in range(pos, pos + n)]
        return torch.stack(rows)                                         # (n, L, 2, KV, hd)

    got, epoch, want = {}, None, None
    for kv in (None, "float16"):
        with _open(tmp_path / f"m-{kv}", kv, memory={"embedder": None, "region_tokens": 64, "max_fact_tokens": 32}) as s:
            for t in FACTS:
                s.remember(t)
            s.append("user: where is the charger?\nassistant:")
            s.generate(4, memory_k=2)
            got[kv] = region_kv(s)
            epoch = s.checkpoint()
            s.generate(8)
            want = s.tokens()
    # facts are encoded in the weights' dtype, rotated in fp32, then rounded once to the pool's
    assert got["float16"].dtype == torch.float16 and len(got["float16"]) > 0
    assert torch.equal(got["float16"], got[None].to(torch.float16))
    with _open(tmp_path / "m-float16", "float16", memory={"embedder": None, "region_tokens": 64, "max_fact_tokens": 32}) as s:
        assert s.restored_epoch == epoch
        s.generate(8)
        assert s.tokens() == want


def test_a_half_kv_capsule_is_refused_by_a_float32_kv_session(tmp_path):
    with _open(tmp_path / "s", "float16") as s:
        s.append(PROMPT)
        s.checkpoint()
    with pytest.raises(CapsuleMismatch, match="kv_dtype=float16 .*!= session .*kv_dtype=float32"):
        _open(tmp_path / "s", "float32")
    with pytest.raises(CapsuleMismatch, match="kv_dtype"):
        _open(tmp_path / "s")                                            # None: the weights' fp32


def test_kv_dtype_equal_to_the_weights_is_the_default_setup(tmp_path):
    # naming the weights' dtype changes nothing: such capsules restore either way
    with _open(tmp_path / "s") as s:
        s.append(PROMPT)
        epoch = s.checkpoint()
    with _open(tmp_path / "s", "float32") as s:
        assert s.restored_epoch == epoch and s.engine.pool.tensor.dtype == torch.float32
