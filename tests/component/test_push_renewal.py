"""Push-mode queueing (protocol 3, issue 10): both scheduler halves.

P (``PushProducer``): a registration for a request P holds itself is
answered ``queued``; D's ``PushWaiting`` renews it (and only it) past its
``ttl``. Built as in ``test_p_push_scheduler.py``: real order sockets on
127.0.0.1, a ``LeaseService`` and the book on one fake clock, a fake outbox.

D (``PushConsumer``): ``queued`` answers move D's deadline, up to
``push_queue_timeout``; renewals leave one at a time every
``push_timeout / 4``. As in ``test_d_push_scheduler.py``, a fake outbox
records each message and the test plays P by calling its callback.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import zmq

from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseTable
from vllm_pd_ext.scheduler.d_push import PushConsumer, WaitState
from vllm_pd_ext.scheduler.p_push import PushProducer
from vllm_pd_ext.scheduler.pushbook import PushState
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.side_channel import SideChannelError

QUEUED = proto.PushAcceptedState.QUEUED
WAITING = proto.PushAcceptedState.WAITING
WRITING = proto.PushAcceptedState.WRITING

COMPAT = proto.CompatInfo(protocol_version=proto.PROTOCOL_VERSION, model="m", dtype="bf16",
                          block_size=16, kv_layout="NHD", num_layers=2, num_kv_heads=1,
                          head_size=8, tp_size=1, transfer_mode="push")


@dataclass
class Sent:
    host: str
    port: int
    msg: proto.Request
    callback: object


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[Sent] = []

    def send(self, host, port, msg, callback=None) -> None:
        self.sent.append(Sent(host, port, msg, callback))

    def of(self, kind: type) -> list[Sent]:
        return [s for s in self.sent if isinstance(s.msg, kind)]

    def close(self) -> None:
        return


# ====================================================================== P side
TTL = 5.0


@pytest.fixture
def producer(clock):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    order_port = pull.bind_to_random_port("tcp://127.0.0.1")
    leases = LeaseService(LeaseTable(30.0, clock))
    prod = PushProducer("eng-p", COMPAT, block_size=16, tp_size=1, leases=leases,
                        notify_timeout_s=1.0, clock=clock)
    prod._outbox.close()
    prod._outbox = FakeOutbox()  # type: ignore[assignment]
    prod.bind_workers({0: f"tcp://127.0.0.1:{order_port}"})
    prod.orders_pull = pull  # type: ignore[attr-defined]
    yield prod
    prod.close()
    pull.close()
    ctx.term()


def registration(pd_id: str = "pd1", engine_id: str = "eng-d") -> proto.PushRegister:
    return proto.PushRegister(
        engine_id=engine_id, compat=COMPAT, expect_engine_id="eng-p", pd_request_id=pd_id,
        request_id="d-req", notify_host="127.0.0.1", notify_port=7000,
        agents=[proto.AgentInfo(tp_rank=0, agent_name="d0", agent_metadata=b"m",
                                mem_type="DRAM", regions=[proto.Region(0, 64, 64, 8)])],
        first_block=0, block_ids=[3, 4, 5], num_tokens=40, ttl_s=TTL)


def waiting(pd_id: str = "pd1", engine_id: str = "eng-d") -> proto.PushWaiting:
    return proto.PushWaiting(engine_id=engine_id, pd_request_id=pd_id)


def accepted_as(state: proto.PushAcceptedState) -> proto.PushAccepted:
    return proto.PushAccepted(engine_id="eng-p", state=state)


def test_registration_of_an_admitted_id_is_queued(producer):
    producer.admit("pd1")
    assert producer.handle(registration()) == accepted_as(QUEUED)
    # (The typed state survives the wire.)
    reply = proto.decode_reply(proto.encode(accepted_as(QUEUED)))
    assert reply.state is QUEUED


def test_registration_of_a_non_admitted_id_is_waiting(producer):
    assert producer.handle(registration()) == accepted_as(WAITING)
    producer.admit("pd2")
    producer.retire("pd2")  # P's leg came and went without a prefill
    assert producer.handle(registration("pd2")) == accepted_as(WAITING)


def test_waiting_renews_an_admitted_registration_past_its_ttl(producer, clock):
    t0 = clock.now
    producer.admit("pd1")
    producer.handle(registration())
    clock.advance(TTL - 1.0)
    assert producer.handle(waiting()) == accepted_as(QUEUED)
    clock.now = t0 + TTL + 0.5  # the original window has closed
    producer.sweep()
    assert producer.book.state("pd1") is PushState.REGISTERED
    assert producer.num_expired_registrations == 0
    clock.now = t0 + TTL - 1.0 + TTL  # the renewed one closes, no renewal since
    producer.sweep()
    assert producer.book.state("pd1") is PushState.EXPIRED
    assert producer.num_expired_registrations == 1


def test_waiting_for_a_non_admitted_registration_does_not_renew(producer, clock):
    producer.handle(registration())
    clock.advance(TTL - 1.0)
    assert producer.handle(waiting()) == accepted_as(WAITING)
    clock.advance(1.0)
    producer.sweep()
    assert producer.book.state("pd1") is PushState.EXPIRED
    assert producer.num_expired_registrations == 1


def test_admission_after_the_registration_starts_the_renewals(producer, clock):
    """D's registration can beat P's own leg to P: answered ``waiting``,
    then renewed once the leg arrives."""
    t0 = clock.now
    assert producer.handle(registration()) == accepted_as(WAITING)
    clock.advance(2.0)
    producer.admit("pd1")
    assert producer.handle(waiting()) == accepted_as(QUEUED)
    clock.now = t0 + TTL
    producer.sweep()
    assert producer.book.state("pd1") is PushState.REGISTERED
    clock.now = t0 + 2.0 + TTL
    producer.sweep()
    assert producer.book.state("pd1") is PushState.EXPIRED


def test_waiting_for_an_unknown_id_is_an_unknown_error(producer):
    reply = producer.handle(waiting("ghost"))
    assert isinstance(reply, proto.ErrorReply) and reply.code == "unknown"
    assert "ghost" in reply.message


def test_waiting_after_expiry_is_an_unknown_error(producer, clock):
    producer.handle(registration())
    clock.advance(TTL)
    producer.sweep()
    reply = producer.handle(waiting())
    assert isinstance(reply, proto.ErrorReply) and reply.code == "unknown"
    assert "expired" in reply.message


def test_waiting_from_another_engine_is_refused_and_renews_nothing(producer, clock):
    producer.admit("pd1")
    producer.handle(registration(engine_id="eng-d"))
    clock.advance(TTL - 1.0)
    reply = producer.handle(waiting(engine_id="eng-other"))
    assert isinstance(reply, proto.ErrorReply) and reply.code == "refused"
    assert "eng-d" in reply.message and "eng-other" in reply.message
    clock.advance(1.0)  # the original window closes: it was not renewed
    producer.sweep()
    assert producer.book.state("pd1") is PushState.EXPIRED


def test_waiting_after_the_match_is_writing(producer, clock):
    producer.admit("pd1")
    producer.handle(registration())
    clock.advance(3.0)
    t_renew = clock.now
    assert producer.handle(waiting()) == accepted_as(QUEUED)
    clock.advance(3.0)  # past the original window (t0 + 5)
    producer.leases.grant("pd1", num_consumers=1)
    producer.prefill_done("pd1", "p-req", [10, 11, 12], 40)
    assert producer.book.state("pd1") is PushState.WRITING
    assert not producer.book.is_admitted("pd1")
    assert producer.handle(waiting()) == accepted_as(WRITING)
    # The WRITE order carries the renewed window, not the original one.
    pull = producer.orders_pull  # type: ignore[attr-defined]
    assert pull.poll(2000)
    order = proto.decode_order(pull.recv())
    assert order.pd_request_id == "pd1"
    assert order.post_before == pytest.approx(t_renew + TTL)
    # Settled: still "writing" to D (its notification is on the way).
    msg = proto.LeaseRelease(engine_id="eng-p", request_ids=["pd1"], tp_rank=0, ok=True)
    producer.leases.release(msg)
    producer.on_release(msg)
    assert producer.book.state("pd1") is PushState.DONE
    assert producer.handle(waiting()) == accepted_as(WRITING)


def test_prefill_failed_retires_so_renewals_stop(producer, clock):
    producer.admit("pd1")
    producer.admit("pd2")
    producer.handle(registration("pd2"))
    producer.prefill_failed("pd1", "p-req", "FINISHED_ABORTED")
    producer.retire("pd2")
    assert not producer.book.is_admitted("pd1")
    assert producer.handle(waiting("pd2")) == accepted_as(WAITING)


# ====================================================================== D side
PUSH_TIMEOUT = 8.0
SC_TIMEOUT = 2.0
WRITE_TIMEOUT = 3.0
QUEUE_TIMEOUT = 40.0
RENEW_EVERY = PUSH_TIMEOUT / 4
EP = ("127.0.0.1", 5999)


@pytest.fixture
def consumer(clock):
    c = PushConsumer("eng-d", COMPAT, "127.0.0.1", 6000, PUSH_TIMEOUT, SC_TIMEOUT, clock=clock,
                     write_timeout_s=WRITE_TIMEOUT, queue_timeout_s=QUEUE_TIMEOUT)
    c._outbox.close()
    c._outbox = FakeOutbox()  # type: ignore[assignment]
    yield c
    c.close()


def outbox(c: PushConsumer) -> FakeOutbox:
    return c._outbox  # type: ignore[return-value]


def renewals(c: PushConsumer) -> list[Sent]:
    return outbox(c).of(proto.PushWaiting)


def aborts(c: PushConsumer) -> list[Sent]:
    return outbox(c).of(proto.PushAbort)


def register_accepted(c: PushConsumer, state: proto.PushAcceptedState) -> None:
    c.register("d-req", "pd1", EP, "eng-p", first_block=0, block_ids=[4, 5], num_tokens=32)
    [reg] = outbox(c).of(proto.PushRegister)
    reg.callback(accepted_as(state))
    assert c.poll() == {}


def answer_renewal(c: PushConsumer, reply: object) -> None:
    renewals(c)[-1].callback(reply)


def test_queued_registration_extends_the_deadline(consumer, clock):
    t0 = clock.now
    consumer.register("d-req", "pd1", EP, "eng-p", first_block=0, block_ids=[4, 5],
                      num_tokens=32)
    wait = consumer._waits["d-req"]
    assert wait.deadline == pytest.approx(t0 + PUSH_TIMEOUT + SC_TIMEOUT)
    clock.advance(1.5)
    outbox(consumer).of(proto.PushRegister)[0].callback(accepted_as(QUEUED))
    clock.advance(0.5)  # the answer is applied by the next poll
    t_answer = clock.now
    assert consumer.poll() == {}
    assert wait.state is WaitState.REGISTERED and wait.queued
    assert wait.deadline == pytest.approx(t_answer + PUSH_TIMEOUT + SC_TIMEOUT)
    # No abort at the original deadline.
    clock.now = t0 + PUSH_TIMEOUT + SC_TIMEOUT
    consumer.poll()
    assert aborts(consumer) == []


def test_renewals_every_quarter_timeout_one_at_a_time(consumer, clock):
    t0 = clock.now
    register_accepted(consumer, WAITING)
    clock.now = t0 + RENEW_EVERY - 0.01
    consumer.poll()
    assert renewals(consumer) == []
    clock.now = t0 + RENEW_EVERY
    consumer.poll()
    [first] = renewals(consumer)
    assert (first.host, first.port) == EP
    assert first.msg == proto.PushWaiting(engine_id="eng-d", pd_request_id="pd1")
    assert first.callback is not None
    # Unanswered: no second renewal, however long it takes.
    clock.now = t0 + 2 * RENEW_EVERY + 0.5
    consumer.poll()
    assert len(renewals(consumer)) == 1
    # Answered after its successor was due: the next one leaves at once.
    answer_renewal(consumer, accepted_as(WAITING))
    consumer.poll()
    assert len(renewals(consumer)) == 2
    answer_renewal(consumer, accepted_as(WAITING))
    consumer.poll()
    assert len(renewals(consumer)) == 2  # the next is due RENEW_EVERY after the last send
    clock.advance(RENEW_EVERY - 0.01)
    consumer.poll()
    assert len(renewals(consumer)) == 2
    clock.advance(0.01)
    consumer.poll()
    assert len(renewals(consumer)) == 3


def test_no_renewal_before_p_accepted(consumer, clock):
    consumer.register("d-req", "pd1", EP, "eng-p", first_block=0, block_ids=[4, 5],
                      num_tokens=32)
    clock.advance(RENEW_EVERY * 3)
    consumer.poll()
    assert renewals(consumer) == []


def test_queued_renewals_extend_the_deadline_up_to_the_queue_timeout(consumer, clock):
    t0 = clock.now
    register_accepted(consumer, QUEUED)
    wait = consumer._waits["d-req"]
    cap = t0 + QUEUE_TIMEOUT + SC_TIMEOUT
    deadlines = [wait.deadline]
    while not aborts(consumer):
        clock.advance(0.25)
        consumer.poll()
        if wait.renewing and not aborts(consumer):
            answer_renewal(consumer, accepted_as(QUEUED))
            consumer.poll()
            assert wait.deadline == pytest.approx(
                min(cap, clock.now + PUSH_TIMEOUT + SC_TIMEOUT))
            deadlines.append(wait.deadline)
        assert clock.now - t0 < QUEUE_TIMEOUT * 2, "D never gave up"
    assert max(deadlines) == pytest.approx(cap)  # reached, never passed
    assert deadlines == sorted(deadlines)
    assert clock.now == pytest.approx(cap)  # gave up exactly at the cap
    assert len(renewals(consumer)) >= QUEUE_TIMEOUT / RENEW_EVERY - 2
    # No more renewals once the abort is out.
    n = len(renewals(consumer))
    clock.advance(RENEW_EVERY * 3)
    consumer.poll()
    assert len(renewals(consumer)) == n
    aborts(consumer)[-1].callback(proto.PushAbortStatus(proto.PushAbortState.ABORTED))
    out = consumer.poll()
    assert out["d-req"][0] == "timeout"
    assert "push_queue_timeout" in out["d-req"][1]
    assert "queued" in out["d-req"][1]


def test_waiting_answers_do_not_extend_the_deadline(consumer, clock):
    t0 = clock.now
    register_accepted(consumer, WAITING)
    wait = consumer._waits["d-req"]
    original = wait.deadline
    assert original == pytest.approx(t0 + PUSH_TIMEOUT + SC_TIMEOUT)
    while clock.now < original - 0.25:
        clock.advance(0.25)
        consumer.poll()
        if wait.renewing:
            answer_renewal(consumer, accepted_as(WAITING))
            consumer.poll()
        assert wait.deadline == original
    assert renewals(consumer), "D sent no renewal while waiting"
    assert aborts(consumer) == []
    clock.now = original
    consumer.poll()
    [abort] = aborts(consumer)
    abort.callback(proto.PushAbortStatus(proto.PushAbortState.ABORTED))
    out = consumer.poll()
    assert out["d-req"][0] == "timeout"
    detail = out["d-req"][1]
    assert "push_timeout" in detail and "push_queue_timeout" not in detail
    assert "never confirmed" in detail


def test_late_queued_renewal_extends_a_waiting_registration(consumer, clock):
    """P answered ``waiting`` (its leg had not arrived yet), then ``queued``."""
    t0 = clock.now
    register_accepted(consumer, WAITING)
    wait = consumer._waits["d-req"]
    assert not wait.queued
    clock.now = t0 + RENEW_EVERY
    consumer.poll()
    answer_renewal(consumer, accepted_as(QUEUED))
    clock.advance(0.5)
    consumer.poll()
    assert wait.queued
    assert wait.deadline == pytest.approx(clock.now + PUSH_TIMEOUT + SC_TIMEOUT)
    assert wait.window_closes == pytest.approx(clock.now + PUSH_TIMEOUT + WRITE_TIMEOUT)


def test_queue_timeout_below_push_timeout_never_shortens_the_deadline(clock):
    c = PushConsumer("eng-d", COMPAT, "127.0.0.1", 6000, PUSH_TIMEOUT, SC_TIMEOUT, clock=clock,
                     write_timeout_s=WRITE_TIMEOUT, queue_timeout_s=1.0)
    c._outbox.close()
    c._outbox = FakeOutbox()  # type: ignore[assignment]
    try:
        assert c.queue_timeout_s == PUSH_TIMEOUT
        t0 = clock.now
        register_accepted(c, QUEUED)
        assert c._waits["d-req"].deadline == pytest.approx(t0 + PUSH_TIMEOUT + SC_TIMEOUT)
    finally:
        c.close()


def test_renewal_error_extends_the_write_window_not_the_deadline(consumer, clock):
    t0 = clock.now
    register_accepted(consumer, QUEUED)
    wait = consumer._waits["d-req"]
    clock.now = t0 + RENEW_EVERY
    consumer.poll()
    deadline, window = wait.deadline, wait.window_closes
    clock.advance(1.0)  # the renewal's send timed out (before the next is due)
    answer_renewal(consumer, SideChannelError("side channel did not answer within 1000 ms",
                                              "timeout"))
    consumer.poll()
    assert not wait.renewing
    assert wait.deadline == deadline
    # P may have renewed the registration just before the answer was lost.
    assert wait.window_closes == pytest.approx(
        clock.now + SC_TIMEOUT + PUSH_TIMEOUT + WRITE_TIMEOUT)
    assert wait.window_closes > window
    # An unknown-id answer is an error too: no extension of the deadline.
    clock.advance(RENEW_EVERY)
    consumer.poll()
    assert len(renewals(consumer)) == 2
    w0 = wait.window_closes
    clock.advance(0.5)
    answer_renewal(consumer, proto.ErrorReply("unknown", "no push registration pd1 waits"))
    consumer.poll()
    assert wait.deadline == deadline and not wait.renewing
    # A definite "no" from P renewed nothing: the window stays where it was.
    assert wait.window_closes == w0


def test_renewal_error_keeps_blocks_until_the_extended_window_closes(consumer, clock):
    """After a lost renewal answer D must not reuse its blocks on an
    unreachable P until the renewed window P may have granted has closed."""
    t0 = clock.now
    register_accepted(consumer, QUEUED)
    clock.now = t0 + RENEW_EVERY
    consumer.poll()
    clock.advance(SC_TIMEOUT)
    answer_renewal(consumer, SideChannelError("did not answer within 2000 ms", "timeout"))
    consumer.poll()
    window = clock.now + SC_TIMEOUT + PUSH_TIMEOUT + WRITE_TIMEOUT
    assert window > t0 + PUSH_TIMEOUT + WRITE_TIMEOUT  # later than the accepted window
    consumer.abandon("d-req", "pd1", EP, "client went away")
    clock.now = window - 0.01
    aborts(consumer)[-1].callback(SideChannelError("did not answer within 2000 ms", "timeout"))
    assert consumer.poll() == {} and consumer.num_waiting == 1
    clock.now = window
    consumer.poll()  # asks again
    aborts(consumer)[-1].callback(SideChannelError("did not answer within 2000 ms", "timeout"))
    out = consumer.poll()
    assert out["d-req"][0] == "aborted" and "unreachable" in out["d-req"][1]


def test_on_event_is_called_once_the_event_is_queued(consumer, clock):
    seen: list[int] = []
    consumer.on_event = lambda: seen.append(len(consumer._events))
    consumer.register("d-req", "pd1", EP, "eng-p", first_block=0, block_ids=[4, 5],
                      num_tokens=32)
    assert seen == []  # sending wakes nobody
    outbox(consumer).of(proto.PushRegister)[0].callback(accepted_as(QUEUED))
    assert seen == [1]  # called after the event was queued
    consumer.poll()
    clock.advance(RENEW_EVERY)
    consumer.poll()
    answer_renewal(consumer, accepted_as(QUEUED))
    assert seen == [1, 1]
    consumer.on_result(proto.PushResult(engine_id="eng-p", pd_request_id="pd1", tp_rank=-1,
                                        ok=False, detail="prefill aborted"))
    assert seen == [1, 1, 2]
    # A result for an id D does not wait for queues nothing and wakes nobody.
    consumer.on_result(proto.PushResult(engine_id="eng-p", pd_request_id="other",
                                        tp_rank=-1, ok=False))
    assert seen == [1, 1, 2]
