"""Session.act / reset / episode over the policy engines; the queue and hidden state in capsules."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnxruntime as ort
import pytest

from capsule import CapsuleCorrupt, CapsuleMismatch, Session
from capsule.policy import export_onnx, load_policy


def _obs(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"observation.state": rng.standard_normal(14).astype(np.float32)}


def test_chunked_policy_serves_its_queue_in_order(tmp_path):
    ref = load_policy("builtin:mlp-chunk")
    chunk0, chunk1 = ref.step(_obs(0)), ref.step(_obs(4))          # (4, 6) each
    with Session.open(tmp_path / "s", device="cpu", model=None, policy="builtin:mlp-chunk") as s:
        got = [s.act(_obs(i)) for i in range(8)]   # observations 1-3, 5-7 are not used
    assert np.array_equal(np.stack(got[:4]), chunk0)
    assert np.array_equal(np.stack(got[4:]), chunk1)


def test_recurrent_actions_equal_a_hand_threaded_onnxruntime_run(tmp_path):
    path = export_onnx("builtin:gru", tmp_path / "gru.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    hidden = np.zeros((1, 32), dtype=np.float32)
    expect = []
    for i in range(20):
        action, hidden = sess.run(["action", "hidden_out"],
                                  {"observation.state": _obs(i)["observation.state"][None],
                                   "hidden_in": hidden})
        expect.append(action[0])
    with Session.open(tmp_path / "s", device="cpu", model=None, policy=str(path)) as s:
        got = [s.act(_obs(i)) for i in range(20)]
    np.testing.assert_allclose(np.stack(got), np.stack(expect), atol=1e-6, rtol=0)
    assert not np.allclose(got[0], got[1])   # the state really moves


@pytest.mark.parametrize("policy", ["builtin:gru", "builtin:mlp-chunk"])
def test_capsule_mid_episode_continues_in_a_fresh_process(tmp_path, policy):
    path = tmp_path / "s"
    with Session.open(path, device="cpu", model=None, policy=policy) as s:
        for i in range(5):                    # mid-chunk: 3 actions still queued
            s.act(_obs(i))
        s.checkpoint()
        expect = np.stack([s.act(_obs(i)) for i in range(5, 12)])
    code = textwrap.dedent(f"""
        import numpy as np
        from capsule import Session
        def obs(i):
            rng = np.random.default_rng(i)
            return {{"observation.state": rng.standard_normal(14).astype(np.float32)}}
        with Session.open({str(path)!r}, device="cpu", model=None, policy={policy!r}) as s:
            assert s.restored_epoch is not None
            np.save({str(tmp_path / "got.npy")!r}, np.stack([s.act(obs(i)) for i in range(5, 12)]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert np.array_equal(np.load(tmp_path / "got.npy"), expect)


def test_reset_and_episode_start_fresh(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", model=None, policy="builtin:gru") as s:
        first = s.act(_obs(0))
        s.act(_obs(1))
        s.reset()
        assert np.array_equal(s.act(_obs(0)), first)
        s.act(_obs(2))
        with s.episode():
            assert np.array_equal(s.act(_obs(0)), first)


def test_restore_into_another_policy_is_refused(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", model=None, policy="builtin:gru") as s:
        s.act(_obs(0))
        s.checkpoint()
    with pytest.raises(CapsuleMismatch):
        Session.open(tmp_path / "s", device="cpu", model=None, policy="builtin:mlp")


def test_policy_errors(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", model=None, policy="builtin:mlp") as s:
        with pytest.raises(ValueError, match="observation.state"):
            s.act({"observation.state": np.zeros(3, dtype=np.float32)})
        with pytest.raises(ValueError, match="observation.state"):
            s.act({})
    with Session.open(tmp_path / "t", device="cpu", model=None) as s:
        with pytest.raises(ValueError, match="no policy"):
            s.act(_obs(0))


def test_act_does_not_wait_for_an_llm_call_on_another_thread(tmp_path):
    import threading
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", policy="builtin:mlp",
                      runtime={"kv_pool_mb": 8}) as s:
        release, t, left = _hold_llm(s)
        acted: list[bool] = []         # was the LLM call still holding its lock when act returned?
        done = threading.Event()
        threading.Thread(target=lambda: (s.act(_obs(0)), acted.append(not left.is_set()), done.set())).start()
        assert done.wait(120) and acted == [True], "act waited for the LLM lock"
        cut: list[bool] = []           # had the LLM call ended when the capsule was taken?
        ckpt = threading.Event()
        threading.Thread(target=lambda: (s.checkpoint(wait=False), cut.append(left.is_set()),
                                         ckpt.set())).start()
        ckpt.wait(0.3)                 # time for a capsule that did not wait to show it: not a deadline
        release.set()
        t.join()
        assert ckpt.wait(10) and cut == [True]   # a capsule waits for the LLM call (a consistent cut)


def test_an_out_of_range_queue_cursor_is_never_restored(tmp_path, monkeypatch):
    from capsule.policy.actor import Actor
    path = tmp_path / "s"
    with Session.open(path, device="cpu", model=None, policy="builtin:mlp-chunk") as s:
        s.act(_obs(0))
        good = s.checkpoint()
        s.act(_obs(1))
        monkeypatch.setattr(Actor, "state", lambda self: {"queued": 99, "served": 1})
        s.checkpoint()   # checksummed like any capsule, but its cursor is out of range
    monkeypatch.undo()
    # the newest capsule is skipped, said, never installed
    with Session.open(path, device="cpu", model=None, policy="builtin:mlp-chunk") as s:
        assert s.restored_epoch == good and any("cursor" in line for line in s.restore_report)
        ref = load_policy("builtin:mlp-chunk").step(_obs(0))
        assert np.array_equal(s.act(_obs(5)), ref[1])   # the good capsule's queue continues
        with pytest.raises(CapsuleCorrupt, match="cursor"):
            s.rollback(good + 1)


def _hold_llm(s):
    """A thread inside an LLM call (as a long generate would be) until `release` is set; `left` is
    set inside the call as it ends, so while it is unset the LLM lock is provably held."""
    import threading
    held, release, left = threading.Event(), threading.Event(), threading.Event()

    def slow_append(*args, **kw):   # Session.append holds the LLM lock while this runs
        held.set()
        release.wait(60)          # a hang guard only: the tests set `release`
        del s.engine.append       # the Engine's own append shows through again
        left.set()
    s.engine.append = slow_append
    t = threading.Thread(target=s.append, args=("hello",))
    t.start()
    assert held.wait(10)
    return release, t, left


def test_a_deferred_capsule_never_waits_and_is_taken_when_the_llm_call_ends(tmp_path):
    from capsule.control import ControlLoop, FakeClock
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", policy="builtin:gru",
                      runtime={"kv_pool_mb": 8}) as s:
        assert isinstance(s.checkpoint(wait=False, defer=True), int)   # LLM idle: taken now
        s.flush()
        n0 = len(s.epochs())
        release, t, left = _hold_llm(s)
        assert s.checkpoint(wait=False, defer=True) is None
        loop = ControlLoop(s, hz=100, checkpoint_every=1, clock=FakeClock())
        stats = loop.run(lambda k: s.act(_obs(k)), steps=5)
        assert not left.is_set() and stats.checkpoints == 5   # all done while the LLM lock is held
        release.set()
        t.join()
        s.flush()
        assert len(s.epochs()) == n0 + 1          # the requests coalesced into one capsule
        with pytest.raises(ValueError, match="wait=False"):
            s.checkpoint(defer=True)


def test_a_deferred_capsule_error_surfaces_at_the_next_checkpoint(tmp_path, monkeypatch):
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime={"kv_pool_mb": 8}) as s:
        release, t, _ = _hold_llm(s)
        assert s.checkpoint(wait=False, defer=True) is None

        def boom(host, *, wait, name):
            raise OSError("disk on fire")
        monkeypatch.setattr(s.checkpointer, "checkpoint", boom)   # the deferred capsule's write fails
        release.set()
        t.join()                                   # the holder's call itself did not fail
        monkeypatch.undo()
        with pytest.raises(OSError, match="disk on fire"):
            s.checkpoint()
        assert isinstance(s.checkpoint(), int)


def test_control_loop_continue_survives_a_failed_background_write(tmp_path):
    """on_checkpoint_error="continue": a write failure on the writer thread (disk full) reaches
    the loop one capsule late; the robot keeps acting and later capsules are committed."""
    import threading
    import time
    from capsule.control import ControlLoop, FakeClock
    from capsule.store.errors import StoreIOError
    with Session.open(tmp_path / "s", device="cpu", model=None, policy="builtin:gru") as s:
        real_stage, real_discard = s.store.stage_epoch, s.store.discard_staged
        armed, failed = threading.Event(), threading.Event()

        def stage(*a, **kw):
            if armed.is_set() and not failed.is_set():
                raise StoreIOError("injected: no space left on device")
            return real_stage(*a, **kw)

        def discard(*a, **kw):
            try:
                return real_discard(*a, **kw)
            finally:
                failed.set()
        s.store.stage_epoch, s.store.discard_staged = stage, discard

        def step(tick: int) -> None:
            s.act(_obs(tick))
            if tick == 10:
                armed.set()                        # the next write (capsule 6, after tick 11) fails
            elif tick > 11:                        # let the writer record it before the next capsule
                assert failed.wait(10)
                time.sleep(0.01)

        loop = ControlLoop(s, hz=100, checkpoint_every=2, clock=FakeClock(), on_checkpoint_error="continue")
        with pytest.warns(RuntimeWarning, match="no space left"):
            st = loop.run(step, steps=40)
        assert st.steps == 40 and st.checkpoints == 20
        assert st.checkpoint_failures == 1 and "were not committed" in st.last_checkpoint_error
        s.flush()                                  # nothing pending: the failure was reported in the run
        expect = s.act(_obs(40))
    with Session.open(tmp_path / "s", device="cpu", model=None, policy="builtin:gru") as s:   # the last capsule
        np.testing.assert_array_equal(s.act(_obs(40)), expect)                   # (after tick 39) holds
