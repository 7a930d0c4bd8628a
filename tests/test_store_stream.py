"""Store.write_epoch / stage_epoch with a PageStream: pages made while they are appended, the
keys checked first, every produced page checked against them, nothing committed on a bad one."""
from __future__ import annotations

import pytest

from capsule.store import PageStream, Store


def _stream(pages, keys=None, nbytes=0) -> PageStream:
    return PageStream(keys if keys is not None else [(r, i) for r, i, _ in pages], iter(pages), nbytes)


def test_a_stream_is_written_like_a_list_and_reuses_one_buffer(tmp_path):
    buf = bytearray(64)

    def produce():
        for i in range(5):          # every page a view into the same buffer, refilled per page
            buf[:] = bytes([i]) * 64
            yield "r", i, memoryview(buf)
    with Store.open(tmp_path / "s") as st:
        st.write_epoch(PageStream([("r", i) for i in range(5)], produce(), 5 * 64), b"m1")
        _, pages = st.load_epoch(1)
        assert {i: bytes(p) for i, p in pages["r"].items()} == {i: bytes([i]) * 64 for i in range(5)}
        # a delta over it, streamed, keeps the unwritten pages
        st.write_epoch(_stream([("r", 2, b"x" * 64)]), b"m2")
        _, pages = st.load_epoch(2)
        assert bytes(pages["r"][2]) == b"x" * 64 and bytes(pages["r"][4]) == bytes([4]) * 64


@pytest.mark.parametrize("bad, match", [
    ([("r", 0, b"a"), ("r", 2, b"b")], r"produced r\[2\] where its keys say r\[1\]"),
    ([("r", 0, b"a")], r"ended before page r\[1\]"),
    ([("r", 0, b"a"), ("r", 1, b"b"), ("r", 2, b"c")], "more than its 2 pages"),
    ([("r", 0, b"a"), ("r", 1, 12345)], "must be bytes"),
])
def test_a_stream_that_breaks_its_keys_commits_nothing(tmp_path, bad, match):
    with Store.open(tmp_path / "s") as st:
        st.write_epoch([("r", 0, b"old")], b"m1")
        with pytest.raises(ValueError, match=match):
            st.write_epoch(_stream(bad, keys=[("r", 0), ("r", 1)]), b"m2")
        assert [e.id for e in st.epochs()] == [1]
        st.write_epoch([("r", 1, b"next")], b"m3")          # the store goes on, no torn bytes
        _, pages = st.load_epoch(2)
        assert bytes(pages["r"][0]) == b"old" and bytes(pages["r"][1]) == b"next"
    with Store.open(tmp_path / "s") as st:                  # and reopens clean
        assert [e.id for e in st.epochs()] == [1, 2]


def test_stream_keys_are_checked_before_any_page_is_made(tmp_path):
    made = []

    def produce():
        made.append(1)
        yield "r", 0, b"a"
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(ValueError, match="appears twice"):
            st.write_epoch(PageStream([("r", 0), ("r", 0)], produce(), 2), b"m")
        with pytest.raises(ValueError, match="page index"):
            st.write_epoch(PageStream([("r", -1)], produce(), 1), b"m")
        assert made == [] and st.epochs() == []


def test_a_stream_is_consumed_once(tmp_path):
    with Store.open(tmp_path / "s") as st:
        s = _stream([("r", 0, b"a")])
        st.write_epoch(s, b"m1")
        with pytest.raises(ValueError, match="written once"):
            st.write_epoch(s, b"m2")
        assert [e.id for e in st.epochs()] == [1]
