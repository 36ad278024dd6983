"""The side channel: a pyzmq ROUTER in each engine's scheduler process.

Role: serves this engine's handshake (NIXL agent metadata, KV layout,
compatibility info), the lease protocol (renew / acquire / release) and, in
push mode, registrations, aborts and WRITE results to peers. One daemon
thread, started when the workers' metadata is known
(``set_xfer_handshake_metadata``), stopped by ``close``. Every message is
decoded once by ``protocol.decode_request``; garbage gets an ``ErrorReply``
naming the problem and the thread keeps serving.

``SideChannelClient`` is the other end: request/reply with a timeout, one REQ
socket per endpoint, owned by a single thread (zmq sockets are not
thread-safe), rebuilt after a timeout because a REQ socket that missed its
reply is unusable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from vllm_pd_ext import protocol as proto
from vllm_pd_ext.leases import LeaseState, LeaseTable
from vllm_pd_ext.log import get_logger

logger = get_logger(__name__)


class SideChannelError(RuntimeError):
    """A peer did not answer, or answered with an error."""


class LeaseService:
    """The P side of the lease protocol, shared by the server thread and the
    scheduler step. All lease-table access goes through ``self.lock``.
    """

    def __init__(self, table: LeaseTable) -> None:
        self.table = table
        self.lock = threading.Lock()
        self.num_heartbeats = 0
        self.num_late_messages = 0
        #: Push: D heartbeats from arrival, usually before P's prefill has
        #: finished, so an unknown id is normal there.
        self.unknown_heartbeats_expected = False

    def renew(self, msg: proto.LeaseRenew) -> proto.LeaseStatus:
        with self.lock:
            # Push: a heartbeat can cross P's release after its WRITE; that is
            # not a late message.
            released = {rid for rid in msg.request_ids
                        if (lease := self.table.get(rid)) is not None
                        and lease.state is LeaseState.RELEASED}
            remaining = [self.table.renew(rid, acquire=msg.acquire) for rid in msg.request_ids]
            if not msg.acquire:
                self.num_heartbeats += len(msg.request_ids)
        for rid, left in zip(msg.request_ids, remaining, strict=True):
            if not msg.acquire and self.unknown_heartbeats_expected and (
                    left == proto.LEASE_UNKNOWN or rid in released):
                continue
            if left < 0:
                self.num_late_messages += 1
                logger.warning(
                    "PDConnector: %s for request %s from engine %s refused: lease %s",
                    "pin" if msg.acquire else "heartbeat", rid, msg.engine_id,
                    "expired" if left == proto.LEASE_EXPIRED else "unknown",
                )
        return proto.LeaseStatus(remaining)

    def release(self, msg: proto.LeaseRelease) -> proto.Ack:
        with self.lock:
            for rid in msg.request_ids:
                lease = self.table.get(rid)
                if lease is not None and not 0 <= msg.tp_rank < lease.num_consumers:
                    logger.warning(
                        "PDConnector: release of request %s from engine %s names rank %d; "
                        "the lease has %d consumer rank(s): ignored", rid, msg.engine_id,
                        msg.tp_rank, lease.num_consumers)
                    continue
                if not self.table.release(rid, msg.tp_rank, msg.ok) and rid not in self.table:
                    self.num_late_messages += 1
                    logger.info(
                        "PDConnector: release of request %s from engine %s after its lease "
                        "ended (ok=%s %s)", rid, msg.engine_id, msg.ok, msg.reason,
                    )
        return proto.Ack()


class PushHandler(Protocol):
    """Push-mode messages: P's producer half, or D's consumer half."""

    def handle(self, msg: proto.Request) -> proto.Reply: ...

    def on_release(self, msg: proto.LeaseRelease) -> None: ...


class SideChannelServer:
    """ROUTER socket + daemon thread answering handshakes and lease messages."""

    def __init__(
        self,
        host: str,
        port: int,
        engine_id: str,
        compat: proto.CompatInfo,
        agents: dict[int, proto.AgentInfo],
        leases: LeaseService | None,
        push: PushHandler | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.push = push
        self.compat = compat
        self.agents = agents
        self.leases = leases
        self.address = f"tcp://{host}:{port}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # zmq drops a larger frame and disconnects its sender before any of
        # it is buffered whole: a hostile peer cannot make us allocate more.
        self._sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_FRAME_BYTES)
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise SideChannelError(
                f"PDConnector: cannot bind side channel {self.address}: {exc} "
                "(is side_channel_port used by another engine?)"
            ) from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pd-side-channel", daemon=True)
        self._thread.start()
        logger.info("PDConnector: side channel of engine %s listening on %s",
                    engine_id, self.address)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 3:
                # REQ clients send [identity, b"", payload]; anything else is noise.
                logger.warning("PDConnector: side channel dropped a %d-frame message",
                               len(frames))
                continue
            reply = self.handle(frames[-1])
            try:
                self._sock.send_multipart([frames[0], b"", proto.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone
                logger.debug("PDConnector: side channel reply dropped: %s", exc)

    def handle(self, payload: bytes) -> proto.Reply:
        try:
            msg = proto.decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("PDConnector: malformed side-channel message (%d bytes): %s",
                           len(payload), exc)
            return proto.ErrorReply("malformed", f"malformed side-channel message: {exc}")
        try:
            return self._dispatch(msg)
        except Exception as exc:  # never let one message kill the thread
            logger.exception("PDConnector: side-channel handler failed")
            return proto.ErrorReply("internal", f"{type(exc).__name__}: {exc}")

    def _dispatch(self, msg: proto.Request) -> proto.Reply:
        if isinstance(msg, proto.HandshakeRequest):
            diff = self.compat.diff(msg.compat)
            if diff:
                logger.error("PDConnector: refused handshake from engine %s: incompatible %s",
                             msg.engine_id, "; ".join(diff))
                return proto.ErrorReply("incompatible", "incompatible peer: " + "; ".join(diff))
            agent = self.agents.get(msg.tp_rank)
            if agent is None:
                return proto.ErrorReply(
                    "no_rank", f"engine {self.engine_id} has no TP rank {msg.tp_rank}")
            logger.info("PDConnector: handshake from engine %s rank %d", msg.engine_id,
                        msg.tp_rank)
            return proto.HandshakeReply(engine_id=self.engine_id, compat=self.compat, agent=agent)
        if isinstance(msg, (proto.PushRegister, proto.PushAbort, proto.PushResult)):
            if isinstance(msg, proto.PushRegister):
                diff = self.compat.diff(msg.compat)
                if diff:
                    logger.error("PDConnector: refused push registration from engine %s: "
                                 "incompatible %s", msg.engine_id, "; ".join(diff))
                    return proto.ErrorReply("incompatible",
                                            "incompatible peer: " + "; ".join(diff))
            if self.push is None:
                return proto.ErrorReply(
                    "not_push", f"engine {self.engine_id} does not run transfer_mode='push'")
            return self.push.handle(msg)
        if self.leases is None:
            return proto.ErrorReply("not_producer", f"engine {self.engine_id} holds no leases")
        if isinstance(msg, proto.LeaseRenew):
            return self.leases.renew(msg)
        reply = self.leases.release(msg)
        if self.push is not None:
            self.push.on_release(msg)
        return reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()


class SideChannelClient:
    """Blocking request/reply to peers' side channels; single-thread use."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._clock = clock

    def request(self, host: str, port: int, msg: proto.Request) -> proto.Reply:
        addr = proto.tcp_address(host, port)
        sock = self._socks.get(addr)
        try:
            if sock is None:
                sock = self._ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
                sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
                sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_FRAME_BYTES)
                self._socks[addr] = sock
                # Inside the try: libzmq refuses some addresses here
                # (``tcp://p 1:5600``), and that must fail this request only.
                sock.connect(addr)
            sock.send(proto.encode(msg))
            data = sock.recv()
        except zmq.ZMQError as exc:
            if sock is not None:
                sock.close()
            self._socks.pop(addr, None)
            raise SideChannelError(
                f"side channel {addr} did not answer within {self.timeout_ms} ms ({exc})"
                if exc.errno == zmq.EAGAIN else f"side channel {addr}: {exc}"
            ) from exc
        try:
            reply = proto.decode_reply(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SideChannelError(f"side channel {addr} sent a malformed reply: {exc}") from exc
        if isinstance(reply, proto.ErrorReply):
            raise SideChannelError(f"side channel {addr} refused: {reply.message}")
        return reply

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
