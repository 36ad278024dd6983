"""D's heartbeat sender: keeps P's leases alive while D holds a request.

Runs in D's scheduler process on one daemon thread with its own side-channel
client. Lifecycle of a tracked request:

1. ``track`` on arrival (``on_new_request``): the first heartbeat leaves at
   once, then one every ``interval`` seconds, batched per P endpoint.
2. ``untrack`` when the load finished or failed, or the request ended.
3. ``release`` (queued) tells P to free blocks D will never read (request
   aborted before its load, or its KV already cached on D).

A dead P costs at most one ``timeout`` per endpoint per round and never
blocks the engine step, which only touches the locked dicts.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from vllm_pd_ext import protocol as proto
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.side_channel import SideChannelClient, SideChannelError

logger = get_logger(__name__)

Endpoint = tuple[str, int]


class HeartbeatSender:
    def __init__(self, engine_id: str, interval_s: float, timeout_s: float) -> None:
        self.engine_id = engine_id
        self.interval_s = interval_s
        # Side-channel replies take well under a millisecond; a short timeout
        # keeps one dead P from delaying the heartbeats of the others.
        self.timeout_s = min(timeout_s, interval_s / 2, 1.0)
        self._lock = threading.Condition()
        # D request id -> (endpoint, P request id)
        self._tracked: dict[str, tuple[Endpoint, str]] = {}
        self._fresh: set[str] = set()
        self._releases: list[tuple[Endpoint, proto.LeaseRelease]] = []
        self._stop = False
        self.num_sent = 0
        self.num_refused = 0
        self._thread: threading.Thread | None = None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pd-heartbeats", daemon=True)
            self._thread.start()

    def track(self, request_id: str, endpoint: Endpoint, remote_request_id: str) -> None:
        with self._lock:
            self._ensure_thread()
            self._tracked[request_id] = (endpoint, remote_request_id)
            self._fresh.add(request_id)
            self._lock.notify()

    def untrack(self, request_id: str) -> None:
        with self._lock:
            self._tracked.pop(request_id, None)
            self._fresh.discard(request_id)

    def release(self, endpoint: Endpoint, remote_request_id: str, tp_size: int,
                reason: str) -> None:
        with self._lock:
            self._ensure_thread()
            for rank in range(tp_size):
                self._releases.append((endpoint, proto.LeaseRelease(
                    engine_id=self.engine_id, request_ids=[remote_request_id], tp_rank=rank,
                    ok=False, reason=reason)))
            self._lock.notify()

    def _run(self) -> None:
        client = SideChannelClient(self.timeout_s)
        next_round = time.monotonic()
        try:
            while True:
                with self._lock:
                    timeout = max(0.0, next_round - time.monotonic())
                    if not (self._fresh or self._releases or self._stop):
                        self._lock.wait(timeout)
                    if self._stop:
                        return
                    releases, self._releases = self._releases, []
                    full_round = time.monotonic() >= next_round
                    ids = list(self._tracked) if full_round else list(self._fresh)
                    self._fresh.clear()
                    batches: dict[Endpoint, list[str]] = defaultdict(list)
                    for rid in ids:
                        if rid in self._tracked:
                            endpoint, remote_id = self._tracked[rid]
                            batches[endpoint].append(remote_id)
                if full_round:
                    next_round = time.monotonic() + self.interval_s
                for endpoint, msg in releases:
                    self._send(client, endpoint, msg)
                for endpoint, remote_ids in batches.items():
                    left = self._send(client, endpoint, proto.LeaseRenew(
                        engine_id=self.engine_id, request_ids=remote_ids))
                    if left is not None:
                        # P's lease may be shorter than ours: beat at least
                        # three times per remaining lease.
                        next_round = min(next_round, time.monotonic() + left / 3)
        finally:
            client.close()

    def _send(self, client: SideChannelClient, endpoint: Endpoint, msg: proto.Request
              ) -> float | None:
        """Send one message; for a renew, return the shortest lease left."""
        try:
            reply = client.request(endpoint[0], endpoint[1], msg)
        except SideChannelError as exc:
            logger.warning("PDConnector: heartbeat/release to %s:%d failed: %s",
                           endpoint[0], endpoint[1], exc)
            return None
        except Exception:  # the thread serves every request on this D: never end it
            logger.exception("PDConnector: heartbeat/release to %s:%d failed",
                             endpoint[0], endpoint[1])
            return None
        if not isinstance(msg, proto.LeaseRenew) or not isinstance(reply, proto.LeaseStatus):
            return None
        self.num_sent += len(msg.request_ids)
        self.num_refused += sum(1 for r in reply.remaining_s if r < 0)
        return min((r for r in reply.remaining_s if r > 0), default=None)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=2)
