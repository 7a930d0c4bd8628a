"""The ONNX Runtime LLM step (capsule.llm.engine_ort, onnx_step) equals Decoder.forward and writes
the KV pool in place (issue 15): prefill + 256 greedy decode steps on builtin:small, batched
rows and every random HF checkpoint kind, memory-region holes, the graph's in-place contract."""
from __future__ import annotations

import onnx
import pytest
import torch

from capsule.errors import EngineUnavailable
from capsule.llm import load_model
from capsule.llm.engine_ort import OrtStep
from capsule.llm.onnx_step import (INPUTS, KV_OUT, OUTPUTS, ROW_OUTPUTS, StepShape, build_step,
                                   step_bias, write_rows)
from hf_checkpoints import CHECKPOINT_KINDS, make_checkpoint

BS = 16
TOL = 1e-4


def _pool(model, nb: int, seed: int = 0) -> torch.Tensor:
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nb, cfg.num_layers, 2, BS, cfg.num_kv_heads, cfg.head_dim, generator=g) * 0.3


def _slots(tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (tables.gather(1, positions // BS) * BS + positions % BS).reshape(-1)


def test_prefill_and_256_greedy_decode_steps_equal_torch():
    torch.manual_seed(0)
    model, _ = load_model("builtin:small")
    model.prepare_rope(512)
    nb = 20                                            # 320 slots: prompt 40 + 256 steps
    tables = torch.arange(1, nb + 1)[None]
    pool_t, pool_o = _pool(model, nb + 1), None
    pool_o = pool_t.clone()
    ptr = pool_o.data_ptr()
    ort_step = OrtStep(model, threads=1)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 40))
    pos = torch.arange(40)[None]
    tokens_t, tokens_o = [], []
    worst = 0.0
    with torch.no_grad():
        for step in range(257):
            slot = _slots(tables, pos)
            h_t = model(ids, pos, slot, tables, pool_t)
            h_o = ort_step(ids_o if step else ids, pos, slot, tables, pool_o)
            lt, lo = model.lm_head(h_t[:, -1]), model.lm_head(h_o[:, -1])
            worst = max(worst, (lt - lo).abs().max().item())
            nt, no = int(lt.argmax()), int(lo.argmax())
            tokens_t.append(nt)
            tokens_o.append(no)
            ids, ids_o = torch.tensor([[nt]]), torch.tensor([[no]])
            pos = pos[:, -1:] + 1
    assert worst < TOL, worst
    assert tokens_o == tokens_t                       # identical greedy ids, 257 of them
    # the same K/V in the same slots (block 0: the scratch block the 40 -> 64 padding wrote to)
    assert torch.allclose(pool_o[1:], pool_t[1:], atol=TOL, rtol=0)
    assert pool_o.data_ptr() == ptr                   # written in place, never replaced
    assert {s.tokens for s in ort_step.shapes} == {64, 1}      # one session per bucketed shape


@pytest.fixture(scope="module", params=CHECKPOINT_KINDS)
def hf_model(request, tmp_path_factory):
    folder = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    model, _ = load_model(folder)
    model.prepare_rope(512)
    return model


def test_batched_rows_of_every_checkpoint_kind_equal_torch(hf_model):
    # three rows at different lengths: a 5-token prefill chunk each (starting at 0, 17 and 40),
    # then 256 batched greedy decode steps
    model = hf_model
    nb, B = 20, 3
    tables = torch.arange(1, B * nb + 1).view(B, nb)
    pool_t = _pool(model, B * nb + 1, seed=1)
    pool_o = pool_t.clone()
    step = OrtStep(model, threads=1)
    start = torch.tensor([0, 17, 40])
    pos = start[:, None] + torch.arange(5)
    ids = torch.randint(0, model.cfg.vocab_size, (B, 5), generator=torch.Generator().manual_seed(2))
    worst, same = 0.0, True
    with torch.no_grad():
        for _ in range(257):
            slot = _slots(tables, pos)
            lt = model.lm_head(model(ids, pos, slot, tables, pool_t)[:, -1])
            lo = model.lm_head(step(ids, pos, slot, tables, pool_o)[:, -1])
            worst = max(worst, (lt - lo).abs().max().item())
            same &= torch.equal(lt.argmax(-1), lo.argmax(-1))
            ids = lt.argmax(-1, keepdim=True)
            pos = pos[:, -1:] + 1
    assert worst < TOL, worst
    assert same                                            # identical greedy ids every step
    # the same K/V in the same slots; block 0 is the scratch block the padding tokens of the
    # bucketed 5 -> 8 token chunk wrote to (torch pads nothing)
    assert torch.allclose(pool_o[1:], pool_t[1:], atol=TOL, rtol=0)
    assert not torch.equal(pool_o[0], pool_t[0])
    assert int(pos.max()) <= nb * BS
    # the prefill chunk read only the blocks before its first position (40: 3 blocks)
    assert StepShape(B, 8, 3, B * nb + 1, BS) in step.shapes


def test_memory_region_holes_are_never_attended(hf_model):
    model = hf_model
    tables = torch.tensor([[1, 2, 3]])
    pool_t = _pool(model, 4, seed=3)
    pool_o = pool_t.clone()
    valid = torch.ones(4, BS, dtype=torch.bool)
    valid[1, 3:9] = False                                  # holes inside the live range
    valid[2, :5] = False
    pos = torch.tensor([[30]])
    ids = torch.tensor([[7]])
    slot = _slots(tables, pos)
    with torch.no_grad():
        h_t = model(ids, pos, slot, tables, pool_t, slot_valid=valid)
        h_o = OrtStep(model, threads=1)(ids, pos, slot, tables, pool_o, slot_valid=valid)
        h_no_holes = model(ids, pos, slot, tables, pool_t.clone())
    assert (h_t - h_o).abs().max().item() < TOL
    assert (h_t - h_no_holes).abs().max().item() > 1e-3    # the holes do change the result


def test_the_graph_writes_the_pool_input_it_was_given(hf_model):
    # torch.onnx drops in-place writes to inputs silently; this graph must have the updated pool
    # as an output, made by one ScatterND straight from the pool input (so ORT can alias them)
    blob, weights = build_step(hf_model, StepShape(2, 1, 4, 9, BS))
    proto = onnx.load_from_string(blob)
    # no weight bytes in the graph: every weight is an input, bound to the model's own tensor
    assert len(blob) < 200_000 and weights["model.norm.weight"] is not None
    assert all(t.data_ptr() == hf_model.p(n).data_ptr() for n, t in weights.items() if not n.startswith("rope."))
    assert [i.name for i in proto.graph.input] == [*INPUTS, *weights]
    assert not {i.name for i in proto.graph.initializer} & set(weights)
    assert [o.name for o in proto.graph.output] == list(OUTPUTS)
    (writer,) = [n for n in proto.graph.node if "kv_pool_out" in n.output]
    assert writer.op_type == "ScatterND" and writer.input[0] == "kv_pool"
    readers = [n for n in proto.graph.node if "kv_pool" in n.input]
    assert sorted(n.op_type for n in readers) == ["Reshape", "ScatterND"]  # one view, one write
    pool_in = [i for i in proto.graph.input if i.name == "kv_pool"][0]
    pool_out = [o for o in proto.graph.output if o.name == "kv_pool_out"][0]
    assert pool_in.type == pool_out.type                   # same shape and dtype: bindable as one


def test_the_rows_graph_and_write_rows_equal_the_in_place_graph(hf_model):
    # the graph TensorRT builds from (kv_out="rows", the write left to torch) computes the same
    # hidden states and, written with write_rows, the same pool, bit for bit
    import onnxruntime as ort
    model = hf_model
    shape = StepShape(2, 4, 3, 7, BS)
    tables = torch.tensor([[1, 2, 3], [4, 5, 6]])
    pos = torch.tensor([[20, 21, 22, 23], [3, 4, 5, 6]])
    ids = torch.randint(0, model.cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(4))
    slot = _slots(tables, pos)
    pool = _pool(model, 7, seed=5)
    feeds = {"input_ids": ids, "positions": pos, "slot_mapping": slot, "block_tables": tables,
             "attn_bias": step_bias(pos, 3 * BS), "kv_pool": pool}
    outs = {}
    for kv_out in KV_OUT:
        blob, weights = build_step(model, shape, kv_out=kv_out)
        sess = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
        outs[kv_out] = sess.run(None, {k: v.numpy() for k, v in {**feeds, **weights}.items()})
    assert [o.name for o in sess.get_outputs()] == list(ROW_OUTPUTS)
    hidden_pool, pool_out = (torch.from_numpy(a) for a in outs["pool"])
    hidden_rows, rows = (torch.from_numpy(a) for a in outs["rows"])
    written = pool.clone()
    write_rows(written, slot, rows)
    assert torch.equal(hidden_rows, hidden_pool)
    assert torch.equal(written, pool_out) and not torch.equal(written, pool)
    with torch.no_grad():                               # and both are the torch step's
        want = pool.clone()
        assert (model(ids, pos, slot, tables, want) - hidden_pool).abs().max() < TOL
    assert torch.allclose(written, want, atol=TOL, rtol=0)


def test_each_shape_binds_static_buffers_once(hf_model):
    # a captured CUDA graph (ORT's) replays over fixed addresses: a shape's buffers are bound
    # once, and every call of that shape returns the same hidden buffer, its inputs copied in
    step = OrtStep(hf_model, threads=1)
    pool = _pool(hf_model, 5)
    tables = torch.tensor([[1, 2]])
    first = step(torch.tensor([[3]]), torch.tensor([[17]]), torch.tensor([33]), tables, pool)
    ptr, kept = first.data_ptr(), first.clone()
    again = step(torch.tensor([[9]]), torch.tensor([[18]]), torch.tensor([34]), tables, pool)
    assert again.data_ptr() == ptr and len(step.shapes) == 1
    assert not torch.equal(again, kept)                 # the new inputs were copied in and ran


def test_refusals_say_what_to_fix(hf_model):
    model16 = type(hf_model)(hf_model.cfg, {n.replace("/", "."): p.detach().half()
                                            for n, p in hf_model.w.items()})
    with pytest.raises(EngineUnavailable, match="runs fp32 models"):
        OrtStep(model16)
    step = OrtStep(hf_model)
    pool = _pool(hf_model, 5).half()
    with pytest.raises(ValueError, match="contiguous fp32 pool"):
        step(torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([16]),
                     torch.tensor([[1]]), pool)


def test_without_onnx_the_engine_is_unavailable_at_construction(hf_model, monkeypatch):
    # the graph is built with onnx on the first step: a missing onnx must make the engine
    # unavailable when it is picked (so runtime.llm_engines falls back), not fail mid-generate
    import sys

    from capsule.llm.engines import select_llm_engine
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(EngineUnavailable, match="needs onnx and onnxruntime"):
        OrtStep(hf_model)
    assert select_llm_engine(hf_model, ["onnxruntime", "torch"]) is None
