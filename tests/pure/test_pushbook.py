"""PushBook (P's push bookkeeping) with an injected fake clock: every ordering
of registration, prefill, abort, settle and sweep."""

from __future__ import annotations

import pytest

from vllm_pd_ext.scheduler.pushbook import Match, Prefill, PushBook, PushRefused, PushState
from vllm_pd_ext.wire.protocol import PushAbortState

TTL = 5.0


@pytest.fixture
def book(clock):
    return PushBook(clock)


def prefill(clock, rid="p-req", blocks=(3, 4, 5), tokens=40):
    return Prefill(rid, list(blocks), tokens, clock())


# ------------------------------------------------------------------ matching
def test_registration_then_prefill_matches_once(book, clock):
    t_reg = clock.now
    assert book.register("pd1", "reg", TTL, num_ranks=1) is None
    assert book.state("pd1") is PushState.REGISTERED
    clock.advance(3.0)
    pf = prefill(clock)
    match = book.prefill_done("pd1", pf, num_ranks=1)
    assert isinstance(match, Match)
    assert match.pd_request_id == "pd1" and match.reg == "reg" and match.prefill is pf
    assert match.waited_s == pytest.approx(3.0)  # D's registration waited for the prefill
    assert match.post_before == pytest.approx(t_reg + TTL)  # from receipt, not from match
    assert book.state("pd1") is PushState.WRITING
    assert book.counts() == {"registered": 0, "prefilled": 0, "writing": 1}
    # A second arrival of either kind never matches again.
    assert book.prefill_done("pd1", prefill(clock), num_ranks=1) is PushState.WRITING  # dup
    with pytest.raises(PushRefused, match="already registered"):
        book.register("pd1", "again", TTL, num_ranks=1)


def test_prefill_then_registration_matches_once(book, clock):
    pf = prefill(clock)
    assert book.prefill_done("pd1", pf, num_ranks=2) is None
    assert book.state("pd1") is PushState.PREFILLED
    assert book.prefill_done("pd1", prefill(clock), num_ranks=2) is PushState.PREFILLED  # dup
    clock.advance(2.0)
    match = book.register("pd1", "reg", TTL, num_ranks=2)
    assert isinstance(match, Match)
    assert match.prefill is pf and match.reg == "reg"
    assert match.waited_s == pytest.approx(2.0)  # the prefill waited for D
    assert match.post_before == pytest.approx(clock.now + TTL)
    assert book.counts() == {"registered": 0, "prefilled": 0, "writing": 1}
    with pytest.raises(PushRefused, match="already registered"):
        book.register("pd1", "reg", TTL, num_ranks=2)


def test_duplicate_registration_refused(book):
    book.register("pd1", "first", TTL, num_ranks=1)
    with pytest.raises(PushRefused, match="already registered"):
        book.register("pd1", "second", TTL, num_ranks=1)
    assert book.counts()["registered"] == 1


def test_ids_are_independent(book, clock):
    book.register("a", "ra", TTL, num_ranks=1)
    assert book.prefill_done("b", prefill(clock), num_ranks=1) is None
    assert book.state("a") is PushState.REGISTERED and book.state("b") is PushState.PREFILLED


# ------------------------------------------------------------------ abort
def test_abort_unknown_tombstones(book, clock):
    assert book.abort("pd1") == (PushAbortState.UNKNOWN, None)
    assert book.state("pd1") is PushState.ABORTED
    # The registration still on the wire is refused; a late prefill is freed.
    with pytest.raises(PushRefused, match="already aborted"):
        book.register("pd1", "reg", TTL, num_ranks=1)
    assert book.prefill_done("pd1", prefill(clock), num_ranks=1) is PushState.ABORTED
    assert book.abort("pd1") == (PushAbortState.ABORTED, None)


def test_abort_registered(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=1)
    assert book.abort("pd1") == (PushAbortState.ABORTED, None)
    assert book.counts()["registered"] == 0
    assert book.prefill_done("pd1", prefill(clock), num_ranks=1) is PushState.ABORTED


def test_abort_prefilled_returns_waiting_prefill(book, clock):
    pf = prefill(clock)
    book.prefill_done("pd1", pf, num_ranks=1)
    state, waiting = book.abort("pd1")
    assert state == "aborted" and waiting is pf
    assert book.counts()["prefilled"] == 0
    with pytest.raises(PushRefused, match="already aborted"):
        book.register("pd1", "reg", TTL, num_ranks=1)


def test_abort_in_flight_then_settled(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=1)
    book.prefill_done("pd1", prefill(clock), num_ranks=1)
    assert book.abort("pd1") == (PushAbortState.IN_FLIGHT, None)
    assert book.state("pd1") is PushState.WRITING  # abort does not cancel a WRITE
    assert book.settle("pd1", 0, ok=True) is True
    assert book.abort("pd1") == (PushAbortState.DONE, None)
    assert book.state("pd1") is PushState.DONE


def test_abort_after_failed_write(book, clock):
    book.prefill_done("pd1", prefill(clock), num_ranks=1)
    book.register("pd1", "reg", TTL, num_ranks=1)
    assert book.settle("pd1", 0, ok=False) is False
    assert book.abort("pd1") == (PushAbortState.FAILED, None)
    with pytest.raises(PushRefused, match="already failed"):
        book.register("pd1", "reg", TTL, num_ranks=1)


# ------------------------------------------------------------------ settle
def test_settle_needs_every_rank(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=2)
    book.prefill_done("pd1", prefill(clock), num_ranks=2)
    assert book.settle("pd1", 0, ok=True) is None
    assert book.settle("pd1", 0, ok=True) is None  # the same rank twice counts once
    assert book.state("pd1") is PushState.WRITING
    assert book.abort("pd1") == (PushAbortState.IN_FLIGHT, None)
    assert book.settle("pd1", 1, ok=True) is True
    assert book.state("pd1") is PushState.DONE
    assert book.settle("pd1", 1, ok=True) is None  # already settled


def test_settle_one_failed_rank_fails_all(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=2)
    book.prefill_done("pd1", prefill(clock), num_ranks=2)
    assert book.settle("pd1", 1, ok=False) is None
    assert book.settle("pd1", 0, ok=True) is False
    assert book.state("pd1") is PushState.FAILED


def test_settle_unknown_is_none(book):
    assert book.settle("ghost", 0, ok=True) is None
    assert book.state("ghost") is PushState.UNKNOWN


# ------------------------------------------------------------------ expiry
def test_sweep_expires_registration_and_late_prefill_is_freed(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=1)
    clock.advance(2.0)
    book.register("pd2", "reg2", TTL, num_ranks=1)
    clock.advance(TTL - 2.0 - 0.01)
    assert book.sweep() == []
    clock.advance(0.01)  # pd1's window closes exactly now
    assert book.sweep() == ["pd1"]
    assert book.num_expired_registrations == 1
    assert book.state("pd1") is PushState.EXPIRED and book.state("pd2") is PushState.REGISTERED
    assert book.prefill_done("pd1", prefill(clock), num_ranks=1) is PushState.EXPIRED
    with pytest.raises(PushRefused, match="already expired"):
        book.register("pd1", "reg", TTL, num_ranks=1)
    # To D an expired registration is simply aborted: no WRITE will come.
    assert book.abort("pd1") == (PushAbortState.ABORTED, None)
    clock.advance(2.0)
    assert book.sweep() == ["pd2"]
    assert book.num_expired_registrations == 2
    assert book.sweep() == []


def test_sweep_leaves_matched_and_prefilled_alone(book, clock):
    book.register("w", "reg", TTL, num_ranks=1)
    book.prefill_done("w", prefill(clock), num_ranks=1)
    book.prefill_done("p", prefill(clock), num_ranks=1)
    clock.advance(TTL * 10)
    assert book.sweep() == []
    assert book.counts() == {"registered": 0, "prefilled": 1, "writing": 1}


def test_forget_prefill(book, clock):
    book.prefill_done("pd1", prefill(clock), num_ranks=1)
    assert book.forget_prefill("pd1") is True
    assert book.state("pd1") is PushState.EXPIRED
    assert book.forget_prefill("pd1") is False
    assert book.forget_prefill("ghost") is False
    with pytest.raises(PushRefused, match="already expired"):
        book.register("pd1", "reg", TTL, num_ranks=1)
    # A registered (not prefilled) id is not the prefill's to forget.
    book.register("pd2", "reg", TTL, num_ranks=1)
    assert book.forget_prefill("pd2") is False
    assert book.state("pd2") is PushState.REGISTERED


def test_tombstones_bounded(clock):
    book: PushBook[str] = PushBook(clock, max_tombstones=2)
    for pd_id in ("a", "b", "c"):
        book.abort(pd_id)
    # The oldest tombstone is dropped: "a" is unknown again and may register.
    assert book.state("a") is PushState.UNKNOWN
    assert book.register("a", "reg", TTL, num_ranks=1) is None
    for pd_id in ("b", "c"):
        with pytest.raises(PushRefused, match="already aborted"):
            book.register(pd_id, "reg", TTL, num_ranks=1)


# ------------------------------------------------- cost: the deadline heap
def test_sweep_expires_in_deadline_order(book, clock):
    book.register("long", "reg", 10.0, num_ranks=1)
    book.register("short", "reg", 2.0, num_ranks=1)
    clock.advance(20.0)
    assert book.sweep() == ["short", "long"]


def test_matched_or_aborted_registration_leaves_only_a_stale_entry(book, clock):
    book.register("w", "reg", TTL, num_ranks=1)
    book.register("a", "reg", TTL, num_ranks=1)
    book.prefill_done("w", prefill(clock), num_ranks=1)
    book.abort("a")
    clock.advance(TTL)
    assert book.sweep() == [] and book.num_expired_registrations == 0
    assert book.state("w") is PushState.WRITING and book.state("a") is PushState.ABORTED


def test_re_registration_after_its_tombstone_was_evicted_keeps_its_own_deadline(clock):
    book: PushBook[str] = PushBook(clock, max_tombstones=1)
    book.register("a", "first", 1.0, num_ranks=1)
    book.abort("a")
    book.abort("b")  # evicts "a"'s tombstone: "a" may register again
    assert book.register("a", "second", 10.0, num_ranks=1) is None
    clock.advance(2.0)  # the first registration's deadline: stale now
    assert book.sweep() == [] and book.state("a") is PushState.REGISTERED
    clock.advance(8.0)
    assert book.sweep() == ["a"]


def test_deadline_heap_stays_bounded_under_churn(book, clock):
    book.register("waiting", "reg", TTL, num_ranks=1)
    for i in range(10_000):
        book.register(f"pd{i}", "reg", TTL, num_ranks=1)
        book.prefill_done(f"pd{i}", prefill(clock), num_ranks=1)
        book.sweep()
        assert len(book._deadlines) <= 2 * book.counts()["registered"] + 64


def test_sweep_touches_only_due_registrations(book, clock, monkeypatch):
    """P's step sweeps the book: its cost must not grow with the number of
    registrations still waiting for their prefill."""
    from vllm_pd_ext.scheduler import pushbook as pushbook_mod

    reads = [0]

    class CountingRegistration(pushbook_mod._Registration):
        def __getattribute__(self, name):
            reads[0] += 1
            return super().__getattribute__(name)

    monkeypatch.setattr(pushbook_mod, "_Registration", CountingRegistration)
    for i in range(1000):
        book.register(f"pd{i}", "reg", TTL + i, num_ranks=1)
    clock.advance(TTL)
    reads[0] = 0
    assert book.sweep() == ["pd0"]
    assert reads[0] <= 10, f"the sweep read {reads[0]} registration attributes for one expiry"
