"""An all-int4 or all-fp32 decoder's decode step in one C call (edge_kernels/decode_step_cpu.py,
capsule/llm/fused_step.py): it gives the Python layer loop's hidden states and writes the same K/V
(up to summation order), over rows of different lengths, a memory region's holes and an fp32 or
bf16 pool; its bits do not depend on the thread count; it applies only where every layer runs
the C Q4 kernel or every layer is dense fp32; a Session decodes through it and continues
bit-exactly across a restore; capsules are bound to the step they were taken with."""
from __future__ import annotations

import pytest
import torch

from capsule import CapsuleMismatch, Session
from capsule.errors import EngineUnavailable
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


def _open(path, model, linears="int4", **rt):
    return Session.open(path, model=str(model), tokenizer=TOKENIZER, device="cpu", memory={"embedder": None},
                        runtime={"linears": linears, "threads": 1, "kv_pool_mb": 16, "max_context": 1024, **rt})


@pytest.mark.parametrize("linears", ["int4", "dequantized"])
@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_the_step_gives_the_layer_loops_states_and_kv(int4_gguf, tmp_path, kv_dtype, linears):
    with _open(tmp_path / "s", int4_gguf, linears, kv_dtype=kv_dtype) as s:
        m, pool = s.engine.runner.model, s.engine.pool
        assert m.fused_step is not None and m.decode_attention == "cpu" and m.decode_step == "fused"
        for f in FACTS:
            s.remember(f)
        s.append("system: you are a robot.\n", stream="a", system=True)
        s.append("user: where is the charger?\nassistant:", stream="a")
        s.generate(3, stream="a", memory_k=2)                 # a region with holes before its facts
        s.append("user: " + "tell me a long story about bays. " * 6, stream="b")
        s.generate(2, stream="b")
        ids, pos, slots, tables = decode_rows(s, ["a", "b"])
        assert pos[0, 0] != pos[1, 0] and tables.shape[1] > 2
        step, out, kv = m.fused_step, {}, {}
        for kind in ("step", "loop"):
            m.fused_step = step if kind == "step" else None
            before = pool.tensor.clone()
            with torch.inference_mode():
                out[kind] = m(ids, pos, slots, tables, pool.tensor, slot_valid=pool.slot_valid)
            kv[kind] = pool.tensor.clone()
            pool.tensor.copy_(before)
        m.fused_step = step
    assert out["step"].shape == out["loop"].shape == (2, 1, 64)
    # the same weights and attention, the norms and SwiGLU (and fp32 matmuls) summed in another
    # order: fp32 rounding apart (a wrong layer, weight, slot or residual is off by O(1))
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


@pytest.mark.parametrize("linears", ["int4", "dequantized"])
def test_the_steps_bits_do_not_depend_on_the_threads(int4_gguf, tmp_path, linears):
    with _open(tmp_path / "s", int4_gguf, linears) as s:
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
        want = m.fused_step(x, plan, pool.tensor, m.scale, threads=1)
        want_kv = pool.tensor.clone()
        for threads in (2, 3, 16):
            pool.tensor.copy_(before)
            assert torch.equal(m.fused_step(x, plan, pool.tensor, m.scale, threads=threads), want)
            assert torch.equal(pool.tensor.view(torch.int32), want_kv.view(torch.int32))   # free slots: any bits
        assert torch.equal(x, m.p("model.embed_tokens.weight")[ids.view(-1)])   # its input untouched
        # bad arguments are refused before the kernel runs
        with pytest.raises(ValueError, match="x must be"):
            m.fused_step(x[:1], plan, pool.tensor, m.scale)
        with pytest.raises(ValueError, match="kv_pool must be"):
            m.fused_step(x, plan, pool.tensor[:, :1], m.scale)
        bare = DecodePlan(tables, pos[:, 0] + 1, pool.slot_valid, pool.tensor.shape[0], pool.block_size)
        with pytest.raises(ValueError, match="slots and RoPE"):
            m.fused_step(x, bare, pool.tensor, m.scale)


def test_the_step_applies_only_where_every_layer_runs_the_c_kernel_or_is_fp32(tmp_path, monkeypatch):
    from edge_kernels import q4_linear_cpu
    path, _ = checkpoint_gguf("llama", tmp_path / "a", default_qtype="Q4_1")
    assert load_model(path, linears="int4")[0].fused_step is not None
    dense = load_model(path)[0]                     # dequantized: the loop until set_decode_step says
    assert dense.fused_step is None and dense.fused_step_unsupported() is None
    dense.set_decode_step("fused")
    assert dense.fused_step is not None and dense.decode_step == "layers"        # attention "torch"
    dense.set_decode_attention("cpu")
    assert dense.decode_step == "fused"
    assert "fp32" in load_model(path, dtype=torch.bfloat16)[0].fused_step_unsupported()
    mixed, _ = checkpoint_gguf("llama", tmp_path / "b", default_qtype="Q4_1",
                               qtypes={"blk.1.ffn_down.weight": "Q8_0"})          # layer 1 stays dense
    model = load_model(mixed, linears="int4")[0]
    assert model.fused_step is None and "not all int4" in model.fused_step_unsupported()
    with pytest.raises(ValueError, match="not all int4"):
        model.set_decode_step("fused")
    with pytest.raises(ValueError, match="decode step must be one of"):
        model.set_decode_step("fast")
    if torch_kernel_missing() is None:                                           # torch's int4 kernel
        monkeypatch.setattr(q4_linear_cpu, "missing", lambda: "not built")
        assert load_model(path, linears="int4")[0].fused_step is None


@pytest.mark.parametrize("linears", ["int4", "dequantized"])
def test_a_session_decodes_through_the_step_and_continues_bit_exactly(int4_gguf, tmp_path, monkeypatch, linears):
    calls = []
    real = decode_step_cpu.DecodeStep.__call__
    monkeypatch.setattr(decode_step_cpu.DecodeStep, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    with _open(tmp_path / "s", int4_gguf, linears) as s:
        s.append("user: bring me the red cup from the kitchen\n")
        s.generate(4)
        epoch = s.checkpoint()
        s.generate(8)
        want = s.tokens()
    assert len(calls) >= 11
    with _open(tmp_path / "s", int4_gguf, linears) as s:
        assert s.restored_epoch == epoch
        s.generate(8)
        assert s.tokens() == want


def test_a_capsule_continues_under_the_decode_step_it_was_taken_with(int4_gguf, tmp_path):
    def run(path, linears, **rt):
        with _open(path, int4_gguf, linears, **rt) as s:
            s.append("user: bring me the red cup from the kitchen\n")
            s.generate(4)
            epoch = s.checkpoint()
            s.generate(6)
            return epoch, s.tokens()
    # dense fp32 under the layer loop, as every SDK before runtime.decode_step decoded it
    epoch, want = run(tmp_path / "loop", "dequantized", decode_step="layers")
    with _open(tmp_path / "loop", int4_gguf, "dequantized") as s:    # "auto" picks the C step, then finds the loop
        assert s.restored_epoch == epoch and s.engine.runner.model.decode_step == "layers"
        s.generate(6)
        assert s.tokens() == want
        s.checkpoint()
    with pytest.raises(CapsuleMismatch, match="decode_step"):
        _open(tmp_path / "loop", int4_gguf, "dequantized", decode_step="fused")
    # and the other way: a fused capsule is refused by the loop; int4's loop is named too
    for linears in ("dequantized", "int4"):
        epoch, want = run(tmp_path / linears, linears)
        with pytest.raises(CapsuleMismatch, match="decode_step"):
            _open(tmp_path / linears, int4_gguf, linears, decode_step="layers")
        with _open(tmp_path / linears, int4_gguf, linears, decode_step="fused") as s:
            assert s.restored_epoch == epoch
            s.generate(6)
            assert s.tokens() == want
    with _open(tmp_path / "int4-loop", int4_gguf, "int4", decode_step="layers") as s:
        assert s.engine.runner.model.fused_step is None
        s.append("hello")
        s.checkpoint()
    with _open(tmp_path / "int4-loop", int4_gguf, "int4") as s:       # "auto" finds the loop
        assert s.restored_epoch is not None and s.engine.runner.model.decode_step == "layers"


def test_an_explicit_fused_step_that_cannot_run_says_why(int4_gguf, tmp_path):
    with pytest.raises(EngineUnavailable, match="decode_step='fused' cannot run.*decode_attention 'cpu'"):
        _open(tmp_path / "s", int4_gguf, "dequantized", decode_step="fused", decode_attention="torch")
    with _open(tmp_path / "t", int4_gguf, "dequantized", decode_attention="torch") as s:   # "auto": the loop
        assert s.engine.runner.model.decode_step == "layers" and s.engine.runner.model.fused_step is None
