"""A text ending in one giant pre-tokenizer piece: its BPE is redone near the edit only, exactly.

PieceBpe is checked against each reference on long single pieces, its restart against a full
BPE of the new piece, and the incremental tokenizer against the reference after every edit of
texts that end in whitespace, digit and letter runs.
"""
from __future__ import annotations

import random

import pytest

from capsule.tokenize import IncrementalTokenizer, load_reference
from capsule.tokenize.long_piece import LONG_MIN
from capsule.tokenize.piece_bpe import piece_bpe

FAMILIES = ["cl100k_base", "r50k_base", "o200k_base", "qwen2.5", "llama3", "deepseek-v3"]


def _runs(rng: random.Random, n: int) -> list[str]:
    """Single-piece texts (in every family above) that BPE finds hard: runs of one char, of
    two letters, of mixed case, of random letters."""
    return [" " * n, "\t" * n, "ab" * (n // 2), "".join(rng.choice("ab") for _ in range(n)),
            "".join(rng.choice("aAbB") for _ in range(n)).lower(),
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))]


@pytest.mark.parametrize("family", FAMILIES)
def test_piece_bpe_is_the_reference_on_long_pieces(family):
    ref = load_reference(family)
    pb = piece_bpe(ref)
    assert pb is not None
    rng = random.Random(family)
    for n in (1, 2, 3, 17, 300, 2500):
        for text in _runs(rng, n):
            want = ref.encode(text)
            if len(want) == 1 and pb.whole(text.encode()):
                continue   # the reference's shortcut for a piece that is a token
            assert pb.encode(text.encode()) == want, (family, text[:20], n)


def test_piece_bpe_gpt2_digit_runs():
    ref = load_reference("r50k_base")   # ` ?\p{N}+`: a digit run is one piece
    pb = piece_bpe(ref)
    rng = random.Random(3)
    for n in (5, 400, 3000):
        text = " " + "".join(rng.choice("0123456789") for _ in range(n))
        assert pb.encode(text.encode()) == ref.encode(text)


def test_seam_pair_check():
    ref = load_reference("cl100k_base")
    pb = piece_bpe(ref)
    sp, = ref.encode(" ")
    two, = ref.encode("  ")
    assert not pb.valid_pair(sp, sp)            # "  " is one token: the pair would merge
    ids = ref.encode(" " * 200)
    assert all(pb.valid_pair(x, y) for x, y in zip(ids, ids[1:]))
    assert pb.length(two) == 2


@pytest.mark.parametrize("family", ["cl100k_base", "qwen2.5"])
def test_reencode_equals_bpe_of_the_new_piece(family):
    """Edits at the end of long pieces (appends, cut-backs, both), including ones whose first
    seam is not valid: the result always equals a fresh BPE of the new piece."""
    pb = piece_bpe(load_reference(family))
    rng = random.Random(7)
    restarted = 0
    for trial in range(400):
        alpha = rng.choice([" ", "ab", "ab ", "abc", "a", "0123456789"])
        old = "".join(rng.choice(alpha) for _ in range(rng.randint(50, 3000))).encode()
        cut = rng.randint(0, min(40, len(old)))
        new = old[:len(old) - cut] + "".join(
            rng.choice(alpha) for _ in range(rng.randint(0, 300))).encode()
        old_ids, want = pb.encode(old), pb.encode(new)
        pad = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]   # ids read in place
        got = pb.reencode(old, pad + old_ids + [1, 2], len(pad), len(old_ids), new)
        assert got is not None
        k, tail = got
        assert old_ids[:k] + tail == want, (family, alpha, len(old), cut)
        restarted += k > 0
    assert restarted > 300


def test_reencode_refuses_a_far_edit():
    pb = piece_bpe(load_reference("cl100k_base"))
    old = b" " * 10000
    assert pb.reencode(old, pb.encode(old), 0, len(pb.encode(old)), b"x" + old) is None


def _edits(rng: random.Random, run: str):
    """Mostly extend the run or cut back into it; now and then end it with another char and
    take that back again."""
    for _ in range(60):
        r = rng.random()
        if r < 0.75:
            yield "append", "".join(rng.choice(run) for _ in range(rng.randint(1, 150)))
        elif r < 0.9:
            yield "replace", (rng.randint(0, 40), "".join(rng.choice(run) for _ in range(3)))
        else:
            end = rng.choice(["x", " 1", "\n", ".", " y", "\n\n"])
            yield "append", end
            yield "replace", (len(end), run[0])


@pytest.mark.parametrize("family,run", [
    ("cl100k_base", " "), ("cl100k_base", "ab"), ("r50k_base", "0123456789"),
    ("r50k_base", " "), ("qwen2.5", " "), ("o200k_base", " \t"), ("llama3", "abc"),
    ("deepseek-v3", " ")])
def test_incremental_over_a_long_run_is_exact(family, run):
    ref = load_reference(family)
    tok = IncrementalTokenizer(ref, shadow_rate=0)
    rng = random.Random(f"{family}{run}")
    tok.append("user: the log follows:\n" + "".join(rng.choice(run) for _ in range(6000)))
    short = 0
    for kind, arg in _edits(rng, run):
        before = tok.stats["long_pieces"]
        sp = tok.append(arg) if kind == "append" else tok.replace_tail(*arg)
        assert tok.ids == ref.encode(tok.text), (family, kind, arg)
        if tok.stats["long_pieces"] > before:
            short += tok.stats["last_window"] < 1000
        assert sp.keep <= tok.num_tokens
    assert tok.stats["long_pieces"] >= 20
    assert short >= 15          # most long-piece edits redid a few hundred chars, not the run
    assert tok.stats["check_failures"] == 0


def test_long_piece_splice_is_tight_and_admit_refusal_leaves_no_trace():
    ref = load_reference("cl100k_base")
    tok = IncrementalTokenizer(ref, shadow_rate=0)
    tok.append("hello" + " " * 5000)
    tok.append(" " * 10)            # the piece is now known
    ids, text = tok.ids, tok.text

    def refuse(n):
        raise RuntimeError("no room")

    with pytest.raises(RuntimeError):
        tok.append(" " * 7, admit=refuse)
    assert tok.ids == ids and tok.text == text
    sp = tok.append(" " * 7)
    new = tok.ids
    assert new == ref.encode(text + " " * 7)
    assert new[:sp.keep] == ids[:sp.keep] and new[sp.keep:] == sp.ids
    assert sp.keep >= len(ids) - 3     # only the run's last tokens changed
    assert tok.stats["last_window"] < 500


def test_state_round_trip_in_a_long_run():
    ref = load_reference("r50k_base")
    tok = IncrementalTokenizer(ref, shadow_rate=0)
    rng = random.Random(5)
    digits = lambda n: "".join(rng.choice("0123456789") for _ in range(n))  # noqa: E731
    tok.append("total: " + digits(LONG_MIN * 2))
    tok.append(digits(50))
    meta, blobs = tok.state_dict()
    back = IncrementalTokenizer.from_state(ref, meta, blobs)
    for _ in range(5):
        d = digits(rng.randint(1, 80))
        tok.append(d)
        back.append(d)
        assert back.ids == tok.ids == ref.encode(tok.text)
    assert back.stats["long_pieces"] >= 4


def test_a_piece_with_a_dropped_byte_goes_to_the_reference():
    ref = load_reference("starcoder2")   # lacks some control bytes' symbols
    pb = piece_bpe(ref)
    assert pb is not None and pb.dropped
    ch = chr(pb.dropped[0])
    tok = IncrementalTokenizer(ref, shadow_rate=0)
    tok.append("x = " + "!" * 3000 + ch + "!" * 100)
    for _ in range(5):
        tok.append("!" * 20)
        assert tok.ids == ref.encode(tok.text)
