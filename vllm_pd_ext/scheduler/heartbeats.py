"""D's heartbeat sender: keeps P's leases alive while D holds a request.

Runs in D's scheduler process. Lifecycle of a tracked request:

1. ``track`` on arrival (``on_new_request``): the first heartbeat leaves at
   once, then one every ``interval`` seconds, batched per P endpoint.
2. ``untrack`` when the load finished or failed, or the request ended.
3. ``release`` tells P to free blocks D will never read (request aborted
   before its load, or its KV already cached on D).

P answers each renew with the seconds left per lease. A lease P reports
expired (``LEASE_EXPIRED``: it expired or was released, so P freed or
will free the blocks) is passed to ``on_expired``: in push mode D then
stops waiting for a WRITE that will not come (``d_push``) instead of
waiting out ``push_timeout``.

One daemon thread keeps the rounds' time; the messages leave on one
``Outbox`` lane per P endpoint, so a dead or frozen P delays only its own
heartbeats and releases, never another P's renewals. At most one renew per
endpoint is outstanding: a P that does not answer gets no pile of renews,
and what is queued behind a timed-out message to it fails at once. The
engine step only touches the locked dicts and never waits on a peer.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.wire.side_channel import SideChannelError

logger = get_logger(__name__)

Endpoint = tuple[str, int]


class HeartbeatSender:
    def __init__(self, engine_id: str, interval_s: float, timeout_s: float,
                 auth: FrameAuth | None = None) -> None:
        self.engine_id = engine_id
        self.interval_s = interval_s
        # Side-channel replies take well under a millisecond; a short timeout
        # bounds how long a dead P holds its own lane.
        self.timeout_s = min(timeout_s, interval_s / 2, 1.0)
        self._lock = threading.Condition()
        # D request id -> (endpoint, P request id)
        self._tracked: dict[str, tuple[Endpoint, str]] = {}
        self._fresh: set[str] = set()
        #: Endpoints with a renew sent and not yet answered.
        self._outstanding: set[Endpoint] = set()
        self._next_round = 0.0
        self._stop = False
        self.num_sent = 0
        self.num_refused = 0
        #: Called on a lane thread with a P endpoint and the P request ids it
        #: reported expired; exceptions are logged, never raised into the lane.
        self.on_expired: Callable[[Endpoint, list[str]], None] | None = None
        self._outbox = Outbox(self.timeout_s, name="pd-hb", fail_queued_on_timeout=True,
                             auth=auth)
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
                reason: str, consumer: str = "") -> None:
        """Queue one release per D rank (``tp_size`` is D's own TP size,
        which the lease then counts as its consumers). ``consumer``: D's
        request, which also drops the hold P's answer gave it (a concurrent
        pull); its workers never pinned, since its load was not scheduled."""
        for rank in range(tp_size):
            self._outbox.send(endpoint[0], endpoint[1], proto.LeaseRelease(
                engine_id=self.engine_id, request_ids=[remote_request_id], tp_rank=rank,
                ok=False, reason=reason, consumer_ranks=tp_size, consumer=consumer),
                self._on_release_reply)

    def _run(self) -> None:
        while True:
            with self._lock:
                timeout = max(0.0, self._next_round - time.monotonic())
                if not (self._sendable_fresh() or self._stop):
                    self._lock.wait(timeout)
                if self._stop:
                    return
                full_round = time.monotonic() >= self._next_round
                if full_round:
                    self._next_round = time.monotonic() + self.interval_s
                try:
                    batches = self._due(full_round)
                except Exception:  # the thread serves every request on this D: never end it
                    logger.exception("PDConnector: heartbeat round failed; next round as usual")
                    self._fresh.clear()
                    continue
            for endpoint, remote_ids in batches.items():
                self._outbox.send(endpoint[0], endpoint[1], proto.LeaseRenew(
                    engine_id=self.engine_id, request_ids=remote_ids),
                    functools.partial(self._on_renew_reply, endpoint, remote_ids))

    def _due(self, full_round: bool) -> dict[Endpoint, list[str]]:
        """Under the lock: the renews to send now, one batch per endpoint
        that has none outstanding (fresh ids of a busy endpoint wait)."""
        ids = list(self._tracked) if full_round else list(self._fresh)
        batches: dict[Endpoint, list[str]] = defaultdict(list)
        for rid in ids:
            entry = self._tracked.get(rid)
            if entry is None:
                continue
            endpoint, remote_id = entry
            if endpoint in self._outstanding:
                continue
            batches[endpoint].append(remote_id)
            self._fresh.discard(rid)
        for endpoint, remote_ids in batches.items():
            # Bounded: a batch names each tracked request of that P once.
            del remote_ids[proto.MAX_IDS_PER_MESSAGE:]
            self._outstanding.add(endpoint)
        return batches

    def _sendable_fresh(self) -> bool:
        return any(self._tracked[r][0] not in self._outstanding for r in self._fresh)

    def _on_renew_reply(self, endpoint: Endpoint, remote_ids: list[str],
                        reply: proto.Reply | SideChannelError) -> None:
        """Lane thread: count the answer; P's lease may be shorter than ours,
        so beat at least three times per remaining lease. Expired leases go
        to ``on_expired`` (outside the lock)."""
        expired: list[str] = []
        with self._lock:
            self._outstanding.discard(endpoint)
            if isinstance(reply, SideChannelError):
                logger.warning("PDConnector: heartbeat to %s:%d failed: %s", endpoint[0],
                               endpoint[1], reply)
            elif isinstance(reply, proto.LeaseStatus):
                self.num_sent += len(remote_ids)
                self.num_refused += sum(1 for r in reply.remaining_s if r < 0)
                # Not strict: a peer answering the wrong count only loses
                # its own extra (or missing) entries.
                expired = [rid for rid, left in zip(remote_ids, reply.remaining_s,
                                                    strict=False)
                           if left == proto.LEASE_EXPIRED]
                left = min((r for r in reply.remaining_s if r > 0), default=None)
                if left is not None and time.monotonic() + left / 3 < self._next_round:
                    self._next_round = time.monotonic() + left / 3
                    self._lock.notify()  # the thread sleeps until the old round
            if self._sendable_fresh():
                self._lock.notify()
        if expired and self.on_expired is not None:
            try:
                self.on_expired(endpoint, expired)
            except Exception:  # the lane serves every request to this P: never end it
                logger.exception("PDConnector: handling expired leases of %s:%d failed",
                                 *endpoint)

    @staticmethod
    def _on_release_reply(reply: proto.Reply | SideChannelError) -> None:
        if isinstance(reply, SideChannelError):
            logger.warning("PDConnector: release to P failed (its lease will expire): %s", reply)

    @property
    def num_lanes(self) -> int:
        return self._outbox.num_lanes

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._outbox.close()
