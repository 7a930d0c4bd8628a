"""LLM step engines (runtime.llm_engines): which one runs the decoder's steps on the KV pool.

"torch" is the model's own forward (eager, or CUDA graphs); "onnxruntime" is
``engine_ort.OrtStep`` (the step as an ONNX graph, the pool bound in place); "tensorrt" is
``engine_trt.TrtStep`` (a TensorRT engine per decode shape built from the same graph, CUDA
only). The names are ``devices.profile.LLM_ENGINES``; an engine that cannot run here raises
EngineUnavailable from its constructor and the next one in the list is tried.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from devices.profile import LLM_ENGINES

from ..errors import EngineUnavailable
from .model import Decoder
from .runner import StepEngine

log = logging.getLogger("capsule")


@dataclass(frozen=True)
class EngineOptions:
    threads: int | None = None          # CPU threads (ORT's intra-op pool); None: torch's
    weights_digest: str | None = None   # the weights' sha256 (keys TensorRT's cached plans)


def _onnxruntime(decoder: Decoder, opts: EngineOptions) -> StepEngine:
    from .engine_ort import OrtStep
    return OrtStep(decoder, threads=opts.threads)


def _tensorrt(decoder: Decoder, opts: EngineOptions) -> StepEngine:
    from .engine_trt import TrtStep
    return TrtStep(decoder, weights_digest=opts.weights_digest)


# name -> builder; "torch" has none (the runner calls the model itself)
BUILDERS: dict[str, Callable[[Decoder, EngineOptions], StepEngine]] = {
    "onnxruntime": _onnxruntime, "tensorrt": _tensorrt}
assert set(BUILDERS) | {"torch"} == set(LLM_ENGINES), "an LLM engine without a builder"


def select_llm_engine(decoder: Decoder, names: Sequence[str],
                      opts: EngineOptions = EngineOptions()) -> StepEngine | None:
    """The first of ``names`` that runs here (None: "torch", the model's own step), or
    EngineUnavailable saying why each one could not."""
    why: list[str] = []
    for name in names:
        if name == "torch":
            return None
        if name not in BUILDERS:
            raise ValueError(f"unknown LLM engine {name!r}; one of {LLM_ENGINES}")
        try:
            return BUILDERS[name](decoder, opts)
        except EngineUnavailable as exc:
            why.append(f"{name}: {exc}")
            log.info("LLM engine %s cannot run here: %s", name, exc)
    raise EngineUnavailable("no LLM engine of runtime.llm_engines runs here: " + "; ".join(why)
                            + " (add 'torch' as the last one to fall back to)")
