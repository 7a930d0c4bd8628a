"""Reliability: readers on other threads while a writer checkpoints, and hostile inputs to
signed and unsigned stores (forged records, swapped records, index rows repointed or absurd, a
2^60-byte length, swapped segment files, an index rolled back, wrong signing keys).
"""
from __future__ import annotations

from capsule.tools.bench import reliability_hostile as X
from capsule.tools.bench.reliability_concurrency import run_concurrency


def test_readers_beside_a_writer(work):
    tally = run_concurrency(work, writes=80)
    assert tally.counts.get("concurrent reads", 0) >= 20, tally.counts
    assert not tally.failures, tally.report()


def test_readers_beside_a_writer_signed(work):
    tally = run_concurrency(work, writes=60, signed=True, seed=1)
    assert not tally.failures, tally.report()


def test_hostile_inputs_are_refused_never_served(work):
    tally = X.run_hostile(work, rounds=1)
    assert tally.counts.get("hostile inputs", 0) >= 20, tally.counts
    assert not tally.failures, tally.report()
