"""Differential campaign: incremental ids vs the reference on the full text, over real text.

Texts: source files of installed packages (deterministic choice by seed), a multilingual sample,
hazard-alphabet strings and long space, tab or digit runs among hazards, each cut at random
points into appends (and some tail replacements).
Every call is one check: ``tok.ids == reference.encode(tok.text)``. ``capsule bench --suite
tokenize-diff`` and the tests call ``run_differential``.
"""
from __future__ import annotations

import hashlib
import random
import time
import unicodedata
from pathlib import Path
from typing import Any, Iterable

from .incremental import IncrementalTokenizer
from .reference import load_reference
from .registry import family_names
from .sources import package_dir

PACKAGES = ("torch", "tokenizers", "tiktoken", "hypothesis", "numpy", "yaml", "tqdm")
MULTILINGUAL = (
    "The robot picked up the red cup. It's fragile; don't drop it!\n"
    "机器人拿起了红色的杯子。它很易碎，请不要掉下来！\n"
    "ロボットは赤いカップを持ち上げた。壊れやすいので、落とさないでください。\n"
    "로봇이 빨간 컵을 집어 들었습니다. 깨지기 쉬우니 떨어뜨리지 마세요!\n"
    "Робот поднял красную чашку. Она хрупкая — не урони её!\n"
    "Το ρομπότ σήκωσε το κόκκινο φλιτζάνι. Είναι εύθραυστο!\n"
    "رفع الروبوت الكوب الأحمر. إنه هش، لا تسقطه!\n"
    "रोबोट ने लाल कप उठाया। यह नाज़ुक है, इसे मत गिराना!\n"
    "หุ่นยนต์หยิบถ้วยสีแดงขึ้นมา มันเปราะบาง อย่าทำตก!\n"
    "Le robot a ramassé la tasse rouge. Elle est fragile ; ne la fais pas tomber !\n"
    "Der Roboter hob die rote Tasse auf. Sie ist zerbrechlich – lass sie nicht fallen!\n"
    "Cafe\u0301 nai\u0308ve re\u0301sume\u0301 — Ångström, ﬁne, ①②③, ½, Ⅻ, x²\n"
    "👩\u200d👩\u200d👧\u200d👦 🏳\ufe0f\u200d🌈 👍🏽 🇯🇵 ❤\ufe0f\u200d🔥\n"
    "temp=23.5°C, pose=(0.12, -3.40, 1e-3), ids=[101, 2024, 65535]\r\n\r\n\t\tdone   \n")
HAZARD = [" ", "  ", "\n", "\r", "\r\n", "\t", "a", "b", "x", "Z", "é", "e", "0", "7", "123",
          "'", "'s", "'ll", ".", ",", "!", "中", "文", "日本", "の", "한", "😀", "👩", "\u200d",
          "\u0301", "\u0308", "\ufe0f", "<", "|", ">", "<|", "|>", "im_st", "art", "end", "of",
          "text", "<｜", "｜>", "end▁of▁sen", "tence", "▁", "｜", "<|im_start|>",
          "<|endoftext|>", "<｜end▁of▁sentence｜>", "<think>", "\x01", "\u00a0", "\u3000"]


def corpus_files(seed: int, limit: int = 400) -> list[Path]:
    """A deterministic sample of installed packages' .py files."""
    files: list[Path] = []
    for pkg in PACKAGES:
        root = package_dir(pkg)
        if root is not None and root.is_dir():
            files += sorted(p for p in root.rglob("*.py") if p.is_file())
    rng = random.Random(seed)
    rng.shuffle(files)
    return files[:limit]


def _own_hazards(ref: Any, seed: int) -> list[str]:
    """Up to 24 of the family's own special tokens, whole and cut in two at a random point
    (a digit run inside one, like o200k_harmony's <|reserved_200000|>, is a hazard of its own)."""
    rng = random.Random(f"{seed}:specials")
    specials = sorted(ref.special_tokens)
    out: list[str] = []
    for s in rng.sample(specials, min(24, len(specials))):
        k = rng.randint(1, max(1, len(s) - 1))
        out += [s, s[:k], s[k:]]
    return out


def _texts(seed: int, max_chars: int, hazard: list[str] = HAZARD
           ) -> Iterable[tuple[str, str]]:
    """(source label, text) forever: files, the multilingual sample, hazard strings."""
    rng = random.Random(seed)
    files = corpus_files(seed)
    k = 0
    while True:
        k += 1
        roll = rng.random()
        if roll < 0.6 and files:
            f = files[k % len(files)]
            try:
                t = f.read_text("utf-8", errors="replace")
            except OSError:
                continue
            start = rng.randrange(max(1, len(t) - max_chars))
            yield f"{f.name}@{start}", t[start:start + rng.randint(1, max_chars)]
        elif roll < 0.75:
            start = rng.randrange(len(MULTILINGUAL))
            n = rng.randint(1, max_chars)
            yield f"multilingual@{start}", (MULTILINGUAL * 3)[start:start + n]
        elif roll < 0.95:
            n = rng.randint(1, 120)
            yield "hazard", "".join(rng.choice(hazard) for _ in range(n))
        else:   # long space / tab / digit runs among hazards: the cut runs of space_runs.py
            parts = [rng.choice(hazard) + _run(rng, rng.randint(200, max(200, max_chars)))
                     for _ in range(rng.randint(1, 3))]
            yield "runs", "".join(parts) + rng.choice(hazard)


def _run(rng: random.Random, n: int) -> str:
    kind = rng.choice(" \t0")
    return kind * n if kind != "0" else "".join(rng.choice("0123456789") for _ in range(n))


def _cuts(rng: random.Random, text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        r = rng.random()
        n = 0 if r < 0.03 else 1 if r < 0.3 else rng.randint(2, 8) if r < 0.6 else \
            rng.randint(9, 80) if r < 0.9 else rng.randint(81, 2000)
        out.append(text[i:i + n])
        i += n
    return out


def run_differential(families: Iterable[str] | None = None, n_checks: int = 1000, seed: int = 0,
                     max_chars: int = 3000, replace_rate: float = 0.05,
                     bpe: bool = False) -> dict[str, Any]:
    """Run ``n_checks`` checked calls per family; returns counts and any divergences.

    bpe: also encode every stream's final text with the tensor BPE (``TensorBpe``, batched 64
    texts per kernel pass) and compare it with the reference (``bpe_checks`` in the counts; 0
    for a family the tensor BPE does not run: ``tensor_bpe.unsupported``).
    families: names to check; None checks every registered family.
    """
    out: dict[str, Any] = {"seed": seed, "families": {}, "divergences": []}
    for fam in family_names() if families is None else families:
        ref = load_reference(fam)
        rng = random.Random(f"{seed}:{fam}")
        tok = IncrementalTokenizer(ref, shadow_rate=0.0)
        # the tensor BPE runs the verified char-aligned pipelines only; others get 0 bpe_checks
        kernel = (_BpeCheck(ref, fam, out["divergences"])
                  if bpe and not _bpe_unsupported(ref) else None)
        nfc = tok.normalizes_nfc
        checks = divergences = streams = 0
        t0 = time.perf_counter()
        texts = _texts(seed, max_chars, HAZARD + _own_hazards(ref, seed))
        while checks < n_checks:
            label, text = next(texts)
            streams += 1
            tok.reset("")
            expect = ""
            if kernel is not None:
                kernel.add(label, text)
            for part in _cuts(rng, text):
                if checks >= n_checks:
                    break
                if expect and rng.random() < replace_rate:
                    n = rng.randint(0, min(len(expect), 40))
                    seam = len(expect) - n
                    tok.replace_tail(n, part)
                    expect = _norm(expect[:seam] + part, nfc)
                else:
                    seam = len(expect)
                    tok.append(part)
                    expect = _norm(expect + part, nfc)
                checks += 1
                if tok.text != expect or tok.ids != ref.encode(expect):
                    divergences += 1
                    out["divergences"].append({
                        "family": fam, "source": label, "seam": seam, "chars": len(expect),
                        "text_sha256": hashlib.sha256(expect.encode("utf-8")).hexdigest(),
                        "text_tail": expect[-200:]})
                    tok.reset(expect)
        bpe_counts = (kernel.finish() if kernel is not None
                      else {"bpe_checks": 0, "bpe_divergences": 0} if bpe else {})
        out["families"][fam] = {"checks": checks, "divergences": divergences, "streams": streams,
                                **bpe_counts, "seconds": round(time.perf_counter() - t0, 2),
                                **{k: v for k, v in tok.stats.items()
                                   if k in ("windows", "widenings", "fallbacks",
                                            "check_failures")}}
    return out


def _bpe_unsupported(ref: Any) -> str:
    from .tensor_bpe import unsupported   # torch, only when the tensor BPE is asked for
    return unsupported(ref)


class _BpeCheck:
    """Tensor BPE vs reference on whole texts, in batches (the kernel's natural shape)."""

    def __init__(self, ref: Any, family: str, sink: list[dict[str, Any]]) -> None:
        from .tensor_bpe import TensorBpe
        self._ref, self._family, self._sink = ref, family, sink
        self._bpe = TensorBpe(ref)
        self._batch: list[tuple[str, str]] = []
        self.checks = self.divergences = 0

    def add(self, label: str, text: str) -> None:
        self._batch.append((label, text))
        if len(self._batch) >= 64:
            self._flush()

    def _flush(self) -> None:
        got = self._bpe.encode_batch([t for _, t in self._batch])
        for (label, text), ids in zip(self._batch, got):
            self.checks += 1
            if ids != self._ref.encode(text):
                self.divergences += 1
                self._sink.append({"family": self._family, "source": label, "seam": "tensor-bpe",
                                   "chars": len(text), "text_tail": text[-200:],
                                   "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()})
        self._batch.clear()

    def finish(self) -> dict[str, int]:
        if self._batch:
            self._flush()
        return {"bpe_checks": self.checks, "bpe_divergences": self.divergences}


def _norm(s: str, nfc: bool) -> str:
    return unicodedata.normalize("NFC", s) if nfc else s
