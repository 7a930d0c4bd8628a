"""capture_graph: the one way this package captures a CUDA graph (the LLM's decode buckets, the
torch and TensorRT policy engines, the doctor's probe), so every capture runs in the same modes.

- Under torch.inference_mode(), warm-up included: on torch < 2.11 (every JetPack wheel), once a
  graph was captured in inference mode a later capture outside it raises (pytorch/pytorch#166792),
  so mixing the two modes in one process is what must never happen.
- capture_error_mode="thread_local": torch's default, "global", makes a CUDA call that is unsafe
  during capture (cudaMalloc, a sync) fail and invalidates the capture when *any* thread makes it,
  e.g. a second Session opening or a policy stepping while the LLM captures its buckets.
- On a side stream of our own, never torch.cuda.graph's process-wide default capture stream, and
  one capture at a time in the process (torch documents that only one may be underway).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

CAPTURE_ERROR_MODE = "thread_local"
WARMUP_RUNS = 2          # lazy inits (cuBLAS handles, TensorRT's deferred setup) happen here, not in capture
_one_capture = threading.Lock()


def capture_graph(body: Callable[[], None], device: torch.device, *, pool: Any = None,
                  stream: torch.cuda.Stream | None = None, warmup: int = WARMUP_RUNS) -> torch.cuda.CUDAGraph:
    """Run `body` `warmup` times on a side stream, then capture one call of it into a new graph.

    `pool`: another graph's pool() to share memory with (the LLM's buckets, largest first); pass
    the same `stream` to each of those captures too, as torch asks for effective sharing.
    `stream`: the side stream (default: a new one). Returns after the device finished the
    capture. Raises what torch raises when `body` cannot be captured (the caller decides
    whether to run eagerly instead).
    """
    with _one_capture, torch.inference_mode(), torch.cuda.device(device):
        side = stream if stream is not None else torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))   # the buffers' writes come first
        with torch.cuda.stream(side):
            for _ in range(warmup):
                body()
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode=CAPTURE_ERROR_MODE):
            body()
        side.synchronize()
    return graph
