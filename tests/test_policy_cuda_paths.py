"""The policies' CUDA paths, checked on CPU with fakes (issue 14, items 7 and 8): the ONNX Runtime
provider options built for a CUDA device, and a step that runs on the policy's own stream and
waits on one event, never on another thread's stream or the whole device."""
from __future__ import annotations

import ast
import contextlib
import types
from pathlib import Path

import numpy as np
import torch

from capsule.policy import load_policy
from capsule.policy.engine_ort import CPU_EP, CUDA_EP, TRT_EP, choose_providers, runs_on
from capsule.policy.runner import PolicyRunner

POLICY = Path(__file__).resolve().parents[1] / "sdk" / "capsule" / "policy"


def _ort(*offered: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(get_available_providers=lambda: list(offered))


class FakeStream:
    cuda_stream = 0x7F00_1234

    def __init__(self, log: list):
        self.log = log

    def synchronize(self):
        self.log.append("stream.synchronize")

    def wait_stream(self, other):
        self.log.append(("wait", other))


def test_the_cuda_providers_compute_fp32_in_fp32_on_the_policy_stream():
    stream = FakeStream([])
    chosen = choose_providers(_ort(TRT_EP, CUDA_EP, CPU_EP), torch.device("cuda", 1), stream)
    assert [p if isinstance(p, str) else p[0] for p in chosen] == [TRT_EP, CUDA_EP, CPU_EP]
    trt, cuda = chosen[0][1], chosen[1][1]
    # ORT's CUDA provider defaults to TF32 GEMMs (microsoft/onnxruntime#19357): off, for 1e-4 parity
    assert cuda["use_tf32"] == 0 and cuda["device_id"] == 1 and trt["device_id"] == 1
    assert cuda["user_compute_stream"] == trt["user_compute_stream"] == str(FakeStream.cuda_stream)
    assert "user_compute_stream" not in choose_providers(_ort(CUDA_EP), torch.device("cuda"))[0][1]
    assert choose_providers(_ort(CUDA_EP, CPU_EP), torch.device("cpu"), stream) == [CPU_EP]


def test_a_provider_that_did_not_take_the_stream_is_noticed():
    stream = FakeStream([])

    def session(options):
        return types.SimpleNamespace(get_provider_options=lambda: options)

    took = session({CUDA_EP: {"user_compute_stream": str(FakeStream.cuda_stream), "use_tf32": "0"}})
    assert runs_on(took, CUDA_EP, stream)
    assert not runs_on(session({CUDA_EP: {"user_compute_stream": "0"}}), CUDA_EP, stream)
    assert not runs_on(session({TRT_EP: {}}), TRT_EP, stream)   # then OrtEngine.run syncs first
    assert not runs_on(took, CUDA_EP, None)


def test_a_step_runs_on_the_policy_stream_and_waits_on_one_event(monkeypatch):
    log: list = []
    stream = FakeStream(log)
    current = [None]

    @contextlib.contextmanager
    def on(s):
        log.append("enter")
        current[0], before = s, current[0]
        yield
        current[0] = before
        log.append("exit")

    class Event:
        def record(self, s):
            log.append(("record", s is stream))

        def synchronize(self):
            log.append("event.synchronize")

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    plain = load_policy("builtin:gru", device="cpu", engines=("torch",))
    obs = [{"observation.state": np.random.default_rng(i).standard_normal(14).astype(np.float32)}
           for i in range(3)]
    want = [plain.step(o) for o in obs]
    base = load_policy("builtin:gru", device="cpu", engines=("torch",))
    base.buffers.stream = stream                        # what PolicyBuffers makes on CUDA
    runner = PolicyRunner(base.spec, base.buffers, base.engine)
    run = runner.engine.run
    runner.engine.run = lambda: (log.append(("engine", current[0] is stream)), run())
    got = [runner.step(o) for o in obs]
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    step = ["enter", ("engine", True), ("record", True), "exit", "event.synchronize"]
    assert log == step * 3                              # no stream or device sync in a step
    log.clear()
    runner.reset_state()                                # zeroes on the stream, then waits for it
    assert log == ["enter", "exit", "stream.synchronize"] and not runner.buffers.hidden.any()


def test_policy_steps_never_wait_for_the_device_or_the_callers_stream():
    # torch.cuda.synchronize() and current_stream().synchronize() would wait for another
    # thread's GPU work (the LLM's decode on the default stream): not on a policy's paths
    bad = []
    for path in sorted(POLICY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = ast.unparse(node.func)
                if name == "torch.cuda.synchronize" or (
                        node.func.attr == "synchronize" and "current_stream" in ast.unparse(node.func.value)):
                    bad.append(f"{path.name}:{node.lineno}: {name}()")
    assert not bad, "\n".join(bad)
