"""decode_bytes of SentencePiece-style tokenizer.json files: per-token continuation texts.

Generated tokens are decoded one at a time (the engine's ``decode_bytes([tok])``); for these
layouts that must equal what tokenizers' own decoder shows for the tokens after a prompt: spaces
kept ("▁world" -> " world"), byte-fallback pieces as raw bytes that assemble into characters.
"""
from __future__ import annotations

import json
import random

import pytest

from capsule.tokenize import clear_cache, load_reference

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

CORPUS = ["hello world, the red robot is in bay 2 and the blue cup is on the shelf",
          "wor worldbldoboem robotm robot picked up the cube; the arm moved left",
          "What is 12 + 30? It's 42. Don't panic!\nnew line\tand a tab"] * 30
SPECIALS = ["<unk>", "<s>", "</s>"]
ADDED = "<|tool|>"                       # a non-special added token
FALLBACK_CHARS = "é€中🫨ü"               # absent from CORPUS: byte fallback spells them
LLAMA_DECODER = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
LAYOUTS = ("metaspace-unigram", "metaspace-bpe", "llama2")
PROMPT = "The robot said:"


def _bpe_with_byte_fallback(normalizer, pre_tokenizer) -> Tokenizer:
    """A trained BPE rebuilt with the 256 <0xNN> pieces in its model vocab (as Llama-2 has)."""
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    if normalizer is not None:
        t.normalizer = normalizer
    if pre_tokenizer is not None:
        t.pre_tokenizer = pre_tokenizer
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                                      show_progress=False))
    model = json.loads(t.to_str())["model"]
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)})
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.decoder = LLAMA_DECODER
    return tok


def _build(layout: str) -> Tokenizer:
    if layout == "metaspace-unigram":   # T5/ALBERT style: Metaspace both ways, no byte fallback
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        tok.decoder = decoders.Metaspace(prepend_scheme="always")
        tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(
            vocab_size=120, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False))
    elif layout == "metaspace-bpe":     # Mistral v0.1: Metaspace pre-tokenizer, Llama decoder
        tok = _bpe_with_byte_fallback(None, pre_tokenizers.Metaspace(prepend_scheme="first"))
    elif layout == "llama2":            # Llama-2 / TinyLlama: Prepend + Replace normalizer
        tok = _bpe_with_byte_fallback(
            normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None)
    else:
        raise ValueError(layout)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.add_tokens([AddedToken(ADDED, special=False, normalized=False)])
    return tok


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request, tmp_path_factory):
    """(layout name, tokenizers' own Tokenizer, capsule's ReferenceTokenizer of the same file)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = _build(request.param)
    hf.save(str(folder / "tokenizer.json"))
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))   # exactly what capsule reads
    clear_cache()
    yield request.param, hf, load_reference(folder, prefetch=False)
    clear_cache()


def _continuation(hf: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """tokenizers' decode of ``ids`` after ``prompt``, the prompt's own text cut off."""
    head = hf.decode(prompt, skip_special_tokens=False)
    full = hf.decode(prompt + ids, skip_special_tokens=False)
    assert full.startswith(head)
    return full[len(head):]


def _byte_ids(hf: Tokenizer, data: bytes) -> list[int]:
    return [hf.token_to_id(f"<0x{b:02X}>") for b in data]


def _random_reply(rng: random.Random, hf: Tokenizer, plain: list[int], byte_fallback: bool,
                  n: int) -> list[int]:
    """Random ids; byte-fallback pieces come as whole characters (HF shows a broken run as U+FFFD
    per byte, where decode_bytes keeps the raw bytes)."""
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if byte_fallback and r < 0.15:
            ids += _byte_ids(hf, rng.choice(FALLBACK_CHARS).encode())
        elif byte_fallback and r < 0.2:
            ids += _byte_ids(hf, bytes([rng.randrange(0x20, 0x7F)]))
        else:
            ids.append(rng.choice(plain))
    return ids


def test_layout_is_what_it_claims(layout):
    name, hf, tok = layout
    assert not tok.byte_level
    fallback = name != "metaspace-unigram"
    if fallback:   # the characters really are spelled by byte pieces (after a lone "▁")
        raw = "é🫨".encode()
        ids = tok.encode("é🫨")
        assert ids == hf.encode("é🫨", add_special_tokens=False).ids
        assert ids[-len(raw):] == _byte_ids(hf, raw)
        assert [hf.id_to_token(i) for i in ids[:-len(raw)]] in ([], ["▁"])

def test_per_token_concatenation_equals_hf_continuation(layout):
    name, hf, tok = layout
    byte_fallback = name != "metaspace-unigram"
    byte_pieces = {f"<0x{b:02X}>" for b in range(256)}
    plain = [i for i in range(hf.get_vocab_size(with_added_tokens=True))
             if hf.id_to_token(i) not in byte_pieces]
    assert tok.special_tokens[ADDED] in plain and tok.special_tokens["</s>"] in plain
    rng = random.Random(f"decode-{name}")
    for prompt in (hf.encode(PROMPT, add_special_tokens=False).ids,   # a real prompt
                   [rng.choice(plain)], [tok.special_tokens["<s>"]]):
        for _ in range(150):
            ids = _random_reply(rng, hf, plain, byte_fallback, rng.randrange(1, 24))
            pieces = [tok.decode_bytes([i]) for i in ids]
            joined = b"".join(pieces)
            assert joined == tok.decode_bytes(ids)
            assert joined.decode("utf-8") == _continuation(hf, prompt, ids), (
                [hf.id_to_token(i) for i in ids])


def test_every_token_keeps_its_space(layout):
    name, hf, tok = layout
    for i in range(hf.get_vocab_size(with_added_tokens=True)):
        piece = hf.id_to_token(i)
        if piece.startswith("▁") and i not in tok.special_tokens.values():
            assert tok.decode_bytes([i]) == piece.replace("▁", " ").encode()


def test_reply_keeps_spaces_the_user_probe(layout):
    # the probe's greedy reply lost every space ('worworldbldoboemrobotmrobot')
    name, hf, tok = layout
    text = "wor worldbldoboem robotm robot"
    ids = hf.encode(text, add_special_tokens=False).ids
    streamed = b"".join(tok.decode_bytes([i]) for i in ids).decode()
    assert hf.decode(ids) == text
    # as a reply the first word keeps its leading space: it continues the prompt
    prompt = hf.encode(PROMPT, add_special_tokens=False).ids
    assert streamed == " " + text == _continuation(hf, prompt, ids)
    assert tok.decode(ids) == " " + text


@pytest.mark.parametrize("char", ["é", "€", "🫨"])
def test_byte_fallback_pieces_assemble_a_character(layout, char):
    name, hf, tok = layout
    if name == "metaspace-unigram":
        pytest.skip("no ByteFallback decoder in this layout")
    raw = char.encode()
    ids = _byte_ids(hf, raw)
    assert len(ids) == len(raw) >= 2
    pieces = [tok.decode_bytes([i]) for i in ids]
    assert pieces == [bytes([b]) for b in raw]           # one raw byte each, not U+FFFD
    assert b"".join(pieces).decode() == char == hf.decode(ids)
    assert "\ufffd" in tok.decode(ids[:1])               # a partial character is not text yet
    word = hf.token_to_id("▁the")
    if word is not None:   # after a word: " the" then the character, as HF shows it
        seq = [word, *ids]
        assert tok.decode(seq) == " the" + char == _continuation(hf, [hf.token_to_id("<s>")], seq)


def test_special_and_added_tokens_are_their_content(layout):
    _, hf, tok = layout
    for s in [*SPECIALS, ADDED]:
        assert tok.decode_bytes([tok.special_tokens[s]]) == s.encode()
    eos = tok.special_tokens["</s>"]
    assert eos in tok.eos_ids


def test_bad_ids_raise_value_error(layout):
    _, hf, tok = layout
    for bad in ([tok.max_id + 1], [-1], ["x"], [None]):
        with pytest.raises(ValueError):
            tok.decode_bytes(bad)   # type: ignore[list-item]


def test_cache_served_load_decodes_the_same(layout, tmp_path):
    name, hf, tok = layout
    folder = tmp_path / "copy"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    clear_cache()
    first = load_reference(folder, prefetch=False)
    ids = list(range(first.max_id + 1))
    want = [first.decode_bytes([i]) for i in ids]
    clear_cache()
    again = load_reference(folder, prefetch=False)   # served from the disk cache
    assert [again.decode_bytes([i]) for i in ids] == want
    assert again.decode_bytes(ids) == b"".join(want)


def test_wordpiece_continuation(tmp_path):
    # WordPiece: "##" pieces glue to the previous word, other words come with their space
    vocab = ["[UNK]", "[CLS]", "hello", "world", "wor", "##ld", "##s", "."]
    hf = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(["[UNK]", "[CLS]"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_reference(tmp_path, prefetch=False)
    ids = hf.encode("hello worlds world", add_special_tokens=False).ids
    assert tok.decode(ids) == " hello worlds world" == " " + hf.decode(ids)
    assert tok.decode_bytes([vocab.index("##ld")]) == b"ld"


def test_session_reply_keeps_spaces_and_bytes(tmp_path):
    # the user probe end to end: a tiny random Llama with the Llama-2 layout, greedy reply
    import codecs
    from capsule import Session
    from hf_checkpoints import make_checkpoint
    hf = _build("llama2")
    folder = make_checkpoint("llama", tmp_path / "ckpt", seed=3,
                             vocab_size=hf.get_vocab_size(with_added_tokens=True))
    hf.save(str(folder / "tokenizer.json"))
    prompt = "hello world, the red robot"
    with Session.open(tmp_path / "store", model=folder, tokenizer=folder, device="cpu",
                      runtime={"kv_pool_mb": 8, "max_context": 512}) as s:
        s.append(prompt)
        prompt_ids = s.tokens()
        s.generate(30)
        reply = s.tokens()[len(prompt_ids):]
        text = s.text()
    assert prompt_ids == hf.encode(prompt, add_special_tokens=False).ids
    pieces = [hf.id_to_token(i) for i in reply]
    assert any("▁" in p for p in pieces[1:]), pieces   # the reply has spaces to lose
    # the rule, spelled out independently: "▁" is a space, <0xNN> its byte, the rest its text
    raw = b"".join(bytes([int(p[3:5], 16)]) if len(p) == 6 and p.startswith("<0x")
                   else p.replace("▁", " ").encode() for p in pieces)
    assert text == prompt + codecs.getincrementaldecoder("utf-8")("replace").decode(raw)
    if "\ufffd" not in hf.decode(reply):   # where tokenizers shows no broken byte run: equal
        assert text == hf.decode(prompt_ids + reply)
