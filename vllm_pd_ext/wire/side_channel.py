"""The side channel: a pyzmq ROUTER in each engine's scheduler process.

Role: serves this engine's handshake (NIXL agent metadata, KV layout,
compatibility info), the lease protocol (renew / acquire / release, answered
by the engine's ``leases.service.LeaseService``) and, in
push mode, registrations, aborts and WRITE results to peers. One daemon
thread, started when the workers' metadata is known
(``set_xfer_handshake_metadata``), stopped by ``close``. Every message is
decoded once by ``protocol.decode_request``; garbage gets an ``ErrorReply``
naming the problem and the thread keeps serving.

Authentication (``auth.FrameAuth``, when a shared secret is configured):
a request is two frames, ``[FrameHeader, message]``; the server checks the
MAC, the timestamp window and the nonce *before* decoding the message, and
answers anything else with an unsigned ``ErrorReply("unauthenticated")``
that changes nothing (counted in ``num_unauthenticated``). Replies are
signed over the request's nonce; the client refuses an unsigned reply other
than an error. Without a secret, frames are today's single part and a
compat refusal does not reveal our own values (the peer is unauthenticated).

``SideChannelClient`` is the other end: request/reply with a timeout, one REQ
socket per endpoint, owned by a single thread (zmq sockets are not
thread-safe), rebuilt after a timeout because a REQ socket that missed its
reply is unusable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgspec
import zmq

# Re-exported for the tests that build a P side from this module.
from vllm_pd_ext.leases.service import LeaseService as LeaseService
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.transport.tp_slices import TPMappingError, sharding_of, slices_for
from vllm_pd_ext.wire import curve
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import AuthError, FrameAuth
from vllm_pd_ext.wire.protocol import LOCAL_CODES, ErrorCode
from vllm_pd_ext.wire.zmq_context import GcSafeContext

_T = TypeVar("_T")

logger = get_logger(__name__)


class SideChannelError(RuntimeError):
    """A peer did not answer, or answered with an error.

    ``code`` says which (``protocol.ErrorCode``), so callers never match
    message text: one of the caller's own verdicts (``TIMEOUT``,
    ``UNREACHABLE``, ``BAD_REPLY``, ``LOCAL``) or the peer's
    ``ErrorReply.code`` (a plain string: a newer peer may send a code this
    version does not know).
    """

    def __init__(self, message: str, code: str = ErrorCode.LOCAL) -> None:
        super().__init__(message)
        self.code = code

    @property
    def refused(self) -> bool:
        """The peer answered, with an error: it is alive."""
        return self.code not in LOCAL_CODES


class PushHandler(Protocol):
    """Push-mode messages: P's producer half, or D's consumer half."""

    def handle(self, msg: proto.Request) -> proto.Reply: ...

    def on_release(self, msg: proto.LeaseRelease) -> None: ...


class PullHandler(Protocol):
    """Answers concurrent pull's messages (``PullWait``/``PullWaitCancel`` on
    P, ``PullReady`` on D) on the side-channel thread."""

    def handle(self, msg: proto.Request) -> proto.Reply: ...


class SideChannelServer:
    """ROUTER socket + daemon thread answering handshakes and lease messages.

    Each decoded message goes to the handler its type maps to in
    ``_handlers`` (one per ``protocol.Request`` member): adding a message
    type means adding one entry, and a type without one is a test failure.
    """

    def __init__(
        self,
        host: str,
        port: int,
        engine_id: str,
        compat: proto.CompatInfo,
        agents: dict[int, proto.AgentInfo],
        leases: LeaseService | None,
        push: PushHandler | None = None,
        auth: FrameAuth | None = None,
        on_activity: Callable[[], None] | None = None,
        pull: PullHandler | None = None,
    ) -> None:
        self.engine_id = engine_id
        #: Called on this thread for every well-formed message a peer may
        #: act on (a transfer may follow): rings the workers' pump bells.
        self.on_activity = on_activity
        self.auth = auth
        #: Frames refused by authentication (``unauthenticated`` replies).
        self.num_unauthenticated = 0
        self._auth_logged_at = -1e9
        self._auth_unlogged = 0
        self.push = push
        self.pull = pull
        self.compat = compat
        self.agents = agents
        self.leases = leases
        self._handlers: dict[type, Callable[[Any], proto.Reply]] = {
            proto.HandshakeRequest: self._on_handshake,
            proto.LeaseRenew: self._on_renew,
            proto.LeaseRelease: self._on_release,
            proto.PushRegister: self._on_push_register,
            proto.PushWaiting: self._on_push,
            proto.PushAbort: self._on_push,
            proto.PushResult: self._on_push,
            proto.PullWait: self._on_pull,
            proto.PullWaitCancel: self._on_pull,
            proto.PullReady: self._on_pull,
        }
        self.address = f"tcp://{host}:{port}"
        self._ctx = GcSafeContext()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # zmq drops a larger frame and disconnects its sender before any of
        # it is buffered whole: a hostile peer cannot make us allocate more.
        self._sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, curve.HANDSHAKE_IVL_MS)
        # With a secret: CURVE, and the ZAP handler bound before the socket
        # binds, so a peer without the secret never gets a message assembled.
        self._zap: curve.ZapHandler | None = None
        if auth is not None:
            self._zap = curve.ZapHandler(self._ctx, curve.admitted_keys(auth.keyring))
            curve.configure_server(self._sock)
        #: Handshakes refused or failed (counted in ``num_unauthenticated``).
        self._watch = curve.HandshakeWatch(self._sock)
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as exc:
            self._close_sockets()
            self._ctx.term()
            raise SideChannelError(
                f"PDConnector: cannot bind side channel {self.address}: {exc} "
                "(is side_channel_port used by another engine?)", ErrorCode.UNREACHABLE
            ) from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pd-side-channel", daemon=True)
        self._thread.start()
        logger.info("PDConnector: side channel of engine %s listening on %s",
                    engine_id, self.address)

    def _serve(self) -> None:
        # The thread owns the socket: ``close`` only asks it to stop, so the
        # socket is never closed under a poll (a busy handler may outlast
        # close's join, and zmq sockets are not thread-safe).
        try:
            self._serve_until_stopped()
        finally:
            self._close_sockets(linger_ms=self.CLOSE_LINGER_MS)
            self._ctx.term()

    #: How long closing waits for replies still queued to go out. With no
    #: linger, the answer of the message handled as ``close`` was called
    #: could be dropped before libzmq's I/O thread wrote it (seen in CI
    #: under load: the peer waited out its timeout instead).
    CLOSE_LINGER_MS = 200

    def _close_sockets(self, linger_ms: int = 0) -> None:
        self._watch.close()
        if self._zap is not None:
            self._zap.close()
        self._sock.close(linger=linger_ms)

    def _serve_until_stopped(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._watch.socket, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap.socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(200))
            except zmq.ZMQError as exc:  # e.g. EINTR: never let it end the thread
                logger.warning("PDConnector: side channel poll failed: %s", exc)
                self._stop.wait(0.05)
                continue
            if self._zap is not None and self._zap.socket in ready:
                self._zap.handle()
            if self._watch.socket in ready:
                self._count_failed_handshakes()
            if self._sock not in ready:
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 3 or frames[1] != b"":
                # REQ clients send [identity, b"", payload...]; anything else is noise.
                logger.warning("PDConnector: side channel dropped a %d-frame message",
                               len(frames))
                continue
            try:
                out = self.handle_frames(frames[2:])
            except Exception:  # never let one message kill the thread
                logger.exception("PDConnector: side-channel frame handling failed")
                out = [proto.encode(proto.ErrorReply(ErrorCode.INTERNAL, "internal error"))]
            try:
                self._sock.send_multipart([frames[0], b"", *out], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone
                logger.debug("PDConnector: side channel reply dropped: %s", exc)

    def handle_frames(self, parts: list[bytes]) -> list[bytes]:
        """One request's frames (after the envelope) -> the reply's frames."""
        if self.auth is None:
            if len(parts) != 1:
                return [proto.encode(proto.ErrorReply(
                    ErrorCode.UNAUTHENTICATED, f"engine {self.engine_id} has no shared secret "
                    "configured but the peer signs its frames: give every engine and the "
                    "proxy the same secret"))]
            return [proto.encode(self.handle(parts[0]))]
        if len(parts) != 2:
            return self._unauthenticated("frame is not signed (this engine requires the "
                                         "shared secret)")
        try:
            nonce = self.auth.verify_request(parts[0], parts[1])
        except AuthError as exc:
            return self._unauthenticated(exc.reason)
        body = proto.encode(self.handle(parts[1], authenticated=True))
        return [self.auth.sign_reply(body, nonce), body]

    def _count_failed_handshakes(self) -> None:
        for _ in range(1000):  # bounded: the message socket must not starve
            reason = self._watch.failure()
            if reason is None:
                return
            self._unauthenticated(f"handshake refused: {reason}")

    def _unauthenticated(self, reason: str) -> list[bytes]:
        self.num_unauthenticated += 1
        # One hostile peer may send a flood: a line per 10 s, with the count.
        now = time.monotonic()
        if now - self._auth_logged_at >= 10.0:
            logger.warning("PDConnector: side channel %s refused %d unauthenticated frame(s); "
                           "latest: %s", self.address, self._auth_unlogged + 1, reason)
            self._auth_logged_at, self._auth_unlogged = now, 0
        else:
            self._auth_unlogged += 1
        return [proto.encode(proto.ErrorReply(ErrorCode.UNAUTHENTICATED,
                                              f"unauthenticated: {reason}"))]

    def handle(self, payload: bytes, authenticated: bool = False) -> proto.Reply:
        """Decode and answer one message; ``authenticated``: its frame's MAC
        was verified (an incompatible peer may then be told our values)."""
        try:
            msg = proto.decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("PDConnector: malformed side-channel message (%d bytes): %s",
                           len(payload), exc)
            return proto.ErrorReply(ErrorCode.MALFORMED, f"malformed side-channel message: {exc}")
        try:
            if isinstance(msg, proto.HandshakeRequest | proto.PushRegister):
                diff = self.compat.diff(msg.compat)
                if diff:
                    return self._incompatible(msg, diff, authenticated)
            return self._dispatch(msg)
        except Exception as exc:  # never let one message kill the thread
            logger.exception("PDConnector: side-channel handler failed")
            return proto.ErrorReply(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _dispatch(self, msg: proto.Request) -> proto.Reply:
        if self.on_activity is not None:
            self.on_activity()
        return self._handlers[type(msg)](msg)

    def _incompatible(self, msg: proto.HandshakeRequest | proto.PushRegister,
                      diff: list[str], authenticated: bool) -> proto.Reply:
        what = "handshake" if isinstance(msg, proto.HandshakeRequest) else "push registration"
        logger.error("PDConnector: refused %s from engine %s: incompatible %s", what,
                     msg.engine_id, "; ".join(diff))
        # An unauthenticated peer learns which fields differ, not our values.
        told = diff if authenticated else self.compat.diff(msg.compat, ours=False)
        return proto.ErrorReply(ErrorCode.INCOMPATIBLE, "incompatible peer: " + "; ".join(told))

    def _on_handshake(self, msg: proto.HandshakeRequest) -> proto.Reply:
        # The compat check passed, so the two shardings map (tp_slices.plan).
        try:
            ours, theirs = sharding_of(self.compat), sharding_of(msg.compat)
            if msg.tp_rank >= theirs.tp_size:
                return proto.ErrorReply(
                    ErrorCode.NO_RANK, f"rank {msg.tp_rank} is out of range for the peer's "
                    f"own tp_size {theirs.tp_size}")
            first = slices_for(msg.tp_rank, ours, theirs)[0].p_rank
        except TPMappingError as exc:
            return proto.ErrorReply(ErrorCode.INCOMPATIBLE, f"tensor parallelism: {exc}")
        agent = self.agents.get(first)
        if agent is None:
            return proto.ErrorReply(
                ErrorCode.NO_RANK, f"engine {self.engine_id} has no TP rank {first}")
        logger.info("PDConnector: handshake from engine %s rank %d (its TP %d, ours %d)",
                    msg.engine_id, msg.tp_rank, theirs.tp_size, ours.tp_size)
        return proto.HandshakeReply(
            engine_id=self.engine_id, compat=self.compat, agent=agent,
            agents=[self.agents[r] for r in sorted(self.agents)])

    def _on_renew(self, msg: proto.LeaseRenew) -> proto.Reply:
        if self.leases is None:
            return self._no_leases()
        return self.leases.renew(msg)

    def _on_release(self, msg: proto.LeaseRelease) -> proto.Reply:
        if self.leases is None:
            return self._no_leases()
        reply = self.leases.release(msg)
        if self.push is not None:
            self.push.on_release(msg)
        return reply

    def _on_push_register(self, msg: proto.PushRegister) -> proto.Reply:
        return self._on_push(msg)  # compat was checked in handle

    def _on_push(self, msg: proto.PushRegister | proto.PushWaiting | proto.PushAbort
                 | proto.PushResult) -> proto.Reply:
        if self.push is None:
            return proto.ErrorReply(
                ErrorCode.NOT_PUSH, f"engine {self.engine_id} does not run transfer_mode='push'")
        return self.push.handle(msg)

    def _on_pull(self, msg: proto.PullWait | proto.PullWaitCancel | proto.PullReady
                 ) -> proto.Reply:
        if self.pull is None:
            return proto.ErrorReply(
                ErrorCode.NOT_PULL, f"engine {self.engine_id} does not run transfer_mode='pull'")
        return self.pull.handle(msg)

    def _no_leases(self) -> proto.Reply:
        return proto.ErrorReply(ErrorCode.NOT_PRODUCER, f"engine {self.engine_id} holds no leases")

    def close(self) -> None:
        """Stop serving; the thread closes the socket once its current
        message is answered (at most a poll period when idle)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            logger.warning("PDConnector: side channel %s still answering a message; it "
                           "closes when done", self.address)


class SideChannelClient:
    """Blocking request/reply to peers' side channels; single-thread use.

    One REQ socket per endpoint, created on first use, closed after a
    timeout or error (a REQ socket that missed its reply is unusable), by
    ``drop`` (the owner knows the peer is gone), or once unused for
    ``idle_ttl_s``: every ``request`` first closes the sockets idle that
    long, and ``reap`` does so for an owner between requests. Peers come
    and go, so a socket per peer ever seen would leak descriptors (and
    libzmq would keep reconnecting to dead peers).
    """

    #: A socket unused this long is closed (a later request reconnects).
    IDLE_TTL_S = 60.0

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 idle_ttl_s: float = IDLE_TTL_S, auth: FrameAuth | None = None) -> None:
        self.auth = auth
        self.timeout_ms = int(timeout_s * 1000)
        self.idle_ttl_s = idle_ttl_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        #: Each socket's handshake failures (a refused handshake fails fast).
        self._watches: dict[str, curve.HandshakeWatch] = {}
        #: Address -> last use, least recently used first (``reap`` stops early).
        self._used: dict[str, float] = {}
        self._clock = clock

    def request(self, host: str, port: int, msg: proto.Request) -> proto.Reply:
        addr = proto.tcp_address(host, port)
        now = self._clock()
        self.reap(now)
        self._used.pop(addr, None)
        self._used[addr] = now
        sock = self._socks.get(addr)
        try:
            if sock is None:
                sock = self._ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                # Not ``IMMEDIATE``: with it, a reply that arrived just before
                # the peer disconnected (a server closing right after it
                # answered) was dropped with the pipe before we read it, and
                # the request timed out. A refused handshake is heard anyway:
                # both waits (``_await``) watch for it.
                sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_FRAME_BYTES)
                if self.auth is not None:
                    curve.configure_client(sock, self.auth.keyring)
                self._socks[addr] = sock
                self._watches[addr] = curve.HandshakeWatch(sock)
                # Inside the try: libzmq refuses some addresses here
                # (``tcp://p 1:5600``), and that must fail this request only.
                sock.connect(addr)
            body = proto.encode(msg)
            nonce = b""
            deadline = time.monotonic() + self.timeout_ms / 1000
            if self.auth is None:
                frames = [body]
            else:
                header, nonce = self.auth.sign_request(body)
                frames = [header, body]
            self._when_ready(addr, sock, zmq.POLLOUT, deadline,
                             lambda: sock.send_multipart(frames, zmq.NOBLOCK))
            parts: list[bytes] = self._when_ready(addr, sock, zmq.POLLIN, deadline,
                                                  lambda: sock.recv_multipart(zmq.NOBLOCK))
        except zmq.ZMQError as exc:
            self._close(addr)
            timed_out = exc.errno == zmq.EAGAIN
            raise SideChannelError(
                f"side channel {addr} did not answer within {self.timeout_ms} ms ({exc})"
                if timed_out else f"side channel {addr}: {exc}",
                ErrorCode.TIMEOUT if timed_out else ErrorCode.UNREACHABLE,
            ) from exc
        data = parts[-1]
        try:
            reply = proto.decode_reply(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SideChannelError(f"side channel {addr} sent a malformed reply: {exc}",
                                   ErrorCode.BAD_REPLY) from exc
        if self.auth is not None and not isinstance(reply, proto.ErrorReply):
            # An unsigned error can only fail this request; anything else
            # must come from a holder of the secret.
            try:
                if len(parts) != 2:
                    raise AuthError("the peer's reply is not signed (has it no shared "
                                    "secret configured?)")
                self.auth.verify_reply(parts[0], data, nonce)
            except AuthError as exc:
                raise SideChannelError(f"side channel {addr}: {exc.reason}",
                                       ErrorCode.UNAUTHENTICATED) from None
        if isinstance(reply, proto.ErrorReply):
            raise SideChannelError(f"side channel {addr} refused: {reply.message}", reply.code)
        return reply

    def _when_ready(self, addr: str, sock: zmq.Socket[bytes], event: int, deadline: float,
                    op: Callable[[], _T]) -> _T:
        """``op`` (a non-blocking send or receive) once ``sock`` is ready for it.

        Ready is not a promise: a pipe whose handshake is refused between
        the poll and ``op`` is gone, and ``op`` raises ``Again`` (4 in 200
        refused handshakes came back as ``timeout`` at once, a CI failure
        of the attacker test). So ``Again`` waits again, where the refusal
        is heard, until the deadline.
        """
        while True:
            self._await(addr, sock, event, deadline)
            try:
                return op()
            except zmq.Again:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.001)  # never a busy loop, whatever libzmq's poll says

    def _await(self, addr: str, sock: zmq.Socket[bytes], event: int, deadline: float) -> None:
        """Wait until ``sock`` can send (``POLLOUT``) or has the reply
        (``POLLIN``); a refused handshake fails at once, with why.

        Sending waits too: once a handshake was refused the socket has no
        pipe, and a blocking send sat out the whole timeout, deaf to the
        refusal the monitor had reported (1 refused handshake in about 500
        under load came back as ``timeout``, a CI flake of the attacker test).
        """
        watch = self._watches[addr]
        poller = zmq.Poller()
        poller.register(sock, event)
        poller.register(watch.socket, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(left * 1000))))
            if sock in ready:
                return
            if watch.socket in ready and (reason := watch.failure()) is not None:
                self._close(addr)
                raise SideChannelError(f"side channel {addr}: handshake refused: {reason}",
                                       ErrorCode.UNAUTHENTICATED)
        raise zmq.Again()

    def reap(self, now: float | None = None) -> int:
        """Close the sockets unused for ``idle_ttl_s``; returns how many."""
        now = self._clock() if now is None else now
        idle = []
        for addr, used in self._used.items():
            if now - used < self.idle_ttl_s:
                break  # the rest were used later
            idle.append(addr)
        for addr in idle:
            self._close(addr)
        return len(idle)

    def drop(self, host: str, port: int) -> bool:
        """Close the socket to one endpoint (its peer is gone); False if none."""
        return self._close(proto.tcp_address(host, port))

    def _close(self, addr: str) -> bool:
        self._used.pop(addr, None)
        watch = self._watches.pop(addr, None)
        if watch is not None:
            watch.close()
        sock = self._socks.pop(addr, None)
        if sock is None:
            return False
        sock.close()
        return True

    @property
    def num_sockets(self) -> int:
        return len(self._socks)

    def close(self) -> None:
        for addr in list(self._socks):
            self._close(addr)
