"""Typed errors. Every message says what to fix; bad arguments raise plain ``ValueError``."""
from __future__ import annotations


class CapsuleError(Exception):
    """Base class of every error the SDK raises on purpose (besides ``ValueError``)."""


class ModelLoadError(CapsuleError):
    """A model source could not be loaded (missing file, bad checkpoint, unknown preset)."""


class UnsupportedArchitecture(ModelLoadError):
    """The checkpoint's architecture or one of its settings is not implemented."""


class EngineUnavailable(ModelLoadError):
    """An engine (policy or LLM) cannot run here (package, provider, CUDA, dtype or model kind
    missing); an engine list tries the next one. The message says what is missing."""


class TokenizerError(CapsuleError):
    """A tokenizer could not be found or loaded."""


class VocabMismatch(CapsuleError):
    """The model's vocabulary cannot hold every id the tokenizer emits."""


class StoreError(CapsuleError):
    """The capsule store path is unusable (a regular file, no permission, ...)."""


class CapacityError(CapsuleError):
    """The KV pool, a stream or a batch ran out of room; the message names the limit."""


class ContextFull(CapacityError, ValueError):
    """A stream would pass runtime.max_context (a ValueError too, as it was before it had a type);
    the message names the stream, the positions and the ways out."""


class CapsuleMismatch(CapsuleError):
    """A capsule was taken against another model, tokenizer or buffer layout."""


class CapsuleCorrupt(CapsuleError):
    """No valid epoch could be read from a store that holds data."""


class UnknownStream(CapsuleError, KeyError):
    """No stream of that name (a KeyError too, as a missing key of Session.streams())."""

    def __str__(self) -> str:   # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""


class ChatTemplateError(TokenizerError):
    """A model's chat template is missing, too large, or failed to render (the message names the model)."""


class LiteUnsupported(CapsuleError):
    """The torch-free restore (``capsule.lite``) cannot continue this capsule; the message says
    why and what to do (usually: open the Session, which can)."""
