"""LeaseTable lifecycle with an injected fake clock."""

from __future__ import annotations

import pytest

from vllm_pd_ext.leases import LeaseState, LeaseTable
from vllm_pd_ext.protocol import LEASE_EXPIRED, LEASE_UNKNOWN


@pytest.fixture
def table(clock):
    return LeaseTable(10.0, clock)


def test_duration_must_be_positive(clock):
    with pytest.raises(ValueError, match="duration"):
        LeaseTable(0, clock)


def test_grant_sets_expiry_and_state(table, clock):
    expiry = table.grant("r1")
    assert expiry == clock.now + 10.0
    lease = table.get("r1")
    assert lease is not None and lease.state is LeaseState.HELD
    assert lease.num_consumers == 1
    assert "r1" in table and len(table) == 1
    assert table.next_expiry() == expiry


def test_grant_twice_refused(table):
    table.grant("r1")
    with pytest.raises(KeyError):
        table.grant("r1")


def test_grant_num_consumers_at_least_one(table):
    table.grant("r1", num_consumers=0)
    assert table.get("r1").num_consumers == 1


def test_renew_extends_with_max(table, clock):
    table.grant("r1")
    clock.advance(4.0)
    left = table.renew("r1")
    assert left == pytest.approx(10.0)
    assert table.get("r1").expiry == pytest.approx(clock.now + 10.0)
    # A renewal never shortens: shrink the duration and renew again.
    before = table.get("r1").expiry
    table.duration_s = 1.0
    left = table.renew("r1")
    assert table.get("r1").expiry == before
    assert left == pytest.approx(10.0)
    assert table.num_renewals == 2 and table.get("r1").num_renewals == 2


def test_acquire_sets_reading(table, clock):
    table.grant("r1")
    clock.advance(1.0)
    left = table.renew("r1", acquire=True)
    assert left == pytest.approx(10.0)
    assert table.get("r1").state is LeaseState.READING


def test_renew_unknown(table):
    assert table.renew("nope") == LEASE_UNKNOWN
    assert table.renew("nope", acquire=True) == LEASE_UNKNOWN


def test_expired_never_resurrected(table, clock):
    table.grant("r1")
    clock.advance(10.0)  # expiry <= now counts as expired
    assert table.renew("r1") == LEASE_EXPIRED
    assert table.get("r1").expiry == clock.now  # not extended
    res = table.sweep()
    assert res.expired == ["r1"] and res.released == []
    # After the sweep: tombstoned, still expired, not unknown.
    assert table.renew("r1") == LEASE_EXPIRED
    assert "r1" not in table


def test_pin_refused_after_expiry(table, clock):
    table.grant("r1")
    clock.advance(10.5)
    assert table.renew("r1", acquire=True) == LEASE_EXPIRED
    assert table.get("r1").state is LeaseState.HELD
    assert table.sweep().expired == ["r1"]
    assert table.renew("r1", acquire=True) == LEASE_EXPIRED


def test_release_single_consumer(table):
    table.grant("r1")
    assert table.release("r1", rank=0) is True
    assert table.get("r1").state is LeaseState.RELEASED
    # A released but unswept lease refuses renewals.
    assert table.renew("r1") == LEASE_EXPIRED
    res = table.sweep()
    assert res.released == ["r1"] and res.expired == []
    assert len(table) == 0
    # Released leases are not tombstoned: a later message sees UNKNOWN.
    assert table.renew("r1") == LEASE_UNKNOWN


def test_release_unknown_is_false(table):
    assert table.release("ghost") is False


def test_multi_rank_release_needs_all_ranks(table, clock):
    table.grant("r1", num_consumers=2)
    assert table.release("r1", rank=0) is False
    assert table.get("r1").state is not LeaseState.RELEASED
    # The same rank twice does not count double.
    assert table.release("r1", rank=0) is False
    assert table.sweep().released == []
    assert table.release("r1", rank=1, ok=False) is True
    lease = table.get("r1")
    assert lease.state is LeaseState.RELEASED
    assert lease.release_ok is False
    assert table.sweep().released == ["r1"]


def test_release_ok_flag(table):
    table.grant("r1")
    table.release("r1", ok=True)
    assert table.get("r1").release_ok is True


def test_sweep_frees_each_id_exactly_once(table, clock):
    table.grant("a")
    table.grant("b")
    table.grant("c")
    clock.advance(5.0)
    table.grant("d")  # expires 5 s later than the others
    table.release("b")
    clock.advance(5.0)  # a, c expired; d alive; b released
    res = table.sweep()
    assert sorted(res.expired) == ["a", "c"]
    assert res.released == ["b"]
    assert table.num_expired == 2
    assert list(table.sweep().expired) == [] and table.sweep().released == []
    clock.advance(100.0)
    res = table.sweep()
    assert res.expired == ["d"] and res.released == []
    assert table.sweep() == type(res)([], [])
    assert table.num_expired == 3
    assert len(table) == 0


def test_sweep_empty(table):
    res = table.sweep()
    assert res.released == [] and res.expired == []


def test_renewed_lease_survives_sweep(table, clock):
    table.grant("r1")
    clock.advance(9.0)
    table.renew("r1")
    clock.advance(9.0)
    assert table.sweep().expired == []
    clock.advance(1.0)
    assert table.sweep().expired == ["r1"]


def test_next_expiry(table, clock):
    assert table.next_expiry() is None
    e1 = table.grant("a")
    clock.advance(3.0)
    e2 = table.grant("b")
    assert table.next_expiry() == e1
    clock.advance(1.0)
    table.renew("a")  # a now expires 1 s after b
    assert table.next_expiry() == e2
    table.release("b")
    table.sweep()
    assert table.next_expiry() == clock.now + 10.0
    table.release("a")
    table.release("b")
    table.sweep()
    assert table.next_expiry() is None


def test_regrant_clears_tombstone(table, clock):
    table.grant("r1")
    clock.advance(11)
    table.sweep()
    assert table.renew("r1") == LEASE_EXPIRED
    table.grant("r1")
    assert table.renew("r1") == pytest.approx(10.0)


def test_tombstones_bounded(clock):
    table = LeaseTable(1.0, clock, max_tombstones=2)
    for rid in ("a", "b", "c"):
        table.grant(rid)
    clock.advance(2)
    assert sorted(table.sweep().expired) == ["a", "b", "c"]
    # Oldest tombstone dropped: "a" is forgotten, the two newest remembered.
    assert table.renew("a") == LEASE_UNKNOWN
    assert table.renew("b") == LEASE_EXPIRED
    assert table.renew("c") == LEASE_EXPIRED


# ------------------------------------------------------------------ push: hold
def test_held_lease_never_expires(table, clock):
    table.grant("r1", num_consumers=2)
    assert table.hold("r1") is True
    assert table.get("r1").state is LeaseState.WRITING
    clock.advance(1000.0)
    res = table.sweep()
    assert res.expired == [] and res.released == []
    assert "r1" in table
    assert table.release("r1", rank=0) is False
    clock.advance(1000.0)
    assert table.sweep().expired == []
    assert table.release("r1", rank=1, ok=False) is True
    assert table.get("r1").release_ok is False
    res = table.sweep()
    assert res.released == ["r1"] and res.expired == []
    assert "r1" not in table and table.num_expired == 0


def test_hold_unknown_or_released(table):
    assert table.hold("ghost") is False
    table.grant("r1")
    table.release("r1")
    assert table.hold("r1") is False
    assert table.get("r1").state is LeaseState.RELEASED
    assert table.sweep().released == ["r1"]


def test_unheld_lease_still_expires(table, clock):
    table.grant("held")
    table.grant("free")
    table.hold("held")
    clock.advance(10.0)
    assert table.sweep().expired == ["free"]


def test_release_from_a_rank_outside_the_consumers_is_ignored(table):
    """A hostile or confused peer naming rank 5 (or -1) must not count as one
    more consumer: rank 1 may still be reading."""
    table.grant("r", num_consumers=2)
    for rank in (5, -1, 2):
        assert table.release("r", rank=rank) is False
    assert table.release("r", rank=0) is False
    assert table.get("r").state is not LeaseState.RELEASED
    assert table.release("r", rank=1) is True


def test_pin_on_a_writing_lease_does_not_make_it_expirable(table, clock):
    """Push: P's own WRITE reads the blocks of a held lease. A pin for the
    same id (a confused or hostile peer) must not turn it back into a lease
    that expires while the WRITE may still read."""
    table.grant("w")
    assert table.hold("w") is True
    assert table.renew("w", acquire=True) > 0
    assert table.get("w").state is LeaseState.WRITING
    clock.now += 10 * table.duration_s
    assert table.sweep().expired == []
    assert table.release("w", rank=0) is True
