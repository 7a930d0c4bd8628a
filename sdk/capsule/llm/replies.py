"""A reply as the caller sees it: cut at a stop string or the end-of-sequence token, and handed
out piece by piece to an on_token callback while it is decoded (Engine.generate)."""
from __future__ import annotations

from typing import Callable, Sequence

from ..tokenize import ReferenceTokenizer
from ..tokenize.utf8 import split_incomplete, without_eos

OnToken = Callable[[str, str], None]   # (stream name, text piece), see Engine.generate


class ReplyPieces:
    """The replies' text for an on_token callback while decoding: never a split UTF-8 character
    (incomplete bytes wait for the rest) and never text a stop string may still take back (a
    tail that could start one waits until it is decided); the EOS token's text is the token
    that ends a reply, so it never reaches step. Each stream's pieces join to its reply."""

    def __init__(self, on_token: OnToken, stops: Sequence[str]):
        self.on_token, self.stops = on_token, list(stops)
        self.read: dict[str, int] = {}    # bytes of out decoded so far
        self.held: dict[str, str] = {}    # decoded text not handed out yet
        self.sent: dict[str, int] = {}    # characters handed out

    def step(self, name: str, out: bytearray) -> None:
        """After a token that did not end the reply."""
        complete, _ = split_incomplete(bytes(out[self.read.get(name, 0):]))
        self.read[name] = self.read.get(name, 0) + len(complete)
        text = self.held.get(name, "") + complete.decode("utf-8", errors="replace")
        # a stop string's start at the end; or a whole one the bytes did not show (U+FFFD)
        cut = min([len(text) - k for x in self.stops for k in range(1, len(x)) if text.endswith(x[:k])]
                  + [i for i in (text.find(x) for x in self.stops) if i >= 0], default=len(text))
        self.held[name] = text[cut:]
        self._send(name, text[:cut])

    def finish(self, name: str, reply: str) -> None:
        self._send(name, reply[self.sent.get(name, 0):])

    def _send(self, name: str, piece: str) -> None:
        if piece:
            self.sent[name] = self.sent.get(name, 0) + len(piece)
            self.on_token(name, piece)


def cut_at_stop(text: str, stop: Sequence[str], tokenizer: ReferenceTokenizer, ended_on_eos: bool) -> str:
    """The reply as returned to the caller: without the stop string or the end-of-sequence token."""
    cut = min((i for i in (text.find(x) for x in stop) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut]
    if ended_on_eos:
        return without_eos(text, (tokenizer.decode_bytes([e]).decode("utf-8", errors="replace")
                                  for e in tokenizer.eos_ids))
    return text
