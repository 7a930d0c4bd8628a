"""capsule.trt_plan.bind_io, the one binding check of both TensorRT engines, against a fake engine
(plain Python objects with TensorRT's name-based API; nothing CUDA is faked: no enqueue runs)."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from capsule.errors import EngineUnavailable
from capsule.trt_plan import bind_io

INPUT, OUTPUT = "in", "out"
FAKE_TRT = types.SimpleNamespace(nptype=lambda dt: dt, TensorIOMode=types.SimpleNamespace(INPUT=INPUT))


class FakeEngine:
    def __init__(self, io: dict[str, tuple[str, type, tuple[int, ...]]]):
        self.io = io      # name -> (mode, numpy dtype, shape the engine computes)
        self.num_io_tensors = len(io)

    def get_tensor_name(self, i):
        return list(self.io)[i]

    def get_tensor_dtype(self, name):
        return self.io[name][1]

    def get_tensor_mode(self, name):
        return self.io[name][0]


class FakeContext:
    def __init__(self, engine: FakeEngine, reject: str | None = None):
        self.engine, self.reject = engine, reject
        self.addresses: dict[str, int] = {}
        self.input_shapes: dict[str, tuple[int, ...]] = {}

    def set_input_shape(self, name, shape):
        self.input_shapes[name] = shape
        return name != self.reject

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr

    def get_tensor_shape(self, name):
        return self.engine.io[name][2]


def _setup(**change):
    io = {"x": (INPUT, np.float32, (1, 4)), "ids": (INPUT, np.int64, (1, 2)), "y": (OUTPUT, np.float32, (1, 3))}
    io.update(change)
    engine = FakeEngine(io)
    tensors = {"x": torch.zeros(1, 4), "ids": torch.zeros(1, 2, dtype=torch.long), "y": torch.zeros(1, 3),
               "unread": torch.zeros(5)}
    return engine, FakeContext(engine), tensors


def test_every_tensor_is_bound_to_its_buffer_once():
    engine, ctx, tensors = _setup()
    assert bind_io(FAKE_TRT, engine, ctx, tensors, required=("y",)) == ["x", "ids", "y"]
    assert ctx.addresses == {n: tensors[n].data_ptr() for n in ("x", "ids", "y")}   # "unread": dropped
    assert ctx.input_shapes == {"x": (1, 4), "ids": (1, 2)}


@pytest.mark.parametrize("change, words", [
    ({"x": (INPUT, np.float16, (1, 4))}, "'x' is float16, its buffer is torch.float32"),
    ({"y": (OUTPUT, np.float32, (1, 5))}, "'y' has shape (1, 5), its buffer (1, 3)"),
    ({"z": (OUTPUT, np.float32, (1,))}, "I/O tensor 'z', no buffer has that name"),
])
def test_a_mismatch_is_refused_naming_the_tensor(change, words):
    engine, ctx, tensors = _setup(**change)
    with pytest.raises(EngineUnavailable, match=words.replace("(", r"\(").replace(")", r"\)")):
        bind_io(FAKE_TRT, engine, ctx, tensors)


def test_a_required_tensor_the_engine_dropped_and_a_rejected_shape_are_refused():
    engine, ctx, tensors = _setup()
    with pytest.raises(EngineUnavailable, match=r"lacks I/O tensor\(s\) \['kv_rows'\]"):
        bind_io(FAKE_TRT, engine, ctx, tensors, required=("y", "kv_rows"))
    ctx = FakeContext(engine, reject="ids")
    with pytest.raises(EngineUnavailable, match=r"rejected input shape \(1, 2\) for 'ids'"):
        bind_io(FAKE_TRT, engine, ctx, tensors)
