"""Contract 5: the decoder's logits match transformers on the same weights (fp32, 1e-4)."""
from __future__ import annotations

import pytest
import torch

from capsule.llm import BlockTable, DecodeRow, GraphRunner, KVPool, load_model
from capsule.state.regions import RegionRegistry
from hf_checkpoints import CHECKPOINT_KINDS, load_reference, make_checkpoint

TOL = 1e-4


def _runner(model, *, chunk: int = 16):
    pool = KVPool(model.cfg, pool_bytes=1 << 20, block_size=16, dtype=torch.float32, device="cpu")
    runner = GraphRunner(model, pool, RegionRegistry(), buckets=[1, 2, 4, 8], max_context=256,
                         prefill_chunk=chunk, use_cuda_graphs=False)
    return runner, pool


@pytest.fixture(scope="module", params=CHECKPOINT_KINDS)
def checkpoint(request, tmp_path_factory):
    folder = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, load_reference(folder)


def test_full_prefill_matches_transformers(checkpoint):
    kind, folder, ref = checkpoint
    model, info = load_model(folder)
    ids = torch.randint(0, 512, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits[0]                                  # (T, V)
    runner, pool = _runner(model, chunk=64)                        # one chunk: every position
    table = BlockTable(pool)
    table.ensure_capacity(50)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(50).view(1, -1), torch.tensor(table.slots(0, 50)),
                       torch.tensor([table.blocks]), pool.tensor)
        got = model.lm_head(hidden[0])
    assert (got - want).abs().max().item() < TOL, kind
    assert not info.untrained and len(info.weights_digest) == 64


def test_chunked_prefill_then_paged_decode_match_transformers(checkpoint):
    kind, folder, ref = checkpoint
    model, _ = load_model(folder)
    ids = torch.randint(0, 512, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids).logits[0]
    runner, pool = _runner(model, chunk=16)                        # 40 tokens = 3 chunks
    table = BlockTable(pool)
    last = runner.prefill(ids[0, :40].tolist(), table)
    assert (last - want[39]).abs().max().item() < TOL
    for p in range(40, 70):
        table.ensure_capacity(p + 1)
        logits = runner.decode([DecodeRow(int(ids[0, p]), p, table.slots(p, p + 1)[0], table.blocks)])
        table.num_cached = p + 1
        assert (logits[0] - want[p]).abs().max().item() < TOL, (kind, p)


def test_session_greedy_equals_transformers_greedy(tmp_path):
    from capsule import Session
    folder = make_checkpoint("qwen2", tmp_path / "ckpt", vocab_size=100277)
    ref = load_reference(folder)
    prompt = "robot: the red cup is on the table.\nuser: bring it"
    with Session.open(tmp_path / "store", model=folder, tokenizer="cl100k_base", device="cpu",
                      runtime={"kv_pool_mb": 8, "max_context": 512}) as s:
        s.append(prompt)
        prompt_ids = s.tokens()
        s.generate(12)
        got = s.tokens()[len(prompt_ids):]
    ids = torch.tensor([prompt_ids])
    want = []
    with torch.no_grad():
        for _ in range(12):  # transformers' greedy choice, one full forward per step
            nxt = int(ref(ids).logits[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert got == want
