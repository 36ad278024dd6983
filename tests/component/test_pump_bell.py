"""The pump's bell over real ZMQ sockets (wire/pump_bell.py): a ring wakes
a waiting bell at once on every rank, rings closer than RING_EVERY_S are
coalesced, an unrung bell times out, and a closed ringer is harmless."""

from __future__ import annotations

import threading
import time

from vllm_pd_ext.wire import pump_bell
from vllm_pd_ext.wire.pump_bell import Bell, BellRinger


def _wait_rung(bell: Bell, within_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if bell.wait(0.05):
            return time.monotonic() - t0
    raise AssertionError("the bell was never rung")


def test_a_ring_reaches_every_rank_and_wakes_it() -> None:
    bells = [Bell(), Bell()]
    ringer = BellRinger([b.endpoint for b in bells])
    try:
        assert bells[0].endpoint.startswith("tcp://127.0.0.1:")
        # ZMQ connects asynchronously: ring until the first ring lands.
        deadline = time.monotonic() + 5
        while not bells[0].wait(0.01):
            assert time.monotonic() < deadline, "first ring never arrived"
            ringer._last = -1e9
            ringer.ring()
        _wait_rung(bells[1])
        # Connected now: a bell waiting for 10 s wakes when rung (from
        # another thread, as the side channel's thread rings).
        ringer._last = -1e9
        timer = threading.Timer(0.2, ringer.ring)
        timer.start()
        t0 = time.monotonic()
        assert bells[0].wait(10.0)
        assert time.monotonic() - t0 < 5.0
        timer.join()
        assert bells[0].num_rings >= 2
    finally:
        ringer.close()
        for b in bells:
            b.close()


def test_rings_closer_than_the_period_are_coalesced() -> None:
    now = [0.0]
    bell = Bell()
    ringer = BellRinger([bell.endpoint], clock=lambda: now[0])
    try:
        ringer.ring()
        ringer.ring()
        now[0] += pump_bell.RING_EVERY_S / 2
        ringer.ring()
        assert ringer.num_rings == 1
        now[0] += pump_bell.RING_EVERY_S
        ringer.ring()
        assert ringer.num_rings == 2
    finally:
        ringer.close()
        bell.close()


def test_an_unrung_bell_times_out_and_a_closed_ringer_is_harmless() -> None:
    bell = Bell()
    ringer = BellRinger([bell.endpoint])
    try:
        t0 = time.monotonic()
        assert not bell.wait(0.05)
        assert time.monotonic() - t0 >= 0.04
        ringer.close()
        ringer._last = -1e9
        ringer.ring()  # after close: nothing to send, no error
        assert not bell.wait(0.05)
    finally:
        bell.close()
