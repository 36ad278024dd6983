"""CURVE on the side channel: no peer without the secret gets a message assembled.

Role: ``MAXMSGSIZE`` bounds each zmq frame, not how many frames a message
has, and libzmq assembles a whole multipart message before the server sees
any of it. So an authentication check after ``recv`` cannot protect memory:
a peer without the secret could make an EngineCore allocate whatever it
sends. With a shared secret configured, the side channel therefore runs
zmq's CURVE mechanism and a ZAP handler that admits only client keys
derived from one of the engine's secrets. A peer without the secret fails
the handshake, before libzmq reads a single message frame from it; the
frame MAC (``auth.FrameAuth``) still authenticates every message, binds
each reply to its request and refuses replays on top of it.

Keys:

* **Client**: a Curve25519 key pair derived from each secret
  (``client_keypair``): every holder of the secret can prove it in the
  handshake (CURVE's INITIATE vouches with the client's long-term secret
  key), nobody else can. The signing secret's key connects; every secret's
  key is admitted (rotation works as for frames: docs/security.md).
* **Server**: one fixed key pair, public by design (``SERVER_SECRET_KEY``).
  The server is authenticated by its signed replies, as without CURVE; a
  key derived from the secret could not survive a rolling rotation (a
  socket has one key, and a client cannot know which of its secrets a
  restarted peer derives from). CURVE's per-connection keys still encrypt
  the traffic against a passive observer.

Lifecycle: the server side (``ZapHandler``) is created with the
``SideChannelServer``'s own zmq context, before its socket binds (without a
handler bound, libzmq would admit every CURVE client), and is answered on
the server's thread; ``HandshakeWatch`` watches one client socket's
handshakes so a refused one fails its request at once with a reason instead
of a timeout. Pure zmq and hashlib; no vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
from typing import Final

import zmq
from zmq.utils import monitor, z85

from vllm_pd_ext.wire.auth import Keyring

_CLIENT_TAG: Final = b"vllm-pd-ext curve client v1\0"
#: The server's key pair: public by design (module docstring).
SERVER_SECRET_KEY: Final = z85.encode(hashlib.sha256(
    b"vllm-pd-ext curve server v1\0public by design").digest())
SERVER_PUBLIC_KEY: Final = zmq.curve_public(SERVER_SECRET_KEY)
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
#: A connection still in its handshake after this long is dropped (libzmq's
#: default is 30 s), so half-open connections hold little for long.
HANDSHAKE_IVL_MS: Final = 5000

_watch_ids = itertools.count()

#: Handshake failures a monitor reports (the server counts them, a client
#: fails its request with one).
FAILED_EVENTS: Final = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                        | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def client_keypair(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys of a holder of ``secret``."""
    sk = z85.encode(hmac.new(secret, _CLIENT_TAG, hashlib.sha256).digest())
    return zmq.curve_public(sk), sk


def admitted_keys(keyring: Keyring) -> frozenset[bytes]:
    """The client keys a server with ``keyring`` admits: one per secret."""
    return frozenset(client_keypair(key)[0] for key in keyring.keys.values())


def configure_server(sock: zmq.Socket[bytes]) -> None:
    """Make ``sock`` a CURVE server (before it binds)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, SERVER_SECRET_KEY)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"vllm-pd-ext")


def configure_client(sock: zmq.Socket[bytes], keyring: Keyring) -> None:
    """Make ``sock`` a CURVE client with the signing secret's key (before it connects)."""
    public, secret = client_keypair(keyring.signing_key)
    sock.setsockopt(zmq.CURVE_SERVERKEY, SERVER_PUBLIC_KEY)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def describe_failure(event: int, value: int) -> str:
    """What a handshake failure means to an operator."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ("the peer's key is not derived from this side's shared secret (another or "
                f"a rotated-out secret; ZAP status {value})")
    # A mechanism mismatch shows as a protocol error on the side that sees
    # it, and as the connection closed (no detail) on the other.
    return ("security mechanism mismatch: one side has a shared secret configured and the "
            "other has none (or another program is on the port; zmq "
            f"{'protocol error' if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL else 'error'} "
            f"{value})")


class ZapHandler:
    """libzmq's ZAP handler for one context: admits CURVE clients by key.

    Bound at ``ZAP_ENDPOINT`` of the server's context before the server
    socket binds; its owner polls ``socket`` and calls ``handle`` when it
    is readable (the server thread: no thread of its own). Every refusal
    also shows as a ``EVENT_HANDSHAKE_FAILED_AUTH`` on the server's monitor,
    which is where refusals are counted.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], admitted: frozenset[bytes]) -> None:
        self.admitted = admitted
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.num_refused = 0

    def handle(self) -> None:
        """Answer the one queued ZAP request (non-blocking; nothing queued: no-op)."""
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        # ZAP 1.0: version, request id, domain, address, identity,
        # mechanism, credentials...
        request_id = frames[1] if len(frames) > 1 else b""
        ok = (len(frames) >= 7 and frames[0] == b"1.0" and frames[5] == b"CURVE"
              and z85.encode(frames[6]) in self.admitted)
        if not ok:
            self.num_refused += 1
        status = [b"200", b"OK"] if ok else [b"400", b"key not derived from a shared secret"]
        self.socket.send_multipart([b"1.0", request_id, *status, b"", b""])

    def close(self) -> None:
        self.socket.close()


class HandshakeWatch:
    """A socket's handshake failures, from its monitor (one thread: the socket's owner)."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._watched = sock
        # A fresh endpoint per watch: pyzmq's default names it after the
        # socket's descriptor, which the next socket reuses while the old
        # monitor may still be bound there, and the new watch then fails
        # with "Address already in use" (seen under load).
        self.socket = sock.get_monitor_socket(
            FAILED_EVENTS, addr=f"inproc://pd-handshake-watch-{os.getpid()}-{next(_watch_ids)}")

    def failure(self) -> str | None:
        """The next queued failure's description; None if none is queued."""
        try:
            event = monitor.recv_monitor_message(self.socket, zmq.NOBLOCK)
        except zmq.Again:
            return None
        return describe_failure(int(event["event"]), int(event["value"]))

    def close(self) -> None:
        """Stop the monitor (libzmq closes its half now, not when the reaper
        gets to the watched socket) and close our half. Before the watched
        socket closes."""
        if not self._watched.closed:
            self._watched.disable_monitor()
        self.socket.close()
