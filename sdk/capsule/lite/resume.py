"""Continue a store's newest capsule without importing torch: greedy tokens in a fraction of a
second after a power cut, the very tokens the Session would generate.

``LiteResume.open(store)`` reads the store's restore kit (``<store>.kit``, written by
``Session.write_lite_kit``), the newest committed capsule that verifies and matches the kit's
binding (the same checks as a Session's restore: checksums, manifest bounds, binding), one
stream's token ids and block table, and that stream's K/V blocks into a numpy pool; then
``generate(n)`` decodes greedily through the kit's onnxruntime graphs (the first step's ORT
session builds on a background thread while the capsule's pages are read), or, for a kit of a
model decoding in the one-call C step (an fp32 model under runtime.decode_step 'fused', the
default on CPU, or an all-int4 one), through the package's C decode step and head
(``c_steps.py``). It imports numpy, onnxruntime (ORT kits) or the C kernels (C-step kits) and
the SDK's torch-free store and state readers, nothing else.

Exactness: the graphs (or C functions), weights and inputs are the Session's engine's, so each
token is the one ``Session.generate(n, stream=...)`` (greedy, the default) returns after
restoring the same capsule: a robot can speak or act on them while the full Session loads, then let the
Session regenerate them (same ids) and go on. Nothing is added to the store (its open runs the
store's recovery, as a Session's does), its lock is held only inside ``open`` (a Session opened
meanwhile would find it taken), and the tokens generated here are not checkpointed.

What it refuses (LiteUnsupported, with what to do): a stream with text appended after its last
generate (its new tokens need a prefill; only decode steps run here), a stream holding memory
facts (a memory region), a reply that would pass max_context (the Session shifts the context),
sampling (greedy only), and a store without a kit.

Threading: one LiteResume per thread; it holds its own pool and ORT sessions (or C step).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import CapsuleCorrupt, CapsuleMismatch, LiteUnsupported, UnknownStream
from ..state.host_pages import host_blobs
from ..state.manifest import EpochCorrupt, Limits, Manifest, parse
from ..store import Store
from ..tokenize import incremental_state
from ..tokenize.utf8 import check_tail, split_incomplete, without_eos
from .kit import Kit, Pieces, kit_path
from .c_steps import CSteps
from .steps import LiteSteps, Sessions, step_name

KV_REGION = "kv_pool"


class _KitVocab:
    """What the tokenizer-state check asks of a vocabulary, from the kit (no vocabulary load)."""

    def __init__(self, kit: Kit):
        self.name, self.fingerprint, self.max_id = kit.vocab_name, kit.vocab_fingerprint, kit.max_id


class LiteResume:
    """One stream of a store's newest matching capsule, continued greedily (module docstring)."""

    def __init__(self, kit: Kit, epoch: int, stream: str, ids: list[int], blocks: list[int],
                 used: set[int], tail: bytes, pool: np.ndarray, steps: LiteSteps | CSteps):
        self.kit, self.epoch, self.stream = kit, epoch, stream
        self._ids, self._blocks, self._used = ids, blocks, used
        self._tail = tail            # the bytes of a character the last reply ended inside
        self._pieces: Pieces | None = None
        self._pool, self._steps = pool, steps

    @classmethod
    def open(cls, store: str | os.PathLike, *, stream: str = "main", kit: str | os.PathLike | None = None,
             sign_key: bytes | None = None, threads: int | None = None) -> "LiteResume":
        """Read the kit and the newest capsule of ``store`` that matches it (see the module
        docstring). threads: ORT's intra-op threads (default: the Session's, as the kit records;
        another count may split a sum differently, and then a token could differ), or the C
        kernels' workers (any count gives the same bits). Raises CapsuleError subclasses only: LiteUnsupported,
        CapsuleMismatch, CapsuleCorrupt, UnknownStream, StoreError."""
        path = kit_path(store) if kit is None else Path(kit)
        try:
            k = Kit.read(path)
        except FileNotFoundError:
            raise LiteUnsupported(f"no restore kit at {path}: call Session.write_lite_kit() once (a CPU Session "
                                  "decoding in the C step, the default, or on the onnxruntime LLM engine)") from None
        limits = Limits(k.max_context, k.max_blocks, k.max_manifest_bytes)
        parsed: dict[int, Manifest] = {}
        threads = threads if threads is not None else k.threads
        sessions = Sessions(k, threads) if k.engine == "onnxruntime" else None

        def accept(epoch: int, data: bytes) -> None:
            try:
                manifest = parse(epoch, data, limits)
            except EpochCorrupt as exc:
                raise CapsuleCorrupt(exc.detail) from None
            diffs = k.binding.differences(manifest.binding)
            if diffs:
                raise CapsuleMismatch("taken against another setup than the restore kit's; " + "; ".join(diffs))
            parsed[epoch] = manifest
            width = _first_width(k, manifest, stream)
            if width is not None and sessions is not None:   # built while the pages are read
                sessions.start(step_name(1, width))
                sessions.start("head/1")

        st = Store.open(store, create=False, sign_key=sign_key)
        try:
            found = st.load_newest_valid(accept, max_page_bytes=k.max_page_bytes,
                                         max_manifest_bytes=k.max_manifest_bytes)
            if found is None:
                raise LiteUnsupported(f"store {store} holds no capsule yet: nothing to continue")
            epoch, _, pages, _ = found
            manifest = parsed[epoch]
            ids, blocks, used, tail = _stream(k, manifest, host_blobs(pages, manifest.blob_sizes), stream)
            pool = np.zeros(k.pool, dtype=np.float32)    # untouched blocks stay unallocated pages
            rows = pool.reshape(k.pool[0], -1).view(np.uint8)                  # (NB, block bytes)
            bs, kv = k.pool[3], pages.get(KV_REGION, {})
            for b in blocks[:-(-(len(ids) - 1) // bs)]:      # the blocks of ids[:-1]
                page = kv.get(b)
                if page is None or len(page) != rows.shape[1]:
                    raise CapsuleCorrupt(f"epoch {epoch}: stream {stream!r}'s K/V block {b} is missing "
                                         "or of another size")
                rows[b] = np.frombuffer(page, dtype=np.uint8)
        finally:
            st.close()
        steps = (LiteSteps(k, k.map_weights(), pool, sessions) if sessions is not None
                 else CSteps(k, k.map_weights(), pool, threads))
        return cls(k, epoch, stream, ids, blocks, used, tail, pool, steps)

    @property
    def tokens(self) -> list[int]:
        """The stream's ids: the capsule's, then those generated here."""
        return list(self._ids)

    def generate(self, max_new_tokens: int) -> list[int]:
        """Up to max_new_tokens greedy ids (fewer when an end-of-sequence id comes: it is the last
        one), each the one Session.generate would pick. The ids only; decoding them to text
        needs the tokenizer (the Session's)."""
        if type(max_new_tokens) is not int or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if len(self._ids) + max_new_tokens > self.kit.max_context:
            raise LiteUnsupported(f"stream {self.stream!r} holds {len(self._ids)} tokens; {max_new_tokens} more "
                                  f"would pass max_context {self.kit.max_context} (the Session shifts the "
                                  "context: generate with it)")
        if self._steps is None:
            raise ValueError("this LiteResume is closed")
        out: list[int] = []
        bs = self.kit.pool[3]
        # as a Session's generate: its first token comes from a one-row prefill step, the rest
        # from decode steps of the smallest batch bucket
        decoded = False
        for _ in range(max_new_tokens):
            i = len(self._ids) - 1                          # feed the last id at its position
            if i // bs >= len(self._blocks):
                self._blocks.append(self._free_block())
            nb = i // bs + 1
            rows = self.kit.decode_rows if decoded else 1
            hidden = self._steps.step(rows, [self._ids[i]], [i], [self._blocks[i // bs] * bs + i % bs],
                                      [self._blocks[:nb]])
            logits = self._steps.head(hidden)[0]
            # what the Session's sampler never picks: ids past the tokenizer's, its holes
            logits[self.kit.max_id + 1:] = -np.inf
            logits[list(self.kit.gaps)] = -np.inf
            tok = int(np.argmax(logits))                # the first index of the max, as torch's
            decoded = True
            self._ids.append(tok)
            out.append(tok)
            if tok in self.kit.eos_ids:
                break
        return out

    def reply(self, max_new_tokens: int) -> str:
        """``generate``, as text: exactly the string ``Session.generate(max_new_tokens,
        stream=...)`` returns (a character cut by the last token waits for the next reply, a
        closing end-of-sequence token's text is left out), decoded with the kit's piece table."""
        ids = self.generate(max_new_tokens)
        pieces = self.kit.pieces() if self._pieces is None else self._pieces
        self._pieces = pieces
        complete, self._tail = split_incomplete(self._tail + pieces(ids))
        text = complete.decode("utf-8", errors="replace")
        if ids and ids[-1] in self.kit.eos_ids:      # as llm/replies.cut_at_stop
            return without_eos(text, (pieces([e]).decode("utf-8", errors="replace") for e in self.kit.eos_ids))
        return text

    def close(self) -> None:
        """Drop the ORT sessions and the pool (the store was closed at open)."""
        self._steps = None          # type: ignore[assignment]
        self._pool = None           # type: ignore[assignment]

    def __enter__(self) -> "LiteResume":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _free_block(self) -> int:
        for b in range(self.kit.pool[0]):
            if b != self.kit.scratch_block and b not in self._used:
                self._used.add(b)
                return b
        raise LiteUnsupported("the KV pool has no free block left for this stream; generate with the Session")


def _stream(k: Kit, manifest: Manifest, blobs: dict[str, bytes], name: str
            ) -> tuple[list[int], list[int], set[int], bytes]:
    """(the stream's ids, its block table, every block some stream holds, its reply's cut
    character) from a capsule's host state, checked as the Session's stream import checks them."""
    streams = manifest.host.get("streams")
    if not isinstance(streams, list):
        raise CapsuleCorrupt(f"epoch {manifest.epoch}: host state has no stream list")
    meta = _entry(manifest, name)
    if meta is None:
        have = [m.get("name") for m in streams if isinstance(m, dict)]
        raise UnknownStream(f"epoch {manifest.epoch} has no stream {name!r} (streams: {have[:8]})")
    where = f"epoch {manifest.epoch}, stream {name!r}"
    if meta.get("region") is not None:
        raise LiteUnsupported(f"{where} holds memory facts (a memory region); the lite restore runs "
                              "plain streams only: generate with the Session")
    try:
        saved = incremental_state.parse(_KitVocab(k), meta.get("tokenizer"),
                                        incremental_state.stream_blobs(blobs).get(name, {}))
        generated = _ints(blobs.get(f"gen/{name}", b""), "<u4", "generated ids")
        ids = saved.ids.tolist() + generated
        if meta.get("n_ids") != len(ids) or meta.get("generated") != len(generated):
            raise ValueError(f"{len(ids)} ids ({len(generated)} generated), its entry says "
                             f"{meta.get('n_ids')!r} ({meta.get('generated')!r})")
        if generated and max(generated) > k.max_id:
            raise ValueError(f"generated ids do not fit the model's {k.max_id + 1} ids")
        cached = meta.get("num_cached")
        if type(cached) is not int or not 0 <= cached <= len(ids):
            raise ValueError(f"num_cached={cached!r} is not an int in 0..{len(ids)}")
        blocks = _ints(blobs[f"blocks/{name}"], "<i4", "block table")
        tail = check_tail(blobs.get(f"tail/{name}", b""))
        used: set[int] = set()
        for m in streams:
            other = blobs.get(f"blocks/{m.get('name')}", b"") if isinstance(m, dict) else b""
            used.update(_ints(other, "<i4", "block table"))
    except (KeyError, ValueError, TypeError) as exc:
        raise CapsuleCorrupt(f"{where}: host state is inconsistent ({exc})") from None
    bs = k.pool[3]
    if not ids:
        raise LiteUnsupported(f"{where} is empty: nothing to continue")
    if len(ids) - cached > 1:
        raise LiteUnsupported(f"{where}: {len(ids) - cached} tokens are not in the K/V cache yet (text "
                              "appended after the last generate needs a prefill, which the lite restore does "
                              "not run): generate with the Session")
    if len(blocks) > k.max_blocks or len(blocks) < -(-(len(ids) - 1) // bs) or len(set(blocks)) != len(blocks) \
            or any(not 0 <= b < k.pool[0] or b == k.scratch_block for b in blocks):
        raise CapsuleCorrupt(f"{where}: block table does not cover its tokens or lies outside the pool")
    return ids, blocks, used, tail


def _entry(manifest: Manifest, name: str) -> dict | None:
    """The manifest's host-state entry of stream ``name`` (None: no such entry or no stream list)."""
    streams = manifest.host.get("streams")
    if not isinstance(streams, list):
        return None
    return next((m for m in streams if isinstance(m, dict) and m.get("name") == name), None)


def _first_width(k: Kit, manifest: Manifest, name: str) -> int | None:
    """The block-table width of the first step ``generate`` runs on stream ``name``, when the
    manifest's entry for it says how many ids it holds (checked for real by _stream)."""
    meta = _entry(manifest, name)
    n = meta.get("n_ids") if meta is not None else None
    if type(n) is not int or not 1 <= n <= k.max_context:
        return None
    nb = (n - 1) // k.pool[3] + 1                 # the step feeds id n - 1 at its position
    return k.table_buckets[nb - 1] if nb <= len(k.table_buckets) else None


def _ints(blob: bytes, dtype: str, what: str) -> list[int]:
    if len(blob) % 4:
        raise ValueError(f"{what} is {len(blob)} bytes, not a whole number of 4-byte ints")
    return np.frombuffer(blob, dtype=dtype).tolist()


__all__: Sequence[str] = ["LiteResume"]
