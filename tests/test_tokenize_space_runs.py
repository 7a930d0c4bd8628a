"""Long space and tab runs are cut short before pre-tokenizing (space_runs.py): the pieces and
the incremental ids must be exactly those of the uncut text, in every windowed family."""
from __future__ import annotations

import dataclasses
import random

import pytest

from capsule.tokenize import IncrementalTokenizer, load_reference
from capsule.tokenize.patterns import VERIFIED
from capsule.tokenize.pieces import PieceScanner
from capsule.tokenize.registry import family_names
from capsule.tokenize.rules import CharInfo, rules_for
from capsule.tokenize.space_runs import HEAD, KEEP, RUN_MIN, TAIL, cut, uncut

WINDOWED = [n for n in family_names() if n not in ("llama2", "phi3", "gemma4")]
# what may stand next to a run: newlines (the \s*[\r\n] branches look through the run), a
# lone space before letters/digits/punctuation, other whitespace, specials' first chars
AROUND = ["a", "ab", " x", "Z", "7", "123", "!", ".", "'s", "\n", "\r\n", "\n\n", " \n", "\t",
          "\u00a0", "\u3000", "é", "中", "😀", "<", "|", "\u0301", ""]


def _text(rng: random.Random, parts: int) -> str:
    out = []
    for _ in range(parts):
        out.append(rng.choice(AROUND) * rng.randint(1, 3))
        if rng.random() < 0.6:
            out.append(rng.choice([" ", "\t"]) * rng.choice([RUN_MIN, RUN_MIN + 1, 300, 1000, 2500]))
    if rng.random() < 0.3:   # a digit tail (cut where the pipeline allows: digit_runs)
        n = rng.choice([RUN_MIN - 1, RUN_MIN, 700, 2500])
        out.append("".join(str(rng.randrange(10)) for _ in range(n)))
    return "".join(out)


def test_cut_and_uncut():
    assert cut("a" + " " * (RUN_MIN - 1) + "b") is None       # too short to be worth it
    seg = "x" + " " * 1000 + "y" + "\t" * 300
    c = cut(seg)
    assert c.text == "x" + " " * KEEP + "y" + "\t" * KEEP
    assert c.runs == ((1, 0, 1000 - KEEP), (2 + KEEP, 1000 - KEEP, 1300 - 2 * KEEP))
    # ends next to a run's two ends map to them; one deep inside is refused
    assert uncut([1, 1 + KEEP - 1, 1 + KEEP, len(c.text)], c) == [1, 1000, 1001, len(seg)]
    assert uncut([1 + HEAD + 1], c) is None and uncut([1 + KEEP - TAIL - 1], c) is None


def test_cut_a_trailing_digit_run():
    digits = "".join(str(i * 7 % 10) for i in range(1000))
    seg = "a " * 200 + digits + "." + digits      # only the text's last digit run is cut
    assert cut(seg, spaces=True, digits=False) is None
    c = cut(seg, spaces=False, digits=True)
    u = len(seg) - 1000
    assert c.text == seg[:u] + digits[0] * KEEP and c.runs == ((u, 0, 1000 - KEEP),)
    assert uncut([u, len(c.text)], c) == [u, len(seg)]
    assert cut(seg + "x", digits=True) is None and cut("7" * (RUN_MIN - 1), digits=True) is None
    both = cut(" " * 300 + digits, spaces=True, digits=True)
    assert both.text == " " * KEEP + digits[0] * KEEP


def test_digit_runs_are_cut_only_where_the_run_is_one_piece():
    # GPT-2's ' ?\p{N}+' takes a digit run whole; every other verified pipeline cuts digits
    # into groups (pieces inside the run), where cutting the run would be wrong
    assert {k for k, v in VERIFIED.items() if v.digit_runs} == {"r50k-pattern", "gpt2-pattern"}
    assert all(not v.digit_step for v in VERIFIED.values() if v.digit_runs)


@pytest.mark.parametrize("key", sorted(VERIFIED))
def test_every_verified_pipeline_is_proven_for_space_runs(key):
    # a pipeline added later must come with its own argument (docs/TOKENIZATION.md "Space runs")
    assert VERIFIED[key].space_runs


@pytest.mark.parametrize("family", WINDOWED)
def test_pieces_of_cut_runs_are_the_pieces_of_the_text(family):
    ref = load_reference(family)
    rules, why = rules_for(ref)
    assert rules is not None and rules.space_runs, why
    info = CharInfo(rules.marks_are_letters, rules.cjk_stage, rules.scheme)
    fast = PieceScanner(ref, rules, info)
    plain = PieceScanner(ref, dataclasses.replace(rules, space_runs=False, digit_runs=False),
                         info)
    rng = random.Random(family)
    cuts = 0
    for _ in range(60):
        text = _text(rng, rng.randint(1, 6))
        for s, e, sid in plain.split_specials(text):
            if sid is None:
                seg = text[s:e]
                cuts += cut(seg, rules.space_runs, rules.digit_runs) is not None
                assert fast.pieces(seg) == plain.pieces(seg), (family, seg[:40], seg[-40:])
    assert cuts >= 20      # the cut path was taken, not only the plain one


@pytest.mark.parametrize("family", WINDOWED)
def test_incremental_ids_through_space_runs(family):
    ref = load_reference(family)
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    assert not tok.full_mode
    rng = random.Random(f"runs:{family}")
    tok.append("user: the log follows\n" + " " * 3000)
    assert tok.ids == ref.encode(tok.text)
    edits = [" " * 100, "\t", " " * 400, "\n", " " * 300, "word", " " * 2600, "!", "\t" * 500,
             " 12", " " * 700]
    for k, piece in enumerate(edits):
        if k % 4 == 3:
            tok.replace_tail(rng.randint(1, 60), piece)     # cut into the run's end
        else:
            tok.append(piece)
        assert tok.ids == ref.encode(tok.text), (family, k, repr(tok.text[-30:]))


@pytest.mark.parametrize("family", ["cl100k_base", "llama3", "qwen3"])
def test_a_run_longer_than_the_freeze_point_keeps_short_windows(family, monkeypatch):
    # frozen chunks are cut only at boundaries an append can start from; freezing at the start
    # of a space run (no boundary choose() accepts) made every later append a full rebuild
    from capsule.tokenize import incremental
    monkeypatch.setattr(incremental, "FREEZE_AT", 1500)   # below LONG_MIN: freezes come first
    monkeypatch.setattr(incremental, "TAIL_KEEP", 400)
    ref = load_reference(family)
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    tok.reset(".")
    for _ in range(80):
        tok.append(" " * 97)
    assert tok.ids == ref.encode(tok.text)
    assert tok.stats["long_pieces"] >= 50       # past LONG_MIN (2048 chars) the run goes by pieces
    assert tok.stats["fallbacks"] <= 25         # only while the whole text is under LONG_MIN
