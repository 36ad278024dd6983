"""A side-channel flood as a peer without the secret would send it (issue 27 item 1).

``many_part_flood`` sends many-part zmq messages, every frame under the
side channel's per-frame limit and the message as large as the caller
asks, from one DEALER socket: plain, or CURVE with the key pair given (the
server's key is public by design). Every frame references one buffer, so
the sender allocates one frame's worth whatever it sends. Used by the
component and real-engine tests that check the server allocates nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from vllm_pd_ext.wire import curve
from vllm_pd_ext.wire.zmq_context import GcSafeContext


@dataclass(frozen=True)
class FloodResult:
    #: Messages queued before the socket had no peer left (a refused
    #: handshake drops it; a server that admitted the peer takes them all).
    queued: int
    #: Whether anything came back (a server must answer nothing).
    replied: bool


def many_part_flood(host: str, port: int, keys: tuple[bytes, bytes] | None, *,
                    frame_bytes: int, frames: int, messages: int,
                    settle_s: float = 2.0) -> FloodResult:
    """Up to ``messages`` messages of ``frames`` x ``frame_bytes`` to
    ``host:port``; ``keys``: the socket's CURVE (public, secret) pair, None
    for a plain socket. Waits ``settle_s`` (time to be read, had the
    handshake passed) before it looks for a reply."""
    ctx: zmq.Context[zmq.Socket[bytes]] = GcSafeContext()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.SERVER_PUBLIC_KEY)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
    # Once a refused handshake dropped the connection the socket has no peer,
    # and a send would block for ever.
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    try:
        sock.connect(f"tcp://{host}:{port}")
        chunk = memoryview(bytes(frame_bytes))
        queued = 0
        for _ in range(messages):
            try:
                sock.send_multipart([b"", *([chunk] * frames)], copy=False)
            except zmq.Again:
                break
            queued += 1
        time.sleep(settle_s)
        try:
            sock.recv(zmq.NOBLOCK)
            replied = True
        except zmq.Again:
            replied = False
        return FloodResult(queued, replied)
    finally:
        sock.close()
        ctx.term()
