"""LeaseTable lifecycle with an injected fake clock: states, the expiry heap,
pin holders."""

from __future__ import annotations

import pytest

from vllm_pd_ext.leases.table import Consumer, LeaseState, LeaseTable
from vllm_pd_ext.wire.protocol import LEASE_EXPIRED, LEASE_UNKNOWN


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


# ------------------------------------------------- cost: heap and release queue
def test_renewal_after_the_push_moves_the_expiry(table, clock):
    """A renewal leaves the heap entry where it was; the sweep finds the
    lease renewed when the old entry comes due and re-pushes it."""
    table.grant("r1")
    clock.advance(6.0)
    table.renew("r1")  # now expires at +16
    clock.advance(5.0)  # past the granted expiry (+10)
    assert table.sweep().expired == []
    assert "r1" in table and len(table._expiries) == 1  # re-pushed, not duplicated
    assert table.next_expiry() == pytest.approx(clock.now + 5.0)
    clock.advance(5.0)
    assert table.sweep().expired == ["r1"]
    assert table._expiries == []


def test_expired_ids_come_in_expiry_order(table, clock):
    """In expiry order, a renewed lease at its renewed expiry, even when
    its old heap entry and the renewed expiry both passed before the sweep."""
    table.grant("late")  # expires at +10 ...
    clock.advance(1.0)
    table.grant("early")  # +11
    clock.advance(1.0)
    table.renew("late")  # ... renewed: +12
    clock.advance(1.0)
    table.grant("last")  # +13
    clock.advance(20.0)
    assert table.sweep().expired == ["early", "late", "last"]


def test_writing_lease_leaves_the_heap_and_never_expires(table, clock):
    table.grant("w", num_consumers=2)
    table.grant("h")
    table.hold("w")
    clock.advance(10.0)
    assert table.sweep().expired == ["h"]
    assert table._expiries == []  # the WRITING lease's entry is dropped, not re-pushed
    assert table.next_expiry() is None  # nothing left that can expire
    clock.advance(1000.0)
    assert table.sweep().expired == [] and "w" in table
    table.release("w", rank=0)
    assert table.release("w", rank=1) is True and table.has_released()
    assert table.sweep().released == ["w"]


def test_has_released_until_the_sweep(table):
    table.grant("a")
    table.grant("b")
    assert not table.has_released()
    table.release("a")
    assert table.has_released()
    assert table.release("a") is False  # already released: not queued twice
    assert table.sweep().released == ["a"]
    assert not table.has_released() and "b" in table


def test_heap_stays_bounded_under_churn(table, clock):
    """Released leases leave stale heap entries behind; the heap is rebuilt
    before they outnumber the live leases."""
    table.grant("live")
    for i in range(10_000):
        table.grant(f"r{i}")
        table.release(f"r{i}")
        table.sweep()
        assert len(table._expiries) <= 2 * len(table) + 64
    clock.advance(10.0)
    assert table.sweep().expired == ["live"]


def test_regranted_id_ignores_its_old_heap_entry(table, clock):
    table.grant("r1")
    table.release("r1")
    table.sweep()
    clock.advance(5.0)
    table.grant("r1")  # expires at +15; the first grant's entry (+10) is stale
    clock.advance(6.0)
    assert table.sweep().expired == [] and "r1" in table
    clock.advance(4.0)
    assert table.sweep().expired == ["r1"]


def test_tombstones_bounded_with_many_expiries(clock):
    table = LeaseTable(1.0, clock, max_tombstones=8)
    for i in range(100):
        table.grant(f"r{i}")
    clock.advance(2)
    assert len(table.sweep().expired) == 100
    assert len(table._tombstones) == 8 and table._expiries == []
    assert table.renew("r99") == LEASE_EXPIRED and table.renew("r0") == LEASE_UNKNOWN


def test_sweep_and_has_released_touch_only_what_changed(clock, monkeypatch):
    """The step's path (sweep + has_released) reads no lease that neither
    came due nor was released: its cost does not grow with the live leases."""
    from vllm_pd_ext.leases import table as leases_mod

    reads = [0]

    class CountingLease(leases_mod.Lease):
        def __getattribute__(self, name):
            reads[0] += 1
            return super().__getattribute__(name)

    monkeypatch.setattr(leases_mod, "Lease", CountingLease)
    table = LeaseTable(10.0, clock)
    for i in range(1000):
        table.grant(f"r{i}")
    table.release("r7")
    clock.advance(1.0)
    reads[0] = 0
    res = table.sweep()
    assert res.released == ["r7"] and res.expired == []
    assert reads[0] <= 10, f"the sweep read {reads[0]} lease attributes for one change"
    reads[0] = 0
    assert not table.has_released()
    assert reads[0] == 0


# ------------------------------------------------- holders (replay, n > 1)
D1 = Consumer("eng-d", "d-req-1")
D2 = Consumer("eng-d", "d-req-2")


def test_two_consumers_pin_the_same_lease_first_release_keeps_it(table):
    table.grant("r")
    assert table.renew("r", acquire=True, holder=(D1, 0)) > 0
    assert table.renew("r", acquire=True, holder=(D2, 0)) > 0
    # D1 is done; D2 may still be reading.
    assert table.release("r", rank=0, consumer=D1) is False
    assert table.get("r").state is LeaseState.READING and not table.has_released()
    assert table.sweep().released == []
    assert table.release("r", rank=0, consumer=D2) is True
    assert table.sweep().released == ["r"]


def test_holder_needs_its_own_release_even_if_another_consumer_released_twice(table):
    table.grant("r")
    table.renew("r", acquire=True, holder=(D1, 0))
    table.renew("r", acquire=True, holder=(D2, 0))
    assert table.release("r", rank=0, consumer=D2) is False
    assert table.release("r", rank=0, consumer=D2) is False
    assert table.get("r").holders == {(D1, 0)}


def test_tp2_one_consumer(table):
    table.grant("r", num_consumers=2)
    table.renew("r", acquire=True, holder=(D1, 0))
    table.renew("r", acquire=True, holder=(D1, 1))
    assert table.release("r", rank=0, consumer=D1) is False
    assert table.get("r").state is LeaseState.READING
    assert table.release("r", rank=1, consumer=D1) is True


def test_tp2_two_consumers_each_rank_held_until_released(table):
    table.grant("r", num_consumers=2)
    for holder in ((D1, 0), (D1, 1), (D2, 0), (D2, 1)):
        table.renew("r", acquire=True, holder=holder)
    for rank in (0, 1):
        assert table.release("r", rank=rank, consumer=D1) is False
    assert table.release("r", rank=0, consumer=D2) is False
    assert table.get("r").holders == {(D2, 1)}
    assert table.release("r", rank=1, consumer=D2) is True


def test_not_needed_release_before_any_pin_ends_the_lease_as_before(table):
    table.grant("r", num_consumers=2)
    table.renew("r")  # heartbeats only; D's prefix cache had everything
    assert table.release("r", rank=0, ok=False) is False
    assert table.release("r", rank=1, ok=False) is True
    assert table.sweep().released == ["r"]


def test_release_naming_no_consumer_never_ends_another_consumers_hold(table):
    table.grant("r")
    table.renew("r", acquire=True, holder=(D2, 0))
    # An older peer (or D1's not-needed path) releases without a consumer.
    assert table.release("r", rank=0) is False
    assert table.get("r").state is LeaseState.READING
    assert table.release("r", rank=0, consumer=D2) is True


def test_pin_without_consumer_counts_ranks_only(table):
    """An older peer's pin (no consumer) records no holder: its release,
    which names none either, ends the lease as before."""
    table.grant("r")
    table.renew("r", acquire=True)
    assert table.get("r").holders == set()
    assert table.release("r", rank=0) is True


def test_pin_without_rank_is_dropped_by_that_consumers_release(table):
    table.grant("r")
    table.renew("r", acquire=True, holder=(D1, -1))
    assert table.release("r", rank=0, consumer=D2) is False
    assert table.release("r", rank=0, consumer=D1) is True


def test_holder_that_never_releases_expires_when_heartbeats_stop(table, clock):
    table.grant("r")
    table.renew("r", acquire=True, holder=(D1, 0))
    table.renew("r", acquire=True, holder=(D2, 0))
    table.release("r", rank=0, consumer=D2)
    for _ in range(5):  # D1 keeps heartbeating: held well past one duration
        clock.advance(8.0)
        table.renew("r")
        assert table.sweep().expired == []
    clock.advance(10.0)  # D1 went silent (died after its pin)
    res = table.sweep()
    assert res.expired == ["r"] and res.released == []
    assert table.renew("r", acquire=True, holder=(D1, 0)) == LEASE_EXPIRED


def test_pin_on_a_writing_lease_takes_no_holder(table):
    """Push: a pin naming a consumer must not keep P's own WRITE lease (which
    never expires) alive after P's ranks released it."""
    table.grant("w")
    table.hold("w")
    table.renew("w", acquire=True, holder=(D1, 0))
    assert table.get("w").holders == set()
    assert table.release("w", rank=0) is True


def test_holders_per_lease_are_bounded(table, monkeypatch):
    from vllm_pd_ext.leases import table as leases_mod

    monkeypatch.setattr(leases_mod, "MAX_HOLDERS", 3)
    table.grant("r")
    for i in range(3):
        assert table.renew("r", acquire=True, holder=(Consumer("d", f"c{i}"), 0)) > 0
    assert table.renew("r", acquire=True, holder=(Consumer("d", "c3"), 0)) == LEASE_EXPIRED
    assert table.renew("r", acquire=True, holder=(Consumer("d", "c0"), 0)) > 0  # known holder
    assert len(table.get("r").holders) == 3
