"""A crash between the fsync and the index commit: the tail is adopted record by record, not by a
whole-log rebuild (open stays O(tail)), and what is adopted is exactly what was written."""
from __future__ import annotations

import shutil
from pathlib import Path

from capsule.memory.facttable import FactTable
from capsule.store import FileOps, Store

from test_store_findings import pages_for, view


class ImageAtFsync(FileOps):
    """Copies the store folder right after the next segment fsync: the power-cut image of a
    writer that died before its index commit."""

    def __init__(self, src: Path, dst: Path) -> None:
        self.src, self.dst, self.armed = src, dst, False

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        if self.armed:
            self.armed = False
            shutil.copytree(self.src, self.dst)


def _page_map(pages):
    return {r: {i: bytes(b) for i, b in p.items()} for r, p in pages.items()}


def test_uncommitted_epochs_of_a_group_commit_are_adopted_with_a_rollback_base(tmp_path):
    src, img = tmp_path / "s", tmp_path / "img"
    fs = ImageAtFsync(src, img)
    with Store.open(src, fs=fs) as st:
        for e in range(1, 6):
            st.write_epoch(pages_for(e), b'{"epoch": %d}' % e)
        # epoch 6 continues from epoch 2 (a rollback): its view reuses epoch 1-2 records the index holds
        assert st.stage_epoch([("kv", 99, b"six")], b'{"epoch": 6}', base=2) == 6
        assert st.stage_epoch([("kv", 98, b"seven")], b'{"epoch": 7}') == 7
        fs.armed = True
        st.sync()
    want6 = {**view(2), "kv": {**view(2)["kv"], 99: b"six"}}
    want7 = {**want6, "kv": {**want6["kv"], 98: b"seven"}}
    with Store.open(img) as st:
        assert st.latest_epoch() == 7 and len(st.recovery_report) == 1
        assert "6, 7" in st.recovery_report[0] and "adopted" in st.recovery_report[0]
        assert not (img / "quarantine").exists()                       # no rebuild, nothing set aside
        assert _page_map(st.load_epoch(6)[1]) == want6 and _page_map(st.load_epoch(7)[1]) == want7
        assert st.epochs()[-2].base == 2 and st.verify().ok
        assert st.write_epoch([("kv", 97, b"eight")], b"{}").id == 8      # writes go on after the tail
    with Store.open(img) as st:
        assert st.recovery_report == [] and _page_map(st.load_newest_valid()[2])["kv"][97] == b"eight"


def test_an_uncommitted_fact_and_forget_are_adopted(tmp_path):
    src = tmp_path / "s"
    fs = ImageAtFsync(src, tmp_path / "img-add")
    with Store.open(src, fs=fs) as st:
        st.write_epoch(pages_for(1), b"{}")
        first = FactTable(st).add_fact("The charger is in bay 2.", tags=["place"], n_tokens=6, fingerprint="f", rope="r",
                            kv=b"kv-one")
        fs.armed = True
        second = FactTable(st).add_fact("The red cup is fragile.", n_tokens=5, fingerprint="f", rope="r", kv=b"kv-two")
        fs.dst, fs.armed = tmp_path / "img-forget", True
        FactTable(st).forget_fact(first)
    with Store.open(tmp_path / "img-add") as st:
        assert "adopted" in st.recovery_report[0]
        assert [(f.id, f.text, f.tags) for f in FactTable(st).facts()] == [(first, "The charger is in bay 2.", ("place",)),
                                                               (second, "The red cup is fragile.", ())]
        assert FactTable(st).fact_kv(second) == b"kv-two" and st.verify().ok
        assert FactTable(st).add_fact("later", n_tokens=1, fingerprint="f", rope="r", kv=b"x") == second + 1
    with Store.open(tmp_path / "img-forget") as st:
        assert "adopted" in st.recovery_report[0] and [f.id for f in FactTable(st).facts()] == [second]
        st.repair()                                                     # and a rebuild agrees
        assert [f.id for f in FactTable(st).facts()] == [second] and FactTable(st).fact_kv(second) == b"kv-two"


def test_after_compaction_the_index_still_names_the_log_head(tmp_path):
    with Store.open(tmp_path / "s", segment_bytes=4096) as st:
        for e in range(1, 25):
            st.write_epoch(pages_for(e), b"{}")
        st.retain(3)
        assert st.compact() > 0
    with Store.open(tmp_path / "s") as st:   # a clean open: no rebuild, nothing adopted
        assert st.recovery_report == [] and _page_map(st.load_newest_valid()[2]) == view(24)
