"""Exact incremental tokenization: after every call, ids == the reference on the full text."""
from __future__ import annotations

import json
import logging
import threading
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsule.tokenize import (IncrementalTokenizer, family_names, get_family, incremental,
                              load_reference, run_differential)
from capsule.tokenize.incremental_state import CHUNK_CHARS, CHUNK_IDS
from capsule.tokenize.rules import rules_for
from capsule.tokenize.shadow import MAX_PENDING

from tokenizer_facts import windowed

FAMILIES = family_names()
WINDOWED = windowed()   # the rest re-encode fully (exact; test_tokenize_registry says why)
CONTEXT = "The robot said: it's done, we'll see.\nprint(x)  # ok\n"
CODE = ("def f(x):\n    return x**2  # café\n\n\nclass A:\n\tpass\r\n"
        "中文测试，日本語のテキスト。한국어 문장 👩\u200d👩\u200d👧 12345678 don't\n")


@pytest.fixture(scope="module")
def refs():
    return {f: load_reference(f) for f in FAMILIES}


def _norm(ref, s: str) -> str:
    return unicodedata.normalize("NFC", s) if ref.normalization == "NFC" else s


def _drive(ref, parts, prefix="", **kw) -> IncrementalTokenizer:
    """Append prefix then each part; after every call check text, ids and the splice."""
    tok = IncrementalTokenizer(ref, shadow_rate=0.0, **kw)
    text = ""
    for part in ([prefix] if prefix else []) + list(parts):
        before = tok.ids
        sp = tok.append(part)
        text += part
        want = _norm(ref, text)
        assert tok.text == want
        ids = ref.encode(want)
        assert tok.ids == ids, (ref.name, repr(text[-80:]))
        assert before[:sp.keep] + sp.ids == ids
        assert tok.num_tokens == len(ids)
    return tok


HAZARDS = {
    "ws-run-grows": ["today\n ", "\n"],
    "space-goes-to-word": ["a   ", "b"],
    "contraction": ["it'", "s"],
    "newlines-then-digit": ["\n\n", "0"],
    "x-40-spaces-y": ["x" + " " * 40, "y"],
    "nfc-across-seam": ["cafe", "\u0301", " ok"],
    "deepseek-special": ["<｜end▁of▁sen", "tence｜>", "x"],
    "deepseek-dot-letters": [".a", "b"],
    "qwen-special": ["<|im_st", "art|>", "user"],
    "cl100k-special": ["<|endof", "text|>", "!"],
    "cjk-runs": ["中文", "测试", "日本語の", "テキスト", "한국", "어 문장"],
    "emoji-zwj": ["👩\u200d", "👩\u200d", "👧", "\u200d👦", " 🏳\ufe0f", "\u200d🌈"],
    "crlf-split": ["line one\r", "\nline two\r", "\n", "\r", "\n\n"],
    "empty-appends": ["", "abc", "", "", " def", ""],
    "tabs-and-mixed-ws": ["\t \t", "\n \n", "  ", "\n", "x"],
    "combining-run": ["e", "\u0301", "\u0301", "\u0327", "x"],
    "hangul-jamo": ["\u1100", "\u1161", "\u11a8", " "],
    # o200k / tekken: a letter run goes on with a contraction or marks; '/' joins newline runs
    "contraction-after-letters": ["don'", "t", " it'", "LL", " we'", "re"],
    "case-split": ["Hello", "World", "HTTP", "Server", "ÉCOLE", "école"],
    "letter-then-mark": ["cafe", "\u0301", "\u0301x", "!\u0301", "a"],
    "newline-slash-run": ["a!/\n", "/\n/", "\n/x", " //\n", "\n"],
    # GPT-2: ' ?\p{N}+' keeps a whole digit run; old DeepSeek: each digit and newline alone
    "digits-after-space": [" 12", "34", "5 x", " 9", "9"],
    "devanagari-digits": ["क", "१२", "ख", "\n", "३"],
    "harmony-special": ["<|start|>assistant<|chan", "nel|>final<|mes", "sage|>hi<|ret", "urn|>"],
    "llama3-special": ["<|start_header_", "id|>user<|end_header_id|>", "\n\nhi<|eot_", "id|>"],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(HAZARDS))
def test_hazard(refs, family, case):
    _drive(refs[family], HAZARDS[case])
    _drive(refs[family], HAZARDS[case], prefix=CONTEXT * 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_long_digit_run_one_digit_at_a_time(refs, family):
    digits = "31415926535897932384626433832795028841971693993751" * 4
    _drive(refs[family], list(digits), prefix=CONTEXT + "pi = ")


@pytest.mark.parametrize("family", FAMILIES)
def test_one_char_appends(refs, family):
    tok = _drive(refs[family], list(CODE * 2), prefix=CONTEXT)
    assert (tok.stats["windows"] > 0) == (family in WINDOWED) == (not tok.full_mode)


@pytest.mark.parametrize("family", FAMILIES)
def test_special_token_completed_by_the_append_cuts_a_whitespace_run(refs, family):
    """A special token completed across the seam ends the ordinary text before it.

    ``\\s+(?!\\S)`` then matches the whole run at that end instead of leaving one space for
    the next piece. A rule that only asks len(T) - a >= the longest special token (and run
    changes up to len(T) - 4) splices wrongly here for qwen3.6 and deepseek-v4.
    """
    ref = refs[family]
    # tekken's text has no special tokens: its control tokens' names are plain text there
    longest = max(ref.special_tokens, key=len, default="[/SYSTEM_PROMPT]")
    _drive(ref, ["hello x  " + longest[:-1], longest[-1:]])
    _drive(ref, ["hello x\n    " + longest[:-1], longest[-1:], "  y"])


FRAGMENTS = [" ", "  ", "\n", "\r", "\t", "a", "b", "Z", "é", "0", "42", "'", "'s", "中", "文",
             "の", "😀", "👩", "\u200d", "\u0301", "<|", "|>", "im_st", "art", "<｜", "｜>",
             "end▁of▁sen", "tence", "<|im_start|>", "<｜end▁of▁sentence｜>", "<think>", ".",
             "endoftext", "\u00a0"]
PARTS = st.lists(st.lists(st.sampled_from(FRAGMENTS), max_size=6).map("".join),
                 min_size=1, max_size=10)


@pytest.mark.parametrize("family", FAMILIES)
def test_hypothesis_hazard_alphabet(refs, family):
    ref = refs[family]

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(prefix=st.sampled_from(["", CONTEXT, CONTEXT * 3 + "x"]), parts=PARTS)
    def check(prefix, parts):
        _drive(ref, parts, prefix=prefix)

    check()


@pytest.mark.parametrize("family", FAMILIES)
def test_replace_tail(refs, family):
    ref = refs[family]
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    text = ""
    steps = [(0, CONTEXT * 3), (5, "cafe"), (0, "\u0301 au lait"), (9, " x  "), (3, "y\r"),
             (0, "\n"), (len(CONTEXT), "<|im_start|>"), (2, "<｜end▁of"), (0, "▁sentence｜>")]
    for n, new in steps:
        before = tok.ids
        sp = tok.replace_tail(n, new)
        text = _norm(ref, text[:len(text) - n] + new)
        assert tok.text == text and tok.ids == ref.encode(text)
        assert before[:sp.keep] + sp.ids == tok.ids
    with pytest.raises(ValueError):
        tok.replace_tail(len(text) + 1, "")
    with pytest.raises(TypeError):
        tok.append(b"bytes")


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_text_leaves_state_intact(refs, family):
    ref = refs[family]
    tok = _drive(ref, [CONTEXT, "abc"])
    before = (tok.text, tok.ids)
    try:   # tiktoken replaces a lone surrogate, tokenizers refuses it
        tok.append("x\ud800y")
    except ValueError:
        assert (tok.text, tok.ids) == before
    else:
        assert tok.ids == ref.encode(tok.text)
        meta, blobs = tok.state_dict()
        back = IncrementalTokenizer.from_state(ref, meta, blobs, shadow_rate=0.0)
        assert back.text == tok.text and back.ids == tok.ids
    tok.append(" z")
    assert tok.ids == ref.encode(tok.text)


class _Counting:
    """A reference proxy that counts the chars it encodes."""

    def __init__(self, ref):
        self._ref, self.chars = ref, 0

    def encode(self, text):
        self.chars += len(text)
        return self._ref.encode(text)

    def __getattr__(self, name):
        return getattr(self._ref, name)


@pytest.mark.parametrize("family", WINDOWED)
def test_window_stays_small_on_a_long_text(refs, family):
    ref = refs[family]
    counting = _Counting(ref)
    tok = IncrementalTokenizer(counting, shadow_rate=0.0)
    body = (CODE + CONTEXT) * 1700   # ~200K chars, grown by appends so old state gets frozen
    for i in range(0, len(body), 4000):
        tok.append(body[i:i + 4000])
    assert len(tok.text) > 200_000 and tok.stats["fallbacks"] == 0
    for part in ["x", " y = 1\n", "  ", "\n", "中文", "😀", "<|im_st", "art|>", "1234", ""]:
        counting.chars = 0
        tok.append(part)
        assert counting.chars < 5000 and tok.stats["last_window"] < 5000
    assert tok.ids == ref.encode(tok.text)
    sp = tok.replace_tail(300, "tail replaced")
    assert tok.stats["last_window"] < 5000 and tok.ids == ref.encode(tok.text)
    assert sp.keep > len(tok.ids) - 200
    tok.replace_tail(50_000, "far back")   # behind the kept boundary state: a full re-encode
    assert tok.ids == ref.encode(tok.text) and tok.stats["fallbacks"] == 1
    tok.append(" and on")
    assert tok.ids == ref.encode(tok.text) and tok.stats["last_window"] < 5000


@pytest.mark.parametrize("family", WINDOWED)
def test_state_round_trip_stays_incremental(refs, family):
    ref = refs[family]
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    for i in range(25):
        tok.append((CODE + CONTEXT)[i % 7:] * 20)
    meta, blobs = tok.state_dict()
    json.dumps(meta)
    n_tc, n_ic = meta["chars"] // CHUNK_CHARS, meta["tokens"] // CHUNK_IDS   # chunks, then the rest
    assert n_tc and set(blobs) == {"text", "ids", *(f"text/{k}" for k in range(n_tc)),
                                   *(f"ids/{k}" for k in range(n_ic))}
    assert all(type(b) is bytes for b in blobs.values())
    for handle in (ref, family):
        back = IncrementalTokenizer.from_state(handle, meta, blobs, shadow_rate=0.0)
        assert back.text == tok.text and back.ids == tok.ids
        windows, fallbacks = back.stats["windows"], back.stats["fallbacks"]
        for part in ["it'", "s", " ok\n", "cafe", "\u0301", "<|im_st", "art|>"]:
            back.append(part)
            assert back.ids == ref.encode(back.text)
            assert back.stats["last_window"] < 5000
        assert back.stats["windows"] == windows + 7 and back.stats["fallbacks"] == fallbacks
    assert IncrementalTokenizer.from_state(ref, meta, blobs, verify=True).ids == tok.ids


def test_state_validation(refs):
    ref = refs["qwen2.5"]
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    tok.append(CODE * 3)
    meta, blobs = tok.state_dict()

    def bad(meta_=None, **changes):
        with pytest.raises(ValueError):
            IncrementalTokenizer.from_state(ref, meta if meta_ is None else meta_,
                                            {**blobs, **changes})

    bad(ids=blobs["ids"][:-1])
    bad(ids=blobs["ids"][:-4] + (2**31).to_bytes(4, "little"))
    bad(ids=blobs["ids"][4:] + blobs["ids"][:4])        # same size, wrong tail ids
    bad(text=b"\xff" + blobs["text"][1:])
    bad(text=blobs["text"][:-1])
    bad({**meta, "base": [meta["chars"] + 1, meta["tokens"]]})   # the tail's boundary: inside,
    bad({**meta, "base": [1, 0]})                                   # both zero or neither
    bad({**meta, "base": "0,0"})
    bad(boundaries=b"")                                             # no other blob
    bad(text=None)
    bad({**meta, "fingerprint": "0" * 64})
    bad({**meta, "format": "pickle"})
    bad({**meta, "tokens": -1})
    bad({**meta, "full_mode": "yes"})
    bad([("not", "a dict")])
    with pytest.raises(ValueError):
        IncrementalTokenizer.from_state(refs["cl100k_base"], meta, blobs)


class _Broken:
    """A shadow reference that disagrees with the real one. With `gate`, each check blocks until
    the gate is set (`entered` says one began; `returned` counts the checks that finished)."""

    def __init__(self, ref, gate: threading.Event | None = None):
        self._ref, self._gate = ref, gate
        self.entered, self.returned = threading.Event(), 0

    def encode(self, text):
        self.entered.set()
        if self._gate is not None:
            self._gate.wait(60)   # a hang guard only: the test sets the gate
        self.returned += 1
        return self._ref.encode(text) + [0]


@pytest.mark.parametrize("family", ["cl100k_base", "deepseek-v4"])
def test_shadow_mismatch_switches_to_full_mode(refs, family, caplog):
    ref = refs[family]
    tok = IncrementalTokenizer(ref, shadow_rate=1.0, shadow_reference=_Broken(ref))
    with caplog.at_level(logging.WARNING, logger="capsule"):
        tok.append(CONTEXT * 3)
        tok.append("more text")
        assert tok.flush_shadow(timeout=10)
    s = tok.stats
    assert s["shadow_checks"] >= 1 and s["shadow_mismatches"] >= 1 and tok.full_mode
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert f"family={ref.name}" in msg and "text_sha256=" in msg and "seam_offset=" in msg
    windows = s["windows"]
    for part in [" and", " still", " exact\n"]:
        tok.append(part)
        assert tok.ids == ref.encode(tok.text)
    assert tok.stats["windows"] == windows   # every later call re-encodes fully


def test_shadow_never_blocks_and_is_deterministic(refs):
    ref = refs["cl100k_base"]
    gate = threading.Event()
    shadow = _Broken(ref, gate)
    tok = IncrementalTokenizer(ref, shadow_rate=1.0, shadow_reference=shadow)
    for part in ["a", " b", " c", " d", " e", " f", " g", " h"]:
        tok.append(part)
    # every append returned while the first check is still inside the (blocked) reference
    assert shadow.entered.wait(20) and shadow.returned == 0
    s = tok.stats
    assert s["shadow_sampled"] > MAX_PENDING   # a full queue drops the rest: submitting never waits
    assert s["shadow_dropped"] == s["shadow_sampled"] - MAX_PENDING
    gate.set()
    assert tok.flush_shadow(timeout=20)
    assert shadow.returned == MAX_PENDING and tok.ids == ref.encode(tok.text)
    counts = []
    for _ in range(2):
        t = IncrementalTokenizer(ref, shadow_rate=0.3, seed=7)
        for i in range(60):
            t.append(f" w{i}")
        assert t.flush_shadow(timeout=20)
        s = t.stats
        assert s["shadow_checks"] + s["shadow_dropped"] == s["shadow_sampled"]
        counts.append(s["shadow_sampled"])
    assert counts[0] == counts[1] and 5 < counts[0] < 40
    assert t.stats["shadow_mismatches"] == 0
    with pytest.raises(ValueError):
        IncrementalTokenizer(ref, shadow_rate=2)


def test_from_family_files_and_unverified_patterns(refs, tmp_path):
    import shutil
    for fam in WINDOWED:   # a package upgrade that changes a pipeline must show up here
        assert not IncrementalTokenizer(refs[fam]).full_mode, fam
    src = get_family("deepseek-v4").source_files()[0]
    shutil.copy(src, tmp_path / "tokenizer.json")
    tok = IncrementalTokenizer.from_family(tmp_path, shadow_rate=0.0)
    assert not tok.full_mode
    ranks = get_family("cl100k_base").source_files()[0]
    pat = refs["cl100k_base"].pattern
    tok2 = IncrementalTokenizer.from_family(ranks, pattern=pat, shadow_rate=0.0)
    assert not tok2.full_mode
    odd = IncrementalTokenizer.from_family(ranks, pattern=r"\S+|\s+", shadow_rate=0.0)
    assert odd.full_mode and "pattern" in odd.full_reason
    for t in (tok, tok2, odd):
        for part in ["hello ", "world", "  \n", "x"]:
            t.append(part)
            assert t.ids == t.reference.encode(t.text)
    alias = IncrementalTokenizer.from_family("deepseek", shadow_rate=0)
    assert alias.reference is refs["deepseek-v4"]


@pytest.mark.parametrize("freeze", [None, (1500, 400)])
def test_differential_slice(freeze, monkeypatch):
    if freeze:   # tiny frozen chunks: the frozen-state paths run on short texts too
        monkeypatch.setattr(incremental, "FREEZE_AT", freeze[0])
        monkeypatch.setattr(incremental, "TAIL_KEEP", freeze[1])
    out = run_differential(n_checks=400, seed=11 if freeze is None else 12,
                           max_chars=3000 if freeze is None else 6000)
    assert set(out["families"]) == set(FAMILIES)
    for fam, c in out["families"].items():
        assert c["checks"] == 400 and c["divergences"] == 0, (fam, out["divergences"][:3])
        assert (c["windows"] > 300) == (fam in WINDOWED), fam
    assert out["divergences"] == []


@pytest.mark.parametrize("pre", ["bytelevel", "digits", "prefix", "none"])
def test_byte_level_layouts(tmp_path, pre):
    # the GPT-2 layout (a plain ByteLevel, its regex on) and Digits + ByteLevel are verified
    # shapes: windowed. With add_prefix_space, or no pre-tokenizer at all: not in the verified
    # set, so every append re-encodes in full: slower, still exact
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    if pre == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif pre != "none":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=pre == "prefix")
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, the red cup is in bay 2"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    inc = IncrementalTokenizer.from_family(tmp_path, shadow_rate=0.0)
    windowed = pre in ("bytelevel", "digits")
    assert inc.full_mode != windowed and (windowed or "pre-tokenizer" in inc.full_reason)
    for part in ["hello ", "wor", "ld", ", the red", " cup\n", "x", " bay 2", "22", "\n"]:
        inc.append(part)
        assert inc.ids == inc.reference.encode(inc.text)
    assert inc.stats["windows"] > 5 if windowed else inc.stats["windows"] == 0


def test_cased_anchor_rule_has_teeth(refs, monkeypatch):
    # o200k's letter alternative takes a contraction suffix, so "don'" + "t" is one piece
    # " don't". With the plain anchor rule (any letter run end) the old boundary before "'"
    # would be taken as stable and the splice would diverge; the "cased" rule refuses it.
    ref = refs["o200k_base"]
    text = "The robot said: I don'"
    ok = IncrementalTokenizer(ref, shadow_rate=0.0)
    ok.append(text)
    ok.append("t")
    assert ok.ids == ref.encode(text + "t")
    from capsule.tokenize import rules
    monkeypatch.setattr(rules.CharInfo, "anchor", lambda self, p, c: self.cls(p) in "LN"
                        and self.cls(c) not in (self.cls(p), "?"))
    naive = IncrementalTokenizer(ref, shadow_rate=0.0)
    naive.append(text)
    naive.append("t")
    assert naive.ids != ref.encode(text + "t")


@pytest.mark.parametrize("family", WINDOWED)
def test_a_long_digit_run_keeps_windows_short(refs, family):
    # Rule 3: where digit pieces have a fixed length (1 or up to 3 digits; Falcon: ASCII
    # [0-9]{3} groups), a boundary inside a digit run is stable, so appending to a 6K-digit run
    # re-encodes a short window. GPT-2's ' ?\p{N}+' makes the whole run one piece: its merges
    # are redone near the end only (long pieces)
    ref = refs[family]
    digits = "".join(str((i * 7919) % 10) for i in range(6000))
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    tok.append("total: " + digits[:5000])
    for i in range(5000, 6000, 100):
        tok.append(digits[i:i + 100])
    assert tok.ids == ref.encode("total: " + digits)
    fixed = rules_for(ref)[0].digit_step > 0
    # digit runs without fixed groups: GPT-2's ' ?\p{N}+'
    assert fixed == (get_family(family).splice not in ("r50k-pattern", "gpt2-pattern")), family
    assert tok.stats["last_window"] < 1000, tok.stats
    assert (tok.stats["long_pieces"] > 0) == (not fixed), tok.stats


def test_the_campaign_cuts_the_familys_own_special_tokens(monkeypatch):
    # Rule 3 without the special-token margin for digit pairs inside special tokens splices
    # wrongly on o200k_harmony's '<|reserved_20000' + '0|>': the campaign's hazard strings
    # include each family's special tokens cut in two, so it must find that
    import dataclasses

    from capsule.tokenize import rules
    orig = rules._make

    def no_digit_margin(kind, v, nfc, pattern, specials, first):
        r = orig(kind, v, nfc, pattern, specials, first)
        info = rules.CharInfo(v.marks_are_letters, v.cjk_stage, v.scheme)
        pairs = {s[i:i + 2] for s in specials for i in range(len(s) - 1)}
        return dataclasses.replace(r, follow=frozenset(p[1] for p in pairs
                                                       if info.anchor(p[0], p[1])))
    monkeypatch.setattr(rules, "_make", no_digit_margin)
    out = run_differential(["o200k_harmony"], n_checks=4000, seed=1)
    assert out["families"]["o200k_harmony"]["divergences"] > 0
