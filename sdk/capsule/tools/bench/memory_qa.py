"""A fixed, seeded QA set for the memory answer-accuracy benchmark (bench/memory_accuracy.py).

Each item is one (object, place) fact, "The amber wrench is in bin 12.", with the question
"Where is the amber wrench?". Object names (adjective + noun) and places (kind + number) are
distinct across the set, so every question has exactly one right answer and every other
item's place is a wrong one. Distractor facts name an object of the set without a place
("The amber wrench was last used by Mara on Tuesday."). Each fact comes with the conversation
it was said in: filler lines from the Chit-Chat Challenge corpus (the `chitchat-dataset`
package), used as the fact's context-window encoding context.
"""
from __future__ import annotations

import codecs
import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ...errors import CapsuleError

ADJECTIVES = ("amber", "crimson", "teal", "violet", "olive", "silver", "cobalt", "scarlet", "ivory",
              "jade", "copper", "bronze", "golden", "maroon", "navy", "coral", "indigo", "khaki",
              "lime", "plum")
NOUNS = ("wrench", "hammer", "drill", "ladder", "lantern", "kettle", "compass", "stapler", "toolbox",
         "helmet", "thermos", "flashlight", "screwdriver", "backpack", "notebook", "clipboard",
         "tripod", "blender", "stopwatch", "magnet")
PLACE_KINDS = ("bin", "shelf", "locker", "drawer", "room", "cabinet", "crate", "bay")
PLACE_NUMBERS = range(1, 100)
TEMPLATES = ("The {obj} is in {place}.", "The {obj} is kept in {place}.",
             "We put the {obj} in {place}.", "You can find the {obj} in {place}.")
DISTRACTORS = ("The {obj} was last used by {name} on {day}.", "{name} cleaned the {obj} on {day}.",
               "The {obj} needs new batteries, {name} said on {day}.")
NAMES = ("Mara", "Tomas", "Ines", "Lev", "Ada", "Ravi", "Nora", "Omar", "Yuki", "Bram")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")

# "bin 12", "Bin #12", "locker no. 7", "room12": a place mention, normalized to "bin 12"
_PLACE = re.compile(r"\b(" + "|".join(PLACE_KINDS) + r")\s*(?:number\s*|no\.?\s*|#\s*)?(\d+)\b",
                    re.IGNORECASE)
_SKIP, _COLON = re.compile(r"[\s,]*"), re.compile(r"\s*:\s*")   # between a conversation's entries
MAX_CORPUS_BYTES = 4 << 20        # dataset.json is ~40 MB: the head holds thousands of lines
MAX_QUESTIONS = len(ADJECTIVES) * len(NOUNS)
INSTALL_HINT = "pip install chitchat-dataset  (or: pip install 'exec-capsules[test]')"


class QADataError(CapsuleError):
    """The conversation corpus the QA set's filler comes from is missing or unreadable."""


@dataclass(frozen=True)
class QAItem:
    """One question: its fact (with the conversation said before it) and its one right place."""
    obj: str          # "amber wrench"
    place: str        # "bin 12" (normalized, unique in the set)
    fact: str         # "The amber wrench is in bin 12.\n"
    question: str     # "Where is the amber wrench?"
    context: str      # filler conversation lines the fact followed (window encoding context)


@dataclass(frozen=True)
class QASet:
    items: tuple[QAItem, ...]
    distractors: tuple[tuple[str, str], ...]   # (fact text, context) naming an object, no place
    seed: int

    def facts(self) -> list[tuple[str, str]]:
        """Every fact to remember, (text, context), in a seeded order (targets and distractors mixed)."""
        out = [(i.fact, i.context) for i in self.items] + list(self.distractors)
        random.Random(self.seed + 1).shuffle(out)
        return out

    @property
    def places(self) -> frozenset[str]:
        return frozenset(i.place for i in self.items)


def chitchat_file() -> Path:
    """chitchat_dataset/dataset.json, found without importing the package."""
    spec = importlib.util.find_spec("chitchat_dataset")   # a top-level name: nothing is imported
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / "dataset.json"
        if path.is_file():
            return path
    raise QADataError(f"the Chit-Chat conversation corpus (chitchat_dataset/dataset.json) is not "
                      f"installed; run: {INSTALL_HINT}")


def chitchat_lines(limit: int = 3000, path: Path | None = None,
                   max_bytes: int = MAX_CORPUS_BYTES) -> list[str]:
    """Up to `limit` distinct chat messages (4..160 chars, one line, naming no place), in corpus
    order, from the first `max_bytes` of the corpus (parsed one conversation at a time)."""
    if limit < 1 or not 1 <= max_bytes <= MAX_CORPUS_BYTES * 16:
        raise ValueError(f"limit must be >= 1 and max_bytes in 1..{MAX_CORPUS_BYTES * 16}, got "
                         f"{limit}, {max_bytes}")
    path = chitchat_file() if path is None else path
    try:
        with open(path, "rb") as f:
            head = f.read(max_bytes)
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except (OSError, UnicodeDecodeError) as exc:
        raise QADataError(f"cannot read the conversation corpus {path}: {exc}") from None
    dec, seen, out = json.JSONDecoder(), set(), []
    i = _SKIP.match(text).end()
    if not text.startswith("{", i):
        raise QADataError(f"{path} is not the Chit-Chat corpus (a JSON object of conversations)")
    i += 1
    while len(out) < limit:
        try:
            i = _SKIP.match(text, i).end()
            _, i = dec.raw_decode(text, i)               # the conversation's id
            i = _COLON.match(text, i).end()
            conv, i = dec.raw_decode(text, i)
        except (json.JSONDecodeError, AttributeError):
            break                                         # the end of the head read (or of the object)
        messages = conv.get("messages") if isinstance(conv, dict) else None
        for msg in messages if isinstance(messages, list) else ():
            parts = [u.get("text") for u in msg if isinstance(u, dict)] if isinstance(msg, list) else []
            line = " ".join(p.strip() for p in parts if isinstance(p, str)).strip()
            if (4 <= len(line) <= 160 and line.isprintable() and not _PLACE.search(line)
                    and line not in seen):
                seen.add(line)
                out.append(line)
    if not out:
        raise QADataError(f"no usable conversation lines in the first {max_bytes} bytes of {path}")
    return out[:limit]


def build_qa(n_questions: int = 200, *, seed: int = 0, distractor_fraction: float = 0.5,
             context_lines: int = 4, lines: list[str] | None = None) -> QASet:
    """A reproducible QA set: n_questions items with distinct objects and places, plus
    distractor facts about round(n * distractor_fraction) of the objects."""
    if isinstance(n_questions, bool) or not isinstance(n_questions, int) or not 1 <= n_questions <= MAX_QUESTIONS:
        raise ValueError(f"n_questions must be an int in 1..{MAX_QUESTIONS} (distinct adjective + noun "
                         f"names), got {n_questions!r}")
    if not 0.0 <= distractor_fraction <= 1.0 or context_lines < 0:
        raise ValueError("distractor_fraction must be in [0, 1] and context_lines >= 0")
    rng = random.Random(seed)
    lines = chitchat_lines() if lines is None else lines
    objects = rng.sample([f"{a} {n}" for a in ADJECTIVES for n in NOUNS], n_questions)
    places = rng.sample([f"{k} {n}" for k in PLACE_KINDS for n in PLACE_NUMBERS], n_questions)

    def context() -> str:   # a run of consecutive corpus lines: a piece of a real conversation
        if not context_lines or not lines:
            return ""
        start = rng.randrange(max(1, len(lines) - context_lines))
        return "".join(f"{line}\n" for line in lines[start:start + context_lines])

    items = tuple(QAItem(obj, place, rng.choice(TEMPLATES).format(obj=obj, place=place) + "\n",
                         f"Where is the {obj}?", context()) for obj, place in zip(objects, places))
    chosen = rng.sample(objects, round(n_questions * distractor_fraction))
    distractors = tuple((rng.choice(DISTRACTORS).format(obj=o, name=rng.choice(NAMES), day=rng.choice(DAYS))
                         + "\n", context()) for o in chosen)
    return QASet(items, distractors, seed)


def mentioned_places(text: str) -> set[str]:
    """Every place an answer names, normalized ("Bin #12" -> "bin 12")."""
    return {f"{m.group(1).lower()} {int(m.group(2))}" for m in _PLACE.finditer(text)}


def score(answer: str, place: str) -> str:
    """"correct": names the right place and no other; "other_too": the right one and another;
    "wrong_place": only other places; "no_place": none."""
    said = mentioned_places(answer)
    if place in said:
        return "correct" if len(said) == 1 else "other_too"
    return "wrong_place" if said else "no_place"
