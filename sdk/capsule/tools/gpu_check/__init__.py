"""The GPU check (`packaging/gpu_check.py --device cpu|cuda --out DIR`): the steps, in order.

Each step is a module here with ``run(device, quick, budget_s) -> dict`` (its figures, plus
``ok`` when the step checks something); the runner (runner.py) starts each one alone in a
child process (step.py) with its own timeout, so a hang or a crash in one is reported as that
step's failure and the next step still runs. The timeouts add up to at most TOTAL_BUDGET_S:
a lent GPU machine gives one command 600 s and a task 15 minutes in all.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str         # the key in gpu_check.json's "steps"
    module: str       # capsule.tools.gpu_check.<module>
    timeout_s: int    # the child process is killed (its whole process group) after this
    what: str         # one line for the report


TOTAL_BUDGET_S = 300

STEPS: tuple[Step, ...] = (
    Step("env", "env", 15, "python, torch, CUDA, GPU, ONNX Runtime providers, triton / cupy, project packages"),
    Step("pytest_cuda", "pytest_cuda", 70, "pytest -m cuda over the test files that mark CUDA tests: counts"),
    Step("llm_graphs", "llm_graphs", 50, "builtin:small decode, CUDA graphs vs eager, fp16 and fp32"),
    Step("restore", "restore", 30, "checkpoint, in-place rollback (same buffers, no re-capture), fresh open"),
    Step("policy_engines", "policy_engines", 35, "every policy engine vs the CPU torch reference: error, p50/p99"),
    Step("act_while_chat", "act_while_chat", 30, "Session.act p50/p99 while a chat thread generates"),
    Step("tensor_bpe", "tensor_bpe", 40, "tensor BPE merges on 1M characters, exact vs the reference"),
    Step("llm_engines", "llm_engines", 30, "each LLM engine (onnxruntime, tensorrt) vs the torch step: logits, ids, ms/step"),
)

assert sum(s.timeout_s for s in STEPS) <= TOTAL_BUDGET_S, "the GPU check's step timeouts exceed its budget"


def step_named(name: str) -> Step:
    for s in STEPS:
        if s.name == name:
            return s
    raise ValueError(f"unknown gpu_check step {name!r}; steps: {', '.join(s.name for s in STEPS)}")


__all__ = ["STEPS", "Step", "TOTAL_BUDGET_S", "step_named"]
