"""One owner of a stream's text and ids (its incremental tokenizer): an append applies the
tokenizer's Splice to the K/V and never copies the history, and the checkpoint after it writes
about what the append added (docs/FORMAT.md, "What a Session capsule holds")."""
from __future__ import annotations

import dataclasses

import pytest

from capsule import Session
from capsule.llm.streams import Stream
from capsule.state.snapshot import HOST_PAGE
from capsule.tokenize import IncrementalTokenizer, load_reference

RT = {"kv_pool_mb": 16, "max_context": 4096}
LINE = "t=00412 joint3=-1.250 user: move the red cup to bin 7 (120 mm)\n"


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_stream_holds_no_copy_of_its_text_or_ids():
    names = {f.name for f in dataclasses.fields(Stream)}
    assert not names & {"text", "ids"} and "tok" in names


def test_append_and_generate_never_copy_the_whole_history(tmp_path, monkeypatch):
    ref = load_reference("cl100k_base")
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append(LINE * 40)                                  # the first append: a full encode

        def whole(self):
            raise AssertionError("the whole text or id list was copied")
        monkeypatch.setattr(IncrementalTokenizer, "ids", property(whole))
        monkeypatch.setattr(IncrementalTokenizer, "text", property(whole))
        for part in ["user: where is it?\n", "robot:", " 12", "34", "\n"]:
            s.append(part)
            s.generate(3)
            s.checkpoint()
        s.append(" ok")
        monkeypatch.undo()
        text = s.text()
        assert s.tokens() == ref.encode(text) and text.startswith(LINE * 40 + "user: where is it?\n")
        assert text.endswith(" ok")
        assert s.engine.stream("main").tok.stats["fallbacks"] == 0


def test_the_kv_keeps_what_the_splice_keeps(tmp_path):
    ref = load_reference("cl100k_base")
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        engine = s.engine
        s.append("user: count to 5: 1 2 3 4 12")
        st = engine.stream("main")
        s.generate(4)
        before, cached = s.tokens(), st.table.num_cached
        s.append("34 and on")                                # re-tokenizes the seam
        after = s.tokens()
        assert after == ref.encode(s.text())
        assert st.table.num_cached == min(cached, _common(before, after))
        # generated ids that equal the reference's ids of their text keep their K/V
        s.append("\nuser: hi")
        st.generated += ref.encode(" there")
        st.pending += " there"
        engine._prefill_pending(st)                          # K/V for every id, generated too
        n = st.n_ids
        assert st.table.num_cached == n
        s.append("\n")
        assert st.table.num_cached == n
        assert s.tokens() == ref.encode(s.text())


def _append_bytes(s: Session, name: str, history: str, text: str) -> tuple[int, int, int]:
    """(bytes of the checkpoint after appending text, of one with nothing new, new bytes)."""
    s.append(history, stream=name)
    s.checkpoint()
    s.checkpoint()
    constant = s.epochs()[-1].bytes_written
    n = len(s.tokens(name))
    s.append(text, stream=name)
    s.checkpoint()
    new = len(text.encode()) + 4 * (len(s.tokens(name)) - n)
    return s.epochs()[-1].bytes_written, constant, new


@pytest.mark.parametrize("text", [LINE * 22, "5678 and the rest " * 4])   # ~1.4K chars; a re-tokenized seam
def test_a_checkpoint_after_an_append_writes_what_it_added(tmp_path, text):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        got = {}
        for name, lines in (("short", 15), ("long", 50)):         # ~1K and ~3.4K tokens
            history = LINE * lines + "reading 1234"
            written, constant, new = _append_bytes(s, name, history, text)
            assert written <= 2 * new + constant + 2 * HOST_PAGE, (name, written, constant, new)
            got[name] = written - constant
        assert abs(got["long"] - got["short"]) <= HOST_PAGE          # not the history's size


def test_the_stream_views_read_the_tokenizer_then_the_generated_part(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append(LINE * 3)
        s.generate(5)
        st = s.engine.stream("main")
        ids, text = s.tokens(), s.text()
        assert st.n_ids == len(ids) and st.n_chars == len(text) and st.last_id == ids[-1]
        assert len(st.generated) == 5 and st.pending and text.endswith(st.pending)
        for lo, hi in ((0, 3), (len(ids) - 7, len(ids) - 2), (len(ids) - 3, None), (2, len(ids))):
            assert st.ids_slice(lo, hi) == ids[lo:hi]
        for n in (1, len(st.pending), len(st.pending) + 9, len(text) + 5):
            assert st.text_tail(n) == text[-n:]
