"""The device-side columns of `capsule bench --suite tokenize-bpe`: regex split and full encode.

For the families whose pre-tokenizer is a GPT-family pattern (``device_split.spec_of``): the
split of the whole text into pieces by ``DeviceSplitter`` (CPU tensors always, CUDA when
present), checked piece for piece against the host's pieces; on CUDA also the full
``DeviceEncoder`` encode (split, rows and merges on the device) and its exactness.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...tokenize.device_encode import DeviceEncoder
from ...tokenize.device_split import DeviceSplitter, reference_spans, spec_of
from ...tokenize.reference import ReferenceTokenizer

Timer = Callable[..., float]   # _median_ms(fn, reps[, sync])


def device_columns(ref: ReferenceTokenizer, text: str, want: list[int], reps: int, cpu: bool,
                   cuda: bool, timer: Timer) -> dict[str, Any]:
    """split_{cpu,cuda}_ms, split_exact, device_encode_cuda_ms, exact_device_cuda (None where
    not measured) and device_note (why not, else "")."""
    row: dict[str, Any] = {"split_cpu_ms": None, "split_cuda_ms": None, "split_exact": None,
                           "device_encode_cuda_ms": None, "exact_device_cuda": None,
                           "device_note": ""}
    if spec_of(ref) is None:
        return {**row, "device_note": "not a GPT-family pattern"}
    data = text.encode("utf-8")
    want_spans = reference_spans(ref, text)
    for dev, on in (("cpu", cpu), ("cuda", cuda)):
        if not on:
            continue
        split = DeviceSplitter(ref, dev)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        row[f"split_{dev}_ms"] = timer(lambda: split.starts(data), reps, sync)
        row["split_exact"] = bool(row["split_exact"] in (None, True)
                                  and split.spans(text) == want_spans)
    if cuda:
        try:
            enc = DeviceEncoder(ref, device="cuda")
        except Exception as exc:   # noqa: BLE001 - refused vocabularies say why
            row["device_note"] = f"{type(exc).__name__}: {exc}"[:500]
            return row
        row["device_encode_cuda_ms"] = timer(lambda: enc.encode(text), reps,
                                             torch.cuda.synchronize)
        row["exact_device_cuda"] = enc.encode(text).tolist() == want
    return row
