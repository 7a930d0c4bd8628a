"""Session: append/generate/tokens/text/state, batched streams, and the bad-input errors."""
from __future__ import annotations

import json

import pytest

from capsule import (ModelLoadError, Session, StoreError, TokenizerError, UnsupportedArchitecture,
                     VocabMismatch)
from capsule.tokenize import load_reference
from hf_checkpoints import make_checkpoint

RT = {"kv_pool_mb": 8, "max_context": 1024}


@pytest.fixture
def session(tmp_path):
    with Session.open(tmp_path / "s.capsules", model="builtin:tiny", device="cpu", runtime=RT) as s:
        yield s


def test_tokens_equal_reference_after_every_append(session):
    ref = load_reference("cl100k_base")
    text = ""
    for piece in ["user: bring me the", " red", " cup", "\n", "\n", "  ", "x", "1234", "567", "'", "s"]:
        session.append(piece)
        text += piece
        assert session.tokens() == ref.encode(text)
        assert session.text() == text


def test_generate_then_append_recanonicalizes(session):
    session.append("robot: ready.\nuser: go")
    n_prompt = len(session.tokens())
    reply = session.generate(8)
    assert len(session.tokens()) >= n_prompt + 1
    assert session.text().endswith(reply)
    session.append("\nuser: again")
    assert session.tokens() == load_reference("cl100k_base").encode(session.text())


def test_greedy_is_deterministic_across_sessions(tmp_path):
    outs = []
    for i in range(2):
        with Session.open(tmp_path / f"s{i}", device="cpu", runtime=RT) as s:
            s.append("user: where is the charger?\n")
            outs.append((s.generate(10), s.tokens()))
    assert outs[0] == outs[1]


def test_seeded_sampling_reproduces(session):
    session.append("a", stream="x")
    session.append("a", stream="y")
    a = session.generate(12, stream="x", temperature=0.9, top_p=0.95, seed=11)
    b = session.generate(12, stream="y", temperature=0.9, top_p=0.95, seed=11)
    assert a == b and session.tokens("x") == session.tokens("y")


def test_streams_decode_together_and_equal_separate_runs(tmp_path):
    prompts = {"a": "user: hi\n", "b": "user: bring the cup to the kitchen\n", "c": "x" * 40}
    with Session.open(tmp_path / "one", device="cpu", runtime=RT) as s:
        for name, p in prompts.items():
            s.append(p, stream=name)
        together = s.generate(6, stream=list(prompts))
        tok_together = {n: s.tokens(n) for n in prompts}
    assert set(together) == set(prompts)
    with Session.open(tmp_path / "two", device="cpu", runtime=RT) as s:
        for name, p in prompts.items():
            s.append(p, stream=name)
            assert s.generate(6, stream=name) == together[name]
            assert s.tokens(name) == tok_together[name]


def test_more_streams_than_the_largest_bucket(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime={**RT, "batch_buckets": [1, 2]}) as s:
        for i in range(5):
            s.append(f"stream {i}", stream=f"s{i}")
        assert len(s.generate(2, stream=[f"s{i}" for i in range(5)])) == 5


def test_stop_string_is_cut_from_the_reply(session):
    session.append("hello")
    full = session.generate(6)
    session2_text = session.text()
    assert session2_text.endswith(full)
    # a stop equal to the reply's second half ends generation and is not returned
    with Session.open(session.path.parent / "again", device="cpu", runtime=RT) as s:
        s.append("hello")
        stop = full[len(full) // 2:]
        assert stop
        assert s.generate(6, stop=stop) == full[: full.find(stop)]


def test_state_must_be_json(session):
    session.state = {"goal": "cup", "step": 3}
    assert json.loads(json.dumps(session.state)) == {"goal": "cup", "step": 3}
    with pytest.raises(ValueError, match="JSON"):
        session.state = {"x": object()}


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=2, temperature=-1), "temperature"),
    (dict(max_new_tokens=2, top_p=0), "top_p"), (dict(max_new_tokens=2, stream=["main", "main"]), "distinct"),
    (dict(max_new_tokens=2, stop=[""]), "stop")])
def test_bad_generate_arguments(session, kw, match):
    session.append("x")
    with pytest.raises(ValueError, match=match):
        session.generate(**kw)


def test_generate_on_empty_or_unknown_stream(session):
    with pytest.raises(KeyError, match="append text"):
        session.generate(2, stream="nope")
    with pytest.raises(ValueError, match="max_context"):
        session.append("word " * 2000)


def test_closed_session_refuses_calls(tmp_path):
    s = Session.open(tmp_path / "s", device="cpu", runtime=RT)
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.append("x")


def test_policy_only_session_has_no_llm(tmp_path):
    with Session.open(tmp_path / "p", model=None, device="cpu") as s:
        with pytest.raises(ValueError, match="no model"):
            s.append("x")


# -- bad inputs: typed error, message says what to fix, nothing half-created ----------------------
def _assert_not_created(path):
    assert not path.exists(), f"{path} was created although open failed"


def test_unknown_preset(tmp_path):
    with pytest.raises(ModelLoadError, match="builtin:tiny"):
        Session.open(tmp_path / "s", model="builtin:huge", device="cpu")
    _assert_not_created(tmp_path / "s")


def test_vocab_smaller_than_tokenizer(tmp_path):
    folder = make_checkpoint("llama", tmp_path / "ckpt", vocab_size=512)
    with pytest.raises(VocabMismatch, match="512 embeddings.*100276"):
        Session.open(tmp_path / "s", model=folder, tokenizer="cl100k_base", device="cpu")
    _assert_not_created(tmp_path / "s")


def test_checkpoint_without_tokenizer_needs_one(tmp_path):
    folder = make_checkpoint("llama", tmp_path / "ckpt", vocab_size=512)
    with pytest.raises(TokenizerError, match="pass tokenizer="):
        Session.open(tmp_path / "s", model=folder, device="cpu")


def test_unsupported_architecture(tmp_path):
    folder = make_checkpoint("llama", tmp_path / "ckpt", vocab_size=512)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitecture, match="LlamaForCausalLM"):
        Session.open(tmp_path / "s", model=folder, tokenizer="cl100k_base", device="cpu")
    _assert_not_created(tmp_path / "s")


def test_missing_model_folder_and_files(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a folder"):
        Session.open(tmp_path / "s", model=tmp_path / "nope", tokenizer="cl100k_base", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        Session.open(tmp_path / "s", model=tmp_path / "empty", tokenizer="cl100k_base", device="cpu")
    _assert_not_created(tmp_path / "s")


def test_store_path_is_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreError, match="regular file"):
        Session.open(f, device="cpu")
    assert f.read_text() == "x"


def test_store_folder_is_private(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT):
        pass
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700


def test_bad_policy_creates_nothing(tmp_path):
    with pytest.raises(ModelLoadError, match="builtin:nope"):
        Session.open(tmp_path / "s", model=None, policy="builtin:nope", device="cpu")
    _assert_not_created(tmp_path / "s")
