"""A background sender for side-channel requests whose replies can wait.

Role: the engine step must never block on a peer, so D's registrations and
aborts (and P's failure notices and releases) are queued here and sent by
daemon threads, one per peer endpoint ("lane"), each with its own
``SideChannelClient``. Each item's callback runs on its lane's thread with
the reply or the ``SideChannelError``; callbacks only append to locked
queues that the scheduler drains on its own thread.

Lane lifecycle:

1. ``send`` to an endpoint without a lane creates one (thread
   ``<outbox name>-<peer port>``).
2. The lane sends its queue in order, one message at a time (a reply or a
   timeout ends each). A bug in a message or a callback fails that message
   only; the lane goes on.
3. Once its queue has stayed empty for ``idle_ttl_s``, the lane *retires*:
   under its lock, so no message can be queued into it afterwards (``put``
   then says no and ``send`` makes a new lane). Its thread closes its
   client (the REQ socket) and ends. Peers come and go (restarts, scaling),
   so a lane per peer ever seen would leak threads and sockets.
4. ``Outbox.close`` stops every lane; what is still queued is dropped.

Order matters within a lane: D's abort for an id always leaves after its
registration, to the same P, so P sees them in that order (a registration
whose reply timed out may still arrive; P refuses it once the id is
tombstoned). Retiring keeps that order: a lane retires only with nothing
queued and nothing in flight, and the next lane to that peer starts after
it retired, so every message to a peer leaves after the ones sent before
it. Lanes are independent, so a dead or slow peer delays only its own
messages, never those to other peers (no head-of-line blocking across
prefill engines).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth
from vllm_pd_ext.wire.protocol import NO_ANSWER_CODES
from vllm_pd_ext.wire.side_channel import SideChannelClient, SideChannelError

logger = get_logger(__name__)

Callback = Callable[[proto.Reply | SideChannelError], None]
Endpoint = tuple[str, int]

#: A lane whose queue stayed empty this long ends (a new one starts on demand).
LANE_IDLE_TTL_S = 60.0
#: Errors after which the peer will not answer what is queued behind either.


class _Lane:
    """One peer's queue and its sender thread (lifecycle: module docstring)."""

    def __init__(self, endpoint: Endpoint, timeout_s: float, name: str, idle_ttl_s: float,
                 fail_queued_on_timeout: bool, on_exit: Callable[[_Lane], None],
                 first: tuple[proto.Request, Callback | None],
                 auth: FrameAuth | None = None) -> None:
        self.endpoint = endpoint
        self.auth = auth
        self.timeout_s = timeout_s
        self.idle_ttl_s = idle_ttl_s
        self.fail_queued_on_timeout = fail_queued_on_timeout
        self._on_exit = on_exit
        self.cv = threading.Condition()
        # Born with its first message, so a new lane never retires unused.
        self.queue: deque[tuple[proto.Request, Callback | None]] = deque([first])
        self.stop = False
        #: Set under ``cv`` when the thread decided to end: ``put`` refuses.
        self.retired = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, msg: proto.Request, callback: Callback | None) -> bool:
        """Queue ``msg``; False if the lane retired (the caller needs a new one)."""
        with self.cv:
            if self.retired:
                return False
            self.queue.append((msg, callback))
            self.cv.notify()
            return True

    def _next(self) -> tuple[proto.Request, Callback | None] | None:
        """The next message, or None once the lane retires (idle or closed).

        The idle check and ``retired`` are one critical section with
        ``put``: a message is either taken here or refused there, never lost.
        """
        with self.cv:
            idle_until = time.monotonic() + self.idle_ttl_s
            while not self.queue and not self.stop:
                left = idle_until - time.monotonic()
                if left <= 0:
                    break
                self.cv.wait(left)
            if self.stop or not self.queue:
                self.retired = True
                return None
            return self.queue.popleft()

    def _run(self) -> None:
        client: SideChannelClient | None = None
        try:
            while (item := self._next()) is not None:
                msg, callback = item
                try:
                    if client is None:  # here, so a failure (EMFILE) fails one message
                        client = SideChannelClient(self.timeout_s, auth=self.auth)
                    result = self._send(client, msg)
                except Exception as exc:  # never let one message end the lane
                    logger.exception("PDConnector: %s to %s:%d failed", type(msg).__name__,
                                     *self.endpoint)
                    result = SideChannelError(f"{type(exc).__name__}: {exc}")
                self._deliver(msg, callback, result)
                if (self.fail_queued_on_timeout and isinstance(result, SideChannelError)
                        and result.code in NO_ANSWER_CODES):
                    self._fail_queued(result)
        finally:
            if client is not None:
                try:
                    client.close()
                except Exception:
                    logger.exception("PDConnector: closing the side-channel client failed")
            self._on_exit(self)

    def _send(self, client: SideChannelClient, msg: proto.Request
              ) -> proto.Reply | SideChannelError:
        try:
            return client.request(self.endpoint[0], self.endpoint[1], msg)
        except SideChannelError as exc:
            return exc

    def _deliver(self, msg: proto.Request, callback: Callback | None,
                 result: proto.Reply | SideChannelError) -> None:
        try:
            if callback is not None:
                callback(result)
            elif isinstance(result, SideChannelError):
                logger.warning("PDConnector: %s to %s:%d failed: %s", type(msg).__name__,
                               *self.endpoint, result)
        except Exception:  # a callback bug must not stop the sender
            logger.exception("PDConnector: side-channel callback failed")

    def _fail_queued(self, cause: SideChannelError) -> None:
        """Fail what is queued now at once: each would wait one more timeout."""
        with self.cv:
            queued, self.queue = list(self.queue), deque()
        host, port = self.endpoint
        for msg, callback in queued:
            self._deliver(msg, callback, SideChannelError(
                f"not sent to {host}:{port}: an earlier message failed ({cause})", cause.code))

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify()
        self.thread.join(timeout=2)


class Outbox:
    """Per-peer ordered senders (see the module docstring).

    ``idle_ttl_s``: how long an idle lane lives. ``fail_queued_on_timeout``:
    when a message times out (or its peer is unreachable), fail what is
    queued behind it at once, each callback hearing a ``SideChannelError``
    with the same ``code``, instead of waiting one more timeout each.
    """

    def __init__(self, timeout_s: float, name: str = "pd-outbox",
                 idle_ttl_s: float = LANE_IDLE_TTL_S,
                 fail_queued_on_timeout: bool = False,
                 auth: FrameAuth | None = None) -> None:
        self.timeout_s = timeout_s
        self.idle_ttl_s = idle_ttl_s
        #: Signs every message (a shared secret is configured); None: unsigned.
        self.auth = auth
        self._name = name
        self._fail_queued = fail_queued_on_timeout
        self._lock = threading.Lock()
        self._lanes: dict[Endpoint, _Lane] = {}
        self._closed = False

    def send(self, host: str, port: int, msg: proto.Request, callback: Callback | None = None
             ) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                lane = self._lanes.get((host, port))
                if lane is None:
                    self._lanes[(host, port)] = _Lane(
                        (host, port), self.timeout_s, f"{self._name}-{port}", self.idle_ttl_s,
                        self._fail_queued, self._forget, (msg, callback), self.auth)
                    return
            if lane.put(msg, callback):
                return
            # It retired between the lookup and the put: the next lane takes it.
            self._forget(lane)

    def _forget(self, lane: _Lane) -> None:
        with self._lock:
            if self._lanes.get(lane.endpoint) is lane:
                del self._lanes[lane.endpoint]

    @property
    def num_lanes(self) -> int:
        with self._lock:
            return len(self._lanes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close()
