"""LLMPart: a Session's language model: the engine (graph runner, paged KV pool, streams), its
tokenizer, its persistent memory and its chat template.

Not thread-safe: the Session calls it inside its gate's LLM section.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable, TypeVar

from .assembly import LLMParts
from .llm import ModelInfo, SamplingParams
from .llm.chat_template import ChatState, ChatTemplate, next_turn, template_variables
from .llm.choices import check_choices
from .llm.engine import Engine
from .llm.replies import OnToken
from .llm.streams import check_stream_name
from .memory.facts import Memory
from .session_memory import MemoryPart
from .tokenize import ReferenceTokenizer

T = TypeVar("T")


class LLMPart:
    def __init__(self, parts: LLMParts, memory: Memory):
        self.parts = parts
        self.engine: Engine = parts.engine
        self.tokenizer: ReferenceTokenizer = parts.tokenizer
        self.info: ModelInfo = parts.info
        self.memory = MemoryPart(memory, self.engine, self.tokenizer)
        self._template: ChatTemplate | None = None
        self._callback_thread: int | None = None   # the thread running an on_token callback

    def append(self, stream: str, text: str, system: bool) -> None:
        self.engine.append(stream, text, system=system)
        s = self.engine.streams.get(stream)
        if s is not None and s.chat is not None:   # text outside the chat's messages
            s.chat = replace(s.chat, exact=False)

    def chat(self, stream: str, role: str, text: str) -> None:
        """Append one turn formatted by the model's chat template (chat_template.next_turn)."""
        check_stream_name(stream)
        template = self.chat_template()
        s = self.engine.streams.get(stream)
        pending = s.tail.decode("utf-8", errors="replace") if s is not None else ""
        start = s.n_chars + len(pending) if s is not None else 0
        state = s.chat if s is not None and s.chat is not None else ChatState(start)

        def held(n: int | None) -> str:   # the chat's last n characters (None: all) the append sees
            avail = s.n_chars + len(pending) - state.start if s is not None else 0
            chars = avail if n is None else min(n, avail)
            if s is None or chars <= 0:
                return ""
            return (s.text_tail(min(chars, s.n_chars)) + pending)[-chars:]
        delta, after = next_turn(template, state, role, text, held, pending,
                                 self.tokenizer.normalization == "NFC")
        self.engine.append(stream, delta, system=role == "system")
        self.engine.stream(stream).chat = after

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            source = self.info.chat_template
            eos = [self.tokenizer.decode([i]) for i in self.tokenizer.eos_ids]
            # the named tokens sit beside the tokenizer: a folder's, or the one built from a GGUF
            where = (str(Path(self.info.tokenizer_path).parent) if self.info.tokenizer_path
                     else self.info.source)
            self._template = ChatTemplate(source, self.info.source,
                                          template_variables(where, source or "", eos))
        return self._template

    def generate(self, names: list[str], max_new_tokens: int, params: SamplingParams,
                 seed: int | None, stops: list[str], memory_k: int,
                 on_token: OnToken | None = None, choices: list[str] | None = None) -> dict[str, str]:
        """Every stream's reply; more streams than the largest batch bucket decode in groups.
        A chat stream's reply joins its conversation (its open assistant message)."""
        streams = [self.engine.stream(n) for n in names]   # unknown streams fail before any memory work
        if memory_k:
            self.memory.inject(names, memory_k, max_new_tokens)
        before = {s.name: s.n_chars for s in streams}
        callback = None if on_token is None else self._tracked(on_token)
        bucket_max = self.engine.runner.buckets[-1]
        replies: dict[str, str] = {}
        try:
            for i in range(0, len(names), bucket_max):
                replies.update(self.engine.generate(names[i:i + bucket_max], max_new_tokens, params,
                                                    seed, stops, callback, choices))
        finally:
            for s in streams:
                if s.chat is None or (s.name not in replies and s.n_chars == before[s.name]):
                    continue
                # a failed call: the text it generated, as the stream holds it
                reply = replies[s.name] if s.name in replies else s.text_tail(s.n_chars - before[s.name])
                s.chat = s.chat.replied(reply)
        return replies

    def check_not_in_callback(self) -> None:
        """Raise if called from an on_token callback (it runs inside generate, under the lock)."""
        if self._callback_thread == threading.get_ident():
            raise ValueError("an on_token callback must not call back into the Session (it runs "
                             "inside generate, which holds the Session's lock); collect the pieces "
                             "and act on them after generate returns")

    def _tracked(self, on_token: OnToken) -> OnToken:
        def call(name: str, piece: str) -> None:
            self._callback_thread = threading.get_ident()
            try:
                on_token(name, piece)
            finally:
                self._callback_thread = None
        return call

    def tokens(self, stream: str) -> list[int]:
        return list(self.engine.stream(stream).ids)

    def text(self, stream: str) -> str:
        return self.engine.stream(stream).text

    def streams(self) -> list[str]:
        return list(self.engine.streams)

    def drop(self, stream: str) -> None:
        self.engine.drop(stream)


def guarded(llm: LLMPart | None, *fns: Callable[..., T]) -> list[Callable[..., T]]:
    """The functions, refused from an on_token callback (a capsule's capture and restore)."""
    def guard(fn: Callable[..., T]) -> Callable[..., T]:
        def call(*args: object) -> T:
            if llm is not None:
                llm.check_not_in_callback()
            return fn(*args)
        return call
    return [guard(f) for f in fns]


def generate_args(max_new_tokens: object, stream: object, temperature: float, top_p: float,
                  seed: object, stop: object, memory_k: object, on_token: object = None,
                  choices: object = None) -> tuple[list[str], SamplingParams, list[str], list[str] | None]:
    """Session.generate's arguments checked (ValueError saying what to fix): the stream names,
    the sampling parameters, the stop strings and the choices."""
    if isinstance(memory_k, bool) or not isinstance(memory_k, int) or memory_k < 0:
        raise ValueError(f"memory_k must be an int >= 0, got {memory_k!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"seed must be an int in 0..2**63-1 or None, got {seed!r}")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token must be a callable (stream, piece) -> None or None, got {on_token!r}")
    params = SamplingParams(float(temperature), float(top_p))
    if not isinstance(stream, (str, list, tuple)):
        raise ValueError(f"stream must be a name or a list of names, got {type(stream).__name__}")
    names = [stream] if isinstance(stream, str) else list(stream)
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"stream must be a name or a list of distinct names, got {stream!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or ())   # type: ignore[arg-type]
    if any(not isinstance(x, str) or not x for x in stops):
        raise ValueError(f"stop must be a non-empty str or a list of them, got {stop!r}")
    if choices is None:
        return names, params, stops, None
    if len(names) != 1 or stops:
        raise ValueError("choices constrain one stream's reply and end it themselves: give one "
                         f"stream and no stop (got streams {names}, stop {stops})")
    return names, params, stops, check_choices(choices)
