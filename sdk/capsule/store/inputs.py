"""Checks and normalization of what callers hand to write_epoch / stage_epoch (ValueError on misuse)."""
from __future__ import annotations

import json
from typing import Any, Iterable, Iterator, Sequence

from .records import MAX_NAME_BYTES, MAX_PAGE_INDEX, MAX_PAYLOAD_BYTES, Buffer

MAX_EPOCH_NAME = 256
Page = tuple[str, int, memoryview]


def as_bytes_view(data: Any, what: str) -> Buffer:
    """bytes stay as they are; other buffers become a flat byte memoryview (no copy)."""
    if isinstance(data, bytes):
        view: Buffer = data
    else:
        try:
            view = memoryview(data).cast("B")
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be bytes, bytearray or a C-contiguous buffer, "
                             f"got {type(data).__name__}") from None
    if len(view) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"{what} is {len(view)} bytes; a record holds at most {MAX_PAYLOAD_BYTES} "
                         f"(split the region into smaller pages)")
    return view


class PageStream:
    """An epoch's pages whose keys are known before their bytes exist: the store appends each
    page as ``pages`` yields it, so a writer can stage a large epoch chunk by chunk through one
    reused buffer (a page's bytes may be a view into it, valid until the next page is asked
    for). ``pages`` must yield exactly ``keys``, in order; one pass only (a second is refused).
    nbytes: the bytes the pages will hold (what a caller reports before writing)."""

    def __init__(self, keys: Sequence[tuple[str, int]], pages: Iterable[tuple[str, int, Any]],
                 nbytes: int) -> None:
        self.keys = list(keys)
        self.nbytes = nbytes
        self._pages = iter(pages)
        self._started = False

    def take(self) -> Iterator[tuple[str, int, Any]]:
        if self._started:
            raise ValueError("a PageStream is written once: its pages were already consumed")
        self._started = True
        return self._pages


def _check_key(region: Any, index: Any, seen: set[tuple[str, int]]) -> None:
    if not isinstance(region, str) or not region:
        raise ValueError(f"region name must be a non-empty str, got {region!r}")
    if len(region.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ValueError(f"region name {region[:40]!r}... is longer than {MAX_NAME_BYTES} UTF-8 bytes")
    try:
        region.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"region name {region!r} is not valid Unicode text") from None
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_PAGE_INDEX:
        raise ValueError(f"page index of region {region!r} must be an int in 0..2**63-1, got {index!r}")
    if (region, index) in seen:
        raise ValueError(f"page {region}[{index}] appears twice in one epoch")
    seen.add((region, index))


def _unpack(item: Any) -> tuple[Any, Any, Any]:
    try:
        region, index, data = item
    except (TypeError, ValueError):
        raise ValueError("pages must be (region: str, index: int, data: bytes) tuples") from None
    return region, index, data


def check_pages(pages: Iterable[tuple[str, int, Any]] | PageStream
                ) -> tuple[set[tuple[str, int]], Iterable[Page]]:
    """(the epoch's page keys, its pages as checked byte views). A list or iterable is read and
    checked whole, now; a PageStream's keys are checked now and each page as it is produced
    (a page that is not the next key, or a stream that ends early or runs long, is refused)."""
    seen: set[tuple[str, int]] = set()
    if isinstance(pages, PageStream):
        for region, index in pages.keys:
            _check_key(region, index, seen)
        return seen, _streamed(pages)   # lazy: a step retried before its first page may rerun
    out = []
    for item in pages:
        region, index, data = _unpack(item)
        _check_key(region, index, seen)
        out.append((region, index, as_bytes_view(data, f"page {region}[{index}]")))
    return seen, out


def _streamed(stream: PageStream) -> Iterator[Page]:
    keys, pages = stream.keys, stream.take()
    for want in keys:
        item = next(pages, None)
        if item is None:
            raise ValueError(f"a PageStream ended before page {want[0]}[{want[1]}]")
        region, index, data = _unpack(item)
        if (region, index) != want:
            raise ValueError(f"a PageStream produced {region}[{index}] where its keys say "
                             f"{want[0]}[{want[1]}]")
        yield region, index, as_bytes_view(data, f"page {region}[{index}]")
    if next(pages, None) is not None:
        raise ValueError(f"a PageStream produced more than its {len(keys)} pages")


def check_name(name: str | None) -> None:
    if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > MAX_EPOCH_NAME):
        raise ValueError(f"epoch name must be a non-empty str of at most {MAX_EPOCH_NAME} characters, "
                         f"got {name!r}")
    if isinstance(name, str) and (name.strip().isdigit() or name.strip().lstrip("+-").isdigit()):
        raise ValueError(f"epoch name {name!r} looks like an epoch id; pick a name with a letter in it")
    if isinstance(name, str):
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"epoch name {name!r} is not valid Unicode text (an unpaired surrogate)") from None
        if any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise ValueError(f"epoch name {name!r} holds a control character; use printable text")


def check_meta(meta: dict | None) -> dict:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"meta must be JSON-serializable ({exc})") from None
