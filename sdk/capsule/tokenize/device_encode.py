"""Full encodes on the device: regex split, byte rows and BPE merges all as tensor work.

``DeviceEncoder(ref, device, kernel)`` gives ``ref.encode(text)``'s ids as a tensor on
``device``. Only the special-token split (and NFC, for the families that normalize) runs on the
host; each text run between special tokens then goes to the device as UTF-8 bytes and stays
there: ``DeviceSplitter`` cuts it into pieces, ``edge_kernels.bpe.pack_spans`` turns the
pieces into byte-id rows, ``TensorBpe.merge_packed`` merges them (kernel "torch" or "triton")
and ``flatten`` lays the ids out in order.

The host path (``TensorBpe``) emits a piece that is a whole token as that token (tiktoken does).
The device path has no piece lookup, so it requires that BPE itself reach every whole token;
this is checked once per vocabulary when the encoder is built (cl100k_base, r50k_base and
Qwen2.5 pass; Llama 3 has 588 tokens BPE never makes, and is refused by name).
"""
from __future__ import annotations

import threading
import unicodedata

import torch

from edge_kernels.bpe import flatten, pack_spans
from edge_kernels.regex_split import split_utf8

from ..errors import TokenizerError
from .device_split import DeviceSplitter
from .pieces import PieceScanner
from .reference import ReferenceTokenizer
from .rules import CharInfo, rules_for
from .tensor_bpe import TensorBpe

_reachable: dict[str, int] = {}   # fingerprint -> number of whole tokens BPE does not make
_reachable_lock = threading.Lock()


class DeviceEncoder:
    """Encodes like ``ref.encode``, on ``device``. Not thread-safe; one per thread."""

    def __init__(self, ref: ReferenceTokenizer, device: torch.device | str = "cpu",
                 kernel: str = "torch") -> None:
        rules, why = rules_for(ref)
        if rules is None:
            raise TokenizerError(f"{ref.name}: the device encoder needs a verified pipeline ({why})")
        self.ref, self._nfc = ref, rules.nfc
        self.splitter = DeviceSplitter(ref, device)
        self.bpe = TensorBpe(ref, device, kernel)
        missing = _unreached(ref, self.bpe)
        if missing:
            raise TokenizerError(f"{ref.name}: {missing} whole tokens are not what BPE makes of "
                                 "their bytes; the device path has no whole-piece lookup (use "
                                 "TensorBpe, which has)")
        self._scanner = PieceScanner(ref, rules, CharInfo(rules.marks_are_letters,
                                                           rules.cjk_stage, rules.scheme))

    @property
    def device(self) -> torch.device:
        return self.splitter.device

    def encode(self, text: str) -> torch.Tensor:
        """The ids of ``text`` (int64, on the device)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        parts = []
        for s, e, sid in self._scanner.split_specials(text):
            if sid is not None:
                parts.append(torch.tensor([sid], dtype=torch.int64, device=self.device))
                continue
            try:
                data = text[s:e].encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"{self.ref.name}: text is not valid Unicode (lone surrogate?): "
                                 f"{exc}") from exc
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            starts = split_utf8(raw, self.splitter.table, self.splitter.spec)
            packed = self.bpe.merge_packed(pack_spans(raw, starts, self.bpe.table))
            parts.append(flatten(packed, starts.numel()).to(self.device))
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts)


def _unreached(ref: ReferenceTokenizer, bpe: TensorBpe) -> int:
    """How many whole-piece tokens BPE does not make from their own bytes (0: the lookup the
    host path does is a no-op for this vocabulary). Once per vocabulary and process."""
    key = ref.fingerprint
    with _reachable_lock:
        if key in _reachable:
            return _reachable[key]
    items = [(b, i) for b, i in bpe.whole_pieces.items() if len(b) > 1]
    got = bpe.merge([b for b, _ in items]) if items else []
    bad = sum(g != [i] for (_, i), g in zip(items, got))
    with _reachable_lock:
        _reachable[key] = bad
    return bad
