"""D's idle wait in push mode (``idle_wait.py``, issue 10).

``should_wait`` is pure: a table flips each of its four conditions in turn.
``IdleWait`` / ``Waker`` are tested with their real ZMQ sockets (in-process
and TCP on 127.0.0.1) and real threads, against the wall clock. The machine
may be loaded, so the bounds are generous: a wait that nobody ends lasts at
least ``0.8 * TIMEOUT_S``; a wait that a wake should end runs with a long
timeout (``WOKEN_TIMEOUT_S``) and returns under ``EARLY_S``, so a host that
stalls the waking thread for a second cannot make it time out, and a wake
that never ends the wait still fails it.
"""

from __future__ import annotations

import threading
import time

import pytest

from vllm_pd_ext.wire.wakeup import IdleWait, Waker, should_wait

TIMEOUT_S = 0.2
#: The timeout of a wait that a wake should end (``woken_wait``): a wake that
#: does not end it is seen as a 5 s wait that returns False.
WOKEN_TIMEOUT_S = 5.0
#: A woken wait returns well before its timeout (2 s: a stalled CI host once
#: took 85 ms for what nominally takes 0.1 s, and stalls of seconds happen).
EARLY_S = 2.0


def timed_wait(idle: IdleWait) -> tuple[bool, float]:
    t0 = time.monotonic()
    woken = idle.wait()
    return woken, time.monotonic() - t0


def woken_wait(idle: IdleWait) -> tuple[bool, float]:
    """``timed_wait`` for a wait that a wake should end, with the long timeout."""
    idle.timeout_s = WOKEN_TIMEOUT_S
    try:
        return timed_wait(idle)
    finally:
        idle.timeout_s = TIMEOUT_S


@pytest.fixture
def idle():
    iw = IdleWait(TIMEOUT_S)
    yield iw
    iw.close()


# ------------------------------------------------------------ should_wait
#: (scheduled_tokens, num_push_waits, has_work_for_worker, num_finished)
IDLE_STEP = (0, 3, False, 0)


def test_should_wait_on_an_idle_push_step():
    assert should_wait(*IDLE_STEP) is True


@pytest.mark.parametrize("step,why", [
    ((1, 3, False, 0), "the step schedules tokens"),
    ((512, 3, False, 0), "the step schedules tokens"),
    ((0, 0, False, 0), "D waits for no pushed KV"),
    ((0, 3, True, 0), "the worker must hear of new specs or failures now"),
    ((0, 3, False, 1), "finished requests must be freed"),
    ((0, 0, True, 2), "nothing says wait"),
])
def test_should_not_wait_when_any_condition_fails(step, why):
    assert should_wait(*step) is False, why


# ------------------------------------------------------------ IdleWait
def test_wait_without_wake_times_out(idle):
    woken, took = timed_wait(idle)
    assert woken is False
    assert took >= 0.8 * TIMEOUT_S
    assert idle.num_waits == 1 and idle.num_woken == 0
    assert idle.seconds_waited >= 0.8 * TIMEOUT_S


def test_wake_from_another_thread_ends_the_wait_early(idle):
    def waker() -> None:
        time.sleep(0.02)
        idle.wake()

    thread = threading.Thread(target=waker)
    thread.start()
    try:
        woken, took = woken_wait(idle)
    finally:
        thread.join(5)
    assert woken is True
    assert took < EARLY_S
    assert idle.num_waits == 1 and idle.num_woken == 1


def test_wake_while_not_waiting_ends_only_the_next_wait(idle):
    for _ in range(5):  # several threads' wakes while D was stepping
        idle.wake()
    woken, took = woken_wait(idle)
    assert woken is True and took < EARLY_S
    # The queued wakes were drained: the following wait blocks again.
    woken, took = timed_wait(idle)
    assert woken is False and took >= 0.8 * TIMEOUT_S
    assert idle.num_waits == 2 and idle.num_woken == 1


def test_wakes_from_many_threads_are_safe(idle):
    threads = [threading.Thread(target=lambda: [idle.wake() for _ in range(50)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert idle.wait() is True
    woken, took = timed_wait(idle)
    assert woken is False and took >= 0.8 * TIMEOUT_S


# ------------------------------------------------------------ Waker (worker side)
def test_worker_waker_wakes_across_sockets(idle):
    waker = Waker()
    try:
        assert waker.endpoint.startswith("tcp://127.0.0.1:")
        idle.connect([waker.endpoint])
        # The TCP connection takes a moment; until then a wake finds no peer
        # (and is dropped: not counted). The one that went is waited for with
        # the long timeout, so no late one is left to end a later wait.
        deadline = time.monotonic() + 5.0
        while not waker.num_wakes and time.monotonic() < deadline:
            waker.wake()
            time.sleep(0.01)
        woken, _ = woken_wait(idle)
        assert woken, "the worker's wake never reached the scheduler's wait"
        assert waker.num_wakes >= 1
        # Connected now: one wake while the scheduler waits ends it early.
        thread = threading.Thread(target=lambda: (time.sleep(0.02), waker.wake()))
        thread.start()
        try:
            woken, took = woken_wait(idle)
        finally:
            thread.join(5)
        assert woken is True and took < EARLY_S
        # Nothing left queued: the next wait runs to its timeout.
        woken, took = timed_wait(idle)
        assert woken is False and took >= 0.8 * TIMEOUT_S
    finally:
        waker.close()


def test_waker_without_a_scheduler_does_not_block():
    waker = Waker()
    try:
        t0 = time.monotonic()
        for _ in range(10):
            waker.wake()  # no peer: dropped, never blocks the progress pump
        assert time.monotonic() - t0 < 3.0  # generous for stalled hosts; a blocking send hangs
        assert waker.num_wakes == 0
    finally:
        waker.close()


def test_close_both_sides():
    idle = IdleWait(TIMEOUT_S)
    waker = Waker()
    idle.connect([waker.endpoint])
    waker.wake()
    idle.wait()
    done = threading.Event()

    def close() -> None:
        idle.close()
        waker.close()
        done.set()

    thread = threading.Thread(target=close, daemon=True)
    thread.start()
    assert done.wait(5.0), "closing the idle wait or the waker hung"
    assert idle._pull.closed and idle._local.closed and waker._sock.closed
    # A late wake from the outbox or side-channel thread after shutdown is harmless.
    idle.wake()


# ------------------------------------------- forwarded notifications (issue 29)
def connected(idle: IdleWait, waker: Waker) -> None:
    idle.keep_forwarded = True
    idle.connect([waker.endpoint])
    deadline = time.monotonic() + 5.0
    while not waker.num_wakes and time.monotonic() < deadline:
        waker.wake()
        time.sleep(0.01)
    assert waker.num_wakes, "the worker's wake never reached the scheduler"
    # Long timeout: a connecting wake that came after a short wait would end the
    # test's next wait before the wake it means.
    woken_wait(idle)
    idle.take_forwarded()


def test_a_wake_forwards_its_rank_and_notifications_to_the_scheduler(idle):
    waker = Waker(rank=3)
    try:
        connected(idle, waker)
        waker.wake([b"pdx:tok+5/pd-1", b"pdx:tok/pd-2"])
        assert woken_wait(idle)[0] is True  # over TCP: 0.2 s is too short on a loaded host
        assert idle.take_forwarded() == [(3, [b"pdx:tok+5/pd-1", b"pdx:tok/pd-2"])]
        assert idle.take_forwarded() == []
        # Taken without a wait too (a busy D drains before each schedule()).
        waker.wake([b"pdx:tok/pd-3"])
        deadline = time.monotonic() + 2.0
        got: list = []
        while not got and time.monotonic() < deadline:
            idle.drain()
            got = idle.take_forwarded()
        assert got == [(3, [b"pdx:tok/pd-3"])]
    finally:
        waker.close()


def test_what_a_wake_forwards_is_bounded(idle):
    """Oversized messages are no WRITE notification of ours and are not
    forwarded; at most MAX_FORWARDED per wake; the inbox keeps the newest
    MAX_INBOX when nobody takes them."""
    from vllm_pd_ext.wire import wakeup

    waker = Waker(rank=0)
    try:
        connected(idle, waker)
        big = b"pdx:" + b"x" * wakeup.MAX_FORWARDED_BYTES
        many = [f"pdx:t/pd-{i}".encode() for i in range(wakeup.MAX_FORWARDED + 10)]
        waker.wake([big, *many])
        assert woken_wait(idle)[0] is True
        ((rank, notifs),) = idle.take_forwarded()
        assert rank == 0 and big not in notifs
        assert notifs == many[:wakeup.MAX_FORWARDED - 1]
        # Garbage from a local wake, or frames without a rank, forward nothing.
        idle.wake()
        idle.wait()
        assert idle.take_forwarded() == []
        for i in range(5):
            waker.wake([f"pdx:t/x-{i}".encode()])
        old = wakeup.MAX_INBOX
        wakeup.MAX_INBOX = 2
        try:
            # Drain until the last wake is in (not one drain after a fixed 0.2 s,
            # which a loaded host's TCP delivery can outlast): the inbox still keeps
            # only the newest 2, however many each drain found.
            deadline = time.monotonic() + 5.0
            idle.drain()
            while (not idle._inbox or idle._inbox[-1][1] != [b"pdx:t/x-4"]) \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
                idle.drain()
        finally:
            wakeup.MAX_INBOX = old
        assert [n for _, ns in idle.take_forwarded() for n in ns] == [b"pdx:t/x-3", b"pdx:t/x-4"]
    finally:
        waker.close()


def test_forwards_are_not_kept_for_a_scheduler_that_does_not_read_them(idle):
    """Without the landing view (``same_step_landing`` off, the default) a
    wake still ends the wait, and what it carried is dropped at once."""
    waker = Waker(rank=0)
    try:
        connected(idle, waker)
        idle.keep_forwarded = False
        waker.wake([b"pdx:tok/pd-1"])
        assert woken_wait(idle)[0] is True
        assert idle.take_forwarded() == [] and idle._inbox == []
    finally:
        waker.close()
