"""HostPart: the host half of a Session's capsules (the app's state, the streams' ids and
text, the policy's queue cursor) and what the last restore did.

Not thread-safe: the gate calls capture and restore under both locks.
"""
from __future__ import annotations

from typing import Any, Mapping

from . import assembly
from .policy.actor import Actor
from .session_llm import LLMPart
from .state.checkpointer import Checkpointer, HostState


class HostPart:
    def __init__(self, checkpointer: Checkpointer, llm: LLMPart | None, actor: Actor | None):
        self._ckpt = checkpointer
        self._llm = llm
        self._actor = actor
        self.app_state: dict = {}
        self.restored_epoch: int | None = None
        # epochs the last restore skipped (damaged, unreadable, another setup's), each with why;
        # after the restore at open, first what the store's recovery did (e.g. an index rebuilt)
        self.restore_report: list[str] = []

    def set_app_state(self, value: Mapping[str, Any]) -> None:
        self.app_state = assembly.check_app_state(value)

    def capture(self) -> HostState:
        return assembly.host_state(self._llm.parts if self._llm else None, self.app_state, self._actor)

    def restore(self, epoch_or_name: int | str | None) -> int | None:
        """Install an epoch (None: the newest fully valid one); its epoch, or None if none is."""
        loader = assembly.host_loader(self._llm.parts if self._llm else None, self._put_app_state,
                                      self._actor)
        ckpt = self._ckpt
        restored = ckpt.restore_newest(loader) if epoch_or_name is None else ckpt.restore(epoch_or_name, loader)
        if restored is None:
            return None
        self.restored_epoch = restored.epoch
        self.restore_report = restored.skipped
        if self._llm is not None:
            self._llm.memory.drop_forgotten()   # facts forgotten since are not attended again
        return restored.epoch

    def _put_app_state(self, value: dict) -> None:
        # a restore's install step: the value was checked while the capsule was (it cannot fail)
        self.app_state = value
