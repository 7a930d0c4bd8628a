"""Rule 4 (docs/TOKENIZATION.md): the end of an added token is a stable boundary once the edit is
a margin past it. GPT-NeoX cuts whitespace into 24-space added tokens: appends to a long run must
keep short windows, and the ids must stay the reference's through specials and tail edits."""
from __future__ import annotations

import random

import pytest

from capsule.tokenize import IncrementalTokenizer, load_reference


@pytest.fixture(scope="module")
def neox():
    return load_reference("gpt-neox")


def test_appends_to_a_long_space_run_keep_short_windows(neox):
    tok = IncrementalTokenizer(neox, shadow_rate=0.0)
    tok.append("user: here it is\n" + " " * 100_000)
    before = dict(tok.stats)
    for _ in range(30):
        tok.append(" " * 100)
        assert tok.stats["last_window"] < 500      # was the whole run (100 KiB) every time
    assert tok.stats["fallbacks"] == before["fallbacks"]
    assert tok.ids == neox.encode(tok.text)


@pytest.mark.parametrize("seed", range(6))
def test_space_runs_with_specials_and_tail_edits_stay_exact(neox, seed):
    rng = random.Random(seed)
    tok = IncrementalTokenizer(neox, shadow_rate=0.0)
    parts = [" ", "  ", " " * 23, " " * 24, " " * 25, " " * 97, "<|endoftext|>", "<|endo",
             "ftext|>", "<|padding|>", "x", "\n", "\t", "é", " y", "12"]
    text = ""
    for _ in range(300):
        part = rng.choice(parts) * rng.choice((1, 1, 2, 5))
        if text and rng.random() < 0.15:
            n = rng.randint(0, min(len(text), 60))
            tok.replace_tail(n, part)
            text = text[:len(text) - n] + part
        else:
            tok.append(part)
            text += part
        assert tok.text == text
        assert tok.ids == neox.encode(text), (seed, text[-80:])


@pytest.mark.parametrize("family", ["cl100k_base", "qwen3", "starcoder2"])
def test_specials_among_long_space_runs_stay_exact(family):
    ref = load_reference(family)
    special = sorted(ref.special_tokens, key=len)[0]
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    text = ""
    for k in range(120):
        part = special if k % 17 == 5 else (" " * 50 if k % 3 else "\t" * 30)
        tok.append(part)
        text += part
        assert tok.ids == ref.encode(text)
