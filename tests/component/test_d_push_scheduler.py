"""PushConsumer (D's scheduler half in push mode) with a fake clock and a fake
outbox: the test plays P by answering each recorded message."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_pd_ext.scheduler.d_push import (
    ABORT_RETRY_S,
    DONE_GRACE_S,
    EventKind,
    PushConsumer,
    PushEvent,
    WaitState,
)
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.side_channel import SideChannelError

PUSH_TIMEOUT = 10.0
SC_TIMEOUT = 2.0
#: D starts aborting this long after registering.
DEADLINE = PUSH_TIMEOUT + SC_TIMEOUT
WRITE_TIMEOUT = 3.0
#: After P accepted, a WRITE from P can land until this much later.
WRITE_WINDOW = PUSH_TIMEOUT + WRITE_TIMEOUT
EP = ("127.0.0.1", 5999)
AbortState = proto.PushAbortState
COMPAT = proto.CompatInfo(protocol_version=2, model="m", dtype="bfloat16", block_size=16,
                          kv_layout="LBHNC", num_layers=2, num_kv_heads=2, head_size=64,
                          tp_size=1, transfer_mode="push")


@dataclass
class Sent:
    host: str
    port: int
    msg: proto.Request
    callback: object


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.closed = False

    def send(self, host, port, msg, callback=None) -> None:
        self.sent.append(Sent(host, port, msg, callback))

    def of(self, kind: type) -> list[Sent]:
        return [s for s in self.sent if isinstance(s.msg, kind)]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def consumer(clock):
    c = PushConsumer("eng-d", COMPAT, "127.0.0.1", 6000, PUSH_TIMEOUT, SC_TIMEOUT, clock=clock,
                     write_timeout_s=WRITE_TIMEOUT)
    c._outbox.close()
    c._outbox = FakeOutbox()
    yield c
    c.close()


def register(c: PushConsumer, rid="d-req", pd_id="pd1") -> Sent:
    c.register(rid, pd_id, EP, "eng-p", first_block=1, block_ids=[4, 5], num_tokens=40)
    sent = c._outbox.sent[-1]
    assert isinstance(sent.msg, proto.PushRegister)
    return sent


def accepted(c: PushConsumer, rid="d-req", pd_id="pd1") -> None:
    register(c, rid, pd_id).callback(
        proto.PushAccepted(engine_id="eng-p", state=proto.PushAcceptedState.WAITING))
    assert c.poll() == {}


def aborts(c: PushConsumer) -> list[Sent]:
    return c._outbox.of(proto.PushAbort)


def answer_abort(c: PushConsumer, state: AbortState) -> None:
    aborts(c)[-1].callback(proto.PushAbortStatus(state))


def refused(message: str, code: str = "refused") -> SideChannelError:
    """What SideChannelClient raises for P's ErrorReply."""
    return SideChannelError(f"side channel tcp://127.0.0.1:5999 refused: {message}", code)


def test_register_sends_registration(consumer):
    sent = register(consumer)
    msg = sent.msg
    assert (sent.host, sent.port) == EP
    assert msg.pd_request_id == "pd1" and msg.request_id == "d-req"
    assert msg.expect_engine_id == "eng-p" and msg.engine_id == "eng-d"
    assert (msg.notify_host, msg.notify_port) == ("127.0.0.1", 6000)
    assert msg.first_block == 1 and msg.block_ids == [4, 5] and msg.num_tokens == 40
    assert msg.ttl_s == PUSH_TIMEOUT
    assert consumer.num_waiting == 1


@pytest.mark.parametrize("message,code,reason", [
    ("pd_request_id 'pd1' was already aborted", "refused", "handshake"),
    ("incompatible peer: block_size: ours=16 theirs=32", "incompatible", "incompatible_peer"),
    # The reason comes from the reply's code, never from its text.
    ("pd_request_id 'incompatible-1' was already aborted", "refused", "handshake"),
])
def test_refused_registration_fails_at_once(consumer, message, code, reason):
    register(consumer).callback(refused(message, code))
    out = consumer.poll()
    assert list(out) == ["d-req"]
    assert out["d-req"][0] == reason
    assert "refused" in out["d-req"][1] and message in out["d-req"][1]
    assert consumer.num_waiting == 0
    assert aborts(consumer) == []  # nothing to abort: P will never write
    assert consumer.poll() == {}


def test_deadline_aborts_then_safe_state_fails(consumer, clock):
    accepted(consumer)
    clock.advance(DEADLINE - 0.01)
    assert consumer.poll() == {} and aborts(consumer) == []
    clock.advance(0.01)
    assert consumer.poll() == {}
    [abort] = aborts(consumer)
    assert abort.msg.pd_request_id == "pd1" and (abort.host, abort.port) == EP
    assert consumer.poll() == {} and len(aborts(consumer)) == 1  # no reply yet: no resend
    answer_abort(consumer, AbortState.ABORTED)
    out = consumer.poll()
    assert out["d-req"][0] == "timeout" and "push_timeout" in out["d-req"][1]
    assert consumer.num_waiting == 0


@pytest.mark.parametrize("state", [AbortState.UNKNOWN, AbortState.FAILED])
def test_deadline_other_safe_states(consumer, clock, state):
    accepted(consumer)
    clock.advance(DEADLINE)
    consumer.poll()
    answer_abort(consumer, state)
    out = consumer.poll()
    assert list(out) == ["d-req"] and "push_timeout" in out["d-req"][1]


def test_unconfirmed_registration_still_bounded(consumer, clock):
    register(consumer).callback(SideChannelError("side channel did not answer within 2000 ms",
                                                 "timeout"))
    assert consumer.poll() == {}  # P may have it: not failed yet
    clock.advance(DEADLINE)
    assert consumer.poll() == {} and len(aborts(consumer)) == 1
    answer_abort(consumer, AbortState.UNKNOWN)
    assert list(consumer.poll()) == ["d-req"]


def test_in_flight_waits_and_resends(consumer, clock):
    accepted(consumer)
    assert consumer.abandon("d-req", "pd1", EP, "client went away") is True
    assert len(aborts(consumer)) == 1
    answer_abort(consumer, AbortState.IN_FLIGHT)
    assert consumer.poll() == {}
    clock.advance(ABORT_RETRY_S - 0.01)
    assert consumer.poll() == {} and len(aborts(consumer)) == 1
    clock.advance(0.01)
    assert consumer.poll() == {} and len(aborts(consumer)) == 2
    answer_abort(consumer, AbortState.IN_FLIGHT)
    assert consumer.poll() == {}  # the retry is timed from when D learns the answer
    clock.advance(ABORT_RETRY_S)
    assert consumer.poll() == {} and len(aborts(consumer)) == 3
    answer_abort(consumer, AbortState.DONE)  # the request ended: its blocks can go now
    out = consumer.poll()
    # Not a load failure: the report only gives the ended request's blocks back.
    assert out == {"d-req": ("aborted", "client went away")}
    assert consumer.num_waiting == 0


def test_done_for_live_request_grants_grace(consumer, clock):
    accepted(consumer)
    clock.advance(DEADLINE)
    consumer.poll()
    answer_abort(consumer, AbortState.DONE)
    assert consumer.poll() == {}  # the notification follows the data
    clock.advance(DONE_GRACE_S - 0.01)
    assert consumer.poll() == {} and len(aborts(consumer)) == 1
    clock.advance(0.01)
    out = consumer.poll()
    assert out["d-req"][0] == "transfer_error" and "notification" in out["d-req"][1]
    assert len(aborts(consumer)) == 1


def test_done_then_notification_is_not_failed(consumer, clock):
    accepted(consumer)
    clock.advance(DEADLINE)
    consumer.poll()
    answer_abort(consumer, AbortState.DONE)
    consumer.poll()
    consumer.loaded("d-req")  # the worker saw the notification
    clock.advance(DONE_GRACE_S * 5)
    assert consumer.poll() == {} and consumer.num_waiting == 0


def test_abort_error_before_window_closes_keeps_blocks(consumer, clock):
    accepted(consumer)  # the WRITE window: until WRITE_WINDOW from now
    clock.advance(1.0)
    consumer.abandon("d-req", "pd1", EP, "client went away")
    aborts(consumer)[-1].callback(SideChannelError("did not answer within 2000 ms", "timeout"))
    assert consumer.poll() == {}
    # Keeps asking until P answers or the WRITE window closes.
    clock.advance(ABORT_RETRY_S)
    assert consumer.poll() == {} and len(aborts(consumer)) == 2
    clock.advance(WRITE_WINDOW - 1.0 - ABORT_RETRY_S - 0.01)
    aborts(consumer)[-1].callback(SideChannelError("did not answer within 2000 ms", "timeout"))
    assert consumer.poll() == {}
    assert consumer.num_waiting == 1


def test_abort_error_after_window_closes_releases(consumer, clock):
    accepted(consumer)
    clock.advance(1.0)
    consumer.abandon("d-req", "pd1", EP, "client went away")
    clock.advance(WRITE_WINDOW - 1.0)
    aborts(consumer)[-1].callback(SideChannelError("did not answer within 2000 ms", "timeout"))
    out = consumer.poll()
    assert out["d-req"][0] == "aborted"
    assert "unreachable" in out["d-req"][1] and "client went away" in out["d-req"][1]


def test_deadline_with_unreachable_p_releases_when_write_window_closes(consumer, clock):
    accepted(consumer)
    clock.advance(DEADLINE)  # give up waiting: abort
    consumer.poll()
    aborts(consumer)[-1].callback(SideChannelError("did not answer within 2000 ms", "timeout"))
    assert consumer.poll() == {}  # a WRITE posted before P's window closed may still land
    clock.advance(WRITE_WINDOW - DEADLINE)
    consumer.poll()  # asks again
    assert len(aborts(consumer)) == 2
    aborts(consumer)[-1].callback(SideChannelError("did not answer within 2000 ms", "timeout"))
    out = consumer.poll()
    assert out["d-req"][0] == "handshake" and "unreachable" in out["d-req"][1]


def test_unsent_registration_keeps_window_open(consumer, clock):
    """Until the registration's send has ended (queued behind others in the
    outbox), D cannot bound when P may receive it: it never frees on an
    unreachable P then."""
    register(consumer)  # no reply yet
    consumer.abandon("d-req", "pd1", EP, "client went away")
    clock.advance(DEADLINE * 10)
    aborts(consumer)[-1].callback(SideChannelError("did not answer within 2000 ms", "timeout"))
    assert consumer.poll() == {} and consumer.num_waiting == 1


def test_push_result_failure_fails_at_once(consumer):
    accepted(consumer)
    reply = consumer.on_result(proto.PushResult(engine_id="eng-p", pd_request_id="pd1",
                                                tp_rank=0, ok=False, detail="NIXL said no"))
    assert isinstance(reply, proto.Ack)
    out = consumer.poll()
    assert out["d-req"][0] == "transfer_error" and "NIXL said no" in out["d-req"][1]
    assert aborts(consumer) == []
    assert consumer.num_waiting == 0


def test_push_result_for_unknown_id_is_ignored(consumer):
    accepted(consumer)
    reply = consumer.on_result(proto.PushResult(engine_id="eng-p", pd_request_id="other",
                                                tp_rank=0, ok=False))
    assert isinstance(reply, proto.Ack)
    assert consumer.poll() == {} and consumer.num_waiting == 1


def test_finished_stops_everything(consumer, clock):
    sent = register(consumer)
    consumer.loaded("d-req")
    assert consumer.num_waiting == 0
    # Late replies and results for it change nothing.
    sent.callback(refused("pd_request_id 'pd1' was already aborted"))
    consumer.on_result(proto.PushResult(engine_id="eng-p", pd_request_id="pd1", tp_rank=0,
                                        ok=False))
    clock.advance(DEADLINE * 3)
    assert consumer.poll() == {}
    assert aborts(consumer) == []


def test_abandon_unregistered_is_fire_and_forget(consumer):
    assert consumer.abandon("d-req", "pd9", EP, "no blocks needed") is False
    [abort] = aborts(consumer)
    assert abort.callback is None and (abort.host, abort.port) == EP
    assert abort.msg.pd_request_id == "pd9" and abort.msg.reason == "no blocks needed"
    assert consumer.num_waiting == 0 and consumer.poll() == {}


def test_abandon_registered_reported_once_p_is_safe(consumer, clock):
    accepted(consumer)
    assert consumer.abandon("d-req", "pd1", EP, "client went away") is True
    [abort] = aborts(consumer)
    assert abort.callback is not None and abort.msg.reason == "client went away"
    assert consumer.poll() == {}  # no answer yet: blocks stay allocated
    clock.advance(DEADLINE * 2)  # no second abort while the first is unanswered
    assert consumer.poll() == {} and len(aborts(consumer)) == 1
    answer_abort(consumer, AbortState.ABORTED)
    assert consumer.poll() == {"d-req": ("aborted", "client went away")}
    assert consumer.poll() == {}  # reported exactly once


def test_close_closes_outbox(clock):
    c = PushConsumer("eng-d", COMPAT, "127.0.0.1", 6000, PUSH_TIMEOUT, SC_TIMEOUT, clock=clock)
    c._outbox.close()
    c._outbox = FakeOutbox()
    c.close()
    assert c._outbox.closed


def test_replies_become_typed_events_and_states(consumer, clock):
    """Replies reach ``poll`` as ``PushEvent`` records; the wait's state is a
    ``WaitState`` through REGISTERING -> REGISTERED -> ABORTING -> IN_FLIGHT."""
    sent = register(consumer)
    wait = consumer._waits["d-req"]
    assert wait.state is WaitState.REGISTERING
    assert consumer.register_seconds("d-req") is None
    clock.advance(0.25)  # the registration's round trip (telemetry's register_ms)
    sent.callback(proto.PushAccepted(engine_id="eng-p", state=proto.PushAcceptedState.WRITING))
    assert consumer._events == [PushEvent("d-req", EventKind.ACCEPTED, "writing", at=1000.25)]
    consumer.poll()
    assert wait.state is WaitState.REGISTERED
    assert consumer.register_seconds("d-req") == 0.25
    consumer.abandon("d-req", "pd1", EP, "client went away")
    assert wait.state is WaitState.ABORTING
    answer_abort(consumer, AbortState.IN_FLIGHT)
    assert consumer._events == [PushEvent("d-req", EventKind.ABORT_STATUS,
                                          abort_state=AbortState.IN_FLIGHT)]
    consumer.poll()
    assert wait.state is WaitState.IN_FLIGHT


def test_abort_status_decoded_from_the_wire(consumer):
    """What the side channel hands over: the wire string decoded into the enum."""
    accepted(consumer)
    consumer.abandon("d-req", "pd1", EP, "client went away")
    wire = proto.encode(proto.PushAbortStatus(AbortState.ABORTED))
    aborts(consumer)[-1].callback(proto.decode_reply(wire))
    assert consumer.poll() == {"d-req": ("aborted", "client went away")}


def test_lease_expired_on_p_aborts_an_unconfirmed_wait_at_once(consumer, clock):
    """P was unreachable while D registered; once reachable it answers D's
    heartbeat "lease expired": D aborts now (and fails the load once P
    confirms no WRITE comes) instead of waiting out push_timeout."""
    register(consumer).callback(SideChannelError("side channel did not answer within 2000 ms",
                                                 "timeout"))
    assert consumer.poll() == {}
    clock.advance(1.0)
    consumer.lease_expired(EP, ["pd1", "pd-not-ours"])
    assert consumer.poll() == {}
    [abort] = aborts(consumer)
    assert abort.msg.pd_request_id == "pd1" and (abort.host, abort.port) == EP
    consumer.lease_expired(EP, ["pd1"])  # a second report: no second abort
    assert consumer.poll() == {} and len(aborts(consumer)) == 1
    answer_abort(consumer, AbortState.ABORTED)
    out = consumer.poll()
    assert out["d-req"][0] == "timeout" and "lease on the prefill expired" in out["d-req"][1]
    assert consumer.num_waiting == 0


def test_lease_expired_after_a_write_landed_keeps_the_load(consumer, clock):
    """The heartbeat crossed P's release after its WRITE: P answers the
    abort "done", and the notification still completes the load."""
    accepted(consumer)
    consumer.lease_expired(EP, ["pd1"])
    consumer.poll()
    answer_abort(consumer, AbortState.DONE)
    assert consumer.poll() == {}
    consumer.loaded("d-req")  # the notification
    clock.advance(DONE_GRACE_S + 1)
    assert consumer.poll() == {} and consumer.num_waiting == 0


def test_lease_expired_from_another_endpoint_is_ignored(consumer, clock):
    accepted(consumer)
    consumer.lease_expired(("127.0.0.1", 1234), ["pd1"])
    assert consumer.poll() == {} and aborts(consumer) == []
