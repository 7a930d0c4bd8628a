"""An all-int4 decoder's decode step in one C call (edge_kernels/decode_step_cpu.py, capsule/llm/q4_step.py):
it gives the Python layer loop's hidden states and writes the same K/V (up to the norms' and
SwiGLU's summation order), over rows of different lengths, a memory region's holes and an fp32 or
bf16 pool; its bits do not depend on the thread count; it applies only where every layer runs
the C Q4 kernel; a Session decodes through it and continues bit-exactly across a restore."""
from __future__ import annotations

import pytest
import torch

from capsule import Session
from capsule.llm import load_model
from capsule.llm.int4_linear import kernel_missing, torch_kernel_missing
from edge_kernels import decode_step_cpu
from edge_kernels.paged_decode_cpu import DecodePlan
from gguf_checkpoints import checkpoint_gguf, int4_session_gguf
from paged_cases import decode_rows

pytestmark = pytest.mark.skipif(kernel_missing() is not None, reason=str(kernel_missing()))
TOKENIZER = "r50k_base"
FACTS = ["The red cup is fragile.", "The charger is in bay 2.", "Alice likes green tea."]


@pytest.fixture(scope="module")
def int4_gguf(tmp_path_factory):
    return int4_session_gguf(tmp_path_factory.mktemp("step"), max_positions=2048)


def _open(path, model, **rt):
    return Session.open(path, model=str(model), tokenizer=TOKENIZER, device="cpu", memory={"embedder": None},
                        runtime={"linears": "int4", "threads": 1, "kv_pool_mb": 16, "max_context": 1024, **rt})


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_the_step_gives_the_layer_loops_states_and_kv(int4_gguf, tmp_path, kv_dtype):
    with _open(tmp_path / "s", int4_gguf, kv_dtype=kv_dtype) as s:
        m, pool = s.engine.runner.model, s.engine.pool
        assert m.step is not None and m.decode_attention == "cpu"
        for f in FACTS:
            s.remember(f)
        s.append("system: you are a robot.\n", stream="a", system=True)
        s.append("user: where is the charger?\nassistant:", stream="a")
        s.generate(3, stream="a", memory_k=2)                 # a region with holes before its facts
        s.append("user: " + "tell me a long story about bays. " * 6, stream="b")
        s.generate(2, stream="b")
        ids, pos, slots, tables = decode_rows(s, ["a", "b"])
        assert pos[0, 0] != pos[1, 0] and tables.shape[1] > 2
        step, out, kv = m.step, {}, {}
        for kind in ("step", "loop"):
            m.step = step if kind == "step" else None
            before = pool.tensor.clone()
            with torch.inference_mode():
                out[kind] = m(ids, pos, slots, tables, pool.tensor, slot_valid=pool.slot_valid)
            kv[kind] = pool.tensor.clone()
            pool.tensor.copy_(before)
        m.step = step
    assert out["step"].shape == out["loop"].shape == (2, 1, 64)
    # the same matmuls and attention, the norms and SwiGLU summed in another order: fp32 rounding
    # apart (a wrong layer, weight, slot or residual is off by O(1))
    assert 0 < (out["step"] - out["loop"]).abs().max().item() < 1e-4
    bs = before.shape[3]
    at = torch.zeros(before.shape[0], bs, dtype=torch.bool)                   # the rows' slots
    at.view(-1)[slots] = True
    bits = torch.int16 if before.dtype == torch.bfloat16 else torch.int32  # free slots may hold NaNs
    for kind in ("step", "loop"):                                             # nothing else written
        assert torch.equal(kv[kind].view(bits).permute(0, 3, 1, 2, 4, 5)[~at],
                           before.view(bits).permute(0, 3, 1, 2, 4, 5)[~at])
    new = {k: v.permute(0, 3, 1, 2, 4, 5)[at].float() for k, v in kv.items()}   # (2, L, 2, KV, hd)
    assert (new["step"] - new["loop"]).abs().max().item() < (2e-2 if kv_dtype else 1e-4)


def test_the_steps_bits_do_not_depend_on_the_threads(int4_gguf, tmp_path):
    with _open(tmp_path / "s", int4_gguf) as s:
        m, pool = s.engine.runner.model, s.engine.pool
        s.append("user: " + "stack the blue blocks. " * 9, stream="a")
        s.append("user: hello", stream="b")
        s.generate(2, stream=["a", "b"])
        ids, pos, slots, tables = decode_rows(s, ["a", "b"])
        cos, sin = m.rope_cos[pos.view(-1)], m.rope_sin[pos.view(-1)]
        plan = DecodePlan(tables, pos[:, 0] + 1, pool.slot_valid, pool.tensor.shape[0], pool.block_size,
                          slots=slots, rope=(cos, sin))
        x = m.p("model.embed_tokens.weight")[ids.view(-1)]
        before = pool.tensor.clone()
        want = m.step(x, plan, pool.tensor, m.scale, threads=1)
        want_kv = pool.tensor.clone()
        for threads in (2, 3, 16):
            pool.tensor.copy_(before)
            assert torch.equal(m.step(x, plan, pool.tensor, m.scale, threads=threads), want)
            assert torch.equal(pool.tensor.view(torch.int32), want_kv.view(torch.int32))   # free slots: any bits
        assert torch.equal(x, m.p("model.embed_tokens.weight")[ids.view(-1)])   # its input untouched
        # bad arguments are refused before the kernel runs
        with pytest.raises(ValueError, match="x must be"):
            m.step(x[:1], plan, pool.tensor, m.scale)
        with pytest.raises(ValueError, match="kv_pool must be"):
            m.step(x, plan, pool.tensor[:, :1], m.scale)
        bare = DecodePlan(tables, pos[:, 0] + 1, pool.slot_valid, pool.tensor.shape[0], pool.block_size)
        with pytest.raises(ValueError, match="slots and RoPE"):
            m.step(x, bare, pool.tensor, m.scale)


def test_the_step_applies_only_where_every_layer_runs_the_c_kernel(tmp_path, monkeypatch):
    from edge_kernels import q4_linear_cpu
    path, _ = checkpoint_gguf("llama", tmp_path / "a", default_qtype="Q4_1")
    assert load_model(path, linears="int4")[0].step is not None
    assert load_model(path)[0].step is None                                        # dequantized
    mixed, _ = checkpoint_gguf("llama", tmp_path / "b", default_qtype="Q4_1",
                               qtypes={"blk.1.ffn_down.weight": "Q8_0"})          # layer 1 stays dense
    assert load_model(mixed, linears="int4")[0].step is None
    if torch_kernel_missing() is None:                                           # torch's int4 kernel
        monkeypatch.setattr(q4_linear_cpu, "missing", lambda: "not built")
        assert load_model(path, linears="int4")[0].step is None


def test_a_session_decodes_through_the_step_and_continues_bit_exactly(int4_gguf, tmp_path, monkeypatch):
    calls = []
    real = decode_step_cpu.Q4DecodeStep.__call__
    monkeypatch.setattr(decode_step_cpu.Q4DecodeStep, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    with _open(tmp_path / "s", int4_gguf) as s:
        s.append("user: bring me the red cup from the kitchen\n")
        s.generate(4)
        epoch = s.checkpoint()
        s.generate(8)
        want = s.tokens()
    assert len(calls) >= 11
    with _open(tmp_path / "s", int4_gguf) as s:
        assert s.restored_epoch == epoch
        s.generate(8)
        assert s.tokens() == want
