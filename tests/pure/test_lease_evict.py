"""LeaseTable.grant(duration_s=...) and evict(): D's kept turns."""

from __future__ import annotations

from pdunit_utils import FakeClock

from vllm_pd_ext.leases.table import LeaseState, LeaseTable


def test_kept_turn_waits_its_own_ttl_then_renews_like_any_lease():
    clock = FakeClock()
    table = LeaseTable(30.0, clock)
    expiry = table.grant("turn", num_consumers=1, duration_s=480.0)
    assert expiry == clock() + 480.0
    clock.advance(400)
    assert table.sweep().expired == []
    # A reader's heartbeat never shortens it (480 is later than 400 + 30) ...
    assert table.renew("turn") == 80
    clock.advance(70)
    # ... and extends it by the lease duration once that is later.
    assert table.renew("turn") == 30
    clock.advance(29)
    assert table.sweep().expired == []
    clock.advance(2)
    assert table.sweep().expired == ["turn"]


def test_evict_ends_only_unused_leases():
    table = LeaseTable(30.0, FakeClock())
    for key in ("idle", "heartbeated", "pinned"):
        table.grant(key)
    table.renew("heartbeated")
    table.renew("pinned", acquire=True)
    assert table.evict("idle")
    assert not table.evict("heartbeated") and not table.evict("pinned")
    assert not table.evict("unknown") and not table.evict("idle")  # already ended
    result = table.sweep()
    assert result.released == ["idle"] and result.expired == []
    assert table.get("pinned").state is LeaseState.READING
