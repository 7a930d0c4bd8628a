"""Session edges a user probe hit: stream names, dropping a stream, error types, store paths,
epoch names, and a background capsule made durable at exit without close()."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from capsule import CapsuleError, Session, StoreError, UnknownStream

RT = {"kv_pool_mb": 8, "max_context": 1024}


def _open(path, **kw):
    return Session.open(path, device="cpu", runtime=RT, **kw)


def test_stream_names_that_could_not_be_saved_are_refused(tmp_path):
    with _open(tmp_path / "s") as s:
        for bad in ("\udc80", "main\n", "a\x00b"):
            with pytest.raises(ValueError, match="stream name"):
                s.append("x", stream=bad)
        assert s.streams() == []
        s.append("x", stream="robot arm/left")       # printable text is fine
        s.checkpoint()
        with pytest.raises(ValueError, match="a name or a list"):
            s.generate(1, stream=None)
        with pytest.raises(UnknownStream, match="no stream 'nope'") as err:
            s.generate(1, stream="nope")
        assert isinstance(err.value, KeyError) and isinstance(err.value, CapsuleError)
        assert str(err.value).startswith("no stream")           # not KeyError's quoted repr


def test_drop_stream_frees_its_blocks_and_leaves_the_next_capsule(tmp_path):
    with _open(tmp_path / "s") as s:
        s.append("user: hello there\n" * 20, stream="chat")
        s.generate(4, stream="chat")
        s.append("keep me", stream="main")
        pool = s.engine.pool
        free = pool.free_blocks
        s.drop_stream("chat")
        assert s.streams() == ["main"] and pool.free_blocks > free
        with pytest.raises(UnknownStream):
            s.drop_stream("chat")
        s.append("a new chat", stream="chat")               # the name is free again
        s.generate(2, stream="chat")
        s.drop_stream("chat")
        s.checkpoint()
    with _open(tmp_path / "s") as s:
        assert s.streams() == ["main"] and s.text() == "keep me"


def test_state_and_epoch_names_raise_value_errors(tmp_path):
    with _open(tmp_path / "s") as s:
        deep: list = []
        for _ in range(5000):
            deep = [deep]
        with pytest.raises(ValueError, match="nested too deeply"):
            s.state = {"x": deep}
        s.append("x")
        for bad in (" 1", "\u0661", "-1", "a\x00b", "a\udc80"):
            with pytest.raises(ValueError, match="epoch name"):
                s.checkpoint(name=bad)
        assert s.epochs() == []


def test_store_paths(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="store folder"):
        _open("")
    monkeypatch.setenv("HOME", str(tmp_path))
    with _open("~/robot.capsules") as s:
        assert s.path == tmp_path / "robot.capsules"
    busy = tmp_path / "photos"
    busy.mkdir()
    (busy / "cat.jpg").write_bytes(b"x")
    with pytest.raises(StoreError, match="other files"):
        _open(busy)
    assert sorted(p.name for p in busy.iterdir()) == ["cat.jpg"]


CHILD = textwrap.dedent("""
    import sys
    from capsule import Session
    s = Session.open(sys.argv[1], device="cpu", runtime={"kv_pool_mb": 8, "max_context": 1024})
    s.append("hello")
    s.checkpoint()
    s.append(" world")
    s.generate(5)
    print(s.checkpoint(wait=False))
    # no close(): the interpreter exits right away
""")


def test_a_background_capsule_is_made_durable_at_exit_without_close(tmp_path):
    path = tmp_path / "s"
    res = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr
    epoch = int(res.stdout.strip().splitlines()[-1])
    with _open(path) as s:
        assert s.restored_epoch == epoch == 2


FORK_CHILD = textwrap.dedent("""
    import os, sys
    from capsule import Session
    s = Session.open(sys.argv[1], device="cpu", runtime={"kv_pool_mb": 8, "max_context": 1024})
    s.append("hello")
    s.checkpoint()
    pid = os.fork()
    if pid == 0:
        s.append(" from the child")
        sys.exit(0)             # the child's interpreter exit must not close the parent's store
    os.waitpid(pid, 0)
    import fcntl
    fd = os.open(os.path.join(sys.argv[1], "LOCK"), os.O_RDWR)
    try:                        # the parent still holds the store's lock
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("lock free")
    except BlockingIOError:
        print("lock held")
    os.close(fd)
    s.append(" world")
    print(s.checkpoint())
    s.close()
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_closes_its_parents_session_at_exit(tmp_path):
    path = tmp_path / "s"
    res = subprocess.run([sys.executable, "-c", FORK_CHILD, str(path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-2:] == ["lock held", "2"]
    with _open(path) as s:
        assert s.restored_epoch == 2 and s.text() == "hello world"


def test_a_character_split_across_replies_is_completed_by_the_next(tmp_path, monkeypatch):
    from capsule.llm import engine
    pieces = iter([b"\xc3", b"\xa9", b"!", b"\xe2\x82", b"\xac", b"\xf0\x9f"])
    monkeypatch.setattr(engine, "sample_decodable",
                        lambda sampler, tok, logits, params, gens: [(5, next(pieces)) for _ in gens])
    with _open(tmp_path / "s") as s:
        s.append("price:")
        assert s.generate(1) == ""                    # the first byte of 'é' waits
        s.checkpoint()                                # ... in the capsule too
    with _open(tmp_path / "s") as s:
        assert s.generate(1) == "é" and s.generate(1) == "!"
        assert s.generate(1) == "" and s.generate(1) == "€"
        assert s.text() == "price:é!€"
        assert s.generate(1) == ""                    # half an emoji, then the user speaks
        s.append(" ok")
        assert s.text() == "price:é!€\ufffd ok"
        assert s.tokens() == s.tokenizer.encode(s.text())
