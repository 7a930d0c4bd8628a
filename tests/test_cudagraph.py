"""capsule.cudagraph: every CUDA graph capture of the package goes through capture_graph, which
captures under inference mode, in thread_local error mode, on its own side stream (issue 14,
items 6 and 9). Checked on CPU: statically over sdk/, and with a fake torch.cuda."""
from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import torch

from capsule import cudagraph
from capsule.cudagraph import CAPTURE_ERROR_MODE, capture_graph
from capsule.llm import BlockTable, DecodeRow, GraphRunner, KVPool, load_model
from capsule.llm import runner as runner_module
from capsule.state.regions import RegionRegistry

SDK = Path(__file__).resolve().parents[1] / "sdk" / "capsule"
HELPER = SDK / "cudagraph.py"
# what starts a capture in torch: only capture_graph may call these
CAPTURE_CALLS = ("torch.cuda.graph", "torch.cuda.CUDAGraph", "CUDAGraph", "capture_begin",
                 "make_graphed_callables", "graph_pool_handle")


def _calls(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [(n.lineno, ast.unparse(n.func)) for n in ast.walk(tree) if isinstance(n, ast.Call)]


def test_only_capture_graph_starts_a_capture():
    outside = [f"{p.relative_to(SDK.parent)}:{line}: {name}(...)" for p in sorted(SDK.rglob("*.py"))
               if p != HELPER for line, name in _calls(p)
               if any(name == c or name.endswith("." + c) for c in CAPTURE_CALLS)]
    assert not outside, ("capture CUDA graphs with capsule.cudagraph.capture_graph (inference mode, "
                         "thread_local error mode, one capture at a time):\n" + "\n".join(outside))
    users = sorted(p.relative_to(SDK).as_posix() for p in SDK.rglob("*.py")
                   if any(name.endswith("capture_graph") for _, name in _calls(p)))
    assert users == ["llm/runner.py", "policy/engine_torch.py", "policy/engine_trt.py", "tools/doctor.py"]


def test_the_helper_passes_thread_local_to_its_one_capture():
    tree = ast.parse(HELPER.read_text(encoding="utf-8"))
    graphs = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.cuda.graph"]
    assert len(graphs) == 1
    modes = [ast.unparse(k.value) for k in graphs[0].keywords if k.arg == "capture_error_mode"]
    assert modes == ["CAPTURE_ERROR_MODE"] and CAPTURE_ERROR_MODE == "thread_local"


class FakeCuda:
    """Stands in for torch.cuda: records what capture_graph does and in which mode."""

    def __init__(self):
        self.events: list[tuple] = []

    def install(self, monkeypatch) -> None:
        fake = self

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device = device

            def wait_stream(self, other):
                fake.events.append(("wait", other))

            def synchronize(self):
                fake.events.append(("sync",))

        class CUDAGraph:
            pass

        @contextlib.contextmanager
        def stream(s):
            fake.events.append(("stream", s, torch.is_inference_mode_enabled()))
            yield

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            fake.events.append(("capture", g, pool, stream, capture_error_mode, torch.is_inference_mode_enabled()))
            yield

        for name, value in {"Stream": Stream, "CUDAGraph": CUDAGraph, "stream": stream, "graph": graph,
                            "device": lambda d: contextlib.nullcontext(),
                            "current_stream": lambda device=None: "caller's stream"}.items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_capture_graph_warms_up_and_captures_in_inference_mode(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    modes = []
    graph = capture_graph(lambda: modes.append(torch.is_inference_mode_enabled()), torch.device("cuda", 0),
                          pool="pool-token")
    assert modes == [True] * (cudagraph.WARMUP_RUNS + 1)        # warm-up and the captured call
    kinds = [e[0] for e in fake.events]
    assert kinds == ["wait", "stream", "sync", "capture", "sync"]
    assert fake.events[0] == ("wait", "caller's stream")        # after the buffers' writes
    side = fake.events[1][1]
    assert fake.events[1][2] is True                            # warm-up in inference mode too
    assert fake.events[3] == ("capture", graph, "pool-token", side, "thread_local", True)
    assert not torch.is_inference_mode_enabled()                # the mode ends with the capture
    given = torch.cuda.Stream()
    fake.events.clear()
    capture_graph(lambda: None, torch.device("cuda", 0), stream=given)
    assert fake.events[1][1] is given and fake.events[3][3] is given


def test_a_failed_capture_releases_the_capture_lock(monkeypatch):
    FakeCuda().install(monkeypatch)
    calls = []

    def body():
        calls.append(1)
        if len(calls) > cudagraph.WARMUP_RUNS:
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="capturing"):
        capture_graph(body, torch.device("cuda", 0))
    capture_graph(lambda: None, torch.device("cuda", 0))        # would deadlock if the lock were kept


def test_the_runner_captures_every_bucket_through_capture_graph(monkeypatch):
    class Graph:   # replays what was captured: the graph path over the static buffers, on CPU
        def __init__(self, body):
            self.body = body

        def pool(self):
            return ("pool of", self)

        def replay(self):
            self.body()

    captured = []

    def fake_capture(body, device, *, pool=None, stream=None):
        graph = Graph(body)
        captured.append((graph, pool, stream))
        return graph

    monkeypatch.setattr(runner_module, "capture_graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: ("side stream on", device))
    model, _ = load_model("builtin:tiny", vocab_size=1000)
    pool = KVPool(model.cfg, pool_bytes=1 << 20, block_size=16, dtype=torch.float32, device="cpu")
    runner = GraphRunner(model, pool, RegionRegistry(), buckets=(1, 2, 4), max_context=256,
                         prefill_chunk=32, use_cuda_graphs=True)
    assert [b for b in runner.graphs] == [4, 2, 1] and set(runner.capture_seconds) == {1, 2, 4}
    assert [p for _, p, _ in captured] == [None, ("pool of", captured[0][0]), ("pool of", captured[1][0])]
    assert {s for _, _, s in captured} == {("side stream on", pool.tensor.device)}   # one side stream
    rows = []
    for n in (20, 5, 37):                                      # three streams: bucket 4's graph
        table = BlockTable(pool)
        runner.prefill(list(range(1, n + 1)), table)
        table.ensure_capacity(n + 1)
        rows.append(DecodeRow(7, n, table.slots(n, n + 1)[0], tuple(table.blocks)))
    replayed = runner.decode(rows).clone()
    runner.graphs.clear()                                       # same buffers, eager path
    torch.testing.assert_close(runner.decode(rows), replayed, rtol=1e-5, atol=1e-5)
