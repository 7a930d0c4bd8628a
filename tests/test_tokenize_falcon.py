"""Falcon (falcon-splits): ASCII digit runs are cut into [0-9]{3} groups from the run's first
ASCII digit (Rule 3 with ASCII digits), and its all-ASCII long pieces take the long-piece path;
a non-ASCII numeric before the run (a gap before the first group) must not shift the groups."""
from __future__ import annotations

import pytest

from capsule.tokenize import IncrementalTokenizer, load_reference


@pytest.fixture(scope="module")
def falcon():
    return load_reference("falcon")


@pytest.mark.parametrize("before", ["total: ", "x²", "ò", "٣", "१2", "½", " 1", "a-"])
def test_digit_runs_after_any_numeric_keep_short_windows(falcon, before):
    digits = "".join(str((i * 7919) % 10) for i in range(4000))
    tok = IncrementalTokenizer(falcon, shadow_rate=0.0)
    tok.append(before + digits[:3000])
    for i in range(3000, 4000, 7):          # 7: appends that end inside a group
        tok.append(digits[i:i + 7])
        assert tok.ids == falcon.encode(tok.text), (before, i)
    assert tok.stats["last_window"] < 200, tok.stats


def test_whitespace_runs_take_the_long_piece_path(falcon):
    tok = IncrementalTokenizer(falcon, shadow_rate=0.0)
    tok.append("user: x\n" + " " * 20_000)
    for _ in range(20):
        tok.append(" " * 100)
    assert tok.ids == falcon.encode(tok.text)
    assert tok.stats["long_pieces"] >= 20 and tok.stats["last_window"] < 500, tok.stats


def test_long_non_ascii_pieces_are_not_bpe_d_as_one(falcon):
    # 'ò' is bytes C3 B2 and the digit stage cuts the byte symbol '²' away: a letter run ending
    # in 'ò' is two Falcon pieces, which the scanner joins into one; BPE over it as one piece
    # may merge across the cut, so only all-ASCII long pieces take the long-piece path
    tok = IncrementalTokenizer(falcon, shadow_rate=0.0)
    tok.append("w " + "a" * 3000 + "é")
    for c in "òéòaòòéò":
        tok.replace_tail(1, c)                # an edit inside the long (joined) piece
        assert tok.ids == falcon.encode(tok.text), c
    assert tok.stats["long_pieces"] == 1, tok.stats     # the all-ASCII one ("a")
