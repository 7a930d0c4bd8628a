"""Session.generate(on_token=...): text pieces while decoding that join to exactly the reply."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from capsule import Session
from capsule.tokenize.utf8 import split_incomplete
from hf_checkpoints import make_checkpoint

RT = {"kv_pool_mb": 16}


def _collect():
    got: list[tuple[str, str]] = []
    return got, lambda name, piece: got.append((name, piece))


def _joined(got, name):
    return "".join(p for n, p in got if n == name)


def _held_back(got, name, stop):
    """No text handed out before the last piece ended with the start of the stop string."""
    pieces = [p for n, p in got if n == name]
    sofar = ""
    for p in pieces[:-1]:
        sofar += p
        assert not any(sofar.endswith(stop[:k]) for k in range(1, len(stop))), (sofar, stop)


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A random model over a byte-level vocabulary without merges: every character past ASCII
    takes several tokens, so a reply often ends a token inside a character."""
    folder = make_checkpoint("llama", tmp_path_factory.mktemp("bytes") / "m", vocab_size=272)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_pieces_join_to_the_reply_greedy_and_seeded_sampling(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        for name in "abcd":
            s.append("user: where is the red cup?\nassistant:", stream=name)
        got, cb = _collect()
        greedy = s.generate(16, stream="a", on_token=cb)
        assert greedy == s.generate(16, stream="b")        # the callback changes nothing
        assert _joined(got, "a") == greedy and all(p for _, p in got)
        got, cb = _collect()
        sampled = s.generate(16, stream="c", temperature=0.9, seed=7, on_token=cb)
        assert sampled == s.generate(16, stream="d", temperature=0.9, seed=7)
        assert _joined(got, "c") == sampled and sampled != greedy
        s.append(" ok", stream="c")
        assert s.tokens("c") == s.tokenizer.encode(s.text("c"))


def test_no_piece_is_past_a_stop_string(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        for name in "abc":
            s.append("robot log:", stream=name)
        n0 = len(s.tokens("a"))
        full = s.generate(20, stream="a")
        # a stop string over two tokens: its start shows up one step before it completes
        texts = [s.tokenizer.decode([t]) for t in s.tokens("a")[n0:]]
        j = next(j for j in range(len(texts) // 2, len(texts) - 1)
                 if len(texts[j]) > 1 and len(texts[j + 1]) > 1 and full.startswith("".join(texts[:j + 2])))
        stop = texts[j][-2:] + texts[j + 1][:2]
        cut = full.find(stop)
        assert cut <= len("".join(texts[:j + 1])) - 2
        got, cb = _collect()
        reply = s.generate(20, stream="b", stop=[stop, "\x00never"], on_token=cb)
        assert reply == full[:cut] and _joined(got, "b") == reply
        _held_back(got, "b", stop)
        # a stop string whose start shows up but never completes: held back, then handed out
        almost = stop[:2] + "\x00"
        got, cb = _collect()
        assert s.generate(20, stream="c", stop=almost, on_token=cb) == full
        assert _joined(got, "c") == full
        _held_back(got, "c", almost)
        assert len(got) > 1


def test_batched_streams_interleave_and_each_joins_to_its_reply(tmp_path):
    runtime = {**RT, "batch_buckets": [1, 2]}    # three streams: two decode groups
    with Session.open(tmp_path / "s", device="cpu", runtime=runtime) as s:
        prompts = {"x": "one", "y": "two two", "z": "three three three"}
        for name, text in prompts.items():
            s.append(text, stream=name)
        got, cb = _collect()
        replies = s.generate(6, stream=list(prompts), temperature=1.0, seed=3, on_token=cb)
        order = [n for n, _ in got]
        assert order.index("y") < len(order) - 1 - order[::-1].index("x") < order.index("z")  # x, y together, then z
        for name in prompts:
            assert _joined(got, name) == replies[name]
            assert len(s.tokens(name)) == len(s.tokenizer.encode(prompts[name])) + 6   # max_new_tokens cut


def test_no_piece_splits_a_character(tmp_path, byte_model):
    with Session.open(tmp_path / "s", model=byte_model, device="cpu", runtime=RT) as s:
        splits = tails = 0
        for name in ("p", "q"):
            s.append("héllo wörld, 你好 ", stream=name)
            for seed in range(16):
                before = len(s.tokens(name))
                got, cb = _collect()
                reply = s.generate(6, stream=name, temperature=1.0, seed=seed + 100 * (name == "q"),
                                   on_token=cb)
                assert _joined(got, name) == reply
                assert all(p.encode("utf-8") for _, p in got)    # whole characters (no lone surrogates)
                tails += bool(s.engine.stream(name).tail)        # it ended inside a character
                acc = b""
                for tok in s.tokens(name)[before:]:
                    acc += s.tokenizer.decode_bytes([tok])
                    splits += bool(split_incomplete(acc)[1])
            s.append(" end", stream=name)
            assert s.tokens(name) == s.tokenizer.encode(s.text(name))
        assert splits > 10 and tails > 0, "the model must produce characters split over tokens"


def test_a_stop_string_only_the_text_shows_is_never_streamed(tmp_path, byte_model):
    """U+FFFD as a stop string: invalid bytes decode to it, yet the bytes never hold it."""
    with Session.open(tmp_path / "s", model=byte_model, device="cpu", runtime=RT) as s:
        s.append("bytes:")
        cut = 0
        for seed in range(8):
            got, cb = _collect()
            reply = s.generate(8, temperature=1.0, seed=seed, stop="\ufffd", on_token=cb)
            assert _joined(got, "main") == reply and "\ufffd" not in reply
            cut += "\ufffd" in s.text()[-40:]
        assert cut


def test_a_raising_callback_stops_decoding_and_leaves_the_stream_consistent(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append("user: hi\nassistant:")
        n0, seen = len(s.tokens()), []

        def cb(name, piece):
            seen.append(piece)
            if len(seen) == 3:
                raise RuntimeError("boom")
        with pytest.raises(RuntimeError, match="boom"):
            s.generate(30, on_token=cb)
        assert n0 + 3 <= len(s.tokens()) < n0 + 30
        assert s.text().endswith("".join(seen))
        s.append("\nuser: again\nassistant:")
        assert s.tokens() == s.tokenizer.encode(s.text())
        assert s.generate(4)
        assert s.checkpoint() is not None


@pytest.mark.parametrize("call", ["append", "text", "checkpoint", "defer", "rollback", "close", "remember"])
def test_a_callback_calling_back_into_the_session_gets_a_clear_error(tmp_path, call):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append("hello")
        epoch = s.checkpoint()
        calls = {"append": lambda: s.append("x"), "text": lambda: s.text(),
                 "checkpoint": lambda: s.checkpoint(), "remember": lambda: s.remember("a fact"),
                 "defer": lambda: s.checkpoint(wait=False, defer=True),
                 "rollback": lambda: s.rollback(epoch), "close": lambda: s.close()}

        def cb(name, piece):
            calls[call]()
        n0 = len(s.tokens())
        with pytest.raises(ValueError, match="on_token callback must not call back into the Session"):
            s.generate(20, on_token=cb)
        assert not s.closed and n0 < len(s.tokens()) < n0 + 20 and s.epochs()[-1].id == epoch
        s.append(" more")
        assert s.tokens() == s.tokenizer.encode(s.text())
        assert s.checkpoint() == epoch + 1


def test_on_token_must_be_callable(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append("hello")
        with pytest.raises(ValueError, match="on_token must be a callable"):
            s.generate(2, on_token="print")
