"""A background sender for side-channel requests whose replies can wait.

Role: the engine step must never block on a peer, so D's registrations and
aborts (and P's failure notices and releases) are queued here and sent by
daemon threads, one per peer endpoint ("lane", created on first use), each
with its own ``SideChannelClient``. Each item's callback runs on its lane's
thread with the reply or the ``SideChannelError``; callbacks only append to
locked queues that the scheduler drains on its own thread.

Order matters within a lane: D's abort for an id always leaves after its
registration, to the same P, so P sees them in that order (a registration
whose reply timed out may still arrive; P refuses it once the id is
tombstoned). Lanes are independent, so a dead or slow peer delays only its
own messages, never those to other peers (no head-of-line blocking across
prefill engines).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from vllm_pd_ext import protocol as proto
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.side_channel import SideChannelClient, SideChannelError

logger = get_logger(__name__)

Callback = Callable[[proto.Reply | SideChannelError], None]
Endpoint = tuple[str, int]


class _Lane:
    """One peer's queue and its sender thread."""

    def __init__(self, endpoint: Endpoint, timeout_s: float, name: str) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.cv = threading.Condition()
        self.queue: deque[tuple[proto.Request, Callback | None]] = deque()
        self.stop = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, msg: proto.Request, callback: Callback | None) -> None:
        with self.cv:
            self.queue.append((msg, callback))
            self.cv.notify()

    def _run(self) -> None:
        host, port = self.endpoint
        client = SideChannelClient(self.timeout_s)
        try:
            while True:
                with self.cv:
                    while not self.queue and not self.stop:
                        self.cv.wait()
                    if self.stop:
                        return
                    msg, callback = self.queue.popleft()
                result: proto.Reply | SideChannelError
                try:
                    result = client.request(host, port, msg)
                except SideChannelError as exc:
                    result = exc
                except Exception as exc:  # never let one message end the lane
                    logger.exception("PDConnector: %s to %s:%d failed", type(msg).__name__,
                                     host, port)
                    result = SideChannelError(f"{type(exc).__name__}: {exc}")
                if callback is not None:
                    try:
                        callback(result)
                    except Exception:  # a callback bug must not stop the sender
                        logger.exception("PDConnector: side-channel callback failed")
                elif isinstance(result, SideChannelError):
                    logger.warning("PDConnector: %s to %s:%d failed: %s",
                                   type(msg).__name__, host, port, result)
        finally:
            client.close()

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify()
        self.thread.join(timeout=2)


class Outbox:
    def __init__(self, timeout_s: float, name: str = "pd-outbox") -> None:
        self.timeout_s = timeout_s
        self._name = name
        self._lock = threading.Lock()
        self._lanes: dict[Endpoint, _Lane] = {}
        self._closed = False

    def send(self, host: str, port: int, msg: proto.Request, callback: Callback | None = None
             ) -> None:
        with self._lock:
            if self._closed:
                return
            lane = self._lanes.get((host, port))
            if lane is None:
                lane = self._lanes[(host, port)] = _Lane(
                    (host, port), self.timeout_s, f"{self._name}-{port}")
        lane.put(msg, callback)

    @property
    def num_lanes(self) -> int:
        return len(self._lanes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close()
