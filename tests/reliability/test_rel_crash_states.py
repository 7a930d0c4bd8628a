"""Reliability: crash-state enumeration of the commit protocol.

A scripted workload (creation, write_epoch, stage+sync, retain, compact, add_fact, set_fact_kv,
forget_fact, close + reopen) runs with a recording FileOps (Store.open(fs=...)); before and after
every file operation and after every call the state a power cut could leave is taken (the index
files as they are: SQLite is crash-safe at its commit boundaries; each segment kept, dropped back
to its last fsync, torn inside its unsynced part, or that part zeroed) and checked with the kill
oracle against what was acknowledged at that moment. States of the first open are added.
"""
from __future__ import annotations

from capsule.tools.bench import reliability_crash as C


def test_every_crash_state_of_a_small_workload_recovers(work):
    tally = C.run_crash_states(work, size=1, seeds=(0,), signed=(False,))
    assert tally.counts["crash states"] >= 80, tally.counts
    assert not tally.failures, tally.report()


def test_every_crash_state_of_a_signed_store_recovers(work):
    tally = C.run_crash_states(work, size=1, seeds=(1,), signed=(True,))
    assert tally.counts["crash states"] >= 80, tally.counts
    assert not tally.failures, tally.report()


class LyingDisk(C.RecordingFS):
    """fsync returns without making anything durable: acknowledged bytes can vanish."""

    def fsync(self, fd):
        return self._around("fsync (lying)", lambda: C.FileOps.fsync(self, fd))


def test_the_enumeration_catches_a_disk_that_lies_about_fsync(work):
    # the harness must have teeth: with fsync ignored by the model, "dropped" states lose
    # acknowledged epochs, and the oracle has to say so
    en = C.Enumerator(work, work / "live", None, seed=3, tears=1)
    en.fs = LyingDisk(en.snapshot)
    C.run_workload(en, C.workload(1)[:6])
    causes = {cause for cause, _ in en.tally.failures}
    assert any("dropped" in c for c in causes), en.tally.report()
