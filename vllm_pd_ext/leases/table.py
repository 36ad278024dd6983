"""Block leases on the producer (P): who holds a finished prefill's blocks.

Pure: no vLLM, NIXL or clock of its own (``clock`` is injected), so the
lifecycle is unit-tested with a fake clock. Not thread-safe; the owner
(``service.LeaseService``) serialises access with one lock.

Lifecycle of one lease (keyed by P's request id, which D learns as
``remote_request_id``):

1. ``grant`` when P's prefill finishes: state HELD, expiry = now + duration.
2. ``renew`` for every heartbeat from D: expiry = max(expiry, now + duration).
   ``renew(acquire=True)`` is D's pin just before it posts its READs: state
   READING. A pin that names its consumer (D's request id) and D rank becomes
   a *holder* of the lease. A pin is refused once the lease has expired.
3. ``release`` by each of D's ``num_consumers`` ranks when their READs are
   done (or failed, or were not needed); a release from a holder also drops
   that holder. State RELEASED once every rank released *and* no holder is
   left, so a second D request reading the same answer (a replayed D leg,
   or n > 1) keeps the blocks until it released too.
   Push mode: ``hold`` when P's own WRITE is ordered (the lease then never
   expires), and each P rank ``release``-s when its WRITE settled.
4. ``sweep`` (every P scheduler step) returns released and expired ids and
   forgets them; the caller then frees their blocks exactly once. Expired ids
   are remembered in a bounded tombstone set so that a late message can be
   told apart from an unknown id.

Cost: the sweep runs on every step and every arriving request, so it does
work only for what changed. Released ids wait in a queue; expiries live in a
heap with lazy deletion (one live entry per lease; a renewal only moves
``expiry``, and the sweep re-pushes an entry whose lease was renewed since).
Sweep is O(changed * log n), ``has_released`` O(1).

Safety: D posts READs only after a successful pin and only while its view of
the lease (pin send time + remaining, strictly earlier than P's expiry) is
valid, and keeps heartbeating until its READs complete. So P frees blocks
either after D said it is done, or after D was silent for a whole lease
duration. Holders do not stop expiry: a holder that never releases keeps
the lease only as long as heartbeats keep renewing it.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm_pd_ext.wire.protocol import LEASE_EXPIRED, LEASE_UNKNOWN

#: Pin holders per lease; a pin past this (a hostile or runaway peer) is
#: refused, so one lease's state stays bounded.
MAX_HOLDERS = 4096


class LeaseState(enum.Enum):
    HELD = "held"
    READING = "reading"
    #: Push: P's own WRITE reads the blocks; never expires (P settles it).
    WRITING = "writing"
    RELEASED = "released"


class Consumer(NamedTuple):
    """Who reads a lease's blocks: D's engine and D's own request id."""

    engine_id: str
    request_id: str


#: A pin holder: the consumer and the D rank that pinned (-1: rank not named,
#: dropped by that consumer's release of any rank).
Holder = tuple[Consumer, int]


@dataclass
class Lease:
    request_id: str
    expiry: float
    num_consumers: int
    state: LeaseState = LeaseState.HELD
    released_ranks: set[int] = field(default_factory=set)
    holders: set[Holder] = field(default_factory=set)
    num_renewals: int = 0
    release_ok: bool = True
    #: Sequence number of this lease's one live expiry-heap entry (-1: none).
    heap_seq: int = -1


@dataclass(frozen=True)
class SweepResult:
    released: list[str]
    expired: list[str]


class LeaseTable:
    """Leases by request id with an injected monotonic ``clock``."""

    def __init__(
        self, duration_s: float, clock: Callable[[], float], max_tombstones: int = 4096
    ) -> None:
        if duration_s <= 0:
            raise ValueError(f"lease duration must be > 0, got {duration_s}")
        self.duration_s = duration_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        #: (expiry, seq, request_id); an entry is live only while its lease's
        #: ``heap_seq`` is ``seq``.
        self._expiries: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        #: Released, not swept yet, in release order.
        self._released: dict[str, None] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._max_tombstones = max_tombstones
        self.num_expired = 0
        self.num_renewals = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def grant(self, request_id: str, num_consumers: int = 1,
              duration_s: float | None = None) -> float:
        """Hold a finished prefill's blocks; returns the expiry time.
        ``duration_s``: a first expiry other than the lease duration (D's
        kept turns wait ``decoder_kv_blocks_ttl`` for their reader; every
        renewal after that extends by the lease duration, as for P)."""
        if request_id in self._leases:
            raise KeyError(f"lease for {request_id!r} already granted")
        expiry = self._clock() + (self.duration_s if duration_s is None else duration_s)
        lease = Lease(request_id, expiry, max(1, num_consumers))
        self._leases[request_id] = lease
        self._push_expiry(lease)
        self._tombstones.pop(request_id, None)
        return expiry

    def renew(self, request_id: str, acquire: bool = False,
              holder: Holder | None = None, consumer_ranks: int = 0) -> float:
        """Extend a lease; returns seconds left or LEASE_UNKNOWN/LEASE_EXPIRED.
        With ``acquire`` (a pin), ``holder`` is recorded until it releases;
        ``consumer_ranks``: see ``_count_consumers``."""
        lease = self._leases.get(request_id)
        if lease is None:
            return LEASE_EXPIRED if request_id in self._tombstones else LEASE_UNKNOWN
        now = self._clock()
        if lease.expiry <= now or lease.state is LeaseState.RELEASED:
            # Expired but not swept yet: never resurrect it.
            return LEASE_EXPIRED
        if (acquire and holder is not None and holder not in lease.holders
                and len(lease.holders) >= MAX_HOLDERS):
            return LEASE_EXPIRED
        # The heap entry stays where it is: the sweep re-pushes it when it
        # comes due, so a renewal is O(1) however often D heartbeats.
        lease.expiry = max(lease.expiry, now + self.duration_s)
        lease.num_renewals += 1
        self.num_renewals += 1
        if acquire and lease.state is not LeaseState.WRITING:
            # A WRITING lease stays unexpirable and takes no holders: a pin
            # (from a confused or hostile peer) must neither hand P's own
            # WRITE back to the expiry nor keep the lease after P settled.
            lease.state = LeaseState.READING
            if holder is not None:
                lease.holders.add(holder)
            self._count_consumers(lease, consumer_ranks)
        return lease.expiry - now

    def extend(self, request_id: str, holder: Holder | None = None) -> float:
        """P's own extension, as it tells a waiting D its answer (concurrent
        pull): expiry = max(expiry, now + duration), and ``holder`` (that D
        request, every rank: -1) recorded as a pin's would be, so no other
        engine's release ends the lease under D's READ; returns seconds
        left or LEASE_UNKNOWN/LEASE_EXPIRED. Unlike a reader's ``renew`` it
        leaves the lease HELD and uncounted, so D's cancel can still
        ``evict`` it (D then never reads it)."""
        lease = self._leases.get(request_id)
        if lease is None:
            return LEASE_EXPIRED if request_id in self._tombstones else LEASE_UNKNOWN
        now = self._clock()
        if (lease.expiry <= now or lease.state is LeaseState.RELEASED
                or lease.state is LeaseState.WRITING):
            return LEASE_EXPIRED
        if holder is not None and holder not in lease.holders:
            if len(lease.holders) >= MAX_HOLDERS:
                return LEASE_EXPIRED
            lease.holders.add(holder)
        lease.expiry = max(lease.expiry, now + self.duration_s)
        return lease.expiry - now

    @staticmethod
    def _count_consumers(lease: Lease, consumer_ranks: int) -> None:
        """A lease is granted before D is chosen, with P's own rank count;
        D's first pin or release names how many of D's ranks read it (D's TP
        size), which may differ. Taken only before any rank released, so the
        count never changes under a release already made."""
        if (consumer_ranks > 0 and not lease.released_ranks
                and lease.state is not LeaseState.WRITING):
            lease.num_consumers = consumer_ranks

    def hold(self, request_id: str) -> bool:
        """Push: P's WRITE from these blocks is ordered. The lease no longer
        expires; only ``release`` by every rank ends it. False if unknown."""
        lease = self._leases.get(request_id)
        if lease is None or lease.state is LeaseState.RELEASED:
            return False
        lease.state = LeaseState.WRITING
        return True

    def release(self, request_id: str, rank: int = 0, ok: bool = True,
                consumer: Consumer | None = None, consumer_ranks: int = 0) -> bool:
        """Record that ``rank`` (of ``consumer``, if named) is done; True when
        the lease is now fully released. A rank outside ``0..num_consumers-1``
        is ignored: it would otherwise count as one more consumer and end the
        lease while a real rank may still be reading. A release that names no
        consumer counts its rank but never drops another consumer's holder."""
        lease = self._leases.get(request_id)
        if lease is None or lease.state is LeaseState.RELEASED:
            return False  # unknown, or already queued for the sweep
        self._count_consumers(lease, consumer_ranks)
        if not 0 <= rank < lease.num_consumers:
            return False
        lease.released_ranks.add(rank)
        lease.release_ok = lease.release_ok and ok
        if consumer is not None:
            lease.holders.discard((consumer, rank))
            lease.holders.discard((consumer, -1))
        if len(lease.released_ranks) >= lease.num_consumers and not lease.holders:
            lease.state = LeaseState.RELEASED
            self._released[request_id] = None
            return True
        return False

    def evict(self, request_id: str) -> bool:
        """End a lease nobody uses yet (HELD, never renewed or pinned) now;
        True when it is queued for the sweep. A lease a reader heartbeats or
        pins is never evicted: only its release or its expiry ends it."""
        lease = self._leases.get(request_id)
        if lease is None or lease.state is not LeaseState.HELD or lease.num_renewals:
            return False
        lease.state = LeaseState.RELEASED
        self._released[request_id] = None
        return True

    def has_released(self) -> bool:
        """A released lease waits for the sweep (O(1))."""
        return bool(self._released)

    def sweep(self) -> SweepResult:
        """Forget released and expired leases; the caller frees their blocks.
        Expired ids come in expiry order."""
        released = list(self._released)
        self._released.clear()
        for rid in released:
            del self._leases[rid]
        now = self._clock()
        expired: list[str] = []
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expiry, seq, rid = heapq.heappop(heap)
            lease = self._leases.get(rid)
            if lease is None or lease.heap_seq != seq:
                continue  # released, expired earlier, or re-pushed since
            if lease.state is LeaseState.WRITING:
                lease.heap_seq = -1  # never expires; the ranks' releases end it
            elif lease.expiry > expiry:
                # Renewed since this entry was pushed: back in at its real
                # expiry (popped again below if that has passed too).
                self._push_expiry(lease)
            else:
                expired.append(rid)
                self._remember_expired(rid)
                del self._leases[rid]
        self._compact()
        self.num_expired += len(expired)
        return SweepResult(released, expired)

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def next_expiry(self) -> float | None:
        """Earliest expiry among leases that can expire (for bounded idle
        waits); WRITING leases never expire and are not counted."""
        heap = self._expiries
        while heap:
            expiry, seq, rid = heap[0]
            lease = self._leases.get(rid)
            if lease is None or lease.heap_seq != seq:
                heapq.heappop(heap)
            elif lease.state is LeaseState.WRITING:
                heapq.heappop(heap)
                lease.heap_seq = -1
            elif lease.expiry > expiry:
                heapq.heappop(heap)
                self._push_expiry(lease)
            else:
                return expiry
        return None

    def _push_expiry(self, lease: Lease) -> None:
        lease.heap_seq = next(self._seq)
        heapq.heappush(self._expiries, (lease.expiry, lease.heap_seq, lease.request_id))

    def _compact(self) -> None:
        """Rebuild the heap once stale entries (of released leases) outnumber
        the live ones: memory stays O(live), at amortised O(1) per release."""
        if len(self._expiries) <= 2 * len(self._leases) + 64:
            return
        self._expiries = []
        for lease in self._leases.values():
            if lease.heap_seq >= 0:
                lease.heap_seq = next(self._seq)
                self._expiries.append((lease.expiry, lease.heap_seq, lease.request_id))
        heapq.heapify(self._expiries)

    def _remember_expired(self, request_id: str) -> None:
        self._tombstones[request_id] = None
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
