"""``LandingView``: the scheduler's replay of every D rank's push verifier,
fed with the notifications the workers forward (issue 29, same-step landing).

A push counts as landed only when every rank saw the registered P's
notification(s); the seed is P's token #1 only when all ranks agree.
"""

from __future__ import annotations

from vllm_pd_ext.scheduler.d_landing import LandingView
from vllm_pd_ext.wire.protocol import push_notif
from vllm_pd_ext.wire.specs import PushRecvSpec


def spec(rid: str = "r1", pd_id: str = "pd-1", token: str = "tok", seed: bool = True
         ) -> PushRecvSpec:
    return PushRecvSpec(request_id=rid, pd_request_id=pd_id, local_block_ids=[1, 2],
                        num_tokens=40, notif_token=token, want_seed=seed)


def test_a_push_lands_only_when_every_rank_saw_it() -> None:
    view = LandingView(tp_size=2)
    view.expect(spec(), now=0.0)
    view.feed(0, [push_notif("pd-1", "tok", seed=42)])
    assert view.collect(now=0.5) == []  # rank 1 has not seen it
    view.feed(1, [push_notif("pd-1", "tok", seed=42)])
    (seen,) = view.collect(now=1.0)
    assert (seen.spec.request_id, seen.seed, seen.wait_s) == ("r1", 42, 1.0)
    assert view.collect(now=2.0) == [] and view.num_waiting == 0


def test_ranks_that_disagree_on_token_one_give_no_seed() -> None:
    view = LandingView(tp_size=2)
    view.expect(spec(), now=0.0)
    view.feed(0, [push_notif("pd-1", "tok", seed=42)])
    view.feed(1, [push_notif("pd-1", "tok", seed=43)])
    (seen,) = view.collect(now=1.0)
    assert seen.seed == -1


def test_a_notification_without_the_registrations_token_does_not_count() -> None:
    view = LandingView(tp_size=1)
    view.expect(spec(), now=0.0)
    view.feed(0, [push_notif("pd-1", "forged", seed=42)])
    assert view.collect(now=1.0) == []
    view.feed(0, [push_notif("pd-1", "tok", seed=42)])
    assert [s.spec.request_id for s in view.collect(now=1.0)] == ["r1"]


def test_every_p_writer_into_a_rank_must_notify() -> None:
    """P sharded more finely than D: two P ranks write into each D rank."""
    view = LandingView(tp_size=1)
    view.expect(spec(), now=0.0)
    view.feed(0, [push_notif("pd-1", "tok", writer=0, writers=2, seed=7)])
    assert view.collect(now=1.0) == []
    view.feed(0, [push_notif("pd-1", "tok", writer=1, writers=2, seed=7)])
    assert [s.seed for s in view.collect(now=1.0)] == [7]


def test_a_notification_before_its_spec_counts_once_the_spec_comes() -> None:
    view = LandingView(tp_size=1)
    view.feed(0, [push_notif("pd-1", "tok", seed=5)])
    assert view.collect(now=0.0) == []
    view.expect(spec(), now=0.1)
    assert [s.seed for s in view.collect(now=0.2)] == [5]


def test_forget_drops_the_spec_and_what_some_ranks_saw() -> None:
    view = LandingView(tp_size=2)
    view.expect(spec(), now=0.0)
    view.feed(0, [push_notif("pd-1", "tok", seed=1)])
    assert view.collect(now=0.1) == []
    view.forget("r1")
    view.feed(1, [push_notif("pd-1", "tok", seed=1)])
    assert view.collect(now=0.2) == [] and view.num_waiting == 0
    assert view._partial == {}


def test_a_rank_this_engine_does_not_have_is_counted_and_ignored() -> None:
    view = LandingView(tp_size=1)
    view.expect(spec(), now=0.0)
    view.feed(3, [push_notif("pd-1", "tok", seed=1)])
    view.feed(-1, [push_notif("pd-1", "tok", seed=1)])
    assert view.collect(now=0.1) == [] and view.num_bad_rank == 2


def test_a_late_copy_of_a_forgotten_push_is_dropped_soon_and_silently(caplog) -> None:
    """The workers' report usually ends a push before its forwarded copy is
    read: that copy is no anomaly (no warning), and is not kept for long."""
    from vllm_pd_ext.scheduler.d_landing import LATE_COPY_TTL_S

    view = LandingView(tp_size=1)
    view.expect(spec(), now=0.0)
    view.forget("r1")
    view.feed(0, [push_notif("pd-1", "tok", seed=1)])
    assert view.collect(now=0.1) == []
    assert view.collect(now=0.2 + LATE_COPY_TTL_S) == []
    assert view._ranks[0]._early == {}
    assert not [r for r in caplog.records if "unknown push" in r.message]
