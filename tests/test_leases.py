"""The lookup lease table both adapters keep (`lmcache.leases`): one late-release rule.

In-process pins (`lmcache.plugin`) and MP lookup locks (`lmcache.mp_adapter`) are leases in this
one table; the tests of each adapter (test_hot_path, test_stale, test_mp_adapter) check that
what a lease holds (a CPU-tier pin, a disk-cache file) is let go when the table says so. Here:
the rule itself, on explicit clock readings.
"""

from __future__ import annotations

from lmcache_cartridge.lmcache.leases import LeaseTable

LEASE = 10.0


def test_a_release_ends_the_oldest_lease_on_its_key_only():
    t = LeaseTable()
    t.take("k", "a", now=0)
    t.take("k", "b", now=1)
    t.take("j", "c", now=1)
    assert len(t) == 3 and t.keys_held() == 2 and t.held("k") == ("a", "b")
    assert t.release("k") == "a"
    assert t.held("k") == ("b",) and t.held("j") == ("c",)
    assert t.release("k") == "b"
    assert t.release("k") is None  # nothing left: a release of nothing ends nothing
    assert t.held("k") == () and len(t) == 1 and sorted(t.items()) == [("j", "c")]


def test_a_lease_never_released_expires_after_its_lease_and_is_handed_back():
    t = LeaseTable()
    t.take("k", "a", now=0)
    t.take("k", "b", now=8)
    assert t.expire(LEASE, now=LEASE) == []  # not older than the lease yet
    assert t.expire(LEASE, now=LEASE + 1) == [("k", "a")]
    assert t.held("k") == ("b",) and len(t) == 1
    assert t.expire(LEASE, now=LEASE + 1) == []  # handed back once
    assert t.expire(LEASE, now=19) == [("k", "b")]
    assert len(t) == 0 and t.keys_held() == 0


def test_a_late_release_ends_the_expired_lease_not_a_newer_lookups():
    t = LeaseTable()
    t.take("k", "old", now=0)
    assert t.expire(LEASE, now=11) == [("k", "old")]
    t.take("k", "new", now=12)
    assert t.release("k") is None  # LMCache, late, for the old lookup: the new lease stays
    assert t.held("k") == ("new",)
    assert t.release("k") == "new"  # the new lookup's own release
    assert t.held("k") == () and len(t) == 0


def test_the_record_of_an_expired_lease_is_kept_one_more_lease_then_forgotten():
    t = LeaseTable()
    t.take("k", "old", now=0)
    assert t.expire(LEASE, now=11) == [("k", "old")]
    assert t.expire(LEASE, now=21) == []  # one more lease from its expiry: still absorbs
    t.take("k", "new", now=21)
    assert t.release("k") is None and t.held("k") == ("new",)

    t.take("j", "old", now=0)
    t.expire(LEASE, now=11)
    t.expire(LEASE, now=22)  # over a lease since it expired: forgotten
    t.take("j", "new", now=22)
    assert t.release("j") == "new"  # a release that never came cannot absorb releases for ever


def test_a_zero_lease_expires_at_the_next_pass_and_still_absorbs_one_late_release():
    t = LeaseTable()
    t.take("k", "a", now=5)
    assert t.expire(0.0, now=5.001) == [("k", "a")]
    t.take("k", "b", now=5.002)
    assert t.release("k") is None and t.held("k") == ("b",)


def test_records_are_per_key_and_clear_hands_back_every_live_lease():
    t = LeaseTable()
    t.take("k", "a", now=0)
    assert t.expire(LEASE, now=11) == [("k", "a")]
    t.take("j", "b", now=11)
    assert t.release("j") == "b"  # k's record absorbs k's releases only
    t.take("j", "c", now=12)
    t.take("k", "d", now=12)
    assert sorted(t.clear()) == ["c", "d"]
    assert len(t) == 0 and t.release("k") is None  # the record went too
