"""Session.open's restore when runtime.decode_attention or runtime.decode_step is "auto": a capsule
continues under the decode path (attention kernel, one-call step or layer loop) it was taken with.

"auto" resolves to the C attention on a CPU fp32 model, and to the one-call C step where it can
run; the binding names what was resolved (another summation order: a capsule continues
bit-exactly only under its own). A capsule taken under the layer loop or torch's attention (by an
SDK from before the setting, by a session that asked for them, or on a machine where the kernels
were not built) would then be refused by a default Session. So when the restore finds no epoch
of this setup, it is tried again under each slower path an "auto" setting could have stood for,
in order: the layer loop under the same attention, then torch's attention. The first that
restores is kept: the binding's fingerprint decides (it matches only the path the capsule was
taken with), never a label. The Session then goes on under that path, and its new capsules name
it, until a Session opened with explicit settings, or with restore=False, starts over.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from .assembly import Assembled, LLMParts
from .session_binding import binding_of
from .errors import CapsuleMismatch

log = logging.getLogger("capsule")
T = TypeVar("T")


def restore_under_capsule_decode_path(a: Assembled, restore: Callable[[], T]) -> T:
    """restore() (Session's restore_newest); see the module docstring. A refused try changes
    nothing (the checkpointer installs only what fully verifies); when every path is refused, the
    Session is left as it was and the first CapsuleMismatch is raised."""
    try:
        return restore()
    except CapsuleMismatch as exc:
        llm = a.llm
        if llm is None or not _others(a, llm):
            raise
        first = exc
    model = llm.engine.runner.model
    chosen = (model.decode_attention, model.decode_step)
    for path in _others(a, llm):
        _use(a, llm, *path)
        try:
            restored = restore()
        except CapsuleMismatch:
            continue
        log.info("capsule store %s: the capsule was taken under decode attention %r and decode step %r; this "
                 "session continues under them ('auto' would pick %r and %r)", a.path, *path, *chosen)
        return restored
    _use(a, llm, *chosen)
    raise first from None


def _others(a: Assembled, llm: LLMParts) -> list[tuple[str, str]]:
    """(attention, step) paths an "auto" setting could have stood for, slower than the chosen."""
    rt, model = a.profile.runtime, llm.engine.runner.model
    paths = []
    if rt.decode_step == "auto" and model.decode_step == "fused":
        paths.append((model.decode_attention, "layers"))
    if rt.decode_attention == "auto" and model.decode_attention != "torch":
        paths.append(("torch", "layers"))
    return paths


def _use(a: Assembled, llm: LLMParts, attention: str, step: str) -> None:
    """A decode path for the model, and the binding capsules are checked and taken with."""
    model = llm.engine.runner.model
    model.set_decode_attention(attention)
    model.set_decode_step(step)
    a.checkpointer.binding = binding_of(llm, a.profile, a.registry, a.actor)
