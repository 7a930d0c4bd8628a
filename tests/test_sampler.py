"""Sampler: greedy is argmax, seeded sampling reproduces, top-p keeps the nucleus."""
from __future__ import annotations

import pytest
import torch

from capsule.llm import SamplingParams, make_generator, sample_rows


def _logits(seed=0, n=3, v=50):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_and_needs_no_generator():
    logits = _logits()
    assert sample_rows(logits, [SamplingParams()] * 3, [None] * 3) == logits.argmax(-1).tolist()


def test_seeded_sampling_reproduces_and_seeds_differ():
    logits = _logits()
    p = [SamplingParams(temperature=1.0)] * 3

    def run(seed):
        gens = [make_generator(seed + i, "cpu") for i in range(3)]
        return [sample_rows(logits, p, gens) for _ in range(20)]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_generator_state_resumes_the_same_sequence():
    logits = _logits(n=1)
    p = [SamplingParams(temperature=1.0)]
    gen = make_generator(5, "cpu")
    [sample_rows(logits, p, [gen]) for _ in range(5)]
    saved = gen.get_state()
    tail = [sample_rows(logits, p, [gen]) for _ in range(10)]
    gen2 = torch.Generator()
    gen2.set_state(saved)
    assert [sample_rows(logits, p, [gen2]) for _ in range(10)] == tail


def test_tiny_top_p_is_greedy():
    logits = _logits()
    gens = [make_generator(i, "cpu") for i in range(3)]
    picks = sample_rows(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 3, gens)
    assert picks == logits.argmax(-1).tolist()


def test_top_p_never_picks_outside_the_nucleus():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, -2.0]])
    gen = make_generator(0, "cpu")
    seen = {sample_rows(logits, [SamplingParams(1.0, 0.9)], [gen])[0] for _ in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                dict(temperature=float("nan"))])
def test_bad_params_raise(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
