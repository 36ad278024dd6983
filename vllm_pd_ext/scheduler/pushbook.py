"""P's push bookkeeping: match D's registrations with finished prefills.

Pure: no vLLM, NIXL, sockets or clock of its own (``clock`` is injected), so
every ordering is unit-tested. Not thread-safe; the owner
(``p_push.PushProducer``) holds one lock around every call.

Everything is keyed by ``pd_request_id``, the id the proxy gives both legs:
P's and D's internal request ids differ, and a lookup keyed by either alone
never matches (the upstream heartbeat bug of vLLM PR #53244).

Lifecycle of one id:

1. ``register`` (D's ``PushRegister`` arrived) and ``prefill_done`` (P's
   prefill finished; its blocks are pinned and leased) come in either order.
   The second one returns a ``Match``: the caller orders the WRITEs and
   holds the lease so it cannot expire under a WRITE.
2. ``settle`` once per P rank when its WRITE finished or failed and its
   handle was released; after the last rank the id is tombstoned ``DONE``
   or ``FAILED`` and the caller releases the lease.
3. ``abort`` (D gave up) answers D with a ``PushAbortState``: ``ABORTED``
   / ``UNKNOWN`` (no WRITE will ever be posted: the id is tombstoned
   ``ABORTED`` so a registration still on the wire is refused), ``DONE`` /
   ``FAILED`` (settled), or ``IN_FLIGHT`` (D must wait for the result).
4. ``sweep`` drops registrations whose window closed before their prefill
   finished (tombstoned ``EXPIRED``: a late prefill is freed at once).

Queueing (protocol 3): ``admit`` records that P holds the request itself
(its P leg arrived: queued or prefilling) until ``prefill_done`` /
``prefill_failed`` / ``retire``. While it does, D's ``renew`` moves the
registration's window to ``ttl`` from now, so a long P queue does not expire
a registration whose prefill is still coming. Only D's renewal moves it, so
D always knows the window it must assume if P becomes unreachable.

``PushBook.state`` names where an id stands (``PushState``): ``REGISTERED``,
``PREFILLED``, ``WRITING``, one of the ``TOMBSTONES``, or ``UNKNOWN``.

Cost: ``sweep`` runs on every P step, so it touches only what is due:
registration deadlines live in a heap with lazy deletion (an entry whose
registration matched or was aborted is skipped when it comes up; the heap
is rebuilt once such entries outnumber the live ones).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from vllm_pd_ext.wire.protocol import PushAbortState

R = TypeVar("R")


class PushState(enum.Enum):
    """Where one ``pd_request_id`` stands in the book (``PushBook.state``)."""

    #: D's registration waits for the prefill.
    REGISTERED = "registered"
    #: The prefill waits for D's registration.
    PREFILLED = "prefilled"
    #: Matched: WRITEs are ordered and not all ranks have settled.
    WRITING = "writing"
    # Tombstones: the id is finished; late messages for it are refused.
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"
    EXPIRED = "expired"
    #: Never seen, or its tombstone was evicted.
    UNKNOWN = "unknown"


#: The states an id keeps (bounded) after it left the book.
TOMBSTONES: Final = frozenset({PushState.DONE, PushState.FAILED, PushState.ABORTED,
                               PushState.EXPIRED})

#: What ``abort`` tells D about a tombstoned id (an expired registration is
#: simply aborted to D: no WRITE will come).
_ABORT_ANSWER: Final = {PushState.DONE: PushAbortState.DONE,
                        PushState.FAILED: PushAbortState.FAILED,
                        PushState.ABORTED: PushAbortState.ABORTED,
                        PushState.EXPIRED: PushAbortState.ABORTED}


class PushRefused(Exception):
    """A registration that must not be served; the message says why."""


@dataclass(frozen=True)
class Prefill:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    finished_at: float
    #: ``auth.token_digest`` of the prompt P prefilled ("": not known).
    prompt_digest: str = ""
    #: The token P sampled after the prompt (token #1); -1: none.
    first_token: int = -1


@dataclass
class _Registration(Generic[R]):
    reg: R
    received_at: float
    post_before: float
    ttl_s: float


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
        #: (post_before, seq, pd_id, registration): live while ``_regs[pd_id]``
        #: is that registration (seq breaks ties, so entries never compare R).
        self._deadlines: list[tuple[float, int, str, _Registration[R]]] = []
        self._seq = itertools.count()
        self._prefills: dict[str, Prefill] = {}
        self._writing: dict[str, _Writing] = {}
        #: pd_request_id -> one of ``TOMBSTONES``
        self._tombstones: OrderedDict[str, PushState] = OrderedDict()
        self._max_tombstones = max_tombstones
        self.num_expired_registrations = 0
        #: Requests P holds itself (queued or prefilling), by pd_request_id.
        self._admitted: set[str] = set()

    # ------------------------------------------------------------ queueing
    def admit(self, pd_id: str) -> None:
        """P's own leg of ``pd_id`` arrived (it is queued or prefilling)."""
        self._admitted.add(pd_id)

    def retire(self, pd_id: str) -> None:
        """P's leg of ``pd_id`` ended (its prefill finished or failed)."""
        self._admitted.discard(pd_id)

    def is_admitted(self, pd_id: str) -> bool:
        return pd_id in self._admitted

    def registration(self, pd_id: str) -> R | None:
        """The waiting registration of ``pd_id``, if any."""
        entry = self._regs.get(pd_id)
        return entry.reg if entry is not None else None

    def renew(self, pd_id: str) -> PushState:
        """D still waits. A ``REGISTERED`` id whose request P holds gets its
        window moved to ``ttl`` from now; returns the id's state (``REGISTERED``
        whether or not it was renewed: see ``is_admitted``)."""
        entry = self._regs.get(pd_id)
        if entry is not None and pd_id in self._admitted:
            entry.post_before = self._clock() + entry.ttl_s
            heapq.heappush(self._deadlines, (entry.post_before, next(self._seq), pd_id, entry))
        return self.state(pd_id)

    # ------------------------------------------------------------ arrivals
    def register(self, pd_id: str, reg: R, ttl_s: float, num_ranks: int) -> Match[R] | None:
        """D's registration; a ``Match`` if the prefill already finished."""
        if pd_id in self._tombstones:
            raise PushRefused(
                f"pd_request_id {pd_id!r} was already {self._tombstones[pd_id].value}")
        if pd_id in self._regs or pd_id in self._writing:
            raise PushRefused(f"pd_request_id {pd_id!r} is already registered")
        now = self._clock()
        entry = _Registration(reg, now, now + ttl_s, ttl_s)
        prefill = self._prefills.pop(pd_id, None)
        if prefill is None:
            self._regs[pd_id] = entry
            heapq.heappush(self._deadlines, (entry.post_before, next(self._seq), pd_id, entry))
            return None
        return self._match(pd_id, entry, prefill, now - prefill.finished_at, num_ranks)

    def prefill_done(self, pd_id: str, prefill: Prefill, num_ranks: int
                     ) -> Match[R] | PushState | None:
        """P's prefill finished: a ``Match``, ``None`` (wait for D), or the
        id's state when this prefill cannot be used and the caller frees its
        blocks at once: a tombstone (D gave up, or the id is finished), or
        ``PREFILLED`` / ``WRITING`` (a duplicate prefill)."""
        self._admitted.discard(pd_id)
        if pd_id in self._tombstones:
            return self._tombstones[pd_id]
        if pd_id in self._prefills:
            return PushState.PREFILLED
        if pd_id in self._writing:
            return PushState.WRITING
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
        self._admitted.discard(pd_id)
        if pd_id in self._writing or pd_id in self._prefills:
            return None
        entry = self._regs.pop(pd_id, None)
        self._tombstone(pd_id, PushState.FAILED)
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
        self._tombstone(pd_id, PushState.DONE if w.ok else PushState.FAILED)
        return w.ok

    def abort(self, pd_id: str) -> tuple[PushAbortState, Prefill | None]:
        """D gave up. Returns (the answer for D, the prefill whose lease the
        caller must release, if one was waiting)."""
        if pd_id in self._writing:
            return PushAbortState.IN_FLIGHT, None
        if pd_id in self._tombstones:
            return _ABORT_ANSWER[self._tombstones[pd_id]], None
        prefill = self._prefills.pop(pd_id, None)
        known = self._regs.pop(pd_id, None) is not None or prefill is not None
        self._tombstone(pd_id, PushState.ABORTED)
        return (PushAbortState.ABORTED if known else PushAbortState.UNKNOWN), prefill

    def forget_prefill(self, pd_id: str) -> bool:
        """The prefill's lease expired before D registered."""
        if self._prefills.pop(pd_id, None) is None:
            return False
        self._tombstone(pd_id, PushState.EXPIRED)
        return True

    def sweep(self) -> list[str]:
        """Drop registrations whose WRITE window closed unmatched, in
        deadline order. O(what is due)."""
        now = self._clock()
        gone: list[str] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            due, _, pd_id, entry = heapq.heappop(heap)
            if self._regs.get(pd_id) is not entry or entry.post_before > due:
                continue  # matched, aborted or failed since, or renewed (pushed again)
            del self._regs[pd_id]
            self._tombstone(pd_id, PushState.EXPIRED)
            gone.append(pd_id)
        if len(heap) > 2 * len(self._regs) + 64:
            self._deadlines = [(e.post_before, next(self._seq), pd_id, e)
                               for pd_id, e in self._regs.items()]
            heapq.heapify(self._deadlines)
        self.num_expired_registrations += len(gone)
        return gone

    # ------------------------------------------------------------ views
    def state(self, pd_id: str) -> PushState:
        if pd_id in self._writing:
            return PushState.WRITING
        if pd_id in self._regs:
            return PushState.REGISTERED
        if pd_id in self._prefills:
            return PushState.PREFILLED
        return self._tombstones.get(pd_id, PushState.UNKNOWN)

    def counts(self) -> dict[str, int]:
        """Live ids per state, keyed by the state's value."""
        return {PushState.REGISTERED.value: len(self._regs),
                PushState.PREFILLED.value: len(self._prefills),
                PushState.WRITING.value: len(self._writing)}

    @property
    def num_admitted(self) -> int:
        return len(self._admitted)

    def _tombstone(self, pd_id: str, state: PushState) -> None:
        assert state in TOMBSTONES, state
        self._tombstones[pd_id] = state
        self._tombstones.move_to_end(pd_id)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
