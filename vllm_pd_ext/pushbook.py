"""P's push bookkeeping: match D's registrations with finished prefills.

Pure: no vLLM, NIXL, sockets or clock of its own (``clock`` is injected), so
every ordering is unit-tested. Not thread-safe; the owner
(``push_producer.PushProducer``) holds one lock around every call.

Everything is keyed by ``pd_request_id``, the id the proxy gives both legs:
P's and D's internal request ids differ, and a lookup keyed by either alone
never matches (the upstream heartbeat bug of vLLM PR #53244).

Lifecycle of one id:

1. ``register`` (D's ``PushRegister`` arrived) and ``prefill_done`` (P's
   prefill finished; its blocks are pinned and leased) come in either order.
   The second one returns a ``Match``: the caller orders the WRITEs and
   holds the lease so it cannot expire under a WRITE.
2. ``settle`` once per P rank when its WRITE finished or failed and its
   handle was released; after the last rank the id is tombstoned ``done``
   or ``failed`` and the caller releases the lease.
3. ``abort`` (D gave up) answers whether D may reuse its blocks: ``aborted``
   / ``unknown`` (no WRITE will ever be posted: the id is tombstoned so a
   registration still on the wire is refused), ``done`` / ``failed``
   (settled), or ``in_flight`` (D must wait for the result).
4. ``sweep`` drops registrations whose window closed before their prefill
   finished (tombstoned ``expired``: a late prefill is freed at once).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")


class PushRefused(Exception):
    """A registration that must not be served; the message says why."""


@dataclass(frozen=True)
class Prefill:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    finished_at: float


@dataclass
class _Registration(Generic[R]):
    reg: R
    received_at: float
    post_before: float


@dataclass(frozen=True)
class Match(Generic[R]):
    pd_request_id: str
    reg: R
    prefill: Prefill
    #: Monotonic time after which no WRITE may be posted.
    post_before: float
    #: How long the first of the two waited for the second.
    waited_s: float


@dataclass
class _Writing:
    num_ranks: int
    settled: set[int] = field(default_factory=set)
    ok: bool = True


class PushBook(Generic[R]):
    def __init__(self, clock: Callable[[], float], max_tombstones: int = 8192) -> None:
        self._clock = clock
        self._regs: dict[str, _Registration[R]] = {}
        self._prefills: dict[str, Prefill] = {}
        self._writing: dict[str, _Writing] = {}
        #: pd_request_id -> "done" | "failed" | "aborted" | "expired"
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        self._max_tombstones = max_tombstones
        self.num_expired_registrations = 0

    # ------------------------------------------------------------ arrivals
    def register(self, pd_id: str, reg: R, ttl_s: float, num_ranks: int) -> Match[R] | None:
        """D's registration; a ``Match`` if the prefill already finished."""
        if pd_id in self._tombstones:
            raise PushRefused(f"pd_request_id {pd_id!r} was already {self._tombstones[pd_id]}")
        if pd_id in self._regs or pd_id in self._writing:
            raise PushRefused(f"pd_request_id {pd_id!r} is already registered")
        now = self._clock()
        entry = _Registration(reg, now, now + ttl_s)
        prefill = self._prefills.pop(pd_id, None)
        if prefill is None:
            self._regs[pd_id] = entry
            return None
        return self._match(pd_id, entry, prefill, now - prefill.finished_at, num_ranks)

    def prefill_done(self, pd_id: str, prefill: Prefill, num_ranks: int
                     ) -> Match[R] | str | None:
        """P's prefill finished: a ``Match``, ``None`` (wait for D), or the
        tombstone state (``aborted`` / ``expired`` / ...) when D already gave
        up: the caller frees the blocks at once."""
        if pd_id in self._tombstones:
            return self._tombstones[pd_id]
        if pd_id in self._prefills or pd_id in self._writing:
            return "duplicate"
        entry = self._regs.pop(pd_id, None)
        if entry is None:
            self._prefills[pd_id] = prefill
            return None
        return self._match(pd_id, entry, prefill, prefill.finished_at - entry.received_at,
                           num_ranks)

    def prefill_failed(self, pd_id: str) -> R | None:
        """P's prefill ended without KV (aborted, rejected). Returns the
        waiting registration, if any, so the caller can tell D at once; the
        id is tombstoned ``failed`` either way."""
        if pd_id in self._writing or pd_id in self._prefills:
            return None
        entry = self._regs.pop(pd_id, None)
        self._tombstone(pd_id, "failed")
        return entry.reg if entry is not None else None

    def _match(self, pd_id: str, entry: _Registration[R], prefill: Prefill, waited: float,
               num_ranks: int) -> Match[R]:
        self._writing[pd_id] = _Writing(num_ranks)
        return Match(pd_id, entry.reg, prefill, entry.post_before, max(0.0, waited))

    # ------------------------------------------------------------ outcomes
    def settle(self, pd_id: str, rank: int, ok: bool) -> bool | None:
        """A rank's WRITE settled. Returns the overall ``ok`` once every rank
        settled, else ``None``."""
        w = self._writing.get(pd_id)
        if w is None:
            return None
        w.settled.add(rank)
        w.ok = w.ok and ok
        if len(w.settled) < w.num_ranks:
            return None
        del self._writing[pd_id]
        self._tombstone(pd_id, "done" if w.ok else "failed")
        return w.ok

    def abort(self, pd_id: str) -> tuple[str, Prefill | None]:
        """D gave up. Returns (state for D, the prefill whose lease the
        caller must release, if one was waiting)."""
        if pd_id in self._writing:
            return "in_flight", None
        if pd_id in self._tombstones:
            state = self._tombstones[pd_id]
            return ("aborted" if state == "expired" else state), None
        prefill = self._prefills.pop(pd_id, None)
        known = self._regs.pop(pd_id, None) is not None or prefill is not None
        self._tombstone(pd_id, "aborted")
        return ("aborted" if known else "unknown"), prefill

    def forget_prefill(self, pd_id: str) -> bool:
        """The prefill's lease expired before D registered."""
        if self._prefills.pop(pd_id, None) is None:
            return False
        self._tombstone(pd_id, "expired")
        return True

    def sweep(self) -> list[str]:
        """Drop registrations whose WRITE window closed unmatched."""
        now = self._clock()
        gone = [pd_id for pd_id, e in self._regs.items() if e.post_before <= now]
        for pd_id in gone:
            del self._regs[pd_id]
            self._tombstone(pd_id, "expired")
        self.num_expired_registrations += len(gone)
        return gone

    # ------------------------------------------------------------ views
    def state(self, pd_id: str) -> str:
        if pd_id in self._writing:
            return "writing"
        if pd_id in self._regs:
            return "registered"
        if pd_id in self._prefills:
            return "prefilled"
        return self._tombstones.get(pd_id, "unknown")

    def counts(self) -> dict[str, int]:
        return {"registered": len(self._regs), "prefilled": len(self._prefills),
                "writing": len(self._writing)}

    def _tombstone(self, pd_id: str, state: str) -> None:
        self._tombstones[pd_id] = state
        self._tombstones.move_to_end(pd_id)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
