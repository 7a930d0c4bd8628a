"""Session.open's restore when runtime.decode_attention is "auto": a capsule continues under the
decode attention it was taken with.

"auto" resolves to the C kernel on a CPU fp32 model, and the binding names the resolved attention
(another summation order: a capsule continues bit-exactly only under its own). A capsule taken
under torch's attention (by an SDK from before the kernel, by a session that asked for "torch",
or on a machine where the kernel was not built) would then be refused by a default Session. So
when the restore finds no epoch of this setup and the setting is "auto", it is tried again under
each other attention that can run here, and the first that restores is kept: the binding's
fingerprint decides (it matches only the attention the capsule was taken with), never a label.
The Session then goes on under that attention, and its new capsules name it, until a Session
opened with an explicit setting, or with restore=False, starts over.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from edge_kernels.paged_decode_cpu import unsupported as decode_cpu_unsupported

from .assembly import Assembled, LLMParts, binding_of
from .errors import CapsuleMismatch

log = logging.getLogger("capsule")
T = TypeVar("T")
CANDIDATES = ("torch", "cpu")   # what "auto" may resolve to


def restore_under_capsule_attention(a: Assembled, restore: Callable[[], T]) -> T:
    """restore() (Session's restore_newest); see the module docstring. A refused try changes
    nothing (the checkpointer installs only what fully verifies), and when no attention
    restores, the Session is left as it was and the first CapsuleMismatch is raised."""
    try:
        return restore()
    except CapsuleMismatch as exc:
        if a.llm is None or a.profile.runtime.decode_attention != "auto":
            raise
        first = exc
    llm = a.llm
    model, pool = llm.engine.runner.model, llm.engine.pool
    chosen = model.decode_attention
    for kind in CANDIDATES:
        if kind == chosen or (kind == "cpu" and decode_cpu_unsupported(
                pool.tensor, model.cfg.head_dim, model.cfg.num_heads, model.dtype)):
            continue
        _use(a, llm, kind)
        try:
            restored = restore()
        except CapsuleMismatch:
            continue
        log.info("capsule store %s: the capsule was taken under decode attention %r; this session "
                 "continues under it (runtime.decode_attention='auto' would pick %r)",
                 a.path, kind, chosen)
        return restored
    _use(a, llm, chosen)
    raise first


def _use(a: Assembled, llm: LLMParts, kind: str) -> None:
    """Decode attention `kind` for the model, and the binding capsules are checked and taken with."""
    llm.engine.runner.model.set_decode_attention(kind)
    a.checkpointer.binding = binding_of(llm, a.profile, a.registry, a.actor)
