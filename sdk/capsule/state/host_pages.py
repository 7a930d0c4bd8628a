"""Host blobs (token ids, text, block tables, RNG state) as a capsule's 4 KiB pages, and back.

Torch-free: the Session's snapshot and the torch-free restore (``capsule.lite``) read host state
through the same function.
"""
from __future__ import annotations

from typing import Mapping

from ..errors import CapsuleCorrupt

HOST_PAGE = 4096


def host_blobs(pages: Mapping[str, Mapping[int, bytes]], blob_sizes: Mapping[str, int]) -> dict[str, bytes]:
    """Each blob of the manifest's ``blob_sizes`` rebuilt from its ``host/<key>`` pages;
    CapsuleCorrupt when a page is missing or the bytes do not add up."""
    blobs = {}
    for key, size in blob_sizes.items():
        got = pages.get(f"host/{key}", {})
        n = -(-size // HOST_PAGE)
        if any(i not in got for i in range(n)):
            raise CapsuleCorrupt(f"host state {key!r}: pages missing from the capsule")
        blob = b"".join(got[i] for i in range(n))[:size]
        if len(blob) != size:
            raise CapsuleCorrupt(f"host state {key!r}: {len(blob)} bytes, manifest says {size}")
        blobs[key] = blob
    return blobs
