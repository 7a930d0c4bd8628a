"""Observation intake: non-finite values and non-str keys are refused before anything changes,
the same on every engine (no engine call, no hidden-state update, no queue move)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import onnxruntime  # noqa: F401 -- the test extra: if it is missing the suite fails, never skips

from capsule import Session
from capsule.policy import load_policy
from capsule.policy.actor import Actor

ENGINES = ["torch", "onnxruntime"]
BUILTINS = ["mlp", "mlp-chunk", "gru"]


def _obs(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"observation.state": rng.standard_normal(14).astype(np.float32)}


def _bad(i: int, index: int, value: float) -> np.ndarray:
    q = _obs(i)["observation.state"].copy()
    q[index] = value
    return q


class _Counting:
    """Wraps an engine's run to count calls."""

    def __init__(self, runner) -> None:
        self.calls, real = 0, runner.engine.run

        def run() -> None:
            self.calls += 1
            real()
        runner.engine.run = run


FORMS = {
    "numpy": lambda q: q,
    "numpy batched": lambda q: q[None],
    "torch": lambda q: torch.from_numpy(q),
    "torch batched": lambda q: torch.from_numpy(q)[None],
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_observation_is_refused_before_the_engine_runs(engine, name, value):
    runner = load_policy(f"builtin:{name}", engines=(engine,))
    for i in range(3):
        runner.step(_obs(i))
    before = {k: t.clone() for k, t in runner.buffers.tensors().items()}
    counter = _Counting(runner)
    with pytest.raises(ValueError) as info:
        runner.step({"observation.state": _bad(3, 5, value)})
    msg = str(info.value)
    assert "'observation.state'" in msg and "index 5" in msg and "non-finite" in msg, msg
    assert counter.calls == 0                                  # no engine call
    for k, t in runner.buffers.tensors().items():              # hidden, obs, action untouched
        assert torch.equal(t, before[k]), k


@pytest.mark.parametrize("form", list(FORMS))
def test_every_observation_form_is_checked(form):
    runner = load_policy("builtin:gru", engines=("onnxruntime",))
    q = _bad(0, 11, np.nan)
    q[12] = np.inf
    with pytest.raises(ValueError) as info:
        runner.step({"observation.state": FORMS[form](q)})
    where = "index (0, 11)" if "batched" in form else "index 11"
    assert where in str(info.value) and "2 of 14" in str(info.value), str(info.value)
    assert not runner.buffers.hidden.any()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_refused_observation_leaves_the_episode_as_if_it_never_came(engine):
    ref = load_policy("builtin:gru", engines=(engine,))
    want = [ref.step(_obs(i)) for i in range(6)][3:]
    actor = Actor(load_policy("builtin:gru", engines=(engine,)))   # what Session.act runs
    for i in range(3):
        actor.act(_obs(i))
    with pytest.raises(ValueError, match="non-finite"):
        actor.act({"observation.state": _bad(3, 0, np.nan)})
    got = [actor.act(_obs(i)) for i in range(3, 6)]
    np.testing.assert_array_equal(np.stack(got), np.stack(want))


def test_session_gru_capsule_never_captures_a_nan_hidden_state(tmp_path):
    path = tmp_path / "s"
    with Session.open(path, device="cpu", model=None, policy="builtin:gru") as s:
        for i in range(3):
            s.act(_obs(i))
        with pytest.raises(ValueError, match="index 2"):
            s.act({"observation.state": _bad(3, 2, np.inf)})
        s.checkpoint()
        expect = s.act(_obs(3))
    with Session.open(path, device="cpu", model=None, policy="builtin:gru") as s:
        assert torch.isfinite(s.registry["policy.hidden"].tensor).all()
        np.testing.assert_array_equal(s.act(_obs(3)), expect)


@pytest.mark.parametrize("engine", ENGINES)
def test_chunk_queue_does_not_move_on_a_refused_observation(engine):
    chunk = load_policy("builtin:mlp-chunk", engines=(engine,)).step(_obs(0))   # (4, 6)
    actor = Actor(load_policy("builtin:mlp-chunk", engines=(engine,)))
    assert np.array_equal(actor.act(_obs(0)), chunk[0])
    assert actor.queued == 3
    with pytest.raises(ValueError, match="'observation.state'.*index 7"):
        actor.act({"observation.state": _bad(1, 7, np.nan)})   # served from the queue: still checked
    assert actor.queued == 3
    with pytest.raises(ValueError, match="expected shape"):
        actor.act({"observation.state": np.zeros(3, np.float32)})
    got = [actor.act(_obs(i)) for i in range(1, 4)]
    np.testing.assert_array_equal(np.stack(got), chunk[1:])


@pytest.mark.parametrize("obs, words", [
    ({1: np.zeros(14, np.float32), "a": 1}, ["missing 'observation.state'", "allowed keys",
                                              "(14,) float32", "['a', 1]", "keys must be str"]),
    ({"observation.state": np.zeros(14, np.float32), 1: 0, "a": 1, (2,): 0},
     ["unknown key(s)", "'a'", "(2,)", "keys must be str", "allowed keys: 'observation.state'"]),
    ({None: 0}, ["missing", "[None]", "keys must be str"]),
])
def test_non_str_keys_are_a_value_error_listing_the_allowed_keys(obs, words, tmp_path):
    with Session.open(tmp_path / "s", device="cpu", model=None, policy="builtin:gru") as s:
        with pytest.raises(ValueError) as info:
            s.act(obs)
        for w in words:
            assert w in str(info.value), str(info.value)
        assert not s.registry["policy.hidden"].tensor.any()


def test_finite_extremes_pass_and_check_observation_changes_nothing():
    runner = load_policy("builtin:mlp", engines=("onnxruntime",))
    big = np.full(14, np.finfo(np.float32).max, np.float32)   # finite extremes are fine
    assert runner.step({"observation.state": big}).shape == (6,)
    runner.step(_obs(1))
    before = {k: t.clone() for k, t in runner.buffers.tensors().items()}
    runner.check_observation(_obs(0))                          # changes nothing, raises nothing
    assert all(torch.equal(t, before[k]) for k, t in runner.buffers.tensors().items())
    with pytest.raises(ValueError, match="index 0"):
        runner.check_observation({"observation.state": _bad(0, 0, np.nan)})


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["torch", pytest.param("onnxruntime", marks=pytest.mark.ort_cuda)])
def test_cuda_tensor_observation_is_checked_on_device(engine):
    runner = load_policy("builtin:gru", device="cuda", engines=(engine,))
    runner.step({"observation.state": torch.from_numpy(_obs(0)["observation.state"]).cuda()})
    before = runner.buffers.hidden.clone()
    with pytest.raises(ValueError, match="index 4"):
        runner.step({"observation.state": torch.from_numpy(_bad(1, 4, np.nan)).cuda()})
    assert torch.equal(runner.buffers.hidden, before)
