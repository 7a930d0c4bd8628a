"""Session: the one front object. It composes the parts below and holds no logic of its own.

Threading: a Session may be shared between threads; its calls are serialized by a lock.
Several Sessions may live in one process (they share only read-only vocabularies).
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

import devices

from .errors import StoreError, TokenizerError, VocabMismatch
from .llm import GraphRunner, KVPool, SamplingParams, load_model
from .llm.engine import Engine
from .state.regions import RegionRegistry
from .tokenize import ReferenceTokenizer, load_reference

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_BUILTIN_TOKENIZER = "cl100k_base"


class Session:
    """An LLM (and later a policy) with its execution state, bound to a store folder."""

    def __init__(self, path: Path, profile: devices.DeviceProfile, engine: Engine | None,
                 registry: RegionRegistry, tokenizer: ReferenceTokenizer | None, model_info: Any):
        self.path = path
        self.profile = profile
        self.registry = registry          # every static buffer the graphs use (public, see state/regions)
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.restored_epoch: int | None = None  # capsules arrive with the checkpoint issue
        self._engine = engine
        self._state: dict = {}
        self._lock = threading.RLock()
        self._closed = False

    # -- lifetime ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, model: str | os.PathLike | None = "builtin:tiny",
             tokenizer: str | os.PathLike | None = None, policy: str | None = None,
             device: str = "auto", runtime: Mapping[str, Any] | None = None) -> "Session":
        """Open (creating if missing) the store at `path` and load the model onto `device`.

        device: "auto", "cpu", "cuda", or a profile name / YAML path from devices/.
        runtime: overrides of the profile's runtime defaults, e.g. {"kv_pool_mb": 16}.
        Nothing is created on disk unless everything loads.
        """
        if policy is not None:
            raise NotImplementedError("policies are not implemented yet (see the policy-engines issue); "
                                      "open with policy=None")
        store = Path(path)
        if store.exists() and not store.is_dir():
            raise StoreError(f"store path {str(store)!r} is a regular file; give a folder path "
                             "(it is created if missing)")
        profile = devices.detect_profile(device)
        if runtime:
            profile = profile.replace_runtime(**dict(runtime))
        registry = RegionRegistry()
        engine, tok, info = None, None, None
        if model is not None:
            engine, tok, info = _build_engine(model, tokenizer, profile, registry)
        elif tokenizer is not None:
            tok = load_reference(tokenizer)
        try:
            store.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store folder {str(store)!r}: {exc.strerror}") from None
        return cls(store, profile, engine, registry, tok, info)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._engine = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- text -------------------------------------------------------------------------------
    def append(self, text: str, stream: str = "main") -> None:
        """Add text to a stream (created on first use). Its ids equal the reference tokenizer's."""
        with self._lock:
            self._llm().append(stream, text)

    def generate(self, max_new_tokens: int, *, stream: str | Sequence[str] = "main",
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None) -> str | dict[str, str]:
        """Generate up to max_new_tokens and return the new text (without a stop string or EOS).

        Greedy when temperature is 0. `seed` reseeds the stream's generator; without it a
        sampling stream continues its own generator. Give a list of streams to decode them
        together in one batched step; the result is then a dict stream -> text.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        params = SamplingParams(float(temperature), float(top_p))
        names = [stream] if isinstance(stream, str) else list(stream)
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"stream must be a name or a list of distinct names, got {stream!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if any(not isinstance(x, str) or not x for x in stops):
            raise ValueError(f"stop must be a non-empty str or a list of them, got {stop!r}")
        with self._lock:
            engine = self._llm()
            bucket_max = engine.runner.buckets[-1]
            replies: dict[str, str] = {}
            for i in range(0, len(names), bucket_max):  # more streams than the largest bucket: in groups
                replies.update(engine.generate(names[i:i + bucket_max], max_new_tokens, params, seed, stops))
        return replies[names[0]] if isinstance(stream, str) else replies

    def tokens(self, stream: str = "main") -> list[int]:
        with self._lock:
            return list(self._llm().stream(stream).ids)

    def text(self, stream: str = "main") -> str:
        with self._lock:
            return self._llm().stream(stream).text

    def streams(self) -> list[str]:
        with self._lock:
            return list(self._llm().streams)

    # -- app state --------------------------------------------------------------------------
    @property
    def state(self) -> dict:
        """The app's own small state; JSON-serializable, saved in capsules with everything else."""
        return self._state

    @state.setter
    def state(self, value: Mapping[str, Any]) -> None:
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Session.state must be JSON-serializable: {exc}") from None
        self._state = dict(value)

    # -- internals --------------------------------------------------------------------------
    def _llm(self) -> Engine:
        if self._closed:
            raise ValueError("this Session is closed; open a new one")
        if self._engine is None:
            raise ValueError("this Session has no model (opened with model=None)")
        return self._engine


def _build_engine(model: str | os.PathLike, tokenizer: str | os.PathLike | None,
                  profile: devices.DeviceProfile, registry: RegionRegistry):
    rt = profile.runtime
    source = str(model)
    if tokenizer is None:
        if source.startswith("builtin:"):
            tokenizer = DEFAULT_BUILTIN_TOKENIZER
        elif (Path(source) / "tokenizer.json").is_file():
            tokenizer = Path(source) / "tokenizer.json"
        else:
            raise TokenizerError(f"{source} has no tokenizer.json; pass tokenizer= (a family name like "
                                 "'qwen2.5' or a tokenizer.json / .tiktoken path)")
    tok = load_reference(tokenizer)
    dev = torch.device("cuda" if profile.device == "cuda" else "cpu")
    decoder, info = load_model(source, device=dev, dtype=_DTYPES[rt.dtype], vocab_size=tok.vocab_size)
    if decoder.cfg.vocab_size <= tok.max_id:
        raise VocabMismatch(f"model {source} has {decoder.cfg.vocab_size} embeddings but tokenizer "
                            f"{tok.name} emits ids up to {tok.max_id}; use the model's own tokenizer")
    pool = KVPool(decoder.cfg, pool_bytes=rt.kv_pool_bytes, block_size=rt.block_size,
                  dtype=decoder.dtype, device=dev)
    runner = GraphRunner(decoder, pool, registry, buckets=rt.batch_buckets, max_context=rt.max_context,
                         prefill_chunk=rt.prefill_chunk, use_cuda_graphs=rt.cuda_graphs and dev.type == "cuda")
    return Engine(runner, pool, tok), tok, info
