"""PushBook queueing (protocol 3, issue 10) with an injected fake clock.

While P holds a request itself (``admit``: its P leg is queued or
prefilling), D's ``renew`` moves the registration's window to ``ttl`` from
now; otherwise the registration expires at its original time. The renewed
window is what the match (and so the WRITE order) carries, and the
deadline heap stays bounded however often D renews.
"""

from __future__ import annotations

import pytest

from vllm_pd_ext.scheduler.pushbook import Match, Prefill, PushBook, PushState

TTL = 5.0


@pytest.fixture
def book(clock):
    return PushBook(clock)


def prefill(clock, rid="p-req"):
    return Prefill(rid, [3, 4, 5], 40, clock())


# ------------------------------------------------------------ admit / retire
def test_admit_retire_is_admitted(book):
    assert not book.is_admitted("pd1") and book.num_admitted == 0
    book.admit("pd1")
    book.admit("pd2")
    assert book.is_admitted("pd1") and book.is_admitted("pd2") and book.num_admitted == 2
    book.retire("pd1")
    assert not book.is_admitted("pd1") and book.is_admitted("pd2")
    book.retire("pd1")  # twice: harmless
    book.retire("ghost")
    assert book.num_admitted == 1


def test_admission_does_not_register(book):
    book.admit("pd1")
    assert book.state("pd1") is PushState.UNKNOWN
    assert book.registration("pd1") is None
    assert book.counts() == {"registered": 0, "prefilled": 0, "writing": 0}


def test_prefill_done_retires(book, clock):
    book.admit("pd1")
    book.register("pd1", "reg", TTL, num_ranks=1)
    assert isinstance(book.prefill_done("pd1", prefill(clock), num_ranks=1), Match)
    assert not book.is_admitted("pd1")
    # Also when the prefill waits for D's registration.
    book.admit("pd2")
    assert book.prefill_done("pd2", prefill(clock), num_ranks=1) is None
    assert not book.is_admitted("pd2")


def test_prefill_failed_retires(book):
    book.admit("pd1")
    book.register("pd1", "reg", TTL, num_ranks=1)
    assert book.prefill_failed("pd1") == "reg"
    assert not book.is_admitted("pd1") and book.state("pd1") is PushState.FAILED
    book.admit("pd2")
    assert book.prefill_failed("pd2") is None
    assert not book.is_admitted("pd2")


def test_registration_view(book):
    book.register("pd1", "reg", TTL, num_ranks=1)
    assert book.registration("pd1") == "reg"
    book.abort("pd1")
    assert book.registration("pd1") is None


# ------------------------------------------------------------ renew
def test_renew_of_admitted_id_survives_its_original_deadline(book, clock):
    t0 = clock.now
    book.register("pd1", "reg", TTL, num_ranks=1)
    book.admit("pd1")
    clock.advance(4.0)
    assert book.renew("pd1") is PushState.REGISTERED
    clock.advance(TTL - 4.0)  # the original deadline: t0 + TTL
    assert book.sweep() == []
    assert book.state("pd1") is PushState.REGISTERED
    # Not renewed again: expires at the renewed deadline, t0 + 4 + TTL.
    clock.now = t0 + 4.0 + TTL - 0.01
    assert book.sweep() == []
    clock.now = t0 + 4.0 + TTL
    assert book.sweep() == ["pd1"]
    assert book.state("pd1") is PushState.EXPIRED
    assert book.num_expired_registrations == 1


def test_renew_of_non_admitted_id_does_not_move_the_window(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=1)
    clock.advance(4.0)
    # Still registered (so the answer is REGISTERED), but not renewed.
    assert book.renew("pd1") is PushState.REGISTERED
    clock.advance(TTL - 4.0)
    assert book.sweep() == ["pd1"]
    assert book.state("pd1") is PushState.EXPIRED


def test_renew_after_retire_does_not_move_the_window(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=1)
    book.admit("pd1")
    book.retire("pd1")  # P's leg ended without a prefill (e.g. rejected)
    clock.advance(4.0)
    assert book.renew("pd1") is PushState.REGISTERED
    clock.advance(TTL - 4.0)
    assert book.sweep() == ["pd1"]


def test_repeated_renewals_keep_a_long_queue_alive(book, clock):
    t0 = clock.now
    book.register("pd1", "reg", TTL, num_ranks=1)
    book.admit("pd1")
    for _ in range(40):  # 40 s in P's queue, renewed every second
        clock.advance(1.0)
        assert book.renew("pd1") is PushState.REGISTERED
        assert book.sweep() == []
    assert clock.now - t0 == pytest.approx(40.0)
    assert book.state("pd1") is PushState.REGISTERED
    clock.advance(TTL)
    assert book.sweep() == ["pd1"]


def test_match_after_renewal_carries_the_renewed_window(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=1)
    book.admit("pd1")
    clock.advance(3.0)
    t_renew = clock.now
    book.renew("pd1")
    clock.advance(4.0)  # past the original window (t0 + 5), inside the renewed one
    assert book.sweep() == []
    match = book.prefill_done("pd1", prefill(clock), num_ranks=1)
    assert isinstance(match, Match)
    assert match.post_before == pytest.approx(t_renew + TTL)
    assert match.waited_s == pytest.approx(7.0)
    # The matched id's heap entries are stale: nothing expires later.
    clock.advance(TTL * 4)
    assert book.sweep() == [] and book.state("pd1") is PushState.WRITING


@pytest.mark.parametrize("setup,expected", [
    ("nothing", PushState.UNKNOWN),
    ("registered", PushState.REGISTERED),
    ("writing", PushState.WRITING),
    ("done", PushState.DONE),
    ("aborted", PushState.ABORTED),
    ("expired", PushState.EXPIRED),
    ("prefilled", PushState.PREFILLED),
])
def test_renew_returns_the_state(book, clock, setup, expected):
    book.admit("pd1")
    if setup != "nothing" and setup != "prefilled":
        book.register("pd1", "reg", TTL, num_ranks=1)
    if setup in ("writing", "done"):
        book.prefill_done("pd1", prefill(clock), num_ranks=1)
    if setup == "done":
        book.settle("pd1", 0, ok=True)
    if setup == "aborted":
        book.abort("pd1")
    if setup == "expired":
        book.retire("pd1")
        clock.advance(TTL)
        assert book.sweep() == ["pd1"]
        book.admit("pd1")
    if setup == "prefilled":
        book.prefill_done("pd1", prefill(clock), num_ranks=1)
    assert book.renew("pd1") is expected
    assert book.state("pd1") is expected  # renew changes no state


def test_renewing_a_tombstoned_id_does_not_resurrect_it(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=1)
    book.abort("pd1")
    book.admit("pd1")
    assert book.renew("pd1") is PushState.ABORTED
    clock.advance(TTL * 3)
    assert book.sweep() == [] and book.num_expired_registrations == 0
    assert book.state("pd1") is PushState.ABORTED


# ------------------------------------------------------------ cost
def test_deadline_heap_stays_bounded_under_many_renewals(book, clock):
    """Each renewal pushes a new heap entry (the old one goes stale); the
    rebuild in ``sweep`` must bound them."""
    for i in range(10):
        book.register(f"pd{i}", "reg", TTL, num_ranks=1)
        book.admit(f"pd{i}")
    for _ in range(2_000):
        clock.advance(0.01)
        for i in range(10):
            book.renew(f"pd{i}")
        book.sweep()
        assert len(book._deadlines) <= 2 * book.counts()["registered"] + 64
    assert book.counts()["registered"] == 10  # all kept alive by the renewals
    clock.advance(TTL)
    assert sorted(book.sweep()) == sorted(f"pd{i}" for i in range(10))
    book.sweep()
    assert len(book._deadlines) <= 64


def test_renewals_without_sweep_grow_the_heap_until_the_next_sweep(book, clock):
    """Documents the cost model: the bound holds after each ``sweep`` (P
    sweeps every step), not between sweeps."""
    book.register("pd1", "reg", TTL, num_ranks=1)
    book.admit("pd1")
    for _ in range(500):
        book.renew("pd1")
    assert len(book._deadlines) == 501
    book.sweep()
    assert len(book._deadlines) <= 2 * 1 + 64
    assert book.state("pd1") is PushState.REGISTERED
