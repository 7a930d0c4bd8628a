"""Session.append runs the exact incremental tokenizer: small windows, reference ids, capsule-safe."""
from __future__ import annotations

import pytest

from capsule import Session
from capsule.tokenize import IncrementalTokenizer, load_reference
from capsule.tokenize.registry import family_names, get_family

RT = {"kv_pool_mb": 8, "max_context": 4096}


@pytest.mark.parametrize("family", family_names())    # every registered family, through a Session
def test_appends_equal_reference_and_stay_windowed(tmp_path, family):
    ref = load_reference(family)
    base = "def step(self, q):\n    return self.policy(q)  # ok\n" * 150          # ~7.5K chars
    with Session.open(tmp_path / "s", tokenizer=family, device="cpu", runtime=RT) as s:
        s.append(base)
        text = base
        for piece in ["\n", "  ", "x", " = ", "1234", "5", "'", "s", "cafe", "\u0301", " 東京", "\r", "\n"]:
            s.append(piece)
            text += piece
            assert s.tokens() == ref.encode(text), piece
        stats = s.engine.stream("main").tok.stats
        # 13 full re-encodes would be ~100K chars; windows around each seam are far less
        assert stats["appends"] >= 14 and stats["window_chars"] < len(base) + 13 * 2000, stats


def test_generated_text_joins_the_canonical_ids_on_the_next_append(tmp_path):
    ref = load_reference("cl100k_base")
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append("user: hi\nrobot:")
        s.generate(6)
        s.append("\nuser: go on")
        assert s.tokens() == ref.encode(s.text())


def test_restored_stream_appends_incrementally_from_its_saved_state(tmp_path):
    ref = load_reference("cl100k_base")
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append("robot log line 0.1 0.2\n" * 200)
        s.generate(3)
        s.checkpoint()
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        stream = s.engine.stream("main")
        assert stream.tok.check_pending    # restored unchecked: no encoder needed to restore
        s.append(" and one more")
        assert s.tokens() == ref.encode(s.text())
        assert stream.tok.stats["appends"] >= 2                       # continued, not rebuilt


def test_damaged_tokenizer_state_falls_back_to_one_exact_encode(tmp_path):
    ref = load_reference("cl100k_base")
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append("hello world " * 50)
        s.checkpoint()
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        stream = s.engine.stream("main")
        meta, blobs = stream.tok.state_dict()   # the restored state, its last id replaced
        stream.tok = IncrementalTokenizer.from_state(ref, meta, {**blobs, "ids": blobs["ids"][:-4]
                                                                 + (7).to_bytes(4, "little")},
                                                     deferred=True)
        s.append("!")
        assert s.tokens() == ref.encode(s.text()) and stream.tok.stats["fallbacks"] == 1


def test_rejected_append_to_an_existing_stream_changes_nothing(tmp_path):
    ref = load_reference("cl100k_base")
    with Session.open(tmp_path / "s", device="cpu", runtime={**RT, "max_context": 256}) as s:
        s.append("user: hello there\n")
        before = (s.tokens(), s.text())
        with pytest.raises(ValueError, match="max_context"):
            s.append("word " * 400)
        assert (s.tokens(), s.text()) == before
        s.append("robot: hi")
        assert s.tokens() == ref.encode(s.text())


def test_a_tiktoken_file_with_its_pattern_opens_a_session_and_restores(tmp_path):
    # a .tiktoken rank file carries no regex: load_reference(path, pattern=...) gives the
    # tokenizer, and Session.open(tokenizer=) takes it as is; the capsule binds its fingerprint
    fam = load_reference("r50k_base")
    ranks = get_family("r50k_base").source_files()[0]
    tok = load_reference(ranks, pattern=fam.pattern, special_tokens=fam.special_tokens)
    assert tok.fingerprint == fam.fingerprint
    with pytest.raises(ValueError, match="pattern="):
        Session.open(tmp_path / "bad", tokenizer=ranks, device="cpu", runtime=RT)
    with Session.open(tmp_path / "s", tokenizer=tok, device="cpu", runtime=RT) as s:
        assert s.tokenizer is tok
        s.append("user: hello  world 12345<|endoftext|>x")
        assert not s.engine.stream("main").tok.full_mode
        assert s.tokens() == fam.encode(s.text())
        s.checkpoint()
    with Session.open(tmp_path / "s", tokenizer=tok, device="cpu", runtime=RT) as s:
        assert s.restored_epoch is not None
        s.append(" again")
        assert s.tokens() == fam.encode("user: hello  world 12345<|endoftext|>x again")
