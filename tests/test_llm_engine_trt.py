"""The step graph on disk (capsule.llm.onnx_export), the TensorRT LLM engine (engine_trt) and the
engines' CUDA paths (issue 15). On CPU: the exported file is the graph TensorRT builds from, run
here by ONNX Runtime from the file against the torch step; the engine refuses with the reason
and the engine list falls back. CUDA-marked: TensorRT and ORT's CUDA provider against torch."""
from __future__ import annotations

import stat

import pytest
import torch

from capsule import Session
from capsule.errors import EngineUnavailable
from capsule.llm import load_model
from capsule.llm.engine_trt import TrtStep
from capsule.llm.engines import select_llm_engine
from capsule.llm.onnx_export import export_key, export_step, weights_sha256
from capsule.llm.onnx_step import StepShape, step_bias, write_rows

BS = 16


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("builtin:tiny")
    model.prepare_rope(128)
    return model


def _pool(model, nb: int, seed: int) -> torch.Tensor:
    c = model.cfg
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nb, c.num_layers, 2, BS, c.num_kv_heads, c.head_dim, generator=g) * 0.3


def test_the_exported_file_runs_as_the_torch_step(tiny, tmp_path):
    import onnx
    import onnxruntime as ort
    shape = StepShape(2, 1, 4, 9, BS)
    path = export_step(tiny, shape, weights_digest="d1", root=tmp_path)
    folder = path.parent
    assert sorted(p.name for p in folder.iterdir()) == [path.name, "weights.bin"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    onnx.checker.check_model(str(path))                 # weights as external initializers, valid
    proto = onnx.load(str(path), load_external_data=False)
    assert [i.name for i in proto.graph.input] == ["input_ids", "positions", "slot_mapping",
                                                    "block_tables", "attn_bias", "kv_pool"]
    tables = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    pos = torch.tensor([[37], [5]])
    ids = torch.tensor([[11], [42]])
    slot = (tables.gather(1, pos // BS) * BS + pos % BS).reshape(-1)
    pool = _pool(tiny, 9, seed=1)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    hidden, rows = sess.run(None, {"input_ids": ids.numpy(), "positions": pos.numpy(),
                                   "slot_mapping": slot.numpy(), "block_tables": tables.numpy(),
                                   "attn_bias": step_bias(pos, 4 * BS).numpy(), "kv_pool": pool.numpy()})
    written, want = pool.clone(), pool.clone()
    write_rows(written, slot, torch.from_numpy(rows))
    with torch.no_grad():
        h = tiny(ids, pos, slot, tables, want)
    assert (torch.from_numpy(hidden) - h).abs().max() < 1e-4
    assert torch.allclose(written, want, atol=1e-4, rtol=0) and not torch.equal(written, pool)


def test_the_export_is_cached_by_everything_it_depends_on(tiny, tmp_path):
    shape = StepShape(1, 1, 2, 3, BS)
    path = export_step(tiny, shape, weights_digest="d1", root=tmp_path)
    weights = path.parent / "weights.bin"
    mtimes = path.stat().st_mtime_ns, weights.stat().st_mtime_ns
    assert export_step(tiny, shape, weights_digest="d1", root=tmp_path) == path   # found, not rewritten
    assert (path.stat().st_mtime_ns, weights.stat().st_mtime_ns) == mtimes
    # another shape of the same model: its own small graph, the same weights file
    other = export_step(tiny, StepShape(2, 1, 2, 3, BS), weights_digest="d1", root=tmp_path)
    assert other.parent == path.parent and other != path and weights.stat().st_mtime_ns == mtimes[1]
    weights.write_bytes(weights.read_bytes()[:-1])                 # a torn weights file is rebuilt
    export_step(tiny, shape, weights_digest="d1", root=tmp_path)
    assert weights.stat().st_size % 4 == 0 and weights.stat().st_mtime_ns != mtimes[1]
    others = {export_key(tiny, shape, "d2", "rows"), export_key(tiny, shape, "d1", "pool"),
              export_key(tiny, StepShape(2, 1, 2, 3, BS), "d1", "rows")}
    assert export_key(tiny, shape, "d1", "rows") not in others and len(others) == 3
    assert export_step(tiny, shape, weights_digest="d2", root=tmp_path).parent != path.parent
    assert not [p for p in tmp_path.rglob(".*")]                   # no half-written file left


def test_the_weights_digest_follows_the_weights(tiny):
    other, _ = load_model("builtin:tiny", seed=1)
    assert weights_sha256(tiny) == weights_sha256(tiny) != weights_sha256(other)


def test_tensorrt_refuses_a_cpu_model_and_the_list_falls_back(tiny):
    with pytest.raises(EngineUnavailable, match="needs a CUDA model"):
        TrtStep(tiny)
    with pytest.raises(EngineUnavailable, match="tensorrt: the tensorrt LLM engine needs a CUDA model"):
        select_llm_engine(tiny, ["tensorrt"])
    assert select_llm_engine(tiny, ["tensorrt", "torch"]) is None


def test_a_session_asking_for_tensorrt_first_runs_the_next_engine(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny",
                      runtime={"llm_engines": ["tensorrt", "onnxruntime", "torch"]},
                      memory={"embedder": None}) as s:
        assert s.llm_engine == "onnxruntime"


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["tensorrt", "onnxruntime"])
def test_cuda_engine_steps_equal_torch_and_keep_the_pool_in_place(engine, tmp_path):
    if engine == "tensorrt":
        pytest.importorskip("tensorrt")
    else:
        from conftest import ort_cuda_missing
        if ort_cuda_missing():
            pytest.skip(ort_cuda_missing())
    model, _ = load_model("builtin:small", device=torch.device("cuda"))
    model.prepare_rope(512)
    step = select_llm_engine(model, [engine])
    nb = 8
    tables = torch.arange(1, nb + 1, device="cuda")[None]
    pool_t = _pool(model, nb + 1, seed=2).cuda()
    pool_e = pool_t.clone()
    ptr = pool_e.data_ptr()
    ids, pos = torch.tensor([[5]], device="cuda"), torch.tensor([[40]], device="cuda")
    worst = 0.0
    with torch.no_grad():
        for _ in range(64):
            slot = (tables.gather(1, pos // BS) * BS + pos % BS).reshape(-1)
            lt = model.lm_head(model(ids, pos, slot, tables, pool_t)[:, -1])
            le = model.lm_head(step(ids, pos, slot, tables, pool_e)[:, -1])
            worst = max(worst, float((lt - le).abs().max()))
            assert torch.equal(lt.argmax(-1), le.argmax(-1))
            ids, pos = lt.argmax(-1, keepdim=True), pos + 1
    assert worst < 1e-3, worst
    assert pool_e.data_ptr() == ptr
    assert torch.allclose(pool_e[1:], pool_t[1:], atol=1e-3, rtol=0)


@pytest.mark.cuda
def test_cuda_session_under_tensorrt_graphs_equals_torch(tmp_path):
    pytest.importorskip("tensorrt")
    got = {}
    for engine in ("torch", "tensorrt"):
        with Session.open(tmp_path / engine, device="cuda", model="builtin:tiny",
                          runtime={"dtype": "float32", "llm_engines": [engine]},
                          memory={"embedder": None}) as s:
            assert s.llm_engine == engine and s.engine.runner.uses_graphs
            s.append("user: where is the charger?\nassistant:")
            got[engine] = s.generate(24)
    assert got["tensorrt"] == got["torch"]
