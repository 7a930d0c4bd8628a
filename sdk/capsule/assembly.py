"""Assembly: build a session's parts (model, pool, runner, engine, memory, actor, store,
checkpointer) from Session.open's arguments, and the host half of its capsules.

Kept apart from session.py so the Session class reads as its public API only.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

import devices

from edge_kernels.paged_decode_cpu import unsupported as decode_cpu_unsupported

from .errors import EngineUnavailable, ModelLoadError, StoreError, TokenizerError, VocabMismatch
from .llm import GraphRunner, KVPool, ModelInfo, load_model
from .llm.engine import Engine
from .llm.model import Decoder
from .llm.engines import EngineOptions, select_llm_engine
from .llm.streams import export_streams, import_streams
from .memory.config import MemoryConfig
from .memory.facts import Memory
from .policy import load_policy
from .policy.registry import check_profile_engines
from .policy.actor import Actor
from .state.binding import Binding
from .state.checkpointer import Checkpointer
from .state.manifest import HOST_FORMAT, Limits
from .state.regions import RegionRegistry
from .state.snapshot import Snapshotter
from .store import Store
from .store.folder import OWNED
from .session_binding import binding_of
from .tokenize import ReferenceTokenizer, load_reference

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_BUILTIN_TOKENIZER = "cl100k_base"


@dataclass
class LLMParts:
    engine: Engine
    tokenizer: ReferenceTokenizer
    info: ModelInfo


@dataclass
class Assembled:
    """Everything a Session composes; the caller owns `store` (close it if the Session is not made)."""
    path: Path
    profile: devices.DeviceProfile
    registry: RegionRegistry
    store: Store
    checkpointer: Checkpointer
    llm: LLMParts | None
    memory: Memory | None
    actor: Actor | None


def assemble(path: str | os.PathLike, *, model: str | os.PathLike | None, tokenizer: "str | os.PathLike | ReferenceTokenizer | None",
             policy: str | os.PathLike | None, device: str, runtime: Mapping[str, Any] | None,
             keep_epochs: int | None, sign_key: bytes | None,
             memory: MemoryConfig | Mapping[str, Any] | None) -> Assembled:
    """Session.open's arguments checked and its parts built (see Session.open). The model and the
    tokenizer load before anything is created on disk."""
    store_path = store_folder(path)
    profile = devices.detect_profile(device)
    check_profile_engines(profile.engines, profile.device, profile.name)
    if runtime:
        profile = profile.replace_runtime(**dict(runtime))
    set_threads(profile.runtime.threads)
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
    llm = build_llm(model, tokenizer, profile, registry) if model is not None else None
    actor = build_actor(policy, profile, registry) if policy is not None else None
    if llm is None and tokenizer is not None:
        load_reference(tokenizer)  # fail early on a bad name even without a model
    binding = binding_of(llm, profile, registry, actor)
    store = open_store(store_path, sign_key)
    try:
        mem = None if llm is None else Memory(store, llm.engine.runner.model, llm.tokenizer,
                                              mem_config, binding.model)
        checkpointer = build_checkpointer(store, llm, binding, registry, keep,
                                          unified_memory=profile.runtime.unified_memory)
    except BaseException:
        store.close()
        raise
    return Assembled(store_path, profile, registry, store, checkpointer, llm, mem, actor)


def set_threads(threads: int | None) -> None:
    """runtime.threads: torch's intra-op threads for the LLM (None: leave torch's own count).

    Process-wide: torch has one intra-op pool per process, so this also changes every other
    Session and any torch code of the app in this process, and it stays after close. Policies
    on onnxruntime get the same count per InferenceSession (load_policy's threads).
    The count changes float reduction order (builtin:small's decode logits differ bitwise
    between 1 and 2 threads, its prefill logits too at 3), so on a cpu profile it is part of the binding's layout: a capsule taken
    at 2 threads is refused by a session at 1 (CapsuleMismatch naming threads).
    """
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def store_folder(path: str | os.PathLike) -> Path:
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


def build_llm(model: str | os.PathLike, tokenizer: "str | os.PathLike | ReferenceTokenizer | None",
              profile: devices.DeviceProfile, registry: RegionRegistry) -> LLMParts:
    rt = profile.runtime
    source = str(model)
    dev = torch.device("cuda" if profile.device == "cuda" else "cpu")
    dtype = DTYPES[rt.dtype]
    if rt.linears != "dequantized" and rt.llm_engines[0] != "torch":
        raise ModelLoadError(f"runtime.linears={rt.linears!r} runs on the torch engine; list 'torch' first in "
                             f"runtime.llm_engines (got {list(rt.llm_engines)}) or use runtime.linears='dequantized'")
    # no background encoder build during open: it would hold the GIL while the capsule restores.
    # The encoder is built on the first append, or prefetched after the first generate
    if source.startswith("builtin:"):   # random weights sized to the tokenizer's vocabulary
        tok = load_reference(tokenizer or DEFAULT_BUILTIN_TOKENIZER, prefetch=False)
        decoder, info = load_model(source, device=dev, dtype=dtype, vocab_size=tok.vocab_size,
                                   linears=rt.linears)
    else:   # a model carries its tokenizer: a folder's tokenizer.json, a GGUF's metadata
        decoder, info = load_model(source, device=dev, dtype=dtype, own_tokenizer=tokenizer is None,
                                   linears=rt.linears)
        tokenizer = tokenizer or info.tokenizer_path
        if tokenizer is None:
            raise TokenizerError(f"{source} carries no tokenizer (no tokenizer.json, or a GGUF without "
                                 "tokenizer metadata); pass tokenizer= (a family name like 'qwen2.5' "
                                 "or a tokenizer.json / .tiktoken path)")
        tok = load_reference(tokenizer, prefetch=False)
    if decoder.cfg.vocab_size <= tok.max_id:
        raise VocabMismatch(f"model {source} has {decoder.cfg.vocab_size} embeddings but tokenizer "
                            f"{tok.name} emits ids up to {tok.max_id}; use the model's own tokenizer")
    pool = KVPool(decoder.cfg, pool_bytes=rt.kv_pool_bytes, block_size=rt.block_size,
                  dtype=DTYPES[rt.kv_cache_dtype], device=dev)   # runtime.kv_dtype, else the weights'
    decoder.set_decode_attention(decode_attention(rt.decode_attention, decoder, pool))  # before graphs
    engine = select_llm_engine(decoder, rt.llm_engines, EngineOptions(rt.threads, info.weights_digest))
    decoder.set_decode_step(decode_step(rt.decode_step, decoder, engine is None))
    runner = GraphRunner(decoder, pool, registry, buckets=rt.batch_buckets, max_context=rt.max_context,
                         prefill_chunk=rt.prefill_chunk,
                         use_cuda_graphs=rt.cuda_graphs and dev.type == "cuda", step=engine)
    return LLMParts(Engine(runner, pool, tok, context_policy=rt.context_policy), tok, info)


def decode_attention(setting: str, decoder: Decoder, pool: KVPool) -> str:
    """runtime.decode_attention resolved: "auto" is "cpu" where the C kernel can read this pool
    for this model, else "torch"; an explicit "cpu" that cannot run is an EngineUnavailable."""
    return _resolve("decode_attention", setting, "cpu", "torch", lambda: decode_cpu_unsupported(
        pool.tensor, decoder.cfg.head_dim, decoder.cfg.num_heads, decoder.dtype))


def decode_step(setting: str, decoder: Decoder, torch_engine: bool) -> str:
    """runtime.decode_step resolved: "auto" is "fused" where the one-call C step can run (the
    torch engine, decode attention "cpu", layers it takes), else "layers"; an explicit "fused"
    that cannot run is an EngineUnavailable."""
    return _resolve("decode_step", setting, "fused", "layers", lambda: (
        decoder.fused_step_unsupported()
        or (None if decoder.decode_attention == "cpu" else
            f"it runs under decode_attention 'cpu', this model's is {decoder.decode_attention!r}")
        or (None if torch_engine else "it runs on the torch LLM engine (runtime.llm_engines)")))


def _resolve(name: str, setting: str, fast: str, slow: str, why: Callable[[], str | None]) -> str:
    """runtime.<name> resolved: "auto" is `fast` where it can run (why() is None), else `slow`;
    an explicit `fast` that cannot run is an EngineUnavailable saying why; any other setting as
    is (why() is asked only for "auto" and `fast`)."""
    if setting not in ("auto", fast):
        return setting
    reason = why()
    if setting == "auto":
        return slow if reason else fast
    if reason:
        raise EngineUnavailable(f"runtime.{name}={fast!r} cannot run: {reason}; use {name}={slow!r} (or 'auto')")
    return setting


def build_actor(policy: str | os.PathLike, profile: devices.DeviceProfile,
                registry: RegionRegistry) -> Actor:
    """The policy on the profile's device through its engine preference (static buffers)."""
    dev = torch.device("cuda" if profile.device == "cuda" else "cpu")
    return Actor(load_policy(policy, device=dev, engines=profile.engines, registry=registry,
                             threads=profile.runtime.threads), registry)


def build_checkpointer(store: Store, llm: LLMParts | None, binding: Binding,
                       registry: RegionRegistry, keep_epochs: int,
                       unified_memory: bool = False) -> Checkpointer:
    pool = llm.engine.pool if llm else None

    def kv_state() -> tuple[set[int], set[int]]:
        if pool is None:
            return set(), set()
        dirty, pool.dirty = pool.dirty, set()
        live = {b for s in llm.engine.streams.values() for b in s.table.blocks}
        return dirty, live
    # what this session could ever hold: a manifest claiming more is refused before allocating
    limits = Limits(max_context=llm.engine.runner.max_context if llm else 0,
                    max_blocks=llm.engine.runner.max_blocks if llm else 0)
    return Checkpointer(store, Snapshotter(registry), binding, kv_state, keep_epochs=keep_epochs,
                        limits=limits, stream_full=unified_memory)


def check_app_state(value: object) -> dict:
    """The app's state must come back from a capsule exactly as it was saved."""
    try:
        exact = isinstance(value, dict) and json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Session.state must be JSON-serializable: {exc}") from None
    except RecursionError:
        raise ValueError("Session.state is nested too deeply to save; flatten it") from None
    if not exact:
        raise ValueError("Session.state must be a dict that survives JSON unchanged (str keys; lists, "
                         "not tuples), so a restore gives back exactly what was saved")
    return dict(value)


def host_state(llm: LLMParts | None, app_state: dict,
               actor: Actor | None = None) -> tuple[dict, dict[str, bytes]]:
    check_app_state(app_state)  # s.state is a plain dict the app may have mutated since it was set
    meta, blobs = export_streams(llm.engine) if llm else ([], {})
    host = {"format": HOST_FORMAT, "streams": meta, "app_state": app_state}
    if actor is not None:
        host["policy"] = actor.state()
    return host, blobs


def host_loader(llm: LLMParts | None, put_app_state: Callable[[dict], None],
                actor: Actor | None = None) -> Callable[[dict, dict[str, bytes]], Callable[[], None]]:
    """The checkpointer's HostLoader for this session: validate and build everything first; the
    install it returns only assigns (put_app_state stores a state already checked)."""
    def load(host: dict, blobs: dict[str, bytes]) -> Callable[[], None]:
        try:
            app = check_app_state(host.get("app_state"))
        except ValueError as exc:
            raise ValueError(f"app_state: {exc}") from None
        install_streams = import_streams(llm.engine, host["streams"], blobs) if llm else (lambda: None)
        install_policy = actor.load_state(host.get("policy")) if actor else (lambda: None)

        def install() -> None:
            install_policy()
            install_streams()
            put_app_state(app)
        return install
    return load


def open_store(path: Path, sign_key: bytes | None) -> Store:
    try:
        return Store.open(path, create=True, sign_key=sign_key)
    except OSError as exc:
        raise StoreError(f"cannot open store {str(path)!r}: {exc.strerror or exc}") from None
