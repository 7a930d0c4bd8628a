"""capsule.policy: engines bound to static buffers (torch, onnxruntime, tensorrt), load-time
validation of the ONNX convention, engine fallback, observation checks, region registration."""
from __future__ import annotations

import logging
import tracemalloc

import numpy as np
import pytest
import torch

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from capsule.errors import ModelLoadError, UnsupportedArchitecture
from capsule.policy import PolicySpec, builtin_policy, export_onnx, load_policy
from capsule.policy.spec import spec_from_onnx
from capsule.state.regions import RegionRegistry

BUILTINS = ["mlp", "mlp-chunk", "gru"]
F32, F64 = TensorProto.FLOAT, TensorProto.DOUBLE


def observations(n: int, seed: int = 0, dim: int = 14) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"observation.state": rng.standard_normal(dim).astype(np.float32)} for _ in range(n)]


def run(runner, obs) -> np.ndarray:
    return np.stack([runner.step(o) for o in obs])


# -- engines agree -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILTINS)
def test_torch_and_onnxruntime_agree_over_20_steps(name):
    obs = observations(20)
    got = {e: run(load_policy(f"builtin:{name}", engines=(e,)), obs) for e in ("torch", "onnxruntime")}
    spec = builtin_policy(name).spec()
    assert got["torch"].shape == (20, *spec.action_shape)
    np.testing.assert_allclose(got["onnxruntime"], got["torch"], atol=1e-5, rtol=0)
    assert np.abs(got["torch"][1:] - got["torch"][:-1]).max() > 1e-3  # actions depend on the input


def test_gru_threads_state_like_plain_torch():
    module = builtin_policy("gru")
    obs = observations(20)
    h = torch.zeros(1, 32)
    want = []
    with torch.no_grad():
        for o in obs:
            a, h = module({"observation.state": torch.from_numpy(o["observation.state"])[None]}, h)
            want.append(a[0].numpy())
    for engine in ("torch", "onnxruntime"):
        np.testing.assert_allclose(run(load_policy("builtin:gru", engines=(engine,)), obs), np.stack(want),
                                   atol=1e-5, rtol=0)


def test_runner_matches_hand_threaded_inference_session(tmp_path):
    path = export_onnx("builtin:gru", tmp_path / "gru.onnx")
    runner = load_policy(path, engines=("onnxruntime",))
    assert runner.engine_name == "onnxruntime" and runner.spec.hidden_shape == (32,)
    obs = observations(30, seed=3)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    hidden = np.zeros((1, 32), np.float32)
    want = []
    for o in obs:
        action, hidden = sess.run(["action", "hidden_out"], {"observation.state": o["observation.state"][None],
                                                             "hidden_in": hidden})
        want.append(action[0])
    got = run(runner, obs)
    np.testing.assert_array_equal(got, np.stack(want))  # same kernels, same threading of state
    np.testing.assert_array_equal(runner.buffers.hidden.numpy(), hidden)
    runner.reset_state()  # a new episode replays the same actions
    np.testing.assert_allclose(run(runner, obs[:5]), got[:5], atol=0, rtol=0)


# -- static buffers ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gru", "mlp-chunk"])
def test_no_per_step_allocation_onnxruntime(name):
    registry = RegionRegistry()
    runner = load_policy(f"builtin:{name}", engines=("onnxruntime",), registry=registry)
    obs = observations(64)
    ptrs = registry.data_ptrs()
    twin = runner.engine.hidden_next.data_ptr() if runner.engine.hidden_next is not None else None
    for i in range(50):  # warm-up
        runner.step(obs[i % 64])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(100):
            runner.step(obs[i % 64])
        after_100 = tracemalloc.get_traced_memory()[0] - base
        for i in range(500):
            runner.step(obs[i % 64])
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    after_600 = current - base
    print(f"\n{name} onnxruntime tracemalloc: +{after_100} B after 100 steps, +{after_600} B after 600, "
          f"peak +{peak - base} B")
    assert registry.data_ptrs() == ptrs
    if twin is not None:
        assert runner.engine.hidden_next.data_ptr() == twin
    assert after_600 < 2048, after_600             # a small constant, not ~ steps
    assert after_600 - after_100 < 512              # 500 more steps add (almost) nothing
    assert peak - base < 8192                       # transient: the returned action copies


def test_registry_roles_and_reset_in_place():
    registry = RegionRegistry()
    runner = load_policy("builtin:gru", engines=("torch",), registry=registry)
    roles = {r.name: r.role for r in registry}
    assert roles == {"policy.obs.observation.state": "input", "policy.action": "output", "policy.hidden": "policy"}
    assert registry["policy.hidden"].tensor is runner.buffers.hidden
    assert registry["policy.action"].tensor.shape == (1, 6)
    ptr = runner.buffers.hidden.data_ptr()
    run(runner, observations(5))
    assert runner.buffers.hidden.abs().sum() > 0
    runner.reset_state()
    assert runner.buffers.hidden.data_ptr() == ptr and not runner.buffers.hidden.any()


@pytest.mark.parametrize("engine", ["torch", "onnxruntime"])
def test_restore_in_place_continues_the_episode(engine):
    """A restore writes hidden's bytes back into the same storage; the engine picks them up."""
    registry = RegionRegistry()
    runner = load_policy("builtin:gru", engines=(engine,), registry=registry)
    obs = observations(15, seed=7)
    run(runner, obs[:10])
    saved = {r.name: r.tensor.clone() for r in registry if r.role not in ("output", "kv")}
    tail = run(runner, obs[10:])
    runner.reset_state()
    run(runner, observations(3, seed=99))  # wander off
    for name, t in saved.items():
        registry[name].tensor.copy_(t)
    np.testing.assert_array_equal(run(runner, obs[10:]), tail)


def test_stateless_policy_has_no_hidden_region():
    registry = RegionRegistry()
    runner = load_policy("builtin:mlp-chunk", registry=registry)
    assert runner.buffers.hidden is None and "policy.hidden" not in registry
    assert runner.step(observations(1)[0]).shape == (4, 6)
    runner.reset_state()  # a no-op, not an error


# -- observations ------------------------------------------------------------------------------

def test_observation_forms_are_equivalent():
    runner = load_policy("builtin:mlp", engines=("onnxruntime",))
    q = observations(1)[0]["observation.state"]
    a = runner.step({"observation.state": q})
    for form in (q[None], torch.from_numpy(q), torch.from_numpy(q)[None]):
        np.testing.assert_array_equal(runner.step({"observation.state": form}), a)
    out = runner.step({"observation.state": q})
    out[:] = 42  # a new array each step, not a view of the static buffer
    assert not (runner.buffers.action == 42).any()


@pytest.mark.parametrize("obs, words", [
    ({}, ["missing", "'observation.state'"]),
    ({"observation.stat": np.zeros(14, np.float32)}, ["missing", "'observation.state'"]),
    ({"observation.state": np.zeros(13, np.float32)}, ["'observation.state'", "(14,)", "(13,)"]),
    ({"observation.state": np.zeros((2, 14), np.float32)}, ["'observation.state'", "(2, 14)"]),
    ({"observation.state": np.zeros(14)}, ["'observation.state'", "float32", "float64"]),
    ({"observation.state": torch.zeros(14, dtype=torch.float16)}, ["'observation.state'", "float16"]),
    ({"observation.state": [0.0] * 14}, ["'observation.state'", "list"]),
    ({"observation.state": np.zeros(14, np.float32), "observation.images.top": np.zeros(3)},
     ["unknown", "observation.images.top"]),
])
def test_bad_observation_names_the_key(obs, words):
    runner = load_policy("builtin:gru", engines=("onnxruntime",))
    run(runner, observations(3))
    before = {k: t.clone() for k, t in runner.buffers.tensors().items()}
    with pytest.raises(ValueError) as info:
        runner.step(obs)
    for w in words:
        assert w in str(info.value), str(info.value)
    for k, t in runner.buffers.tensors().items():  # nothing was written
        assert torch.equal(t, before[k]), k


# -- ONNX convention: hand-built models ---------------------------------------------------------

def make_model(path, inputs, outputs, *, batch="batch"):
    """A valid ONNX graph with these (name, elem_type, shape) inputs/outputs: outputs are constants."""
    ins = [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs]
    outs, nodes = [], []
    for n, t, s in outputs:
        outs.append(helper.make_tensor_value_info(n, t, s))
        dims = [1 if isinstance(d, str) else d for d in s]
        nodes.append(helper.make_node("ConstantOfShape", [f"{n}.shape"], [n],
                                      value=helper.make_tensor("v", t, [1], [0.5])))
        nodes.append(helper.make_node("Constant", [], [f"{n}.shape"],
                                      value=helper.make_tensor("s", TensorProto.INT64, [len(dims)], dims)))
    graph = helper.make_graph(nodes, "bad", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return path


STATE_IN = ("observation.state", F32, ["batch", 14])
ACTION_OUT = ("action", F32, ["batch", 6])


@pytest.mark.parametrize("inputs, outputs, error, words", [
    ([STATE_IN], [("act", F32, [1, 6])], ModelLoadError, ["'action'", "'act'"]),
    ([("state", F32, [1, 14])], [ACTION_OUT], ModelLoadError, ["'observation.state'", "'state'"]),
    ([STATE_IN, ("observation.depth", F32, [1, 4])], [ACTION_OUT], ModelLoadError,
     ["unknown input", "observation.depth"]),
    ([STATE_IN], [ACTION_OUT, ("logits", F32, [1, 3])], ModelLoadError, ["unknown output", "logits"]),
    ([STATE_IN, ("hidden_in", F32, [1, 32])], [ACTION_OUT], ModelLoadError,
     ["'hidden_in'", "no 'hidden_out'"]),
    ([STATE_IN], [ACTION_OUT, ("hidden_out", F32, [1, 32])], ModelLoadError,
     ["'hidden_out'", "no 'hidden_in'"]),
    ([STATE_IN, ("hidden_in", F32, [1, 32])], [ACTION_OUT, ("hidden_out", F32, [1, 16])], ModelLoadError,
     ["hidden_in is (32,)", "hidden_out is (16,)"]),
    ([("observation.state", F64, [1, 14])], [ACTION_OUT], UnsupportedArchitecture,
     ["'observation.state'", "float64"]),
    ([("observation.state", F32, [1, "n"])], [ACTION_OUT], UnsupportedArchitecture,
     ["'observation.state'", "fixed"]),
    ([("observation.state", F32, [4, 14])], [ACTION_OUT], UnsupportedArchitecture, ["batch dim 4"]),
])
def test_load_time_validation_names_the_mismatch(tmp_path, inputs, outputs, error, words):
    path = make_model(tmp_path / "bad.onnx", inputs, outputs)
    with pytest.raises(error) as info:
        load_policy(path)
    msg = str(info.value)
    for w in words:
        assert w in msg, msg
    assert "found inputs" in msg and "outputs" in msg  # lists what the graph declares


def test_unreadable_or_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_policy(tmp_path / "nope.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00not an onnx model" * 10)
    with pytest.raises(ModelLoadError, match="junk.onnx"):
        load_policy(junk)
    with pytest.raises(ModelLoadError, match="builtin:mlp"):
        load_policy("builtin:transformer")


def test_onnx_policy_with_env_state_and_uint8_image(tmp_path):
    """action = state + env + mean(image) over a symbolic batch dim; images stay uint8."""
    h = helper
    ins = [h.make_tensor_value_info("observation.state", F32, ["b", 3]),
           h.make_tensor_value_info("observation.environment_state", F32, ["b", 3]),
           h.make_tensor_value_info("observation.images.front", TensorProto.UINT8, ["b", 2, 4, 4])]
    nodes = [h.make_node("Cast", ["observation.images.front"], ["img"], to=F32),
             h.make_node("ReduceMean", ["img"], ["m"], axes=[1, 2, 3], keepdims=1),      # (b, 1, 1, 1)
             h.make_node("Flatten", ["m"], ["mf"], axis=1),                                # (b, 1)
             h.make_node("Add", ["observation.state", "observation.environment_state"], ["s"]),
             h.make_node("Add", ["s", "mf"], ["action"])]                                 # (b, 3)
    graph = h.make_graph(nodes, "env", ins, [h.make_tensor_value_info("action", F32, ["b", 3])])
    path = tmp_path / "env.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8), str(path))
    runner = load_policy(path, engines=("torch", "onnxruntime"))
    assert runner.engine_name == "onnxruntime" and "torch" in runner.skipped
    assert runner.spec.observation == {"observation.state": ((3,), "float32"),
                                       "observation.environment_state": ((3,), "float32"),
                                       "observation.images.front": ((2, 4, 4), "uint8")}
    assert runner.spec.name == "env" and len(runner.spec.digest) == 64
    rng = np.random.default_rng(1)
    img = rng.integers(0, 255, (2, 4, 4), dtype=np.uint8)
    s, e = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    got = runner.step({"observation.state": s, "observation.environment_state": e,
                       "observation.images.front": img[None]})
    np.testing.assert_allclose(got, s + e + img.astype(np.float32).mean(), rtol=1e-6)
    # every float input is checked for NaN / inf (uint8 images cannot hold one), naming its key
    e_bad = e.copy()
    e_bad[2] = np.nan
    with pytest.raises(ValueError, match="'observation.environment_state'.*index 2"):
        runner.step({"observation.state": s, "observation.environment_state": e_bad,
                     "observation.images.front": img})
    assert not np.isnan(runner.buffers.obs["observation.environment_state"].numpy()).any()


# -- engine selection ----------------------------------------------------------------------------

def test_fallback_logs_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="capsule.policy"):
        runner = load_policy("builtin:gru", device="cpu", engines=("tensorrt", "onnxruntime"))
    lines = [r.getMessage() for r in caplog.records if r.name == "capsule.policy"]
    assert runner.engine_name == "onnxruntime" and "tensorrt" in runner.skipped
    assert len(lines) == 1, lines
    assert "engine onnxruntime" in lines[0] and "skipped tensorrt" in lines[0] and "CUDA" in lines[0]


def test_no_engine_lists_each_reason(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        load_policy("builtin:mlp", engines=("tensorrt",))
    assert "tensorrt: needs a CUDA device" in str(info.value)
    path = export_onnx("builtin:mlp", tmp_path / "mlp.onnx")
    with pytest.raises(ModelLoadError) as info:
        load_policy(path, engines=("tensorrt", "torch"))
    assert "tensorrt:" in str(info.value) and "torch: runs builtin torch policies only" in str(info.value)
    with pytest.raises(ValueError, match="engines"):
        load_policy("builtin:mlp", engines=("tflite",))


def test_tensorrt_plan_key_covers_every_field():
    from capsule.trt_plan import plan_key

    args = ("10.3.0", (8, 7), "Orin", "fp32", {"observation.state": [1, 14]}, "d" * 64)
    keys = {plan_key(*args)}
    for i, other in enumerate(("10.4.0", (8, 9), "RTX 4090", "fp16", {"observation.state": [1, 15]}, "e" * 64)):
        keys.add(plan_key(*args[:i], other, *args[i + 1:]))
    assert len(keys) == 7 and plan_key(*args) == plan_key(*args)


# -- builtins and export -------------------------------------------------------------------------

def test_builtins_are_seeded_and_export_checks(tmp_path):
    state = torch.random.get_rng_state()
    a, b = builtin_policy("gru"), builtin_policy("builtin:gru")
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert a.digest() == b.digest() and a.spec() == b.spec()
    assert len({builtin_policy(n).digest() for n in BUILTINS}) == 3
    for n in BUILTINS:
        p = export_onnx(builtin_policy(n), tmp_path / f"{n}.onnx")
        onnx.checker.check_model(onnx.load(str(p)), full_check=True)
        spec = spec_from_onnx(p)
        want = builtin_policy(n).spec()
        assert (spec.observation, spec.action_shape, spec.hidden_shape) == \
               (want.observation, want.action_shape, want.hidden_shape)
    assert p.read_bytes() == export_onnx("builtin:gru", tmp_path / "again.onnx").read_bytes()
    with pytest.raises(ValueError, match="mlp-chunk"):
        builtin_policy("lstm")
    with pytest.raises(UnsupportedArchitecture, match="Linear"):
        export_onnx(torch.nn.Linear(14, 6), tmp_path / "linear.onnx")
    with pytest.raises(ValueError, match="observation.state"):
        PolicySpec(observation={}, action_shape=(6,), hidden_shape=None, digest="x", name="x")


# -- CUDA ------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("name", BUILTINS)
def test_cuda_torch_graph_matches_cpu(name):
    obs = observations(20)
    cpu = run(load_policy(f"builtin:{name}", engines=("torch",)), obs)
    registry = RegionRegistry()
    gpu = load_policy(f"builtin:{name}", device="cuda", engines=("torch",), registry=registry)
    assert gpu.engine_detail == "CUDA graph"
    ptrs = registry.data_ptrs()
    np.testing.assert_allclose(run(gpu, obs), cpu, atol=1e-4, rtol=0)
    assert registry.data_ptrs() == ptrs


@pytest.mark.cuda
@pytest.mark.ort_cuda
def test_cuda_onnxruntime_provider():
    obs = observations(20)
    cpu = run(load_policy("builtin:gru", engines=("onnxruntime",)), obs)
    gpu = load_policy("builtin:gru", device="cuda", engines=("onnxruntime",))
    assert gpu.engine_detail in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
    np.testing.assert_allclose(run(gpu, obs), cpu, atol=1e-4, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("name", BUILTINS)
def test_cuda_tensorrt_engine(name):
    pytest.importorskip("tensorrt")
    obs = observations(20)
    cpu = run(load_policy(f"builtin:{name}", engines=("torch",)), obs)
    registry = RegionRegistry()
    trt_runner = load_policy(f"builtin:{name}", device="cuda", engines=("tensorrt",), registry=registry)
    assert trt_runner.engine_name == "tensorrt" and trt_runner.engine.graph is not None, trt_runner.engine_detail
    ptrs = registry.data_ptrs()
    np.testing.assert_allclose(run(trt_runner, obs), cpu, atol=1e-4, rtol=0)
    assert registry.data_ptrs() == ptrs
    again = load_policy(f"builtin:{name}", device="cuda", engines=("tensorrt",))  # from the plan cache
    np.testing.assert_allclose(run(again, obs), cpu, atol=1e-4, rtol=0)


def test_exported_policy_files_are_private(tmp_path):
    import stat
    path = export_onnx("builtin:mlp", tmp_path / "mlp.onnx")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
