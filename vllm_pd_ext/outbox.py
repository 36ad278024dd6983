"""A background sender for side-channel requests whose replies can wait.

Role: the engine step must never block on a peer, so D's registrations and
aborts (and P's failure notices) are queued here and sent, in order, by one
daemon thread with its own ``SideChannelClient``. Each item's callback runs
on that thread with the reply or the ``SideChannelError``; callbacks only
append to locked queues that the scheduler drains on its own thread.

Order matters: D's abort for an id always leaves after its registration,
from the same thread, so P sees them in that order (a registration whose
reply timed out may still arrive; P refuses it once the id is tombstoned).
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


class Outbox:
    def __init__(self, timeout_s: float, name: str = "pd-outbox") -> None:
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._queue: deque[tuple[str, int, proto.Request, Callback | None]] = deque()
        self._stop = False
        self._name = name
        self._thread: threading.Thread | None = None

    def send(self, host: str, port: int, msg: proto.Request, callback: Callback | None = None
             ) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.append((host, port, msg, callback))
            self._cv.notify()

    def _run(self) -> None:
        client = SideChannelClient(self.timeout_s)
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._stop:
                        self._cv.wait()
                    if self._stop:
                        return
                    host, port, msg, callback = self._queue.popleft()
                result: proto.Reply | SideChannelError
                try:
                    result = client.request(host, port, msg)
                except SideChannelError as exc:
                    result = exc
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
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=2)
