"""Device profiles: frozen, validated dataclasses loaded from the YAML files beside this module.

A profile holds only what the SDK reads: the device, the runtime defaults, the engine order and
the checkpoint retention. Hardware facts for people (GPU, memory, storage) go in `description`.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from ._checks import (bad, check_bool, check_choice, check_int, check_int_list, check_num,
                      check_str, set_field, wrong_type)

PROFILE_DIR = Path(__file__).resolve().parent
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
CONTEXT_POLICIES = ("error", "shift")
# engine names: which ones exist, and where each runs, is capsule.policy.registry's to say
# (Session.open checks a profile's list against it); here only their spelling
_ENGINE_RE = re.compile(r"^[a-z][a-z0-9_-]*$")
# keys older profiles carried that nothing ever read: a profile naming one is refused, saying so
REMOVED = {
    "gpu": "hardware facts nothing read (describe the GPU in description)",
    "storage": "storage facts nothing read (the capsules bench measures the fsync it reports)",
    "checkpoint.mode": "Session.checkpoint(wait=...) picks durable-on-return or background per call",
    "checkpoint.every_steps": "the app (or ControlLoop) decides when to checkpoint",
    "checkpoint.group_commit_ms": "the background writer groups every epoch queued behind a "
                                  "running fsync into the next one",
}
# The KV block size (tokens per paged-KV block) of every profile that does not name its own:
# the one place to change it for all of them
BLOCK_SIZE = 16
# Names double as file stems and CLI arguments, so keep them path-safe.
DECODE_ATTENTION = ("torch", "triton", "cpu")   # the kernels capsule.llm.model runs
# runtime.decode_attention: a kernel, or "auto": "cpu" where it can run (a CPU fp32 model, an fp32
# or bf16 pool, the C kernel built), else "torch" (capsule.assembly resolves it)
DECODE_ATTENTION_SETTINGS = DECODE_ATTENTION + ("auto",)
# runtime.decode_step: "fused" (a decode step in one C call: capsule.llm.fused_step), "layers" (the
# Python loop over the layers), or "auto": "fused" where it can run, else "layers"
DECODE_STEP = ("fused", "layers")
DECODE_STEP_SETTINGS = DECODE_STEP + ("auto",)
LLM_ENGINES = ("torch", "onnxruntime", "tensorrt")   # runtime.llm_engines (capsule.assembly selects)
LINEARS = ("dequantized", "int4")   # runtime.linears (capsule.llm.loader: int4 keeps Q4_0/Q4_1 GGUF weights)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class RuntimeDefaults:
    """Serving defaults: the static paged KV pool, batch buckets for captured graphs, chunking."""
    dtype: str
    kv_pool_mb: float
    batch_buckets: tuple[int, ...]
    max_context: int
    prefill_chunk: int
    cuda_graphs: bool
    block_size: int = BLOCK_SIZE      # optional in a YAML: most profiles share the default
    kv_dtype: str | None = None       # the K/V cache's dtype; None: the weights' (dtype)
    context_policy: str = "error"     # a stream that would pass max_context: "error" or "shift"
    threads: int | None = None        # CPU threads (torch intra-op, ORT); None: the library's own
    # "auto", "torch", "triton" (edge_kernels.paged_decode; needs Triton) or "cpu" (paged_decode_cpu)
    decode_attention: str = "auto"
    # "auto", "fused" (one C call a decode step: an fp32 CPU model under decode_attention "cpu",
    # every layer dense or every layer int4) or "layers" (torch operators, layer by layer)
    decode_step: str = "auto"
    llm_engines: tuple[str, ...] = ("torch",)   # LLM step engines, first that runs here wins
    # "int4": a GGUF's Q4_0 / Q4_1 layers multiply by their 4-bit weights (CPU, torch engine;
    # bf16 matmuls: faster, not parity-exact); "dequantized": every weight in `dtype`
    linears: str = "dequantized"
    # host and GPU share one DRAM (Jetson): a full checkpoint (the first, or the one after a
    # failed write) then streams its KV blocks into the store before returning, even with
    # wait=False, instead of copying the whole pool to host bytes first (a second pool in DRAM)
    unified_memory: bool = False

    def __post_init__(self) -> None:
        check_choice("runtime.dtype", self.dtype, DTYPES)
        set_field(self, "kv_pool_mb", check_num("runtime.kv_pool_mb", self.kv_pool_mb, gt=0))
        bs = check_int("runtime.block_size", self.block_size)
        if not (1 <= bs <= 256 and bs & (bs - 1) == 0):
            raise bad("runtime.block_size", bs, "is not a power of two in 1..256")
        buckets = check_int_list("runtime.batch_buckets", self.batch_buckets)
        if not buckets:
            raise bad("runtime.batch_buckets", list(buckets), "is empty (need at least one bucket)")
        if buckets[0] < 1 or any(a >= b for a, b in zip(buckets, buckets[1:])):
            raise bad("runtime.batch_buckets", list(buckets),
                      "is not strictly increasing ints >= 1")
        set_field(self, "batch_buckets", buckets)
        check_int("runtime.max_context", self.max_context, lo=1)
        if self.max_context % bs:
            raise bad("runtime.max_context", self.max_context,
                      f"is not a multiple of runtime.block_size ({bs})")
        check_int("runtime.prefill_chunk", self.prefill_chunk, lo=1)
        check_bool("runtime.cuda_graphs", self.cuda_graphs)
        check_bool("runtime.unified_memory", self.unified_memory)
        if self.kv_dtype is not None:
            check_choice("runtime.kv_dtype", self.kv_dtype, DTYPES)
        check_choice("runtime.context_policy", self.context_policy, CONTEXT_POLICIES)
        check_choice("runtime.decode_attention", self.decode_attention, DECODE_ATTENTION_SETTINGS)
        check_choice("runtime.decode_step", self.decode_step, DECODE_STEP_SETTINGS)
        check_choice("runtime.linears", self.linears, LINEARS)
        if self.threads is not None:
            check_int("runtime.threads", self.threads, lo=1)
        if not isinstance(self.llm_engines, (list, tuple)) or not self.llm_engines:
            raise bad("runtime.llm_engines", self.llm_engines,
                      f"is not a non-empty list of {', '.join(LLM_ENGINES)}")
        engines = tuple(check_choice(f"runtime.llm_engines[{i}]", e, LLM_ENGINES)
                        for i, e in enumerate(self.llm_engines))
        if len(set(engines)) != len(engines):
            raise bad("runtime.llm_engines", list(engines), "lists an engine more than once")
        set_field(self, "llm_engines", engines)

    @property
    def kv_cache_dtype(self) -> str:
        """The K/V cache's dtype name: kv_dtype, or the weights' dtype when it is not set."""
        return self.kv_dtype or self.dtype

    @property
    def kv_pool_bytes(self) -> int:
        """Size of the one static KV tensor in bytes."""
        return int(self.kv_pool_mb * 2**20)


@dataclass(frozen=True)
class CheckpointDefaults:
    """Checkpointer defaults: the epochs the store retains (Session.open's keep_epochs)."""
    keep_epochs: int

    def __post_init__(self) -> None:
        check_int("checkpoint.keep_epochs", self.keep_epochs, lo=1)


_SECTIONS: dict[str, type] = {"runtime": RuntimeDefaults, "checkpoint": CheckpointDefaults}


def _check_keys(prefix: str, raw: Any, cls: type) -> None:
    """Reject non-mappings, unknown keys and missing keys (those without a default), naming the
    dotted key."""
    where = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, Mapping):
        raise wrong_type(where, raw, "mapping")
    allowed = [f.name for f in dataclasses.fields(cls)]
    for k in raw:
        if f"{prefix}{k}" in REMOVED:
            raise ValueError(f"{prefix}{k}: removed from device profiles, delete it "
                             f"({REMOVED[prefix + k]})")
        if k not in allowed:
            raise ValueError(f"{prefix}{k}: unknown key (allowed: {', '.join(allowed)})")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for k in required:
        if k not in raw:
            raise ValueError(f"{prefix}{k}: missing key (required: {', '.join(required)})")


@dataclass(frozen=True)
class DeviceProfile:
    """One device class: the runtime and checkpoint defaults tuned for it."""
    name: str
    description: str
    device: str
    runtime: RuntimeDefaults
    engines: tuple[str, ...]  # in preference order
    checkpoint: CheckpointDefaults

    def __post_init__(self) -> None:
        if not _NAME_RE.match(check_str("name", self.name)):
            raise bad("name", self.name, "is not a path-safe name ([A-Za-z0-9][A-Za-z0-9._-]*)")
        check_str("description", self.description)
        check_choice("device", self.device, DEVICES)
        for key, cls in _SECTIONS.items():
            value = getattr(self, key)
            if not isinstance(value, cls):
                raise wrong_type(key, value, cls.__name__)
        if not isinstance(self.engines, (list, tuple)):
            raise wrong_type("engines", self.engines, "list of str")
        engines = tuple(check_str(f"engines[{i}]", e) for i, e in enumerate(self.engines))
        for i, e in enumerate(engines):
            if not _ENGINE_RE.match(e):
                raise bad(f"engines[{i}]", e, "is not an engine name (lower case, e.g. 'onnxruntime')")
        if not engines:
            raise bad("engines", [], "is empty (name at least one engine, e.g. [onnxruntime, torch])")
        dup = next((e for i, e in enumerate(engines) if e in engines[:i]), None)
        if dup is not None:
            raise bad("engines", list(engines), f"lists {dup!r} more than once")
        set_field(self, "engines", engines)
        self._check_consistency()

    def _check_consistency(self) -> None:
        cpu = self.device == "cpu"
        if cpu and self.runtime.cuda_graphs:
            raise bad("runtime.cuda_graphs", True, "must be false when device is 'cpu'")

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> DeviceProfile:
        """Build and validate a profile from a parsed-YAML dict; errors name `source`."""
        try:
            _check_keys("", d, cls)
            parts: dict[str, Any] = {}
            for key, sub in _SECTIONS.items():
                _check_keys(key + ".", d[key], sub)
                parts[key] = sub(**d[key])
            return cls(name=d["name"], description=d["description"], device=d["device"],
                       engines=d["engines"], **parts)
        except ValueError as e:
            raise ValueError(f"{e} (file {source})") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, not tuples) that `from_dict` accepts and `yaml.safe_dump` writes."""
        d = dataclasses.asdict(self)
        d["engines"] = list(self.engines)
        d["runtime"]["batch_buckets"] = list(self.runtime.batch_buckets)
        d["runtime"]["llm_engines"] = list(self.runtime.llm_engines)
        return d

    def replace_runtime(self, **kw: Any) -> DeviceProfile:
        """A copy with some runtime fields overridden, validated like a loaded profile."""
        allowed = [f.name for f in dataclasses.fields(RuntimeDefaults)]
        for k in kw:
            if k not in allowed:
                raise ValueError(f"runtime.{k}: unknown key (allowed: {', '.join(allowed)})")
        return dataclasses.replace(self, runtime=dataclasses.replace(self.runtime, **kw))


def list_profiles() -> list[str]:
    """Names of the profiles shipped in this package, sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def _looks_like_path(s: str) -> bool:
    return "/" in s or os.sep in s or s.endswith((".yaml", ".yml"))


def load_profile(name_or_path: str | os.PathLike[str]) -> DeviceProfile:
    """Load a shipped profile by bare name (e.g. 'x86-cpu'), or any profile YAML by path."""
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(str(name_or_path)):
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"device profile file not found: {str(path)!r}")
    elif isinstance(name_or_path, str):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not name_or_path or not path.is_file():
            raise ValueError(f"unknown device profile {name_or_path!r} "
                             f"(available: {', '.join(list_profiles())})")
    else:
        raise wrong_type("profile", name_or_path, "profile name or path")
    try:
        # libyaml's safe loader when present: same documents, ~10x faster on the open path
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as e:
        raise ValueError(f"invalid YAML in device profile (file {path}): {e}") from None
    profile = DeviceProfile.from_dict(raw, source=str(path))
    # The stem is the lookup key; a mismatch would load a different profile than the one named.
    if profile.name != path.stem:
        raise ValueError(f"name: {profile.name!r} does not equal the file stem {path.stem!r} "
                         f"(file {path})")
    return profile
