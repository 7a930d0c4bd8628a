"""The incremental tokenizer as the one owner of a text and its ids: slices, a refused edit, a
restore whose tail check is deferred, and a state written as fixed-size chunks that change only
from an edit's seam on (tokenize/incremental_state.py)."""
from __future__ import annotations

import random

import pytest

from capsule.tokenize import IncrementalTokenizer, incremental, incremental_state, load_reference
from capsule.tokenize.incremental_state import CHUNK_CHARS, CHUNK_IDS

TEXT = ("def step(self, q):\n    return self.policy(q)  # ok, it's 12345\n"
        "日本語のテキスト。café 👩\u200d👩\u200d👧\n") * 120          # ~10K chars


@pytest.fixture(scope="module")
def ref():
    return load_reference("cl100k_base")


def _refuse(n: int) -> None:
    raise ValueError(f"{n} tokens is too many")


def _grown(ref, text=TEXT, step=700) -> IncrementalTokenizer:
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    for i in range(0, len(text), step):
        tok.append(text[i:i + step])
    return tok


def test_slices_equal_the_whole_text_and_ids_across_frozen_chunks(ref, monkeypatch):
    monkeypatch.setattr(incremental, "FREEZE_AT", 1500)   # many frozen chunks on a short text
    monkeypatch.setattr(incremental, "TAIL_KEEP", 400)
    tok = _grown(ref)
    text, ids = tok.text, tok.ids
    assert ids == ref.encode(text) and tok.num_chars == len(text) and tok.num_tokens == len(ids)
    rng = random.Random(0)
    for _ in range(300):
        lo, hi = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        assert tok.text_slice(lo, hi) == text[lo:hi]
        lo, hi = sorted(rng.randrange(len(ids) + 1) for _ in range(2))
        assert tok.ids_slice(lo, hi) == ids[lo:hi]
    assert tok.text_slice(len(text) - 5) == text[-5:] and tok.ids_slice(0) == ids


def test_a_refused_append_leaves_text_ids_and_state_as_they_were(ref):
    tok = _grown(ref)
    before = (tok.text, tok.ids, tok.state_dict()[1])
    for extra in ("x", " and more " * 50, "\u0301", "12"):
        with pytest.raises(ValueError, match="too many"):
            tok.append(extra, _refuse)
        assert (tok.text, tok.ids, tok.state_dict()[1]) == before
    seen = []
    sp = tok.append(" ok", seen.append)
    assert seen == [sp.keep + len(sp.ids)] and tok.ids == ref.encode(tok.text)


def test_the_state_is_chunks_that_change_only_from_the_seam(ref):
    tok = _grown(ref)
    meta, blobs = tok.state_dict()
    n_tc, n_ic = tok.num_chars // CHUNK_CHARS, tok.num_tokens // CHUNK_IDS
    assert n_tc >= 2 and n_ic >= 2
    assert set(blobs) == {"text", "ids", *(f"text/{k}" for k in range(n_tc)),
                          *(f"ids/{k}" for k in range(n_ic))}
    assert all(len(blobs[f"ids/{k}"]) == 4 * CHUNK_IDS for k in range(n_ic))
    assert b"".join(blobs[f"text/{k}"] for k in range(n_tc)) + blobs["text"] == tok.text.encode()
    _, again = tok.state_dict()
    assert all(again[k] is blobs[k] for k in blobs if "/" in k)   # complete chunks: not rebuilt
    tok.append(" one more line\n")
    _, after = tok.state_dict()
    assert all(after[k] is blobs[k] for k in blobs if "/" in k)   # an append changes the rest only
    tok.replace_tail(tok.num_chars - CHUNK_CHARS - 10, "back into chunk 1")
    _, cut = tok.state_dict()
    assert cut["text/0"] == blobs["text/0"] and "text/1" not in cut and cut["text"].endswith(b"chunk 1")
    fresh = IncrementalTokenizer.from_state(ref, *tok.state_dict())
    assert fresh.text == tok.text and fresh.ids == tok.ids == ref.encode(tok.text)


def test_no_chunk_is_served_stale_after_edits_anywhere(ref, monkeypatch):
    monkeypatch.setattr(incremental_state, "CHUNK_IDS", 16)     # tiny chunks: every edit crosses some
    monkeypatch.setattr(incremental_state, "CHUNK_CHARS", 64)
    tok = _grown(ref, TEXT[:3000], step=300)
    rng = random.Random(1)
    for i in range(40):
        tok.state_dict()                                      # fill the cache, then edit
        if i % 3:
            tok.append(rng.choice(["x", " 12", "34", "\n\n", " café", "\u0301", "'s"]))
        else:
            tok.replace_tail(rng.randrange(min(400, tok.num_chars)), rng.choice(["", "y", " z9"]))
        meta, blobs = tok.state_dict()
        clean = IncrementalTokenizer.from_state(ref, meta, blobs)
        clean._capsule = incremental_state.ChunkCache()       # serialized from scratch
        assert clean.state_dict()[1] == blobs and clean.ids == ref.encode(clean.text)


def test_a_deferred_restore_checks_its_tail_on_the_first_edit(ref):
    tok = _grown(ref)
    meta, blobs = tok.state_dict()
    back = IncrementalTokenizer.from_state(ref, meta, blobs, deferred=True)
    assert back.check_pending and back.text == tok.text and back.ids == tok.ids
    back.append(" fine")
    assert not back.check_pending and back.stats["fallbacks"] == tok.stats["fallbacks"]
    assert back.ids == ref.encode(back.text)
    wrong = blobs["ids"][:-4] + (7).to_bytes(4, "little")    # in the vocabulary, not the reference's
    with pytest.raises(ValueError, match="tail"):
        IncrementalTokenizer.from_state(ref, meta, {**blobs, "ids": wrong})
    bad = IncrementalTokenizer.from_state(ref, meta, {**blobs, "ids": wrong}, deferred=True)
    assert bad.ids[-1] == 7
    with pytest.raises(ValueError, match="too many"):   # a refused edit leaves the check pending
        bad.append("!", _refuse)
    assert bad.check_pending
    sp = bad.append("!")
    assert bad.ids == ref.encode(bad.text) and bad.stats["fallbacks"] == tok.stats["fallbacks"] + 1
    assert sp.keep == len(tok.ids) - 1            # the K/V up to the wrong id stays valid


@pytest.mark.parametrize("change, what", [
    (lambda m, b: ({**m, "chunk_ids": 512}, b), "chunks"),
    (lambda m, b: ({**m, "base": [m["chars"], m["tokens"] + 1]}, b), "base"),
    (lambda m, b: (m, {k: v for k, v in b.items() if k != "text/0"}), "missing"),
    (lambda m, b: (m, {**b, "ids/0": b["ids/0"][:-4]}), "ids chunk 0"),
    (lambda m, b: (m, {**b, "text/1": b["text/1"] + b"x"}), "text chunk 1"),
    (lambda m, b: (m, {**b, "ids/9": b"\0" * 4 * CHUNK_IDS}), "unexpected"),
    (lambda m, b: ({**m, "tokens": m["tokens"] + CHUNK_IDS}, b), "missing"),
])
def test_a_bad_chunk_layout_is_refused_by_name(ref, change, what):
    meta, blobs = _grown(ref).state_dict()
    m, b = change(meta, blobs)
    with pytest.raises(ValueError, match=what):
        IncrementalTokenizer.from_state(ref, m, b, deferred=True)
