"""Block leases on the producer (P): who holds a finished prefill's blocks.

Pure: no vLLM, NIXL or clock of its own (``clock`` is injected), so the
lifecycle is unit-tested with a fake clock. Not thread-safe; the owner
(``side_channel.LeaseService``) serialises access with one lock.

Lifecycle of one lease (keyed by P's request id, which D learns as
``remote_request_id``):

1. ``grant`` when P's prefill finishes: state HELD, expiry = now + duration.
2. ``renew`` for every heartbeat from D: expiry = max(expiry, now + duration).
   ``renew(acquire=True)`` is D's pin just before it posts its READs: state
   READING. A pin is refused once the lease has expired.
3. ``release`` by each of D's ``num_consumers`` ranks when their READs are
   done (or failed, or were not needed): state RELEASED once all ranks did.
   Push mode: ``hold`` when P's own WRITE is ordered (the lease then never
   expires), and each P rank ``release``-s when its WRITE settled.
4. ``sweep`` (every P scheduler step) returns released and expired ids and
   forgets them; the caller then frees their blocks exactly once. Expired ids
   are remembered in a bounded tombstone set so that a late message can be
   told apart from an unknown id.

Safety: D posts READs only after a successful pin and only while its view of
the lease (pin send time + remaining, strictly earlier than P's expiry) is
valid, and keeps heartbeating until its READs complete. So P frees blocks
either after D said it is done, or after D was silent for a whole lease
duration.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_pd_ext.protocol import LEASE_EXPIRED, LEASE_UNKNOWN


class LeaseState(enum.Enum):
    HELD = "held"
    READING = "reading"
    #: Push: P's own WRITE reads the blocks; never expires (P settles it).
    WRITING = "writing"
    RELEASED = "released"


@dataclass
class Lease:
    request_id: str
    expiry: float
    num_consumers: int
    state: LeaseState = LeaseState.HELD
    released_ranks: set[int] = field(default_factory=set)
    num_renewals: int = 0
    release_ok: bool = True


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

    def grant(self, request_id: str, num_consumers: int = 1) -> float:
        """Hold a finished prefill's blocks; returns the expiry time."""
        if request_id in self._leases:
            raise KeyError(f"lease for {request_id!r} already granted")
        expiry = self._clock() + self.duration_s
        self._leases[request_id] = Lease(request_id, expiry, max(1, num_consumers))
        self._tombstones.pop(request_id, None)
        return expiry

    def renew(self, request_id: str, acquire: bool = False) -> float:
        """Extend a lease; returns seconds left or LEASE_UNKNOWN/LEASE_EXPIRED."""
        lease = self._leases.get(request_id)
        if lease is None:
            return LEASE_EXPIRED if request_id in self._tombstones else LEASE_UNKNOWN
        now = self._clock()
        if lease.expiry <= now or lease.state is LeaseState.RELEASED:
            # Expired but not swept yet: never resurrect it.
            return LEASE_EXPIRED
        lease.expiry = max(lease.expiry, now + self.duration_s)
        lease.num_renewals += 1
        self.num_renewals += 1
        if acquire and lease.state is not LeaseState.WRITING:
            # A WRITING lease stays unexpirable: a pin (from a confused or
            # hostile peer) must not hand P's own WRITE back to the expiry.
            lease.state = LeaseState.READING
        return lease.expiry - now

    def hold(self, request_id: str) -> bool:
        """Push: P's WRITE from these blocks is ordered. The lease no longer
        expires; only ``release`` by every rank ends it. False if unknown."""
        lease = self._leases.get(request_id)
        if lease is None or lease.state is LeaseState.RELEASED:
            return False
        lease.state = LeaseState.WRITING
        return True

    def release(self, request_id: str, rank: int = 0, ok: bool = True) -> bool:
        """Record that ``rank`` is done; True when the lease is now fully released.
        A rank outside ``0..num_consumers-1`` is ignored: it would otherwise
        count as one more consumer and end the lease while a real rank may
        still be reading."""
        lease = self._leases.get(request_id)
        if lease is None or not 0 <= rank < lease.num_consumers:
            return False
        lease.released_ranks.add(rank)
        lease.release_ok = lease.release_ok and ok
        if len(lease.released_ranks) >= lease.num_consumers:
            lease.state = LeaseState.RELEASED
            return True
        return False

    def sweep(self) -> SweepResult:
        """Forget released and expired leases; the caller frees their blocks."""
        now = self._clock()
        released: list[str] = []
        expired: list[str] = []
        for rid, lease in list(self._leases.items()):
            if lease.state is LeaseState.RELEASED:
                released.append(rid)
            elif lease.expiry <= now and lease.state is not LeaseState.WRITING:
                expired.append(rid)
                self._remember_expired(rid)
            else:
                continue
            del self._leases[rid]
        self.num_expired += len(expired)
        return SweepResult(released, expired)

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def next_expiry(self) -> float | None:
        """Earliest expiry among live leases (for bounded idle waits)."""
        return min((lease.expiry for lease in self._leases.values()), default=None)

    def _remember_expired(self, request_id: str) -> None:
        self._tombstones[request_id] = None
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
