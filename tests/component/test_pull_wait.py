"""Concurrent pull's two halves with fakes (no vLLM, no sockets): D's
``PullWaits`` (deadlines, renewals, P's answers, hostile answers) and P's
``PullProducer`` (whichever of wait and prefill end comes second sends the
answer; cancels and D's ``unknown`` free the lease; bounds and expiry).
The real schedulers and side channels: tests/scheduler/test_pull_concurrent.py."""

from __future__ import annotations

from typing import Any

import pytest
from pdunit_utils import FakeClock

from vllm_pd_ext.scheduler import p_pull
from vllm_pd_ext.scheduler.d_pull_wait import PullWaits
from vllm_pd_ext.scheduler.p_pull import PullProducer
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.protocol import ErrorCode, KVTransferParams
from vllm_pd_ext.wire.side_channel import SideChannelError

P_ADDR = ("10.0.0.1", 7000)
D_ADDR = ("10.0.0.2", 7001)


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, Any, Any]] = []

    def send(self, host: str, port: int, msg: Any, callback: Any = None) -> None:
        self.sent.append((host, port, msg, callback))

    def of(self, kind: type) -> list[tuple[str, int, Any, Any]]:
        return [s for s in self.sent if isinstance(s[2], kind)]

    def close(self) -> None:
        pass


class FakeLeases:
    """``LeaseService.extend``: 30 s left on a lease the lender holds."""

    def __init__(self, lender: FakeLender) -> None:
        self.lender = lender
        self.extended: list[tuple[str, str, str]] = []

    def extend(self, key: str, engine_id: str, consumer: str) -> float:
        self.extended.append((key, engine_id, consumer))
        return 30.0 if key in self.lender.lent else proto.LEASE_UNKNOWN


class FakeLender:
    def __init__(self) -> None:
        self.lent: dict[str, list[int]] = {}
        self.evicted: list[str] = []
        self.leases = FakeLeases(self)

    def lend(self, key: str, block_ids: list[int], *, num_consumers: int) -> float:
        self.lent[key] = block_ids
        return 1e9

    def evict(self, key: str) -> bool:
        self.evicted.append(key)
        return self.lent.pop(key, None) is not None


def leg(pd_id: str = "pd-1") -> KVTransferParams:
    return KVTransferParams(
        do_remote_prefill=True, remote_engine_id="eng-p", remote_host=P_ADDR[0],
        remote_port=P_ADDR[1], remote_request_id=pd_id, pd_request_id=pd_id,
        transfer_mode="pull", pd_seed_pending=True)


# ---------------------------------------------------------------- D's waits
@pytest.fixture
def waits() -> tuple[PullWaits, FakeOutbox, FakeClock]:
    clock, box = FakeClock(), FakeOutbox()
    w = PullWaits("eng-d", *D_ADDR, wait_timeout_s=8.0, queue_timeout_s=60.0,
                  side_channel_timeout_s=1.0, clock=clock, outbox=box)  # type: ignore[arg-type]
    return w, box, clock


def test_the_leg_is_a_pull_wait_and_its_params_decode() -> None:
    wire = msgspec_builtins(leg())
    params = proto.decode_params(wire)
    assert params is not None and params.is_pull_wait
    # With blocks it is a sequential leg; without pd_seed_pending, malformed.
    assert not proto.decode_params({**wire, "remote_block_ids": [1]}).is_pull_wait
    with pytest.raises(proto.ParamsError, match="remote_block_ids is empty"):
        proto.decode_params({**wire, "pd_seed_pending": False})


def msgspec_builtins(params: KVTransferParams) -> dict[str, Any]:
    import msgspec
    out: dict[str, Any] = msgspec.to_builtins(params)
    return out


def test_park_asks_p_renews_and_fails_at_the_deadline(waits) -> None:
    w, box, clock = waits
    w.park("d-1", leg())
    ((host, port, msg, reply),) = box.sent
    assert (host, port) == P_ADDR and isinstance(msg, proto.PullWait)
    assert (msg.pd_request_id, msg.expect_engine_id, msg.notify_port, msg.ttl_s) == (
        "pd-1", "eng-p", D_ADDR[1], 8.0)
    reply(proto.PullWaiting(engine_id="eng-p", state=proto.PullWaitState.WAITING))
    clock.advance(2.1)  # past a quarter of the timeout: renewed, once
    assert w.poll() == {} and w.poll() == {}
    assert len(box.of(proto.PullWait)) == 2
    clock.advance(7.0)  # 9.1 s: past the timeout plus a side-channel timeout
    (why,) = w.poll().values()
    assert "within push_timeout (8.0 s)" in why and "eng-p at 10.0.0.1:7000" in why
    assert w.num_parked == 0 and w.take("d-1") is None


def test_queued_waits_up_to_the_queue_timeout(waits) -> None:
    w, box, clock = waits
    w.park("d-1", leg())
    for _ in range(30):  # P answers every renewal: the request is queued there
        _, _, _, reply = box.sent[-1]
        reply(proto.PullWaiting(engine_id="eng-p", state=proto.PullWaitState.QUEUED))
        clock.advance(2.5)
        if w.poll():
            break
    # Capped: the queue timeout (60 s) plus a side-channel timeout from arrival.
    assert 60.0 <= clock.now - 1000.0 <= 63.5
    assert w.num_parked == 0


def test_p_answer_is_taken_once_and_a_late_copy_is_acknowledged(waits) -> None:
    w, _, _ = waits
    w.park("d-1", leg())
    assert w.take("d-1") is None
    answer = proto.PullReady(engine_id="eng-p", pd_request_id="pd-1", ok=True,
                             params=leg(), first_token=7)
    assert isinstance(w.handle(answer), proto.Ack)
    assert w.has_news
    got = w.take("d-1")
    assert got is not None and got.ready is answer and got.ready_at > 0
    # A renewal that crossed it made P send it again: acknowledged (P must
    # not free the lease this request reads), applied to nothing.
    assert isinstance(w.handle(answer), proto.Ack)
    assert w.take("d-1") is None and w.poll() == {}
    w.forget("d-1")
    reply = w.handle(answer)
    assert isinstance(reply, proto.ErrorReply) and reply.code == ErrorCode.UNKNOWN


def test_d_bounds_p_lease_extension_by_the_send_time_of_the_wait_p_names(waits) -> None:
    """Protocol 10: P extends its lease as it answers, after it had D's wait
    number ``wait_seq``; that wait left D at a time D read before sending,
    so ``sent + lease_s`` is a lower bound of P's expiry on D's clock."""
    w, box, clock = waits
    t0 = clock.now
    w.park("d-1", leg())
    _, _, first, reply = box.sent[-1]
    reply(proto.PullWaiting(engine_id="eng-p", state=proto.PullWaitState.WAITING))
    clock.advance(2.5)
    w.poll()  # renewed: wait number 2
    _, _, second, _ = box.sent[-1]
    assert (first.seq, second.seq) == (1, 2)
    clock.advance(1.0)

    def answer(**kw: Any) -> proto.PullReady:
        return proto.PullReady(engine_id="eng-p", pd_request_id="pd-1", ok=True,
                               params=leg(), first_token=7, **kw)

    w.handle(answer(lease_s=30.0, wait_seq=2))
    got = w.take("d-1")
    assert got is not None and got.valid_until == pytest.approx(t0 + 2.5 + 30.0)
    # Parked again now, at t0 + 3.5 (its wait number 1): naming it bounds
    # from then; a number D never sent, or no extension, gives no bound
    # (the worker then pins).
    for kw, bound in (({"lease_s": 30.0, "wait_seq": 1}, t0 + 3.5 + 30.0),
                      ({"lease_s": 30.0, "wait_seq": 99}, 0.0), ({}, 0.0)):
        w.forget("d-1")
        w.park("d-1", leg())
        w.handle(answer(**kw))
        got = w.take("d-1")
        assert got is not None and got.valid_until == pytest.approx(bound), kw


def test_answers_from_another_engine_are_refused_and_counted(waits) -> None:
    w, _, _ = waits
    w.park("d-1", leg())
    reply = w.handle(proto.PullReady(engine_id="eng-x", pd_request_id="pd-1", ok=False))
    assert isinstance(reply, proto.ErrorReply) and reply.code == ErrorCode.REFUSED
    assert w.num_wrong_sender == 1 and w.take("d-1") is None


def test_a_definite_refusal_fails_the_wait_and_no_answer_does_not(waits) -> None:
    w, box, _ = waits
    w.park("d-1", leg())
    w.park("d-2", leg("pd-2"))
    (_, _, _, first), (_, _, _, second) = box.sent
    first(SideChannelError("no answer in 1.0 s", ErrorCode.TIMEOUT))
    second(SideChannelError("this is engine eng-q, not eng-p (P restarted?)", ErrorCode.STALE))
    assert w.take("d-1") is None  # the deadline decides
    got = w.take("d-2")
    assert got is not None and "P refused the wait" in got.failed and "P restarted" in got.failed


def test_cancel_tells_p_and_forgets_the_id(waits) -> None:
    w, box, _ = waits
    w.park("d-1", leg())
    w.cancel("d-1", P_ADDR, "request ended on D before P's answer")
    (cancel,) = box.of(proto.PullWaitCancel)
    assert cancel[:2] == P_ADDR and cancel[2].pd_request_id == "pd-1"
    assert w.num_parked == 0
    reply = w.handle(proto.PullReady(engine_id="eng-p", pd_request_id="pd-1", ok=False))
    assert isinstance(reply, proto.ErrorReply) and reply.code == ErrorCode.UNKNOWN


# ---------------------------------------------------------------- P's half
@pytest.fixture
def producer() -> tuple[PullProducer, FakeOutbox, FakeLender, FakeClock]:
    clock, box, lender = FakeClock(), FakeOutbox(), FakeLender()
    p = PullProducer(lender, 1, "eng-p", clock=clock, outbox=box)  # type: ignore[arg-type]
    return p, box, lender, clock


def wait_msg(pd_id: str = "pd-1", engine: str = "eng-d", ttl: float = 8.0, seq: int = 0
             ) -> proto.PullWait:
    return proto.PullWait(engine_id=engine, expect_engine_id="eng-p", pd_request_id=pd_id,
                          request_id="d-1", notify_host=D_ADDR[0], notify_port=D_ADDR[1],
                          ttl_s=ttl, seq=seq)


def finish(p: PullProducer, pd_id: str = "pd-1") -> KVTransferParams:
    p.lend(pd_id, "p-1", [3, 4], 20, "digest", 9)
    answer = KVTransferParams(remote_block_ids=[[3, 4]], remote_request_id=pd_id)
    p.announce(pd_id, "p-1", answer, 9, 1e9)
    return answer


@pytest.mark.parametrize("order", ["wait_first", "prefill_first"])
def test_whichever_comes_second_sends_the_answer(producer, order: str) -> None:
    p, box, _, _ = producer
    if order == "wait_first":
        p.admit("pd-1")
        reply = p.handle(wait_msg())
        assert reply == proto.PullWaiting(engine_id="eng-p", state=proto.PullWaitState.QUEUED)
        assert box.sent == []
        answer = finish(p)
    else:
        answer = finish(p)
        reply = p.handle(wait_msg())
        assert reply == proto.PullWaiting(engine_id="eng-p", state=proto.PullWaitState.READY)
    ((host, port, msg, _),) = box.sent
    assert (host, port) == D_ADDR and msg.ok and msg.params == answer and msg.first_token == 9
    # A renewal after it: answered ``ready`` and sent again (D takes one).
    assert p.handle(wait_msg()).state is proto.PullWaitState.READY
    assert len(box.sent) == 2
    # Only the engine that waited may ask again or cancel.
    for msg in (wait_msg(engine="eng-x"), proto.PullWaitCancel(engine_id="eng-x",
                                                                pd_request_id="pd-1")):
        reply = p.handle(msg)
        assert isinstance(reply, proto.ErrorReply) and reply.code == ErrorCode.REFUSED


@pytest.mark.parametrize("order", ["wait_first", "prefill_first"])
def test_the_answer_extends_the_lease_for_the_waiting_d_after_its_latest_wait(
        producer, order: str) -> None:
    """Protocol 10: right before each send P extends the lease and holds it
    for D's request, and says for how long and after which of D's waits."""
    p, box, lender, _ = producer
    if order == "wait_first":
        p.handle(wait_msg(seq=1))
        p.handle(wait_msg(seq=3))  # a renewal: the latest wait P had
        finish(p)
    else:
        finish(p)
        p.handle(wait_msg(seq=3))
    ((_, _, msg, _),) = box.sent
    assert (msg.lease_s, msg.wait_seq) == (30.0, 3)
    assert lender.leases.extended == [("pd-1", "eng-d", "d-1")]
    # A renewal that crossed the answer: sent again, extended again, naming it.
    p.handle(wait_msg(seq=4))
    assert (box.sent[-1][2].lease_s, box.sent[-1][2].wait_seq) == (30.0, 4)
    assert len(lender.leases.extended) == 2


def test_no_extension_without_a_wait_number_or_a_lease(producer) -> None:
    """A D that numbers no wait, a lease already gone, a failed prefill:
    the answer names no extension (D pins, and its pin says what is left)."""
    p, box, lender, _ = producer
    p.handle(wait_msg(seq=0))
    finish(p)
    p.handle(wait_msg("pd-2", seq=2))
    p.announce("pd-2", "p-2", KVTransferParams(), 9, 1e9)  # lent nothing: no lease
    p.handle(wait_msg("pd-3", seq=2))
    p.prefill_failed("pd-3", "p-3", "FINISHED_ABORTED")
    assert [(m.pd_request_id, m.lease_s, m.wait_seq) for _, _, m, _ in box.sent] == [
        ("pd-1", 0.0, 0), ("pd-2", 0.0, 0), ("pd-3", 0.0, 0)]
    assert lender.leases.extended == [("pd-2", "eng-d", "d-1")]


def test_a_sequential_pull_leg_announces_nothing(producer) -> None:
    p, box, lender, _ = producer
    p.lend("p-7", "p-7", [1], 10, "d")
    p.announce("p-7", "p-7", KVTransferParams(), 5, 1e9)
    p.prefill_failed("p-8", "p-8", "FINISHED_ABORTED")
    assert box.sent == [] and p.handle(wait_msg("p-7")).state is proto.PullWaitState.WAITING
    p.sweep()
    assert lender.evicted == [] and "p-7" in lender.lent


def test_a_failed_prefill_tells_the_waiting_d(producer) -> None:
    p, box, _, _ = producer
    p.handle(wait_msg())
    p.prefill_failed("pd-1", "p-1", "FINISHED_ABORTED")
    ((_, _, msg, _),) = box.sent
    assert not msg.ok and "FINISHED_ABORTED" in msg.detail


def test_cancel_before_the_prefill_ends_means_no_lease_survives(producer) -> None:
    p, box, lender, _ = producer
    p.handle(wait_msg())
    assert isinstance(p.handle(proto.PullWaitCancel(engine_id="eng-d", pd_request_id="pd-1")),
                      proto.Ack)
    finish(p)
    assert lender.evicted == ["pd-1"] and lender.lent == {} and box.sent == []
    reply = p.handle(wait_msg())
    assert isinstance(reply, proto.ErrorReply) and "cancelled" in reply.message


def test_cancel_or_unknown_after_the_answer_evict_at_the_sweep(producer) -> None:
    p, box, lender, _ = producer
    p.handle(wait_msg("pd-1"))
    finish(p, "pd-1")
    p.handle(proto.PullWaitCancel(engine_id="eng-d", pd_request_id="pd-1"))
    p.handle(wait_msg("pd-2"))
    finish(p, "pd-2")
    _, _, _, callback = box.sent[-1]
    callback(SideChannelError("no request waits for pd-2", ErrorCode.UNKNOWN))
    assert lender.evicted == []  # the lender is the scheduler thread's
    p.sweep()
    assert sorted(lender.evicted) == ["pd-1", "pd-2"]
    assert p.num_cancelled == 2


def test_no_answer_from_d_keeps_the_lease(producer) -> None:
    p, box, lender, _ = producer
    p.handle(wait_msg())
    finish(p)
    _, _, _, callback = box.sent[-1]
    callback(SideChannelError("no answer in 5.0 s", ErrorCode.TIMEOUT))  # D may have it
    p.sweep()
    assert lender.evicted == [] and "pd-1" in lender.lent


def test_waits_expire_and_are_bounded(producer, monkeypatch) -> None:
    p, _, _, clock = producer
    p.handle(wait_msg("pd-1", ttl=2.0))
    clock.advance(2.5)
    p.sweep()
    assert "pd-1" not in p._waits
    monkeypatch.setattr(p_pull, "MAX_ENTRIES", 2)
    p.handle(wait_msg("a"))
    p.handle(wait_msg("b"))
    reply = p.handle(wait_msg("c"))
    assert isinstance(reply, proto.ErrorReply) and "2 pull waits already" in reply.message
    # A stale expectation (P restarted) is refused at once.
    stale = proto.PullWait(engine_id="eng-d", expect_engine_id="eng-old", pd_request_id="x",
                           request_id="d", notify_host=D_ADDR[0], notify_port=D_ADDR[1],
                           ttl_s=1.0)
    reply = p.handle(stale)
    assert isinstance(reply, proto.ErrorReply) and reply.code == ErrorCode.STALE
