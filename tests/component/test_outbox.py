"""The outbox: ordered per peer, independent across peers, over real sockets.

Lanes retire when idle; tests/component/test_reaping.py checks that nothing of
theirs stays after their peers left.
"""

from __future__ import annotations

import errno
import random
import threading
import time

import zmq
from pdunit_utils import free_port, wait_for

from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.wire.side_channel import SideChannelClient, SideChannelError, SideChannelServer

HOST = "127.0.0.1"
COMPAT = proto.CompatInfo(protocol_version=proto.PROTOCOL_VERSION, model="m", dtype="bf16",
                          block_size=16, kv_layout="NHD", num_layers=2, num_kv_heads=1,
                          head_size=8, tp_size=1, transfer_mode="push")


class Recorder:
    """A push handler that records what reaches the side channel."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def handle(self, msg: proto.Request) -> proto.Reply:
        assert isinstance(msg, proto.PushAbort)
        self.seen.append(msg.pd_request_id)
        return proto.PushAbortStatus("unknown")

    def on_release(self, msg: proto.LeaseRelease) -> None:
        return


def abort(pd_id: str) -> proto.PushAbort:
    return proto.PushAbort(engine_id="eng-d", pd_request_id=pd_id)


def test_messages_to_one_peer_keep_their_order() -> None:
    port, rec = free_port(), Recorder()
    srv = SideChannelServer(HOST, port, "eng-p", COMPAT, {}, None, push=rec)
    box = Outbox(timeout_s=2.0)
    replies: list[object] = []
    try:
        for i in range(20):
            box.send(HOST, port, abort(f"id-{i}"), replies.append)
        assert wait_for(lambda: len(replies) == 20)
        assert rec.seen == [f"id-{i}" for i in range(20)]
        assert all(r == proto.PushAbortStatus("unknown") for r in replies)
        assert box.num_lanes == 1
    finally:
        box.close()
        srv.close()


def test_a_silent_peer_does_not_delay_messages_to_others() -> None:
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent_port = silent.bind_to_random_port(f"tcp://{HOST}")
    port, rec = free_port(), Recorder()
    srv = SideChannelServer(HOST, port, "eng-p", COMPAT, {}, None, push=rec)
    # 3 s, and 2 s for the live peer's answer: a loaded host may take a second
    # for that, and a lane shared with the silent peer would take over 3 s.
    box = Outbox(timeout_s=3.0)
    done: dict[str, float] = {}
    stuck = threading.Event()
    try:
        started = time.monotonic()
        box.send(HOST, silent_port, abort("to-silent"),
                 lambda r: (done.setdefault("silent", time.monotonic() - started),
                            stuck.set() if isinstance(r, SideChannelError) else None))
        box.send(HOST, port, abort("to-live"),
                 lambda r: done.setdefault("live", time.monotonic() - started))
        assert wait_for(lambda: "live" in done, timeout=2.5)
        assert done["live"] < 2.0
        # Timed out on its own lane, after the live peer had answered.
        assert stuck.wait(6.0) and done["silent"] >= 2.9 > done["live"]
    finally:
        box.close()
        srv.close()
        silent.close()
        ctx.term()


def test_closed_outbox_drops_new_messages() -> None:
    box = Outbox(timeout_s=0.5)
    box.close()
    box.send(HOST, free_port(), abort("late"))
    assert box.num_lanes == 0


def test_lane_survives_an_unexpected_exception(monkeypatch) -> None:
    """A bug while sending one message fails that message (its callback
    hears a SideChannelError); the lane goes on with the next one."""
    from vllm_pd_ext.wire.side_channel import SideChannelClient

    port, rec = free_port(), Recorder()
    srv = SideChannelServer(HOST, port, "eng-p", COMPAT, {}, None, push=rec)
    real = SideChannelClient.request

    def flaky(self, host, p, msg):
        if msg.pd_request_id == "boom":
            raise RuntimeError("injected")
        return real(self, host, p, msg)

    monkeypatch.setattr(SideChannelClient, "request", flaky)
    box = Outbox(timeout_s=2.0)
    replies: list[object] = []
    try:
        box.send(HOST, port, abort("boom"), replies.append)
        box.send(HOST, port, abort("after"), replies.append)
        assert wait_for(lambda: len(replies) == 2)
        assert isinstance(replies[0], SideChannelError) and "injected" in str(replies[0])
        assert replies[1] == proto.PushAbortStatus("unknown")
        assert rec.seen == ["after"]
    finally:
        box.close()
        srv.close()


def test_a_send_after_the_lane_retired_makes_a_new_one():
    port, rec = free_port(), Recorder()
    srv = SideChannelServer(HOST, port, "eng-p", COMPAT, {}, None, push=rec)
    box = Outbox(timeout_s=2.0, idle_ttl_s=0.1)
    replies: list[object] = []
    try:
        box.send(HOST, port, abort("a"), replies.append)
        assert wait_for(lambda: box.num_lanes == 0)
        box.send(HOST, port, abort("b"), replies.append)
        assert wait_for(lambda: len(replies) == 2)
        assert rec.seen == ["a", "b"]
    finally:
        box.close()
        srv.close()


def test_no_message_is_lost_or_reordered_across_retirements():
    """Bursts that arrive around the moment their lane retires (a 2 ms
    idle TTL) race each send against the lane's decision to end: every
    message still arrives exactly once, in order."""
    ttl = 0.002
    port, rec = free_port(), Recorder()
    srv = SideChannelServer(HOST, port, "eng-p", COMPAT, {}, None, push=rec)
    box = Outbox(timeout_s=2.0, idle_ttl_s=ttl)
    replies: list[str] = []
    lanes: set[threading.Thread] = set()  # kept alive: no identity is reused
    sent: list[str] = []
    rng = random.Random(7)

    def record(pd_id: str) -> None:
        lanes.add(threading.current_thread())
        replies.append(pd_id)

    try:
        for burst in range(60):
            for j in range(rng.randint(1, 5)):
                pd_id = f"id-{burst}-{j}"
                sent.append(pd_id)
                box.send(HOST, port, abort(pd_id), lambda _r, i=pd_id: record(i))
            n = len(sent)
            assert wait_for(lambda n=n: len(replies) == n)
            time.sleep(rng.uniform(0.5, 2.0) * ttl)  # the lane idles: about to retire
        assert replies == sent and rec.seen == sent
        assert len(lanes) >= 5  # lanes did retire and were replaced meanwhile
    finally:
        box.close()
        srv.close()


def test_lane_survives_a_client_that_cannot_be_created(monkeypatch):
    """Creating the lane's client fails (say, out of descriptors): that
    message fails, the lane lives on and sends the next one."""
    port, rec = free_port(), Recorder()
    srv = SideChannelServer(HOST, port, "eng-p", COMPAT, {}, None, push=rec)
    real = SideChannelClient.__init__
    calls = []

    def flaky(self, *a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise zmq.ZMQError(errno.EMFILE)
        real(self, *a, **kw)

    monkeypatch.setattr(SideChannelClient, "__init__", flaky)
    box = Outbox(timeout_s=2.0)
    replies: list[object] = []
    try:
        box.send(HOST, port, abort("first"), replies.append)
        box.send(HOST, port, abort("second"), replies.append)
        assert wait_for(lambda: len(replies) == 2)
        assert isinstance(replies[0], SideChannelError)
        assert replies[1] == proto.PushAbortStatus("unknown") and rec.seen == ["second"]
    finally:
        box.close()
        srv.close()


def test_fail_queued_on_timeout_fails_the_rest_at_once():
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent_port = silent.bind_to_random_port(f"tcp://{HOST}")
    # 1.5 s: one timeout in all ends near 1.5 s, three would take 4.5 s; 3 s
    # between them leaves a loaded host room for the first.
    box = Outbox(timeout_s=1.5, fail_queued_on_timeout=True)
    got: list[tuple[float, object]] = []
    try:
        started = time.monotonic()
        for i in range(3):
            box.send(HOST, silent_port, abort(f"id-{i}"),
                     lambda r: got.append((time.monotonic() - started, r)))
        assert wait_for(lambda: len(got) == 3, timeout=8.0)
        assert all(isinstance(r, SideChannelError) and r.code == "timeout" for _, r in got)
        assert got[-1][0] < 3.0  # one timeout in all (1.5 s), not three (4.5 s)
        assert "earlier message failed" in str(got[1][1])
    finally:
        box.close()
        silent.close()
        ctx.term()
