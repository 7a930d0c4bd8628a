"""The memory answer-accuracy benchmark: the seeded QA set, the scorer, and the suite's accuracy section."""
from __future__ import annotations

import json
import math

import pytest

import capsule.tools.bench.memory_accuracy as memory_accuracy
import capsule.tools.bench.memory_qa as memory_qa
from capsule.cli import build_parser, main
from capsule.errors import CapsuleError
from capsule.tools.bench import BenchOptions, run_suite
from capsule.tools.bench.memory_accuracy import (KS, PREFIX_MODE, QUICK_KS, RANKED_MODE, QUICK_QUESTIONS, SKIPPED, accuracy_section,
                                                 prompt_parts, region_for, side_by_side, targets)
from capsule.tools.bench.memory_qa import (QADataError, build_qa, chitchat_file, chitchat_lines,
                                           mentioned_places, score)


@pytest.fixture(scope="module")
def qa():
    return build_qa(200, seed=0)


def test_qa_set_is_reproducible_and_200_distinct_questions(qa):
    assert qa == build_qa(200, seed=0)
    other = build_qa(200, seed=1)
    assert [i.fact for i in other.items] != [i.fact for i in qa.items]
    items = qa.items
    assert len(items) == 200
    for attr in ("obj", "place", "fact", "question"):
        assert len({getattr(i, attr) for i in items}) == 200, attr      # unique answers and questions
    assert qa.places == {i.place for i in items} and len(qa.places) == 200


def test_facts_and_questions_agree(qa):
    objects = {i.obj for i in qa.items}
    for i in qa.items:
        assert i.question == f"Where is the {i.obj}?"
        assert f" {i.obj} " in i.fact and i.fact.endswith(".\n") and i.fact.count("\n") == 1
        assert mentioned_places(i.fact) == {i.place}                   # exactly its own place
        assert score(i.fact, i.place) == "correct"
        assert mentioned_places(i.question) == set()
    assert len(qa.distractors) == 100
    for text, ctx in qa.distractors:
        assert mentioned_places(text) == set() and mentioned_places(ctx) == set()
        assert sum(o in text for o in objects) >= 1                    # names an object of the set
    facts = qa.facts()
    assert len(facts) == 300 == len({t for t, _ in facts}) and facts == qa.facts()
    assert {t for t, _ in facts} == {i.fact for i in qa.items} | {t for t, _ in qa.distractors}


def test_filler_comes_from_the_chitchat_corpus(qa):
    path = chitchat_file()
    assert path.name == "dataset.json" and path.parent.name == "chitchat_dataset"
    lines = chitchat_lines()
    assert len(lines) == 3000 == len(set(lines))
    # the package's own reader (loads the whole 40 MB file) yields the same messages, in order
    from chitchat_dataset import MessageDataset
    corpus = []
    for m in MessageDataset():
        corpus.append(m.strip())
        if len(corpus) > 20_000:
            break
    pos = {m: n for n, m in reversed(list(enumerate(corpus)))}
    assert all(line in pos for line in lines)
    assert [pos[line] for line in lines] == sorted(pos[line] for line in lines)
    assert lines[0] == "Hello How are you doing today?"
    known = set(lines)
    for i in qa.items:
        ctx = i.context.splitlines()
        assert len(ctx) == 4 and all(c in known for c in ctx) and i.context.endswith("\n")


def test_corpus_read_is_bounded_and_checked(tmp_path):
    conv = {"messages": [[{"text": "hi there"}, {"text": "friend"}], [{"text": "the cup is in bin 4"}],
                         [{"text": 7}], "junk", [{"text": "how was the game last night?"}]]}
    src = json.dumps({"a": conv, "b": {"messages": [[{"text": "see you tomorrow then"}]]}})
    f = tmp_path / "dataset.json"
    f.write_text(src)
    assert chitchat_lines(path=f) == ["hi there friend", "how was the game last night?", "see you tomorrow then"]
    assert chitchat_lines(path=f, limit=1) == ["hi there friend"]
    # a head that ends inside the second conversation: the first one is kept
    assert chitchat_lines(path=f, max_bytes=len(src) - 10) == ["hi there friend", "how was the game last night?"]
    f.write_text("[1, 2]")
    with pytest.raises(QADataError, match="not the Chit-Chat corpus"):
        chitchat_lines(path=f)
    f.write_text('{"a": {"messages": []}}')
    with pytest.raises(QADataError, match="no usable conversation lines"):
        chitchat_lines(path=f)
    f.write_bytes(b'{"a": "\xff\xfe"}')
    with pytest.raises(QADataError, match="cannot read"):
        chitchat_lines(path=f)


def test_missing_corpus_names_the_package(monkeypatch):
    monkeypatch.setattr(memory_qa.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(QADataError, match="pip install chitchat-dataset") as e:
        chitchat_file()
    assert isinstance(e.value, CapsuleError)


def test_build_qa_checks_its_arguments():
    lines = ["hello there", "how are you", "fine thanks", "good to hear", "bye now"]
    with pytest.raises(ValueError, match="n_questions"):
        build_qa(0, lines=lines)
    with pytest.raises(ValueError, match="n_questions"):
        build_qa(401, lines=lines)
    small = build_qa(5, lines=lines, distractor_fraction=0.0, context_lines=2)
    assert len(small.items) == 5 and small.distractors == ()
    assert all(len(i.context.splitlines()) == 2 for i in small.items)
    assert all(i.context == "" for i in build_qa(5, lines=lines, context_lines=0).items)


@pytest.mark.parametrize("answer, verdict", [
    ("The amber wrench is in bin 12.", "correct"),
    ("Bin #12", "correct"),
    ("It is kept in BIN no. 12", "correct"),
    ("bin12.", "correct"),
    ("The amber wrench is in bin 120.", "wrong_place"),      # one digit more is another bin
    ("The amber wrench is in bin 1.", "wrong_place"),
    ("The amber wrench is on shelf 12.", "wrong_place"),     # the right number, another kind
    ("Either bin 12 or locker 7.", "other_too"),
    ("It is in the kitchen.", "no_place"),
    ("", "no_place"),
])
def test_score(answer, verdict):
    assert score(answer, "bin 12") == verdict


def test_region_and_tables():
    assert region_for(1, 14) == 16 and region_for(10, 14) == 144 and region_for(50, 13) == 656
    rows = [{"mode": m, "k": 50, "questions": 200, "accuracy": a, "retrieval_hit_rate": 1.0, "ttft_p50_ms": t}
            for m, a, t in (("prefilled", 0.80, 600.0), ("prefilled best-last", 0.60, 900.0),
                            ("injected w=0", 0.78, 100.0), ("injected w=32", 0.70, 150.0))]
    (row,) = side_by_side(rows)
    assert row["prefilled acc"] == 0.80 and row["injected w=32 TTFT ms"] == 150.0
    got = targets(rows)
    met = {t["target"]: t["met"] for t in got}
    assert list(met.values()) == ["yes", "yes", "NO", "NO"]   # w=0: -2 points, 6x; w=32: -10, 4x
    assert all("vs 80.0% prefilled (" in t["measured"] for t in got[::2])   # the better order
    rows[1]["accuracy"] = 0.9                                   # now best-last is the baseline
    assert [t["met"] for t in targets(rows)] == ["NO", "yes", "NO", "yes"]
    assert targets(rows[:1], k=10)[0]["met"] == "n/a"


def test_prompt_is_one_function():
    system, turn = prompt_parts("Where is the amber wrench?")
    assert system.endswith("\n") and turn.startswith("Question: Where is the amber wrench?")


def test_accuracy_section_quick_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_accuracy, "QUICK_QUESTIONS", 10)    # the suite's quick run has 20
    opts = BenchOptions(model="builtin:tiny", device="cpu", quick=True, progress=False, only=("accuracy",))
    run = run_suite("memory", opts, out_dir=tmp_path)
    data = json.loads(run.json_path.read_text())
    assert data["settings"]["sections"] == ["accuracy"] and "ttft" not in data["results"]
    acc = data["results"]["accuracy"]
    rows = acc["rows"]
    modes = ("prefilled", "prefilled best-last", "injected w=0", "injected w=32", PREFIX_MODE, RANKED_MODE)
    assert [(r["mode"], r["k"]) for r in rows] == [(m, k) for k in QUICK_KS for m in modes]
    for r in rows:
        n = r["questions"]
        assert n == 10 and 0 <= r["accuracy"] <= 1 and 0 <= r["retrieval_hit_rate"] <= 1
        assert round(r["accuracy"] * n) + r["wrong_place"] + r["other_place_too"] + r["no_place"] \
            + r["not_retrieved"] == n
        assert r["not_retrieved"] == round((1 - r["retrieval_hit_rate"]) * n)
        assert math.isfinite(r["ttft_p50_ms"]) and r["ttft_p50_ms"] > 0
        assert r["region_tokens"] % 16 == 0 and r["region_tokens"] >= r["k"]
    by = {(r["mode"], r["k"]): r for r in rows}
    # the prefilled stream holds the facts' text, an injected one only system + question
    assert by[("prefilled", 10)]["stream_tokens_mean"] > by[("injected w=0", 10)]["stream_tokens_mean"] + 50
    assert by[("injected w=0", 10)]["retrieval_hit_rate"] == by[("prefilled", 10)]["retrieval_hit_rate"]
    assert acc["same_facts_all_modes"] == 1.0                  # every mode saw the same k facts
    assert [r["k"] for r in acc["side_by_side"]] == list(QUICK_KS)
    assert {"prefilled acc", "injected w=0 acc", "injected w=32 TTFT ms"} <= set(acc["side_by_side"][0])
    assert acc["targets"][0]["met"] == "n/a"                   # no k = 50 in a quick run
    assert {e["mode"] for e in acc["examples"]} == set(modes)
    md = run.md_path.read_text()
    assert "answer accuracy: prefilled vs injected, side by side" in md and "| k | questions |" in md
    assert "10 questions" in data["settings"]["accuracy"]


def test_accuracy_needs_a_trained_model_outside_quick(tmp_path):
    opts = BenchOptions(model="builtin:tiny", device="cpu", progress=False, only=("accuracy",))
    res, tables, how = accuracy_section(tmp_path, opts, untrained=True, say=lambda m: None)
    assert res == {"skipped": SKIPPED} and how == SKIPPED and list(tmp_path.iterdir()) == []
    assert tables["answer accuracy"][0]["skipped"].startswith("needs a trained model")
    run = run_suite("memory", opts, out_dir=tmp_path / "out")          # builtin:tiny is untrained
    data = json.loads(run.json_path.read_text())
    assert data["settings"]["untrained"] is True and data["results"]["accuracy"] == {"skipped": SKIPPED}
    assert KS == (1, 10, 50) and QUICK_QUESTIONS == 20


def test_only_option(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown memory section"):
        run_suite("memory", BenchOptions(model="builtin:tiny", device="cpu", only=("acuracy",)), tmp_path)
    with pytest.raises(ValueError, match="no sections"):
        run_suite("decode", BenchOptions(model="builtin:tiny", device="cpu", only=("accuracy",)), tmp_path)
    with pytest.raises(ValueError, match="tuple of section names"):
        BenchOptions(device="cpu", only="accuracy")
    args = build_parser().parse_args(["bench", "--suite", "memory", "--only", "accuracy, ttft"])
    assert args.only == "accuracy, ttft"
    argv = ["bench", "--suite", "memory", "--model", "builtin:tiny", "--device", "cpu", "--out", str(tmp_path)]
    assert main([*argv, "--only", "accuracy,bogus"]) == 1     # the list is split and checked
    assert "unknown memory section(s) ['bogus']" in capsys.readouterr().err
