"""D's HeartbeatSender against a real P side channel (real clock, short leases)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from pdunit_utils import free_port, wait_for

from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.scheduler.heartbeats import HeartbeatSender
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.side_channel import LeaseService, SideChannelServer

HOST = "127.0.0.1"
#: P's lease. Long enough that a loaded CI host that stalls the heartbeat
#: thread (or its 50 ms requests) for a second does not let it lapse; every
#: check that a lease *was kept* sleeps past ``LEASE_S + MARGIN_S``, so a
#: sender that did not renew still lets it expire first.
LEASE_S = 1.5
MARGIN_S = 1.0
COMPAT = proto.CompatInfo(protocol_version=1, model="m", dtype="bfloat16", block_size=128,
                          kv_layout="LBHNC", num_layers=2, num_kv_heads=2, head_size=64,
                          tp_size=1, transfer_mode="pull")


@pytest.fixture
def p_side() -> Iterator[tuple[LeaseService, int]]:
    leases = LeaseService(LeaseTable(LEASE_S, time.monotonic))
    port = free_port()
    server = SideChannelServer(HOST, port, "eng-p", COMPAT, {}, leases)
    try:
        yield leases, port
    finally:
        server.close()


def sweep(leases: LeaseService) -> tuple[list[str], list[str]]:
    with leases.lock:
        result = leases.table.sweep()
    return result.released, result.expired


def test_heartbeats_keep_a_lease_alive_past_its_duration(p_side) -> None:
    leases, port = p_side
    with leases.lock:
        leases.table.grant("p-1")
    sender = HeartbeatSender("eng-d", interval_s=0.1, timeout_s=1.0)
    try:
        sender.track("d-1", (HOST, port), "p-1")
        time.sleep(LEASE_S + MARGIN_S)  # past the lease: it was renewed
        assert sweep(leases) == ([], [])
        # A few, not one per 0.1 s: a loaded host fails some 50 ms requests.
        assert leases.table.get("p-1").num_renewals >= 3
        assert leases.num_heartbeats >= 3
        sender.untrack("d-1")
        # Silence for more than a lease (plus room for a renew still in flight).
        time.sleep(LEASE_S + MARGIN_S)
        assert sweep(leases) == ([], ["p-1"])
    finally:
        sender.close()


def test_first_heartbeat_leaves_at_once(p_side) -> None:
    leases, port = p_side
    with leases.lock:
        leases.table.grant("p-2")
    sender = HeartbeatSender("eng-d", interval_s=5.0, timeout_s=1.0)
    try:
        sender.track("d-2", (HOST, port), "p-2")
        # 3 s, not 0.5: a loaded host is slow to start the thread; a first beat
        # that waited for the interval would come after 5 s.
        assert wait_for(lambda: leases.num_heartbeats >= 1, timeout=3.0)
    finally:
        sender.close()


def test_interval_adapts_to_a_shorter_lease_on_p(p_side) -> None:
    """D configured for 5 s beats still keep P's 1.5 s lease alive."""
    leases, port = p_side
    with leases.lock:
        leases.table.grant("p-3")
    sender = HeartbeatSender("eng-d", interval_s=5.0, timeout_s=1.0)
    try:
        sender.track("d-3", (HOST, port), "p-3")
        time.sleep(LEASE_S + MARGIN_S)  # past the lease: a 5 s beat would let it lapse
        assert sweep(leases) == ([], [])
    finally:
        sender.close()


def test_release_frees_every_rank(p_side) -> None:
    leases, port = p_side
    with leases.lock:
        leases.table.grant("p-4", num_consumers=2)
    sender = HeartbeatSender("eng-d", interval_s=0.1, timeout_s=1.0)
    try:
        sender.release((HOST, port), "p-4", tp_size=2, reason="aborted before load")
        assert wait_for(lambda: leases.table.get("p-4").state is LeaseState.RELEASED)
        assert sweep(leases) == (["p-4"], [])
    finally:
        sender.close()


def test_dead_p_does_not_starve_a_live_one(p_side) -> None:
    leases, port = p_side
    with leases.lock:
        leases.table.grant("p-5")
    dead = free_port()  # nothing listens there
    sender = HeartbeatSender("eng-d", interval_s=0.1, timeout_s=5.0)
    try:
        sender.track("d-dead", (HOST, dead), "p-x")
        sender.track("d-5", (HOST, port), "p-5")
        time.sleep(LEASE_S + MARGIN_S)
        assert sweep(leases) == ([], [])  # kept alive despite the dead endpoint
    finally:
        sender.close()


def test_sender_thread_survives_any_exception_and_serves_other_peers(p_side, monkeypatch
                                                                     ) -> None:
    """An unexpected exception while talking to one P (here: a bug injected
    into the client) is logged; the thread goes on renewing other Ps' leases."""
    from vllm_pd_ext.wire.side_channel import SideChannelClient

    leases, port = p_side
    with leases.lock:
        leases.table.grant("p-good")
    real = SideChannelClient.request

    def flaky(self, host, p, msg):
        if p == 1:
            raise RuntimeError("injected")
        return real(self, host, p, msg)

    monkeypatch.setattr(SideChannelClient, "request", flaky)
    sender = HeartbeatSender("eng-d", interval_s=0.1, timeout_s=1.0)
    try:
        sender.track("d-bad", (HOST, 1), "p-bad")
        sender.track("d-good", (HOST, port), "p-good")
        time.sleep(LEASE_S + MARGIN_S)  # past the lease: a dead thread lets it lapse
        assert sender._thread is not None and sender._thread.is_alive()
        assert leases.table.get("p-good").num_renewals >= 3
        assert sweep(leases) == ([], [])
    finally:
        sender.close()


def test_leases_p_reports_expired_reach_on_expired_and_a_raising_callback_is_survived(
        p_side) -> None:
    """A lease that expired on P (here: never renewed in time) is reported
    to ``on_expired`` with its endpoint; a live lease and an unknown one are
    not; a callback that raises does not stop the renewals."""
    leases, port = p_side
    with leases.lock:
        leases.table.grant("p-gone")
    time.sleep(LEASE_S + 0.1)  # p-gone's lease lapses (a late wake-up only adds)...
    with leases.lock:
        # ...and p-live is granted now, with a whole lease for the sender to renew
        # (granted beside p-gone and renewed in between, a stalled host lost it).
        leases.table.grant("p-live")
    seen: list[tuple[tuple[str, int], list[str]]] = []

    def on_expired(endpoint: tuple[str, int], ids: list[str]) -> None:
        seen.append((endpoint, ids))
        raise RuntimeError("injected")

    sender = HeartbeatSender("eng-d", interval_s=0.1, timeout_s=1.0)
    sender.on_expired = on_expired
    try:
        sender.track("d-gone", (HOST, port), "p-gone")
        sender.track("d-live", (HOST, port), "p-live")
        sender.track("d-unknown", (HOST, port), "p-never-granted")
        assert wait_for(lambda: len(seen) >= 2)
        assert all(s == ((HOST, port), ["p-gone"]) for s in seen), seen
        # p-live still renewed after the raises; only p-gone (not swept yet) expired
        assert sweep(leases) == ([], ["p-gone"])
    finally:
        sender.close()
