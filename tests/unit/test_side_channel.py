"""A real SideChannelServer on 127.0.0.1 and a SideChannelClient."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from pdunit_utils import FakeClock, free_port

from vllm_pd_ext import protocol as proto
from vllm_pd_ext.leases import LeaseState, LeaseTable
from vllm_pd_ext.side_channel import (
    LeaseService,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
)

HOST = "127.0.0.1"


def compat(**over):
    base = dict(protocol_version=1, model="m", dtype="bfloat16", block_size=128,
                kv_layout="LBHNC", num_layers=2, num_kv_heads=2, head_size=64, tp_size=1,
                transfer_mode="pull")
    base.update(over)
    return proto.CompatInfo(**base)


AGENT = proto.AgentInfo(tp_rank=0, agent_name="p-agent", agent_metadata=b"md", mem_type="DRAM",
                        regions=[proto.Region(4096, 64, 64, 8)])


@pytest.fixture
def fake_clock():
    return FakeClock()


@pytest.fixture
def service(fake_clock):
    return LeaseService(LeaseTable(10.0, fake_clock))


@pytest.fixture
def server(service):
    port = free_port()
    srv = SideChannelServer(HOST, port, "eng-p", compat(), {0: AGENT}, service)
    srv.port = port
    yield srv
    srv.close()


@pytest.fixture
def client():
    c = SideChannelClient(timeout_s=2.0)
    yield c
    c.close()


def test_handshake_ok(server, client):
    reply = client.request(HOST, server.port, proto.HandshakeRequest(
        engine_id="eng-d", tp_rank=0, compat=compat()))
    assert isinstance(reply, proto.HandshakeReply)
    assert reply.engine_id == "eng-p"
    assert reply.agent == AGENT
    assert reply.compat == compat()


def test_handshake_incompatible_names_field(server, client):
    with pytest.raises(SideChannelError, match=r"incompatible.*block_size"):
        client.request(HOST, server.port, proto.HandshakeRequest(
            engine_id="eng-d", tp_rank=0, compat=compat(block_size=32)))
    # The socket still works afterwards.
    reply = client.request(HOST, server.port, proto.HandshakeRequest(
        engine_id="eng-d", tp_rank=0, compat=compat()))
    assert isinstance(reply, proto.HandshakeReply)


def test_handshake_unknown_rank(server, client):
    with pytest.raises(SideChannelError, match="no TP rank 3"):
        client.request(HOST, server.port, proto.HandshakeRequest(
            engine_id="eng-d", tp_rank=3, compat=compat()))


def test_renew_acquire_release(server, client, service, fake_clock):
    service.table.grant("r1")
    service.table.grant("r2")
    fake_clock.advance(4.0)
    reply = client.request(HOST, server.port, proto.LeaseRenew(
        engine_id="eng-d", request_ids=["r1", "ghost"]))
    assert isinstance(reply, proto.LeaseStatus)
    assert reply.remaining_s == [pytest.approx(10.0), proto.LEASE_UNKNOWN]
    assert service.num_heartbeats == 2
    assert service.num_late_messages == 1

    reply = client.request(HOST, server.port, proto.LeaseRenew(
        engine_id="eng-d", request_ids=["r1"], acquire=True))
    assert reply.remaining_s == [pytest.approx(10.0)]
    assert service.table.get("r1").state is LeaseState.READING
    assert service.num_heartbeats == 2  # a pin is not a heartbeat

    reply = client.request(HOST, server.port, proto.LeaseRelease(
        engine_id="eng-d", request_ids=["r1"], tp_rank=0))
    assert isinstance(reply, proto.Ack)
    assert service.table.get("r1").state is LeaseState.RELEASED
    res = service.table.sweep()
    assert res.released == ["r1"]

    # r2 expires; a late pin and a late release are counted, not errors.
    fake_clock.advance(20.0)
    assert service.table.sweep().expired == ["r2"]
    reply = client.request(HOST, server.port, proto.LeaseRenew(
        engine_id="eng-d", request_ids=["r2"], acquire=True))
    assert reply.remaining_s == [proto.LEASE_EXPIRED]
    late = service.num_late_messages
    assert isinstance(client.request(HOST, server.port, proto.LeaseRelease(
        engine_id="eng-d", request_ids=["r2"], tp_rank=0)), proto.Ack)
    assert service.num_late_messages == late + 1


def test_lease_messages_without_service_refused(client):
    port = free_port()
    srv = SideChannelServer(HOST, port, "eng-d", compat(), {0: AGENT}, None)
    try:
        with pytest.raises(SideChannelError, match="holds no leases"):
            client.request(HOST, port, proto.LeaseRenew(engine_id="x", request_ids=["a"]))
    finally:
        srv.close()


def test_garbage_gets_malformed_and_server_keeps_serving(server, client):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    try:
        sock.connect(f"tcp://{HOST}:{server.port}")
        for junk in (b"\xc1\xc1garbage", msgspec.msgpack.encode({"type": "nope"}), b""):
            sock.send(junk)
            reply = proto.decode_reply(sock.recv())
            assert isinstance(reply, proto.ErrorReply)
            assert reply.code == "malformed"
    finally:
        sock.close()
        ctx.term()
    reply = client.request(HOST, server.port, proto.HandshakeRequest(
        engine_id="eng-d", tp_rank=0, compat=compat()))
    assert isinstance(reply, proto.HandshakeReply)


def test_handler_exception_is_internal_error(server, client, service, monkeypatch):
    def boom(msg):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(service, "renew", boom)
    with pytest.raises(SideChannelError, match="kaboom"):
        client.request(HOST, server.port, proto.LeaseRenew(engine_id="d", request_ids=["a"]))
    monkeypatch.undo()
    reply = client.request(HOST, server.port, proto.LeaseRenew(engine_id="d", request_ids=["a"]))
    assert reply.remaining_s == [proto.LEASE_UNKNOWN]


def test_dead_port_times_out_quickly():
    port = free_port()  # nothing listens there
    c = SideChannelClient(timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(SideChannelError, match="did not answer"):
            c.request(HOST, port, proto.LeaseRenew(engine_id="d", request_ids=["a"]))
        assert time.monotonic() - t0 < 1.5
        # The broken socket was dropped; a retry also times out instead of raising EFSM.
        with pytest.raises(SideChannelError, match="did not answer"):
            c.request(HOST, port, proto.LeaseRenew(engine_id="d", request_ids=["a"]))
    finally:
        c.close()


def test_client_recovers_when_server_appears_after_timeout(service):
    port = free_port()
    c = SideChannelClient(timeout_s=0.3)
    try:
        with pytest.raises(SideChannelError):
            c.request(HOST, port, proto.HandshakeRequest(engine_id="d", tp_rank=0,
                                                         compat=compat()))
        srv = SideChannelServer(HOST, port, "eng-p", compat(), {0: AGENT}, service)
        try:
            reply = c.request(HOST, port, proto.HandshakeRequest(engine_id="d", tp_rank=0,
                                                                 compat=compat()))
            assert isinstance(reply, proto.HandshakeReply)
        finally:
            srv.close()
    finally:
        c.close()


def test_bind_conflict_raises(server, service):
    with pytest.raises(SideChannelError, match="cannot bind"):
        SideChannelServer(HOST, server.port, "eng-x", compat(), {}, service)


@pytest.mark.parametrize("host", ["p 1", "a/b"])
def test_host_libzmq_refuses_fails_the_request_only(host):
    """libzmq raises in connect() for such addresses; that must be this
    request's SideChannelError, not an exception that ends the caller's thread."""
    c = SideChannelClient(timeout_s=0.3)
    try:
        for _ in range(2):  # and the broken socket is not cached
            with pytest.raises(SideChannelError, match="side channel"):
                c.request(host, 5600, proto.LeaseRenew(engine_id="d", request_ids=["a"]))
    finally:
        c.close()


def test_oversized_frame_is_dropped_and_server_keeps_serving(server, client):
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 500)
    try:
        raw.connect(f"tcp://{HOST}:{server.port}")
        raw.send(b"\x00" * (proto.MAX_FRAME_BYTES + 1))
        with pytest.raises(zmq.Again):  # not decoded, not answered
            raw.recv()
    finally:
        raw.close()
    reply = client.request(HOST, server.port, proto.LeaseRenew(engine_id="d", request_ids=["a"]))
    assert reply.remaining_s == [proto.LEASE_UNKNOWN]


def test_release_naming_a_rank_the_lease_lacks_is_ignored(server, client, service):
    with service.lock:
        service.table.grant("two-ranks", num_consumers=2)
    for rank in (1, 7):
        client.request(HOST, server.port, proto.LeaseRelease(
            engine_id="d", request_ids=["two-ranks"], tp_rank=rank))
    assert service.table.get("two-ranks").state is not LeaseState.RELEASED
