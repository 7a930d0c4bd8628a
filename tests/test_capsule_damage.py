"""Damaged stores through the Session: an older valid epoch or CapsuleCorrupt, never a wrong restore."""
from __future__ import annotations

import pytest

from capsule import CapsuleCorrupt, Session

RT = {"kv_pool_mb": 8, "max_context": 1024}


def _two_epochs(path):
    """Epoch 1 and 2 with known token lists; epoch 2's new pages are the tail of the segment."""
    with Session.open(path, device="cpu", runtime=RT) as s:
        s.append("user: the charger is in bay 2.\n" * 8)
        s.generate(3)
        s.checkpoint()
        first = s.tokens()
        s.generate(40)                       # new KV blocks: epoch 2 writes pages epoch 1 lacks
        s.checkpoint()
        second = s.tokens()
    return first, second


def _segment(path):
    return sorted((path / "segments").glob("*.seg"))[-1]


def test_flipped_byte_in_the_newest_epoch_falls_back(tmp_path):
    store = tmp_path / "s"
    first, second = _two_epochs(store)
    seg = _segment(store)
    data = bytearray(seg.read_bytes())
    data[len(data) - 2000] ^= 0x01           # inside epoch 2's records (its manifest is small)
    seg.write_bytes(bytes(data))
    with Session.open(store, device="cpu", runtime=RT) as s:
        assert s.restored_epoch == 1 and s.tokens() == first
        assert s.restore_report, "the skipped epoch must be reported"


def test_torn_tail_past_the_commit_is_cut(tmp_path):
    store = tmp_path / "s"
    first, second = _two_epochs(store)
    with open(_segment(store), "ab") as f:
        f.write(b"\x00garbage of an unfinished record" * 10)
    with Session.open(store, device="cpu", runtime=RT) as s:
        assert s.restored_epoch == 2 and s.tokens() == second


def test_torn_committed_records_never_restore_wrong_bytes(tmp_path):
    store = tmp_path / "s"
    first, second = _two_epochs(store)
    seg = _segment(store)
    seg.write_bytes(seg.read_bytes()[:-1500])  # cut into epoch 2's committed records
    with Session.open(store, device="cpu", runtime=RT) as s:
        assert s.restored_epoch == 1 and s.tokens() == first


def test_truncated_index_is_rebuilt_from_the_log_not_empty(tmp_path):
    store = tmp_path / "s"
    first, second = _two_epochs(store)
    index = store / "index.sqlite"
    index.write_bytes(index.read_bytes()[:512])
    for extra in ("index.sqlite-wal", "index.sqlite-shm"):
        (store / extra).unlink(missing_ok=True)
    with Session.open(store, device="cpu", runtime=RT) as s:   # the log is the truth
        assert s.restored_epoch == 2 and s.tokens() == second
        assert "index rebuilt from the segment log" in s.restore_report[0]   # said, not silent
        s.generate(3)
        s.checkpoint()
    with Session.open(store, device="cpu", runtime=RT) as s:
        assert s.restored_epoch == 3 and s.tokens()[:len(second)] == second


def test_a_damaged_segment_header_is_not_written_after(tmp_path):
    # every record after a damaged header is unreadable: new writes must go to a new segment,
    # or a checkpoint (and a remembered fact) would be acknowledged and then lost
    store = tmp_path / "s"
    with Session.open(store, model="builtin:tiny", device="cpu", runtime=RT, memory={"embedder": None}) as s:
        s.remember("The red cup is fragile.")
        s.append("user: the charger is in bay 2.\n")
        s.generate(3)
        s.checkpoint()
    seg = _segment(store)
    data = bytearray(seg.read_bytes())
    data[0] ^= 0x01                                   # the segment's magic
    seg.write_bytes(bytes(data))
    with pytest.raises(CapsuleCorrupt):
        Session.open(store, model="builtin:tiny", device="cpu", runtime=RT)
    with Session.open(store, model="builtin:tiny", device="cpu", runtime=RT, restore=False,
                      memory={"embedder": None}) as s:
        fid = s.remember("The green mat is wet.")
        s.append("user: where is the mat?\n")
        s.generate(2)
        s.checkpoint()
        tokens = s.tokens()
    assert _segment(store) != seg                     # a new file took the writes
    with Session.open(store, model="builtin:tiny", device="cpu", runtime=RT,
                      memory={"embedder": None}) as s:
        assert s.tokens() == tokens
        assert [f.id for f in s.recall("green mat wet", 1)] == [fid]
        assert s.memory.kv(fid) is not None          # its K/V record reads back
