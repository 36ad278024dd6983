"""P's lease owner: the one place that grants, renews, releases and sweeps.

Role: wraps the pure ``leases.LeaseTable`` with one lock and names every
operation P performs on its leases, so the invariants (exactly-once free, a
WRITING lease never expires, a holder keeps the lease until it released)
stay in ``table.py`` and nobody else touches the table. Two threads call
in, both in P's EngineCore process:

- the side-channel thread (``pd-side-channel``): ``renew`` and ``release``
  for D's heartbeats, pins and releases, and in push mode P's own workers'
  releases after their WRITEs;
- the scheduler thread: ``grant`` in ``request_finished``, ``sweep`` and
  ``has_released`` every step (and ``sweep`` on every arriving request),
  ``counters`` for the stats.

Push mode's ``PushProducer`` keeps its ``PushBook`` under the same lock:
``atomic()`` makes several operations (and the caller's own state) one
critical section, and ``sweep(on_expired=...)`` runs its callback inside
the sweep's, so a registration can never match a prefill whose lease the
sweep just ended. The lock is reentrant, so operations may be called inside
``atomic()`` and inside the callback.

Lifecycle: one instance per scheduler half (``PDScheduler.__init__``),
whatever the engine's role (D's kept turns are leases too), shared with the
``BlockLender`` (``leases/lender.py``), ``SideChannelServer`` and
``PushProducer``; it has no thread and nothing to close.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from vllm_pd_ext.leases.table import Consumer, LeaseState, LeaseTable, SweepResult
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.protocol import LEASE_UNKNOWN

logger = get_logger(__name__)


@dataclass(frozen=True)
class LeaseCounters:
    """Totals since start (the scheduler reports differences)."""

    num_live: int
    num_heartbeats: int
    num_late_messages: int
    num_expired: int
    num_renewals: int
    num_wrong_sender: int = 0


class LeaseService:
    """P's leases, shared by the side-channel thread and the scheduler step."""

    def __init__(self, table: LeaseTable, unknown_heartbeats_expected: bool = False,
                 owner: str = "") -> None:
        #: The pure table. Code outside this class uses the operations below;
        #: tests may inspect it (or swap it before the first grant).
        self.table = table
        #: Reentrant: operations nest inside ``atomic()`` and sweep callbacks.
        self.lock = threading.RLock()
        self.num_heartbeats = 0
        self.num_late_messages = 0
        #: Push: D heartbeats from arrival, usually before P's prefill has
        #: finished, so an unknown id is normal there.
        self.unknown_heartbeats_expected = unknown_heartbeats_expected
        #: This engine's id: only its own workers release a lease P is
        #: WRITING from (push). "": not checked (tests of the bare service).
        self.owner = owner
        #: Renewals and releases refused because another engine holds the lease.
        self.num_wrong_sender = 0

    def atomic(self) -> AbstractContextManager[bool]:
        """``with leases.atomic():`` one critical section for several
        operations and for state the caller guards with this lock (push
        mode's ``PushBook``). The lock itself: no wrapper on the step's path."""
        return self.lock

    # ------------------------------------------------------------ scheduler
    def grant(self, request_id: str, num_consumers: int,
              duration_s: float | None = None) -> float:
        """Lease a finished prefill's blocks to ``num_consumers`` D ranks;
        returns the monotonic expiry. ``KeyError`` if the id is leased.
        ``duration_s``: the first expiry, if not the lease duration (D's
        kept turns)."""
        with self.lock:
            return self.table.grant(request_id, num_consumers, duration_s)

    def evict(self, request_id: str) -> bool:
        """End a lease no reader has touched yet (D's kept-turn budget)."""
        with self.lock:
            return self.table.evict(request_id)

    def sweep(self, on_expired: Callable[[list[str]], None] | None = None) -> SweepResult:
        """Forget released and expired leases; the caller frees their blocks
        exactly once. ``on_expired`` gets the expired ids inside the same
        critical section (only when there are some). O(what changed)."""
        with self.lock:
            result = self.table.sweep()
            if on_expired is not None and result.expired:
                on_expired(result.expired)
        return result

    def has_released(self) -> bool:
        """A lease D released waits for the next sweep (O(1))."""
        with self.lock:
            return self.table.has_released()

    def next_expiry(self) -> float | None:
        """Earliest monotonic expiry among leases that can expire."""
        with self.lock:
            return self.table.next_expiry()

    def counters(self) -> LeaseCounters:
        with self.lock:
            return LeaseCounters(
                num_live=len(self.table), num_heartbeats=self.num_heartbeats,
                num_late_messages=self.num_late_messages,
                num_expired=self.table.num_expired, num_renewals=self.table.num_renewals,
                num_wrong_sender=self.num_wrong_sender)

    # ------------------------------------------------------------ push (P's WRITE)
    def hold(self, request_id: str) -> bool:
        """P's WRITE from these blocks is ordered: the lease stops expiring.
        False if it already ended (never write from its blocks then)."""
        with self.lock:
            return self.table.hold(request_id)

    def release_ranks(self, request_id: str, ranks: Iterable[int], ok: bool) -> bool:
        """P's own ranks are done with the blocks (their WRITE settled or was
        never posted); True when the lease is now fully released."""
        with self.lock:
            done = False
            for rank in ranks:
                done = self.table.release(request_id, rank, ok) or done
            return done

    def extend(self, request_id: str, engine_id: str, consumer: str) -> float:
        """P tells a waiting D its answer (concurrent pull): the lease lasts
        a whole duration from now, held for D's request ``consumer`` of
        engine ``engine_id`` until it released (``LeaseTable.extend``)."""
        with self.lock:
            if self._held_by_other(request_id, engine_id):
                return LEASE_UNKNOWN
            return self.table.extend(request_id, (Consumer(engine_id, consumer), -1))

    # ------------------------------------------------------------ side channel
    def _held_by_other(self, request_id: str, engine_id: str, releasing: bool = False) -> bool:
        """The lease is pinned by other engines only, or (``releasing``) P is
        WRITING from it and ``engine_id`` is not P itself (lock held). A lease
        nobody pinned yet takes any authenticated engine's renewal or early
        release: D is only chosen after P answers."""
        lease = self.table.get(request_id)
        if lease is None:
            return False
        if releasing and self.owner and lease.state is LeaseState.WRITING:
            return engine_id != self.owner
        return bool(lease.holders) and all(c.engine_id != engine_id
                                           for c, _ in lease.holders)

    def renew(self, msg: proto.LeaseRenew) -> proto.LeaseStatus:
        """D's heartbeat, or its pin (``acquire``) before it posts READs; a
        pin naming its ``consumer`` holds the lease until that consumer's
        release of the same rank."""
        holder = ((Consumer(msg.engine_id, msg.consumer), msg.tp_rank)
                  if msg.acquire and msg.consumer else None)
        with self.lock:
            # Push: a heartbeat can cross P's release after its WRITE; that is
            # not a late message.
            released = {rid for rid in msg.request_ids
                        if (lease := self.table.get(rid)) is not None
                        and lease.state is LeaseState.RELEASED}
            foreign = {rid for rid in msg.request_ids if self._held_by_other(rid, msg.engine_id)}
            remaining = [proto.LEASE_UNKNOWN if rid in foreign
                         else self.table.renew(rid, acquire=msg.acquire, holder=holder,
                                               consumer_ranks=msg.consumer_ranks)
                         for rid in msg.request_ids]
            self.num_wrong_sender += len(foreign)
            if not msg.acquire:
                self.num_heartbeats += len(msg.request_ids)
        if foreign:
            logger.warning("PDConnector: %s of %d lease(s) from engine %s refused: another "
                           "engine holds them (first: %s)", "pin" if msg.acquire else
                           "heartbeat", len(foreign), msg.engine_id, next(iter(foreign)))
        for rid, left in zip(msg.request_ids, remaining, strict=True):
            if rid in foreign:
                continue
            if not msg.acquire and self.unknown_heartbeats_expected and (
                    left == proto.LEASE_UNKNOWN or rid in released):
                continue
            if left < 0:
                with self.lock:
                    self.num_late_messages += 1
                logger.warning(
                    "PDConnector: %s for request %s from engine %s refused: lease %s",
                    "pin" if msg.acquire else "heartbeat", rid, msg.engine_id,
                    "expired" if left == proto.LEASE_EXPIRED else "unknown",
                )
        return proto.LeaseStatus(remaining)

    def release(self, msg: proto.LeaseRelease) -> proto.Ack:
        """D's release of one rank (READ done, failed or not needed), or in
        push mode P's own worker's after its WRITE settled."""
        consumer = Consumer(msg.engine_id, msg.consumer) if msg.consumer else None
        with self.lock:
            for rid in msg.request_ids:
                lease = self.table.get(rid)
                if self._held_by_other(rid, msg.engine_id, releasing=True):
                    self.num_wrong_sender += 1
                    logger.warning("PDConnector: release of request %s from engine %s "
                                   "refused: that engine does not hold the lease", rid,
                                   msg.engine_id)
                    continue
                if (lease is not None and not 0 <= msg.tp_rank < lease.num_consumers
                        and not (msg.consumer_ranks and not lease.released_ranks
                                 and 0 <= msg.tp_rank < msg.consumer_ranks)):
                    logger.warning(
                        "PDConnector: release of request %s from engine %s names rank %d; "
                        "the lease has %d consumer rank(s): ignored", rid, msg.engine_id,
                        msg.tp_rank, lease.num_consumers)
                    continue
                if (not self.table.release(rid, msg.tp_rank, msg.ok, consumer,
                                           msg.consumer_ranks)
                        and rid not in self.table):
                    self.num_late_messages += 1
                    logger.info(
                        "PDConnector: release of request %s from engine %s after its lease "
                        "ended (ok=%s %s)", rid, msg.engine_id, msg.ok, msg.reason,
                    )
        return proto.Ack()
