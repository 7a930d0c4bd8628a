"""Reliability: SIGKILL writers at random moments; the kill oracle after every kill (>= 50 kills).

Store-level writers (write_epoch, stage+sync group commits, retention, compaction, add_fact /
set_fact_kv / forget_fact, discard_staged, close+reopen, and the very first open that creates the
store; a quarter of the chains signed) and Sessions (model=None, policy builtin:gru) checkpointing
with wait=True and wait=False. Each kill is followed by: reopen never raises; every acknowledged
epoch retention would keep is there; the newest is >= the newest acknowledged; every epoch is
bit-exact; acknowledged facts exact, acknowledged forgets stay forgotten; the store takes a write.

The harness is capsule.tools.bench.reliability_* (the same code as `capsule bench --suite reliability`).
A failure message groups the failing kills by cause with one recipe each (chain seed, life,
kill delay, the call the kill landed in, the newest acknowledged epoch, the store folder).
"""
from __future__ import annotations

from capsule.tools.bench import reliability_kills as K


def test_store_writers_survive_sigkill(tmp_path):
    tally = K.run_kills(tmp_path, K.plan(40, 0, seed=1, per_chain=8))
    assert not tally.failures, tally.report()
    assert tally.counts["kills"] == 40
    assert tally.counts.get("acknowledged epochs", 0) > 40     # kills landed after real work, not only at open


def test_sessions_survive_sigkill_wait_true_and_false(tmp_path):
    chains = K.plan(0, 16, seed=2)
    assert {c.wait for c in chains} == {True, False}
    tally = K.run_kills(tmp_path, chains)
    assert not tally.failures, tally.report()
    assert tally.counts["kills"] == 16


def test_a_kill_inside_the_first_open_that_creates_the_store(tmp_path):
    # one kill per fresh store, aimed into the window where the first Store.open (directly, or
    # inside Session.open) creates the store: the next open must work as if nothing had happened
    chains = K.plan(0, 4, seed=3, first_opens=16)
    tally = K.run_kills(tmp_path, chains)
    assert not tally.failures, tally.report()
    assert tally.counts["kills"] == 36
