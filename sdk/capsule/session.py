"""Session: the one front object, a facade over composed parts; it holds no logic of its own.

Parts: the capsule gate (both locks, deferral, checkpoint / flush / rollback, session_gate.py),
the LLM part (engine, streams, memory injection, session_llm.py / session_memory.py), the host
part (app state, restore, session_host.py), the policy's actor (policy/actor.py), the store and
the checkpointer; assembly.py builds them from open's arguments. The read-only views below
(engine, memory, store, checkpointer, actor) are for tools and tests: read them, change state
only through Session methods.

Threading: a Session may be shared between threads. LLM and memory calls are serialized by one
lock, act / reset by another, so a control loop's act never waits for a generate on a chat
thread (on CUDA not on the GPU either: a policy runs on its own stream, policy/buffers.py);
checkpoint, rollback and close take both (in that order), so a capsule is a consistent cut and
waits for a running LLM call. Several Sessions may live in one process (they share only
read-only vocabularies).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, cast

import numpy as np

import devices

from . import assembly, session_fleet
from .llm import ModelInfo
from .llm.engine import Engine
from .memory.facts import Fact, Memory, MemoryConfig
from .policy.actor import Actor
from .session_decode_path import restore_under_capsule_decode_path
from .session_gate import CapsuleGate
from .session_host import HostPart
from .session_llm import LLMPart, generate_args, guarded
from .state.checkpointer import Checkpointer
from .state.regions import RegionRegistry
from .store import EpochInfo, Store
from .tokenize import ReferenceTokenizer

if TYPE_CHECKING:
    from .fleet import Replication, Replicator, ReplicationStatus
    from .fleet.memory_sync import MemorySync


class Session:
    """An LLM and/or a robot policy with their execution state, bound to a capsule store."""

    def __init__(self, path: Path, profile: devices.DeviceProfile, registry: RegionRegistry,
                 store: Store, checkpointer: Checkpointer, llm: LLMPart | None = None,
                 actor: Actor | None = None):
        self.path = path
        self._replicator: Replicator | None = None
        self.profile = profile
        self.registry = registry          # every static buffer the graphs use (public, see state/regions)
        self._llm_part = llm
        self._actor = actor
        self._host = HostPart(checkpointer, llm, actor)
        self._gate = CapsuleGate(checkpointer, store, *guarded(llm, self._host.capture, self._host.restore))
        # a capsule taken with wait=False is durable once written: if the app exits without
        # close(), close at interpreter exit (the writer is a daemon thread) instead of losing it
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self), os.getpid())
        atexit.register(self._at_exit)

    # -- lifetime ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, model: str | os.PathLike | None = "builtin:tiny",
             tokenizer: "str | os.PathLike | ReferenceTokenizer | None" = None, policy: str | None = None,
             device: str = "auto", runtime: Mapping[str, Any] | None = None, restore: bool = True,
             keep_epochs: int | None = None, sign_key: bytes | None = None,
             memory: MemoryConfig | Mapping[str, Any] | None = None,
             replicate: "str | Replication | Mapping[str, Any] | None" = None) -> "Session":
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
        replicate: "s3://bucket/prefix" (or a capsule.fleet.Replication): committed epochs are
        copied there by a background thread (never the caller's; see replication); close() waits
        for it, at most Replication.close_timeout_s. Endpoint and keys: the AWS variables.
        Nothing is created on disk unless the model and tokenizer load.
        """
        replication = None if replicate is None else session_fleet.replication_of(replicate)
        a = assembly.assemble(path, model=model, tokenizer=tokenizer, policy=policy, device=device,
                              runtime=runtime, keep_epochs=keep_epochs, sign_key=sign_key, memory=memory)
        try:
            part = LLMPart(a.llm, a.memory) if a.llm is not None and a.memory is not None else None
            session = cls(a.path, a.profile, a.registry, a.store, a.checkpointer, part, a.actor)
            if restore:   # "auto" decode path: a capsule continues under the one it was taken with
                restore_under_capsule_decode_path(a, session._gate.restore_newest)
            if replication is not None:
                session._replicator = session_fleet.start_replicator(a.store, replication)
        except BaseException:
            a.store.close()
            raise
        return session

    def close(self) -> None:
        """Wait for pending background checkpoints, then release the store. Raises a write failure."""
        if self._llm_part is not None:
            self._llm_part.check_not_in_callback()
        replicator = self._replicator
        if self._gate.close(None if replicator is None else replicator.close):
            atexit.unregister(self._at_exit)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- text -------------------------------------------------------------------------------
    def append(self, text: str, stream: str = "main", *, system: bool = False) -> None:
        """Add text to a stream (created on first use). Its ids equal the reference tokenizer's.

        system=True: the text extends the stream's system prefix (only before other text);
        injected memory facts sit right after it (docs/MEMORY.md).
        """
        with self._gate.llm_section():
            self._llm().append(stream, text, system)

    def chat(self, role: str, text: str, *, stream: str = "main") -> None:
        """Append a turn ("system" first only, "user", "assistant") formatted by the model's chat
        template; a user turn opens the assistant's: generate() writes the reply, which joins the
        conversation, until the end-of-turn token. No template: ChatTemplateError (use append)."""
        with self._gate.llm_section():
            self._llm().chat(stream, role, text)

    def generate(self, max_new_tokens: int, *, stream: str | Sequence[str] = "main",
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, memory_k: int = 0,
                 on_token: Callable[[str, str], None] | None = None,
                 choices: Sequence[str] | None = None) -> str | dict[str, str]:
        """Generate up to max_new_tokens and return the new text (without a stop string or EOS).

        Greedy when temperature is 0. `seed` reseeds the stream's generator; without it a
        sampling stream continues its own generator. Give a list of streams to decode them
        together in one batched step; the result is then a dict stream -> text.
        The stream keeps every generated token, the stop string (or EOS) and the rest of the
        token that completed it included: with stop="\\nuser:", append the next turn without
        repeating "\\nuser:" (s.text() shows what the model sees).
        memory_k: inject the K/V of the k facts most relevant to the user's turn (the text
        appended since the model last spoke) into the stream's memory region first (replacing
        the facts injected before); 0 leaves the region as it is (see clear_memory).
        on_token(stream, piece): called in the decode loop with each reply as it grows; the pieces
        join to the reply. Keep it quick; it must not call the Session (ValueError: the lock is
        held). If it raises, decoding stops and the error propagates (the stream stays consistent).
        choices: the reply is exactly one of these strings (constrained decoding, one stream):
        e.g. ``s.generate(8, choices=[" reach", " open", " home"])`` after "next skill:".
        """
        names, params, stops, options = generate_args(max_new_tokens, stream, temperature, top_p, seed,
                                                      stop, memory_k, on_token, choices)
        with self._gate.llm_section():
            replies = self._llm().generate(names, max_new_tokens, params, seed, stops, memory_k, on_token,
                                           options)
        return replies[names[0]] if isinstance(stream, str) else replies

    def tokens(self, stream: str = "main") -> list[int]:
        with self._gate.llm_section():
            return self._llm().tokens(stream)

    def text(self, stream: str = "main") -> str:
        """The stream's text as the model sees it (for an NFC-normalizing tokenizer: normalized)."""
        with self._gate.llm_section():
            return self._llm().text(stream)

    def streams(self) -> list[str]:
        with self._gate.llm_section():
            return self._llm().streams()

    def drop_stream(self, stream: str) -> None:
        """Forget a stream (text, tokens, K/V blocks back to the pool); the next capsule has no
        such stream. For a long-running robot whose conversation reached max_context or filled
        the pool: drop it and start a new one (rollback restores an older capsule instead)."""
        with self._gate.llm_section():
            self._llm().drop(stream)

    # -- memory (docs/MEMORY.md) --------------------------------------------------------------
    def remember(self, text: str, *, tags: Sequence[str] | None = None,
                 context: str | None = None) -> int:
        """Store a fact durably, its K/V computed once (keys before RoPE); returns its id.

        context: text the fact is encoded after (its last MemoryConfig.window tokens); default:
        the "main" stream's text, when a window is configured.
        """
        with self._gate.llm_section():
            return self._llm().memory.remember(text, tags, context)

    def forget(self, fact_id: int) -> None:
        """Delete a fact (durable when it returns) and drop it from every stream's memory region
        at once (the other facts stay). Capsules taken before still hold its K/V bytes until
        retention drops them; restoring one drops the fact again."""
        with self._gate.llm_section():
            self._llm().memory.forget(fact_id)

    def sync_memory(self, url: str, *, sign_key: bytes | None = None) -> "MemorySync":
        """Share memory with the fleet: publish this robot's facts (and their K/V under this model)
        to the shared prefix `url` ("s3://bucket/fleet-memory") and merge the facts others
        published (their K/V used when it is this model's, else encoded here); one fact per
        content, and a forget, here or elsewhere, wins for good (docs/FORMAT.md, "Fleet memory").
        The network part runs without the LLM lock; act() is never held up. sign_key: the fleet key."""
        return session_fleet.sync_memory(url, sign_key, self._memory_section)

    @contextlib.contextmanager
    def _memory_section(self) -> Iterator[Any]:
        with self._gate.llm_section():
            yield self._llm().memory

    def clear_memory(self, stream: str = "main") -> None:
        """Empty a stream's memory region: no fact is attended until its next memory_k."""
        with self._gate.llm_section():
            self._llm().memory.clear(stream)

    def recall(self, query: str, k: int = 8) -> list[Fact]:
        """The k facts most relevant to query (BM25, fused with MiniLM cosine when installed)."""
        with self._gate.llm_section():
            return self._llm().memory.recall(query, k)

    # -- policy (LeRobot-like select_action; the hidden state and queue are in every capsule) ----
    def act(self, observation: Mapping[str, Any]) -> np.ndarray:
        """One action (A,) for this tick: from the action queue when the policy emitted a chunk,
        else from one policy step (``observation.state`` and the policy's other inputs, numpy or
        torch, batch dimension optional). Takes only the policy lock (never waits for an LLM call).
        A bad observation (key, shape, dtype, NaN/inf: the message names the key and index)
        raises ValueError before anything changes, queued ones included; host arrays are checked
        without allocating, a CUDA tensor with one extra host sync."""
        with self._gate.policy_lock:
            return self.actor.act(observation)

    def reset(self) -> None:
        """Start a new episode: the action queue empties and the policy's hidden state is zeroed."""
        with self._gate.policy_lock:
            self.actor.reset()

    @contextlib.contextmanager
    def episode(self) -> Iterator["Session"]:
        """``with session.episode():`` runs one episode from a fresh policy state."""
        self.reset()
        yield self

    @property
    def policy_engine(self) -> str:
        """Which engine runs the policy ("torch", "onnxruntime" or "tensorrt")."""
        return self.actor.runner.engine_name

    @property
    def llm_engine(self) -> str:
        """Which engine runs the LLM's steps ("torch" or "onnxruntime": runtime.llm_engines)."""
        return self._llm().engine.runner.engine_name

    # -- capsules -----------------------------------------------------------------------------
    def checkpoint(self, *, wait: bool = True, name: str | None = None,
                   defer: bool = False) -> int | None:
        """Take a capsule of everything that decides the next output; returns its epoch.

        wait=True: durable when this returns. wait=False: only stages the dirty pages (host copies)
        and returns; a background writer makes it durable (see flush). A write failure is raised
        by the next checkpoint / flush / close. A capsule is taken between LLM calls, so it waits
        for a running one, unless defer=True (with wait=False): then, when an LLM call is
        running on another thread, it returns None at once and that call takes the capsule as
        it ends (what a control loop wants: it never waits for a generate).
        """
        return self._gate.checkpoint(wait, name, defer)

    def write_lite_kit(self, path: str | os.PathLike | None = None) -> Path:
        """Write the restore kit that lets a process without torch continue this setup's
        capsules greedily (``capsule.lite.LiteResume``); default path ``<store>.kit``. Needs the
        onnxruntime LLM engine on CPU, or an all-int4 model decoding in its C step
        (runtime.linears 'int4'; LiteUnsupported otherwise). Valid for every capsule of this
        setup: write it once, again after a change of model, tokenizer or runtime."""
        from .lite.kit import kit_path
        from .llm.lite_kit import write_kit
        llm = self._llm()
        out = kit_path(self.path) if path is None else Path(path)
        return write_kit(out, llm.engine, llm.tokenizer, llm.info, self.checkpointer)

    def flush(self) -> None:
        """Block until every checkpoint(wait=False) so far is durable (a deferred one included)."""
        self._gate.flush()

    def rollback(self, epoch_or_name: int | str) -> int:
        """Restore an epoch in place (same buffers, no re-capture); returns the epoch.

        The whole epoch is read and checked first: when it cannot be restored (CapsuleCorrupt naming
        the epoch and the field, CapsuleMismatch, UnknownEpoch) nothing of the session changes."""
        return cast(int, self._gate.rollback(epoch_or_name))   # a named epoch is restored or raises

    def epochs(self) -> list[EpochInfo]:
        """Committed epochs, oldest first (id, name, created, bytes_written, n_pages, meta)."""
        return self._gate.epochs()

    # -- app state --------------------------------------------------------------------------
    @property
    def state(self) -> dict:
        """The app's own small state; JSON-serializable, saved in capsules with everything else."""
        return self._host.app_state

    @state.setter
    def state(self, value: Mapping[str, Any]) -> None:
        self._host.set_app_state(value)

    @property
    def replication(self) -> "ReplicationStatus | None":
        """Where the background replication stands (None: not replicating): the newest epoch the
        remote holds, epochs uploaded / skipped, bytes sent, the last error."""
        return None if self._replicator is None else self._replicator.status

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Wait until the remote holds the newest committed epoch (after checkpoint(wait=False),
        flush first); False on timeout or when replication stopped (replication.failed says why).
        ValueError when this Session does not replicate."""
        if self._replicator is None:
            raise ValueError("this Session does not replicate (Session.open(..., replicate='s3://...'))")
        return self._replicator.wait(timeout)

    @property
    def restored_epoch(self) -> int | None:
        """The epoch the last restore (at open, or a rollback) installed; None: none yet."""
        return self._host.restored_epoch

    @property
    def restore_report(self) -> list[str]:
        """Epochs the last restore skipped (damaged, unreadable, another setup's), each with
        why; after the restore at open, first what the store's recovery did (e.g. an index
        rebuilt)."""
        return self._host.restore_report

    # -- read-only views (tools, tests): change state through the methods above ---------------
    @property
    def tokenizer(self) -> ReferenceTokenizer | None:
        return self._llm_part.tokenizer if self._llm_part else None

    @property
    def model_info(self) -> ModelInfo | None:
        return self._llm_part.info if self._llm_part else None

    @property
    def engine(self) -> Engine:
        """The LLM engine: its runner (buckets, graphs), KV pool and streams."""
        return self._llm().engine

    @property
    def memory(self) -> Memory:
        """Persistent memory: the facts, their K/V records and the recall index."""
        return self._llm().memory.memory

    @property
    def actor(self) -> Actor:
        """The policy's actor: its runner (engine, spec, buffers) and action queue."""
        self._gate.check_open()
        if self._actor is None:
            raise ValueError("this Session has no policy; open it with policy=<.onnx path or "
                             "builtin:mlp | builtin:mlp-chunk | builtin:gru>")
        return self._actor

    @property
    def store(self) -> Store:
        return self._gate.store

    @property
    def checkpointer(self) -> Checkpointer:
        return self._gate.checkpointer

    @property
    def closed(self) -> bool:
        return self._gate.closed

    # -- internals --------------------------------------------------------------------------
    def _llm(self) -> LLMPart:
        self._gate.check_open()
        if self._llm_part is None:
            raise ValueError("this Session has no model (opened with model=None)")
        self._llm_part.check_not_in_callback()
        return self._llm_part


def _close_at_exit(ref: "weakref.ref[Session]", pid: int) -> None:
    session = ref()
    if session is None or session.closed or os.getpid() != pid:
        return   # a forked child's copy never writes into its parent's store
    try:
        session.close()
    except Exception as exc:  # noqa: BLE001 - at exit there is no caller left to raise to
        print(f"capsule: closing the Session of {session.path} at exit failed: {exc}", file=sys.stderr)
