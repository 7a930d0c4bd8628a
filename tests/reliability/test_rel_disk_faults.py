"""Reliability: disk full and EIO. Injected through FileOps (ENOSPC / EIO on write, fsync,
fsync_dir, truncate, open, unlink at every call index of a workload; the fault once, for a
while ("stuck": cleanup fails too), or in the cleanup), and for real on a 4 MiB tmpfs.

Contract: every failure is a StoreIOError (a CapsuleError); nothing acknowledged is lost; once
the fault is gone the same Store object writes again; a reopen passes the kill oracle.
"""
from __future__ import annotations

import errno

import pytest

from capsule.tools.bench import reliability_faults as F


def test_enospc_and_eio_at_every_call_index(work):
    tally = F.run_faults(work, size=1, errs=(errno.ENOSPC, errno.EIO), stride=2)
    assert tally.counts["fault runs"] >= 60, tally.counts
    assert not tally.failures, tally.report()


def test_faults_in_a_signed_store(work):
    tally = F.run_faults(work, size=1, errs=(errno.EIO,), stride=5, signed=True)
    assert tally.counts["fault runs"] >= 10, tally.counts
    assert not tally.failures, tally.report()


def test_a_really_full_disk(work):
    tally = F.run_tmpfs(work, rounds=2)
    if tally.counts.get("tmpfs skipped (mount refused)"):
        pytest.skip("mount -t tmpfs was refused here (needs root)")
    assert tally.counts.get("tmpfs failures", 0) >= 2, tally.counts    # the disk really ran full
    assert not tally.failures, tally.report()
