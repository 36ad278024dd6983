"""PushBook (P's push bookkeeping) with an injected fake clock: every ordering
of registration, prefill, abort, settle and sweep."""

from __future__ import annotations

import pytest

from vllm_pd_ext.pushbook import Match, Prefill, PushBook, PushRefused

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
    assert book.state("pd1") == "registered"
    clock.advance(3.0)
    pf = prefill(clock)
    match = book.prefill_done("pd1", pf, num_ranks=1)
    assert isinstance(match, Match)
    assert match.pd_request_id == "pd1" and match.reg == "reg" and match.prefill is pf
    assert match.waited_s == pytest.approx(3.0)  # D's registration waited for the prefill
    assert match.post_before == pytest.approx(t_reg + TTL)  # from receipt, not from match
    assert book.state("pd1") == "writing"
    assert book.counts() == {"registered": 0, "prefilled": 0, "writing": 1}
    # A second arrival of either kind never matches again.
    assert book.prefill_done("pd1", prefill(clock), num_ranks=1) == "duplicate"
    with pytest.raises(PushRefused, match="already registered"):
        book.register("pd1", "again", TTL, num_ranks=1)


def test_prefill_then_registration_matches_once(book, clock):
    pf = prefill(clock)
    assert book.prefill_done("pd1", pf, num_ranks=2) is None
    assert book.state("pd1") == "prefilled"
    assert book.prefill_done("pd1", prefill(clock), num_ranks=2) == "duplicate"
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
    assert book.state("a") == "registered" and book.state("b") == "prefilled"


# ------------------------------------------------------------------ abort
def test_abort_unknown_tombstones(book, clock):
    assert book.abort("pd1") == ("unknown", None)
    assert book.state("pd1") == "aborted"
    # The registration still on the wire is refused; a late prefill is freed.
    with pytest.raises(PushRefused, match="already aborted"):
        book.register("pd1", "reg", TTL, num_ranks=1)
    assert book.prefill_done("pd1", prefill(clock), num_ranks=1) == "aborted"
    assert book.abort("pd1") == ("aborted", None)


def test_abort_registered(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=1)
    assert book.abort("pd1") == ("aborted", None)
    assert book.counts()["registered"] == 0
    assert book.prefill_done("pd1", prefill(clock), num_ranks=1) == "aborted"


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
    assert book.abort("pd1") == ("in_flight", None)
    assert book.state("pd1") == "writing"  # abort does not cancel a WRITE
    assert book.settle("pd1", 0, ok=True) is True
    assert book.abort("pd1") == ("done", None)
    assert book.state("pd1") == "done"


def test_abort_after_failed_write(book, clock):
    book.prefill_done("pd1", prefill(clock), num_ranks=1)
    book.register("pd1", "reg", TTL, num_ranks=1)
    assert book.settle("pd1", 0, ok=False) is False
    assert book.abort("pd1") == ("failed", None)
    with pytest.raises(PushRefused, match="already failed"):
        book.register("pd1", "reg", TTL, num_ranks=1)


# ------------------------------------------------------------------ settle
def test_settle_needs_every_rank(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=2)
    book.prefill_done("pd1", prefill(clock), num_ranks=2)
    assert book.settle("pd1", 0, ok=True) is None
    assert book.settle("pd1", 0, ok=True) is None  # the same rank twice counts once
    assert book.state("pd1") == "writing"
    assert book.abort("pd1") == ("in_flight", None)
    assert book.settle("pd1", 1, ok=True) is True
    assert book.state("pd1") == "done"
    assert book.settle("pd1", 1, ok=True) is None  # already settled


def test_settle_one_failed_rank_fails_all(book, clock):
    book.register("pd1", "reg", TTL, num_ranks=2)
    book.prefill_done("pd1", prefill(clock), num_ranks=2)
    assert book.settle("pd1", 1, ok=False) is None
    assert book.settle("pd1", 0, ok=True) is False
    assert book.state("pd1") == "failed"


def test_settle_unknown_is_none(book):
    assert book.settle("ghost", 0, ok=True) is None
    assert book.state("ghost") == "unknown"


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
    assert book.state("pd1") == "expired" and book.state("pd2") == "registered"
    assert book.prefill_done("pd1", prefill(clock), num_ranks=1) == "expired"
    with pytest.raises(PushRefused, match="already expired"):
        book.register("pd1", "reg", TTL, num_ranks=1)
    # To D an expired registration is simply aborted: no WRITE will come.
    assert book.abort("pd1") == ("aborted", None)
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
    assert book.state("pd1") == "expired"
    assert book.forget_prefill("pd1") is False
    assert book.forget_prefill("ghost") is False
    with pytest.raises(PushRefused, match="already expired"):
        book.register("pd1", "reg", TTL, num_ranks=1)
    # A registered (not prefilled) id is not the prefill's to forget.
    book.register("pd2", "reg", TTL, num_ranks=1)
    assert book.forget_prefill("pd2") is False
    assert book.state("pd2") == "registered"


def test_tombstones_bounded(clock):
    book: PushBook[str] = PushBook(clock, max_tombstones=2)
    for pd_id in ("a", "b", "c"):
        book.abort(pd_id)
    # The oldest tombstone is dropped: "a" is unknown again and may register.
    assert book.state("a") == "unknown"
    assert book.register("a", "reg", TTL, num_ranks=1) is None
    for pd_id in ("b", "c"):
        with pytest.raises(PushRefused, match="already aborted"):
            book.register(pd_id, "reg", TTL, num_ranks=1)
