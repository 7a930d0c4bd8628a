"""Sampler: greedy is argmax, seeded sampling reproduces, top-p keeps the nucleus; batched, a
stream samples the same tokens alone or beside others, greedy rows mixed in."""
from __future__ import annotations

import pytest
import torch

from capsule import Session
from capsule.llm import SamplingParams, make_generator, sample_rows
from capsule.llm.sampler import Sampler

CUTS = ["histogram", "sort"]     # the CPU default, and the one CUDA uses (both run on CPU here)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


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


def _steps(seed, n_steps, v):
    """A fresh row of logits per step (the same sequence for every run that uses this seed)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(v, generator=g) * 2 for _ in range(n_steps)]


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_stream_samples_the_same_alone_and_in_a_batch(cut, device):
    v, steps = 3000, 40
    mine, p = _steps(0, steps, v), SamplingParams(0.8, 0.9)
    sampler = Sampler(4, v, device, nucleus=cut)
    gen = make_generator(42, device)
    alone = [sampler.rows(row.view(1, -1).to(device), [p], [gen])[0] for row in mine]
    state_alone = gen.get_state()
    # beside three other streams with their own logits, parameters and generators, in row 2
    others = [_steps(s, steps, v) for s in (1, 2, 3)]
    params = [SamplingParams(1.3, 1.0), SamplingParams(), p, SamplingParams(0.5, 0.3)]
    gens = [make_generator(7, device), None, make_generator(42, device), make_generator(9, device)]
    batched = []
    for t in range(steps):
        logits = torch.stack([others[0][t], others[1][t], mine[t], others[2][t]]).to(device)
        batched.append(sampler.rows(logits, params, gens)[2])
    assert batched == alone
    assert torch.equal(gens[2].get_state(), state_alone)  # the same draws from the stream's generator


@pytest.mark.parametrize("cut", CUTS)
def test_greedy_rows_mixed_with_sampled_rows(cut):
    v = 500
    sampler = Sampler(4, v, "cpu", nucleus=cut)
    params = [SamplingParams(), SamplingParams(0.9, 0.8), SamplingParams(), SamplingParams(1.0)]
    gens = [None, make_generator(1, "cpu"), None, make_generator(2, "cpu")]
    alone, solo = Sampler(1, v, "cpu", nucleus=cut), [make_generator(1, "cpu"), make_generator(2, "cpu")]
    for logits in _steps(5, 30, v * 4):
        logits = logits.view(4, v)
        picks = sampler.rows(logits, params, gens)
        assert picks[0] == logits[0].argmax() and picks[2] == logits[2].argmax()
        assert picks[1] == alone.rows(logits[1:2], [params[1]], [solo[0]])[0]
        assert picks[3] == alone.rows(logits[3:4], [params[3]], [solo[1]])[0]


def test_the_cut_is_the_same_with_a_histogram_or_a_sort():
    v = 5000
    picks = {}
    for cut in CUTS:
        sampler = Sampler(3, v, "cpu", nucleus=cut)
        gens = [make_generator(i, "cpu") for i in range(3)]
        params = [SamplingParams(0.7, 0.5), SamplingParams(1.0, 0.95), SamplingParams(2.0, 0.05)]
        picks[cut] = [sampler.rows(x.view(3, v), params, gens) for x in _steps(11, 50, 3 * v)]
    assert picks["histogram"] == picks["sort"]


@pytest.mark.parametrize("cut", CUTS)
def test_sampled_frequencies_follow_the_renormalized_nucleus(cut):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, -1.0, -2.0, float("-inf")]])
    sampler, gen = Sampler(1, 7, "cpu", nucleus=cut), make_generator(3, "cpu")
    p = torch.softmax(logits[0].double(), -1)
    nucleus = 4                     # the top 4 hold 0.94 >= 0.9, the top 3 only 0.86
    assert p[:nucleus - 1].sum() < 0.9 <= p[:nucleus].sum()
    counts = torch.zeros(7)
    for _ in range(4000):
        counts[sampler.rows(logits, [SamplingParams(1.0, 0.9)], [gen])[0]] += 1
    assert counts[nucleus:].sum() == 0
    want = p[:nucleus] / p[:nucleus].sum()
    assert torch.allclose(counts[:nucleus].double() / 4000, want, atol=0.03)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sampled_frequencies_over_many_race_groups(top_p):
    # 200 tokens: 13 groups of 16; 8 rows of the same logits, each stream its own generator
    logits = torch.randn(200, generator=torch.Generator().manual_seed(4)) * 1.5
    sampler = Sampler(8, 200, "cpu")
    assert sampler.groups > 1
    gens = [make_generator(100 + i, "cpu") for i in range(8)]
    counts = torch.zeros(200, dtype=torch.float64)
    for _ in range(2500):
        for t in sampler.rows(logits.repeat(8, 1), [SamplingParams(1.0, top_p)] * 8, gens):
            counts[t] += 1
    p = torch.softmax(logits.double(), -1)
    ordered, order = p.sort(descending=True)
    kept = order[:int((ordered.cumsum(0) < top_p).sum()) + 1] if top_p < 1 else order
    want = torch.zeros_like(p)
    want[kept] = p[kept] / p[kept].sum()
    assert counts[want == 0].sum() == 0
    chi2 = ((counts - want * counts.sum()) ** 2 / (want * counts.sum()))[want > 0].sum()
    dof = len(kept) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (float(chi2), dof)


def test_masked_tokens_are_never_picked():
    logits = torch.randn(2, 4000, generator=torch.Generator().manual_seed(0))
    logits[:, 1::2] = float("-inf")        # e.g. rows past the tokenizer's ids, unassigned ids
    sampler = Sampler(2, 4000, "cpu")
    gens = [make_generator(0, "cpu"), make_generator(1, "cpu")]
    for params in ([SamplingParams(1.0, 1.0)] * 2, [SamplingParams(3.0, 0.999)] * 2):
        assert all(t % 2 == 0 for _ in range(60) for t in sampler.rows(logits, params, gens))


@pytest.mark.parametrize("cut", CUTS)
def test_the_cut_ends_at_the_boundary_token_and_keeps_its_ties(cut):
    # 3 tokens of p ~0.28, one of ~0.08 (mass 0.92 with it), 19,996 tied ones sharing the rest
    v = 20000
    logits = torch.zeros(1, v)
    logits[0, :3], logits[0, 3] = 11.08, 9.84
    p = torch.softmax(logits[0].double(), -1)
    assert p[:3].sum() < 0.9 < p[:4].sum() < 0.95
    sampler, gen = Sampler(1, v, "cpu", nucleus=cut), make_generator(0, "cpu")
    picks = [sampler.rows(logits, [SamplingParams(1.0, 0.9)], [gen])[0] for _ in range(300)]
    assert set(picks) == {0, 1, 2, 3}
    # past token 3 the boundary falls among the tied tail: all of it is kept
    picks = [sampler.rows(logits, [SamplingParams(1.0, 0.95)], [gen])[0] for _ in range(300)]
    assert max(picks) > 3


def test_a_step_reuses_the_preallocated_buffers():
    logits = _logits(n=4, v=64)
    sampler = Sampler(4, 64, "cpu")
    gens = [make_generator(i, "cpu") for i in range(4)]
    mixed = [SamplingParams(), SamplingParams(0.8, 0.9)] * 2
    ptrs = {sampler.sample(logits[:n], mixed[:n], gens[:n]).data_ptr() for n in (4, 2, 4, 1, 4)}
    assert len(ptrs) <= 2       # the token rows of the sampled or the mixed path, nothing fresh
    with pytest.raises(ValueError, match="logits must be"):
        sampler.sample(_logits(n=4, v=65), [SamplingParams()] * 4, [None] * 4)


def test_a_small_change_of_the_logits_keeps_the_tokens():
    """The decoder's logits for a stream differ in the last bits with the batch size (~2e-7 on
    CPU). The race pick barely moves with them; an inverse CDF over the vocabulary moves with
    the rounding of all the mass before the pick (on real decoder logits ~0.1% of its steps
    flipped; with the drift below, 3 of these 40)."""
    v, steps = 100277, 40
    sampler = Sampler(1, v, "cpu")
    a, b = make_generator(5, "cpu"), make_generator(5, "cpu")
    drift = torch.arange(v) / v * 3e-5       # a change that piles up along the vocabulary
    params = [SamplingParams(0.9, 0.9)]
    picks = [(sampler.rows(x.view(1, -1), params, [a]), sampler.rows((x + drift).view(1, -1), params, [b]))
             for x in _steps(21, steps, v)]
    assert all(p == q for p, q in picks)


def test_a_seeded_stream_generates_the_same_alone_and_beside_others(tmp_path):
    """End to end: the decoder's logits differ in the last bits between batch sizes (see above),
    and the tokens stay the same."""
    text = "".join(f"user: step {i}: move the red cup {i * 7} cm left.\nrobot: ok.\n" for i in range(12))
    with Session.open(tmp_path / "a", device="cpu") as s:
        s.append(text, stream="x")
        s.generate(16, stream="x", temperature=0.9, top_p=0.9, seed=7)
        alone = s.tokens("x")
    with Session.open(tmp_path / "b", device="cpu") as s:
        s.append("another prompt entirely", stream="o1")
        s.append(text, stream="x")
        s.append(text[:200], stream="o2")
        s.generate(16, stream=["o1", "x", "o2"], temperature=0.9, top_p=0.9, seed=7)
        assert s.tokens("x") == alone
