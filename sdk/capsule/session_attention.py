"""Session.open's restore when runtime.decode_attention is "auto": a capsule continues under the
decode attention it was taken with.

"auto" resolves to the C kernel on a CPU fp32 model, and the binding names the resolved attention
(another summation order: a capsule continues bit-exactly only under its own). A capsule taken
under torch's attention (by an SDK from before the kernel, by a session that asked for "torch",
or on a machine where the kernel was not built) would then be refused by a default Session. So
when the restore finds no epoch of this setup, the setting is "auto" and it picked the kernel,
it is tried again under torch's attention, kept if it restores: the binding's fingerprint
decides (it matches only the attention the capsule was taken with), never a label.
The Session then goes on under that attention, and its new capsules name it, until a Session
opened with an explicit setting, or with restore=False, starts over.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from .assembly import Assembled, LLMParts
from .session_binding import binding_of
from .errors import CapsuleMismatch

log = logging.getLogger("capsule")
T = TypeVar("T")


def restore_under_capsule_attention(a: Assembled, restore: Callable[[], T]) -> T:
    """restore() (Session's restore_newest); see the module docstring. "auto" picks the C kernel
    wherever it can run, so the one other attention to try is torch's, and only when "auto"
    picked the kernel. A refused try changes nothing (the checkpointer installs only what fully
    verifies); when it is refused too, the Session is left as it was and the first
    CapsuleMismatch is raised."""
    try:
        return restore()
    except CapsuleMismatch as exc:
        llm = a.llm
        if llm is None or a.profile.runtime.decode_attention != "auto" \
                or llm.engine.runner.model.decode_attention == "torch":
            raise
        first = exc
    chosen = llm.engine.runner.model.decode_attention
    _use(a, llm, "torch")
    try:
        restored = restore()
    except CapsuleMismatch:
        _use(a, llm, chosen)
        raise first from None
    log.info("capsule store %s: the capsule was taken under decode attention %r; this session "
             "continues under it (runtime.decode_attention='auto' would pick %r)", a.path, "torch", chosen)
    return restored


def _use(a: Assembled, llm: LLMParts, kind: str) -> None:
    """Decode attention `kind` for the model, and the binding capsules are checked and taken with."""
    llm.engine.runner.model.set_decode_attention(kind)
    a.checkpointer.binding = binding_of(llm, a.profile, a.registry, a.actor)
