"""Chat templates: a model's jinja2 chat template rendered as transformers' apply_chat_template
renders it, and the text each chat turn (Session.chat) adds to a stream.

A template is untrusted input (it comes with the model's files): it runs in jinja2's immutable
sandbox only (transformers' environment: trim_blocks, lstrip_blocks, loopcontrols, its tojson,
raise_exception, strftime_now, dict and namespace), its source and its output are bounded, and
any failure is a ChatTemplateError naming the model. As in transformers, CPU time is not bounded
beyond jinja2's own limits (a range is at most 100,000 long).
"""
from __future__ import annotations

import functools
import json
import re
import unicodedata
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import ChatTemplateError

ROLES = ("system", "user", "assistant")
MAX_TEMPLATE_CHARS = 1 << 20       # real templates are a few KB
MAX_RENDER_CHARS = 8 << 20         # one rendering's output
KEEP_MESSAGES = 8                  # kept besides the first (templates read messages[0], loop.first)
MAX_MESSAGE_CHARS = 2048           # of a kept message's content: the state goes into every capsule
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
Message = tuple[str, str]          # (role, content)


class ChatTemplate:
    """One model's template and the variables transformers passes it besides the messages."""

    def __init__(self, source: object, model: str, variables: Mapping[str, str]):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"model {model} has no chat template; format the conversation "
                                    "yourself and add it with Session.append()")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"the chat template of {model} is {len(source)} characters, more "
                                    f"than {MAX_TEMPLATE_CHARS}; use Session.append() instead")
        self.source, self.model, self.variables = source, model, dict(variables)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        chat = [{"role": r, "content": c} for r, c in messages]
        try:
            parts, n = [], 0
            for part in _compile(self.source).generate(
                    messages=chat, tools=None, documents=None,
                    add_generation_prompt=add_generation_prompt, **self.variables):
                n += len(part)
                if n > MAX_RENDER_CHARS:
                    raise ChatTemplateError(f"the chat template of {self.model} renders more than "
                                            f"{MAX_RENDER_CHARS} characters")
                parts.append(part)
        except ChatTemplateError:
            raise
        except Exception as exc:   # noqa: BLE001 - untrusted code: any failure is the template's
            raise ChatTemplateError(f"the chat template of {self.model} failed on {len(chat)} "
                                    f"messages: {type(exc).__name__}: {exc}") from None
        return "".join(parts)


def template_variables(source: str, template: str, eos_texts: Sequence[str]) -> dict[str, str]:
    """The named special tokens transformers passes a template (bos_token, eos_token, ...): a
    checkpoint folder's tokenizer_config.json / special_tokens_map.json; else eos_token only,
    the model's end-of-generation token that the template uses (the first one otherwise)."""
    found: dict[str, str] = {}
    folder = Path(source)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        raw = _small_json(folder / name) if folder.is_dir() else None
        for key in SPECIAL_NAMES:
            v = raw.get(key) if isinstance(raw, dict) else None
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str) and len(v) <= 1024:
                found.setdefault(key, v)
    if "eos_token" not in found and eos_texts:
        found["eos_token"] = next((t for t in eos_texts if t and t in template), eos_texts[0])
    return found


def _small_json(path: Path) -> object:
    try:
        if path.stat().st_size > 4 * MAX_TEMPLATE_CHARS:
            return None
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None   # an unreadable config only means no named tokens from it


@dataclass(frozen=True)
class ChatState:
    """A stream's conversation as its template sees it: the first message and the last few,
    bounded (execution state: saved in capsules). start: where the chat begins in the stream's
    text. open: the stream ends inside the assistant's turn (its generation prompt appended; the
    reply generated so far is the last message). exact: the messages render the chat's text as
    the stream holds it (none dropped or cut, no text but theirs)."""

    start: int
    messages: tuple[Message, ...] = ()
    open: bool = False
    exact: bool = True

    def with_messages(self, messages: Sequence[Message], open_: bool, exact: bool) -> "ChatState":
        kept = [(r, c[-MAX_MESSAGE_CHARS:]) for r, c in messages]
        exact = exact and all(len(c) <= MAX_MESSAGE_CHARS for _, c in messages)
        while len(kept) > 1 + KEEP_MESSAGES:
            del kept[1:3]   # in pairs: templates that check turn order count positions
            exact = False
        return ChatState(self.start, tuple(kept), open_, exact)

    def replied(self, reply: str) -> "ChatState":
        """After a generate: the reply joins the open assistant message (or starts it)."""
        msgs = list(self.messages)
        if not self.open:
            return replace(self, exact=False)   # generated text outside any message
        if msgs[-1][0] == "assistant":
            msgs[-1] = ("assistant", msgs[-1][1] + reply)
        else:
            msgs.append(("assistant", reply))
        return self.with_messages(msgs, True, self.exact)

    def to_json(self) -> dict:
        return {"start": self.start, "open": self.open, "exact": self.exact,
                "messages": [list(m) for m in self.messages]}

    @classmethod
    def from_json(cls, raw: object, n_chars: int) -> "ChatState":
        """A saved state, checked as untrusted input (ValueError saying what is off)."""
        if not isinstance(raw, dict) or set(raw) != {"start", "open", "exact", "messages"}:
            raise ValueError("chat state must be an object with start, open, exact and messages")
        start, open_, exact, msgs = raw["start"], raw["open"], raw["exact"], raw["messages"]
        if type(start) is not int or not 0 <= start <= n_chars:
            raise ValueError(f"chat start {start!r} is not an int in 0..{n_chars}")
        if type(open_) is not bool or type(exact) is not bool:
            raise ValueError("chat open and exact must be booleans")
        if not isinstance(msgs, list) or len(msgs) > 1 + KEEP_MESSAGES:
            raise ValueError(f"chat messages must be a list of at most {1 + KEEP_MESSAGES}")
        out: list[Message] = []
        for i, m in enumerate(msgs):
            if (not isinstance(m, list) or len(m) != 2 or m[0] not in ROLES or not isinstance(m[1], str)
                    or len(m[1]) > MAX_MESSAGE_CHARS or (m[0] == "system" and i)):
                raise ValueError(f"chat message {i} is not [role, content] with a role of {ROLES} "
                                 f"(system only first) and at most {MAX_MESSAGE_CHARS} characters")
            m[1].encode("utf-8")   # UnicodeEncodeError (a ValueError): a lone surrogate
            out.append((m[0], m[1]))
        if open_ and (not out or out[-1][0] == "system"):
            raise ValueError("an open chat must end with a user or assistant message")
        return cls(start, tuple(out), open_, exact)


def next_turn(template: ChatTemplate, state: ChatState, role: str, text: str,
              held: Callable[[int | None], str], pending: str, nfc: bool) -> tuple[str, ChatState]:
    """(the text a chat turn appends, the state after it).

    held(n): the last n characters of the chat's text as the stream holds it (None: all of it);
    pending: text the next append adds before ours (a reply that ended inside a character).
    The text is render(messages + [new]) less what the stream holds, when that is a prefix of
    it. Otherwise (a stop string or a trimmed reply in the stream, messages dropped, text
    appended by hand, or a template that is not prefix-stable, such as Qwen3's, which drops the
    <think> block of earlier replies): the end of the open reply, as the template closes an
    assistant message, then the new turn, as the difference of two canonical renderings (of the
    kept messages, else of the first message alone) with and without it.
    """
    if role not in ROLES:
        raise ValueError(f"chat role must be one of {', '.join(ROLES)}, got {role!r}")
    if not isinstance(text, str):
        raise ValueError(f"chat takes str text, got {type(text).__name__}")
    norm = (lambda t: unicodedata.normalize("NFC", t)) if nfc else (lambda t: t)
    msgs = list(state.messages)
    replying = state.open and msgs[-1][0] == "assistant"
    waiting = state.open and not replying          # a generation prompt ends the stream
    if role == "system" and msgs:
        raise ValueError("a system turn comes first, before any other chat turn")
    if role == "user" and waiting:
        raise ValueError("the assistant's turn is open: generate its reply (or add it with "
                         "chat('assistant', text)) before the next user turn")
    if replying and pending:
        msgs[-1] = ("assistant", msgs[-1][1] + pending)
    new_msgs, agp = msgs + [(role, text)], role == "user"
    new = norm(template.render(new_msgs, agp))
    if state.exact:
        have = held(None)
        if new.startswith(have):
            return new[len(have):], state.with_messages(new_msgs, agp, True)
    turn = _turn(template, msgs, (role, text), agp, waiting, norm)
    close = _closing(template, msgs[:-1], norm) if replying else ""
    have = held(len(close))
    k = next(k for k in range(len(close), -1, -1) if have.endswith(close[:k]))
    return close[k:] + turn, state.with_messages(new_msgs, agp, False)


def _turn(template: ChatTemplate, msgs: list[Message], message: Message, agp: bool,
          waiting: bool, norm: Callable[[str], str]) -> str:
    for base, base_agp in ((msgs, waiting), (msgs[:1], waiting and len(msgs) == 1)):
        try:
            old = norm(template.render(base, base_agp))
            new = norm(template.render(base + [message], agp))
        except ChatTemplateError:
            continue   # e.g. a template that checks the order of turns
        if new.startswith(old):
            return new[len(old):]
    raise ChatTemplateError(f"the chat template of {template.model} does not render a new "
                            f"{message[0]} turn as an extension of the conversation before it; "
                            "format the conversation yourself with Session.append()")


def _closing(template: ChatTemplate, before: list[Message], norm: Callable[[str], str]) -> str:
    """What the template writes after an assistant message's content: from two renderings
    that differ only in that content ("" when they differ otherwise)."""
    try:
        one, two = (norm(template.render(before + [("assistant", c)], False)) for c in ("a", "b"))
    except ChatTemplateError:
        return ""
    i = next((i for i, (x, y) in enumerate(zip(one, two)) if x != y), None)
    if i is None or len(one) != len(two) or one[i + 1:] != two[i + 1:]:
        return ""
    return one[i + 1:]


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    """transformers' environment (chat_template_utils._cached_compile_jinja_template)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise ChatTemplateError(f"jinja2 {jinja2.__version__} has known sandbox escapes and chat "
                                "templates are untrusted code: install jinja2>=3.1.6")
    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} (transformers' assistant mask): its body."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    class TemplateDict:   # `dict` without the type's attributes to climb through
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):   # no underscore names (CPython internals)
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=TemplateDict(), namespace=TemplateNamespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)
