"""P's push scheduler half: D hears of a failed WRITE only when no rank of P
can still write (TP > 1), and at once when nothing was ordered."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.scheduler.p_push import PushProducer
from vllm_pd_ext.scheduler.pushbook import PushState
from vllm_pd_ext.wire import protocol as proto

COMPAT = proto.CompatInfo(protocol_version=proto.PROTOCOL_VERSION, model="m", dtype="bf16",
                          block_size=16, kv_layout="NHD", num_layers=2, num_kv_heads=1,
                          head_size=8, tp_size=2, transfer_mode="push")


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, proto.Request]] = []

    def send(self, host: str, port: int, msg: proto.Request, callback: object = None) -> None:
        self.sent.append((host, port, msg))

    def close(self) -> None:
        return

    def results(self) -> list[proto.PushResult]:
        return [m for _, _, m in self.sent if isinstance(m, proto.PushResult)]


def agent(rank: int) -> proto.AgentInfo:
    return proto.AgentInfo(tp_rank=rank, agent_name=f"d{rank}", agent_metadata=b"m",
                           mem_type="DRAM", regions=[proto.Region(0, 64, 64, 8)])


def registration(pd_id: str = "pd1", num_tokens: int = 40) -> proto.PushRegister:
    return proto.PushRegister(
        engine_id="eng-d", compat=COMPAT, expect_engine_id="eng-p", pd_request_id=pd_id,
        request_id="d-req", notify_host="127.0.0.1", notify_port=7000,
        agents=[agent(0), agent(1)], first_block=0, block_ids=[3, 4, 5], num_tokens=num_tokens,
        ttl_s=30.0)


@pytest.fixture
def rig():
    ctx = zmq.Context()
    pulls = []
    for _ in range(2):
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        pulls.append((sock, sock.bind_to_random_port("tcp://127.0.0.1")))
    leases = LeaseService(LeaseTable(30.0, time.monotonic))
    prod = PushProducer("eng-p", COMPAT, block_size=16, tp_size=2, leases=leases,
                        notify_timeout_s=1.0)
    prod._outbox.close()
    prod._outbox = FakeOutbox()  # type: ignore[assignment]
    yield prod, leases, pulls
    prod.close()
    for sock, _ in pulls:
        sock.close()
    ctx.term()


def start_write(prod: PushProducer, leases: LeaseService, pulls, num_tokens: int = 40) -> None:
    prod.bind_workers({r: f"tcp://127.0.0.1:{port}" for r, (_, port) in enumerate(pulls)})
    assert isinstance(prod.handle(registration(num_tokens=num_tokens)), proto.PushAccepted)
    leases.grant("pd1", num_consumers=2)
    prod.prefill_done("pd1", "p-req", [10, 11, 12], 40)


def release(prod: PushProducer, rank: int, ok: bool, reason: str = "") -> None:
    """What P's side channel does with a worker's release."""
    msg = proto.LeaseRelease(engine_id="eng-p", request_ids=["pd1"], tp_rank=rank, ok=ok,
                             reason=reason)
    prod.leases.release(msg)
    prod.on_release(msg)


def test_both_ranks_get_their_order(rig):
    prod, leases, pulls = rig
    start_write(prod, leases, pulls)
    for rank, (sock, _) in enumerate(pulls):
        assert sock.poll(2000)
        order = proto.decode_order(sock.recv())
        assert order.agent.agent_name == f"d{rank}"
        assert order.src_block_ids == [10, 11, 12] and order.dst_block_ids == [3, 4, 5]
    assert leases.table.get("pd1").state is LeaseState.WRITING


def test_failed_rank_is_reported_only_after_every_rank_settled(rig):
    prod, leases, pulls = rig
    start_write(prod, leases, pulls)
    release(prod, 0, ok=False, reason="NIXL reported an error for the WRITE")
    # Rank 1 may still be writing into D's blocks: D must not hear yet.
    assert prod._outbox.results() == []
    assert prod.book.state("pd1") is PushState.WRITING
    release(prod, 1, ok=True)
    [result] = prod._outbox.results()
    assert result.pd_request_id == "pd1" and result.ok is False
    assert result.detail == "NIXL reported an error for the WRITE"
    assert prod.book.state("pd1") is PushState.FAILED
    assert leases.table.get("pd1").state is LeaseState.RELEASED


def test_successful_write_sends_nothing_to_d(rig):
    prod, leases, pulls = rig
    start_write(prod, leases, pulls)
    release(prod, 0, ok=True)
    release(prod, 1, ok=True)
    assert prod._outbox.results() == [] and prod.book.state("pd1") is PushState.DONE


def test_refused_write_is_reported_at_once(rig):
    prod, leases, pulls = rig
    start_write(prod, leases, pulls, num_tokens=41)  # D's prompt differs from P's
    [result] = prod._outbox.results()
    assert "P prefilled 40 tokens but D's prompt has 41" in result.detail
    assert leases.table.get("pd1").state is LeaseState.RELEASED
    for sock, _ in pulls:
        assert not sock.poll(100)  # nothing was ordered


def test_registration_after_the_lease_ended_orders_no_write(rig):
    """The prefill waits for D; its lease ends (here: released and swept)
    before the book forgets it; D's registration then arrives. P must not
    write from blocks that are freed or about to be: D hears of the failure
    at once and no rank gets an order."""
    prod, leases, pulls = rig
    prod.bind_workers({r: f"tcp://127.0.0.1:{port}" for r, (_, port) in enumerate(pulls)})
    leases.grant("pd1", num_consumers=2)
    prod.prefill_done("pd1", "p-req", [10, 11, 12], 40)  # waits for D's registration
    assert leases.release_ranks("pd1", range(2), ok=False) is True
    assert leases.sweep().released == ["pd1"]
    prod.handle(registration())
    [result] = prod._outbox.results()
    assert result.ok is False and "lease on the prefilled blocks ended" in result.detail
    for sock, _ in pulls:
        assert not sock.poll(100)  # nothing was ordered


def test_expired_prefill_is_forgotten_in_the_sweeps_critical_section(rig):
    """The prefill's lease expires before D registers. The sweep forgets the
    prefill in the same critical section as it ends the lease, so a
    registration on the side-channel thread either matched before (and
    holds the lease) or is refused after: it never sees the freed blocks."""
    prod, _, pulls = rig
    clock = [0.0]
    leases = LeaseService(LeaseTable(30.0, lambda: clock[0]))
    prod.leases = leases
    prod.bind_workers({r: f"tcp://127.0.0.1:{port}" for r, (_, port) in enumerate(pulls)})
    leases.grant("pd1", num_consumers=2)
    prod.prefill_done("pd1", "p-req", [10, 11, 12], 40)
    clock[0] = 31.0
    replies: list[proto.Reply] = []
    side_channel = threading.Thread(target=lambda: replies.append(prod.handle(registration())))
    state_in_callback: list[str] = []

    def on_expired(ids: list[str]) -> None:
        side_channel.start()
        side_channel.join(0.2)  # kept out: the sweep holds the lock
        prod.forget_expired_prefills(ids)
        state_in_callback.append(prod.book.state("pd1"))

    assert leases.sweep(on_expired=on_expired).expired == ["pd1"]
    side_channel.join(2)
    assert state_in_callback == [PushState.EXPIRED]
    [reply] = replies
    assert isinstance(reply, proto.ErrorReply) and "already expired" in reply.message
    for sock, _ in pulls:
        assert not sock.poll(100)  # nothing was ordered


def test_replies_carry_typed_states_that_round_trip_the_wire(rig):
    prod, _, pulls = rig
    prod.bind_workers({r: f"tcp://127.0.0.1:{port}" for r, (_, port) in enumerate(pulls)})
    accepted = prod.handle(registration())
    assert accepted == proto.PushAccepted(engine_id="eng-p",
                                          state=proto.PushAcceptedState.WAITING)
    status = prod.handle(proto.PushAbort(engine_id="eng-d", pd_request_id="pd1"))
    assert status == proto.PushAbortStatus(proto.PushAbortState.ABORTED)
    assert prod.handle(proto.PushAbort(engine_id="eng-d", pd_request_id="ghost")) == (
        proto.PushAbortStatus(proto.PushAbortState.UNKNOWN))
    # The same strings as before on the wire, decoded back into the enums.
    for reply, wire_state in ((accepted, "waiting"), (status, "aborted")):
        data = proto.encode(reply)
        assert msgspec.msgpack.decode(data)["state"] == wire_state
        decoded = proto.decode_reply(data)
        assert decoded == reply and type(decoded.state) is type(reply.state)
