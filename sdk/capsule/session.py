"""Session: the one front object. It composes the parts below and holds no logic of its own.

Threading: a Session may be shared between threads. LLM and memory calls are serialized by one
lock, act / reset by another, so a control loop's act never waits for a generate on a chat
thread; checkpoint, rollback and close take both (in that order), so a capsule is a consistent
cut and waits for a running LLM call. Several Sessions may live in one process (they share only
read-only vocabularies).
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import devices

from . import assembly
from .errors import StoreError
from .store.store import OWNED
from .llm import SamplingParams
from .llm.engine import Engine
from .memory.facts import Memory, MemoryConfig
from .session_capsules import CapsuleMethods
from .session_memory import MemoryMethods
from .session_policy import PolicyMethods
from .state.checkpointer import Checkpointer
from .state.regions import RegionRegistry
from .tokenize import load_reference


class Session(CapsuleMethods, MemoryMethods, PolicyMethods):
    """An LLM and/or a robot policy with their execution state, bound to a capsule store."""

    def __init__(self, path: Path, profile: devices.DeviceProfile, llm: "assembly.LLMParts | None",
                 registry: RegionRegistry, store: Any, checkpointer: Checkpointer,
                 memory: Memory | None = None, actor: Any = None):
        self.path = path
        self.profile = profile
        self.registry = registry          # every static buffer the graphs use (public, see state/regions)
        self.tokenizer = llm.tokenizer if llm else None
        self.model_info = llm.info if llm else None
        self.restored_epoch: int | None = None
        # epochs the last restore skipped (damaged, unreadable, another setup's), each with why;
        # after the restore at open, first what the store's recovery did (e.g. an index rebuilt)
        self.restore_report: list[str] = []
        self._llm_parts = llm
        self._engine: Engine | None = llm.engine if llm else None
        self._store = store
        self._ckpt = checkpointer
        self._state: dict = {}
        self._memory = memory
        self._actor = actor
        self._lock = threading.RLock()          # LLM, memory, store
        self._policy_lock = threading.RLock()   # act / reset: a control loop never waits on an LLM call
        self._llm_depth = 0                     # nesting of _llm_section on the holding thread
        self._deferred: tuple[str | None] | None = None   # a capsule asked for while the LLM was busy
        self._deferred_error: BaseException | None = None
        self._closed = False
        # a capsule taken with wait=False is durable once written: if the app exits without
        # close(), close at interpreter exit (the writer is a daemon thread) instead of losing it
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self), os.getpid())
        atexit.register(self._at_exit)

    # -- lifetime ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, model: str | os.PathLike | None = "builtin:tiny",
             tokenizer: str | os.PathLike | None = None, policy: str | None = None,
             device: str = "auto", runtime: Mapping[str, Any] | None = None, restore: bool = True,
             keep_epochs: int | None = None, sign_key: bytes | None = None,
             memory: MemoryConfig | Mapping[str, Any] | None = None) -> "Session":
        """Open (creating if missing) the store at `path`, load the model, restore the newest capsule.

        device: "auto", "cpu", "cuda", or a profile name / YAML path from devices/.
        runtime: overrides of the profile's runtime defaults, e.g. {"kv_pool_mb": 16}.
        restore: restore the newest committed epoch that is fully valid and taken with this setup
        (``restored_epoch`` says which; epochs skipped on the way, and why, are in
        ``restore_report`` and logged as a warning on the "capsule" logger).
        keep_epochs: epochs retained in the store (default: the profile's checkpoint.keep_epochs).
        memory: MemoryConfig (or a dict of its fields) for remember / recall / memory_k.
        policy: an .onnx file or builtin:mlp | builtin:mlp-chunk | builtin:gru, run by the first
        engine of the profile's `engines` that works here (see act, reset, episode).
        Nothing is created on disk unless the model and tokenizer load.
        """
        store_path = _store_path(path)
        profile = devices.detect_profile(device)
        if runtime:
            profile = profile.replace_runtime(**dict(runtime))
        mem_config = MemoryConfig.of(memory)
        if memory is not None and model is None:
            raise ValueError("memory needs a model: give model=... or leave memory=None")
        if memory is not None and mem_config.region_tokens > profile.runtime.max_context:
            raise ValueError(f"MemoryConfig.region_tokens ({mem_config.region_tokens}) exceeds "
                             f"runtime.max_context ({profile.runtime.max_context}): no stream could hold "
                             "its memory region; lower region_tokens or raise max_context")
        keep = profile.checkpoint.keep_epochs if keep_epochs is None else keep_epochs
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep_epochs must be an int >= 1, got {keep!r}")
        registry = RegionRegistry()
        llm = assembly.build_llm(model, tokenizer, profile, registry) if model is not None else None
        actor = assembly.build_actor(policy, profile, registry) if policy is not None else None
        if llm is None and tokenizer is not None:
            load_reference(tokenizer)  # fail early on a bad name even without a model
        binding = assembly.binding_of(llm, profile, registry, actor)
        store = assembly.open_store(store_path, sign_key)
        try:
            mem = None if llm is None else Memory(store, llm.engine.runner.model, llm.tokenizer,
                                                  mem_config, binding.model)
            session = cls(store_path, profile, llm, registry, store,
                          assembly.build_checkpointer(store, llm, binding, registry, keep), mem, actor)
            if restore:
                session._restore(None)
        except BaseException:
            store.close()
            raise
        return session

    def close(self) -> None:
        """Wait for pending background checkpoints, then release the store. Raises a write failure."""
        with self._whole():
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self._at_exit)
            try:
                self._ckpt.close()
            finally:
                self._store.close()
                self._engine = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _restore(self, epoch_or_name: int | str | None) -> int | None:
        loader = assembly.host_loader(self._llm_parts, self._put_state, self._actor)
        if epoch_or_name is None:
            restored = self._ckpt.restore_newest(loader)
        else:
            restored = self._ckpt.restore(epoch_or_name, loader)
        if restored is None:
            return None
        self.restored_epoch = restored.epoch
        self.restore_report = restored.skipped
        self._drop_forgotten()     # facts forgotten since that capsule are not attended again
        return restored.epoch

    # -- text -------------------------------------------------------------------------------
    def append(self, text: str, stream: str = "main", *, system: bool = False) -> None:
        """Add text to a stream (created on first use). Its ids equal the reference tokenizer's.

        system=True: the text extends the stream's system prefix (only before other text);
        injected memory facts sit right after it (docs/MEMORY.md).
        """
        with self._llm_section():
            self._llm().append(stream, text, system=system)

    def generate(self, max_new_tokens: int, *, stream: str | Sequence[str] = "main",
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, memory_k: int = 0) -> str | dict[str, str]:
        """Generate up to max_new_tokens and return the new text (without a stop string or EOS).

        Greedy when temperature is 0. `seed` reseeds the stream's generator; without it a
        sampling stream continues its own generator. Give a list of streams to decode them
        together in one batched step; the result is then a dict stream -> text.
        The stream keeps every generated token, the stop string (or EOS) and the rest of the
        token that completed it included: with stop="\nuser:", append the next turn without
        repeating "\nuser:" (s.text() shows what the model sees).
        memory_k: inject the K/V of the k facts most relevant to the user's turn (the text
        appended since the model last spoke) into the stream's memory region first (replacing
        the facts injected before); 0 leaves the region as it is (see clear_memory).
        """
        if isinstance(memory_k, bool) or not isinstance(memory_k, int) or memory_k < 0:
            raise ValueError(f"memory_k must be an int >= 0, got {memory_k!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"seed must be an int in 0..2**63-1 or None, got {seed!r}")
        params = SamplingParams(float(temperature), float(top_p))
        if not isinstance(stream, (str, list, tuple)):
            raise ValueError(f"stream must be a name or a list of names, got {type(stream).__name__}")
        names = [stream] if isinstance(stream, str) else list(stream)
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"stream must be a name or a list of distinct names, got {stream!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if any(not isinstance(x, str) or not x for x in stops):
            raise ValueError(f"stop must be a non-empty str or a list of them, got {stop!r}")
        with self._llm_section():
            engine = self._llm()
            for n in names:
                engine.stream(n)   # unknown streams fail before any memory work
            if memory_k:
                self._inject(names, memory_k, max_new_tokens)
            bucket_max = engine.runner.buckets[-1]
            replies: dict[str, str] = {}
            for i in range(0, len(names), bucket_max):  # more streams than the largest bucket: in groups
                replies.update(engine.generate(names[i:i + bucket_max], max_new_tokens, params, seed, stops))
        return replies[names[0]] if isinstance(stream, str) else replies

    def tokens(self, stream: str = "main") -> list[int]:
        with self._llm_section():
            return list(self._llm().stream(stream).ids)

    def text(self, stream: str = "main") -> str:
        with self._llm_section():
            return self._llm().stream(stream).text

    def streams(self) -> list[str]:
        with self._llm_section():
            return list(self._llm().streams)

    def drop_stream(self, stream: str) -> None:
        """Forget a stream (text, tokens, K/V blocks back to the pool); the next capsule has no
        such stream. For a long-running robot whose conversation reached max_context or filled
        the pool: drop it and start a new one (rollback restores an older capsule instead)."""
        with self._llm_section():
            self._llm().drop(stream)

    # -- app state --------------------------------------------------------------------------
    @property
    def state(self) -> dict:
        """The app's own small state; JSON-serializable, saved in capsules with everything else."""
        return self._state

    @state.setter
    def state(self, value: Mapping[str, Any]) -> None:
        self._set_state(value)

    def _set_state(self, value: Mapping[str, Any]) -> None:
        self._state = assembly.check_app_state(value)

    def _put_state(self, value: dict) -> None:
        # a restore's install step: the value was checked while the capsule was (it cannot fail)
        self._state = value

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this Session is closed; open a new one")

    def _llm(self) -> Engine:
        self._check_open()
        if self._engine is None:
            raise ValueError("this Session has no model (opened with model=None)")
        return self._engine


def _store_path(path: str | os.PathLike) -> Path:
    """The store folder: ~ expanded; refused if it is a file, empty, or a folder of other files."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ValueError(f"path must name the store folder (it is created if missing), got {path!r}")
    store_path = Path(os.path.expanduser(os.fspath(path)))
    if store_path.exists() and not store_path.is_dir():
        raise StoreError(f"store path {str(store_path)!r} is a regular file; give a folder path "
                         "(it is created if missing)")
    if store_path.is_dir() and not (store_path / "index.sqlite").exists():
        other = sorted(p.name for p in store_path.iterdir() if p.name != "LOCK" and p.name not in OWNED)
        if other:
            raise StoreError(f"folder {str(store_path)!r} holds other files ({', '.join(other[:3])}"
                             f"{', ...' if len(other) > 3 else ''}) and no capsule store; give an empty "
                             "or new folder")
    return store_path


def _close_at_exit(ref: "weakref.ref[Session]", pid: int) -> None:
    session = ref()
    if session is None or session._closed or os.getpid() != pid:
        return   # a forked child's copy never writes into its parent's store
    try:
        session.close()
    except Exception as exc:  # noqa: BLE001 - at exit there is no caller left to raise to
        print(f"capsule: closing the Session of {session.path} at exit failed: {exc}", file=sys.stderr)
