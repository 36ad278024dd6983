"""Back-pressure for prefill legs: a per-engine in-flight cap and one FIFO queue.

Role: without a cap the proxy sends every request to a prefill engine (P) at
once; under overload P's own queue grows without bound and, in push mode, the
decode engines (D) hold KV blocks for every request P has not reached yet.
:class:`PrefillGate` lets at most ``--max-inflight-per-prefill`` P legs run on
each prefill engine and queues the rest, so P's queue stays short, D holds
blocks only for admitted requests, and overload past ``--max-queued`` or
``--queue-timeout`` becomes a fast 503 with ``Retry-After``.

``create_app`` builds one gate over the prefill pool; the health monitor calls
:meth:`PrefillGate.wake` when a backend's state changes. The
:class:`~vllm_pd_proxy.upstream.Upstream` calls :meth:`PrefillGate.acquire`
before every P leg (pull: each attempt, retries included; push: before the
identity probe, so before either leg is sent) and releases the returned
:class:`PrefillSlot` once that leg's response has ended. Requests prefilled
locally by D never pass through it.

Lifecycle of one :meth:`~PrefillGate.acquire`:

1. A usable engine has room: the routing policy chooses among the usable
   engines with room and the slot is held at once. No usable engine at all:
   None (the caller answers 503 ``no_backend``, as without a cap).
2. Every usable engine is full: the request joins the queue, or gets 503
   ``queue_full`` at once when ``--max-queued`` requests already wait.
3. Queued, it sleeps on its own future. :meth:`~PrefillGate._dispatch` runs
   whenever a slot frees or a backend's health changes and hands free slots
   to the waiters in arrival order. A waiter that can use none of the free
   engines (a retry excluding the engine that failed it) does not hold up
   those behind it; a waiter with no usable engine left is answered None.
4. It leaves with a slot, with None, with 503 ``queue_timeout`` once its
   share of ``--queue-timeout`` is spent, or cancelled (client disconnect).
   A slot granted in the same instant as the timeout is kept; one granted as
   the client left is passed on to the next waiter.
5. The slot counts against its engine until :meth:`PrefillSlot.release`
   (idempotent), however the leg ended.

Invariant, kept by running the dispatch after every such event: no waiter
could use a free slot. So a new request that finds a free slot it can use
takes it without overtaking anyone.

Everything runs on the event loop thread: plain ints and dicts, no locks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import errors
from .backends import Backend, Pool
from .metrics import Metrics

# Weight of the newest hold time in the running mean behind Retry-After.
_HOLD_WEIGHT = 0.2


@dataclass(eq=False, slots=True)
class _Waiter:
    tokens: int
    exclude: frozenset[Backend]
    future: asyncio.Future[Backend | None]


class PrefillSlot:
    """One admitted P leg's place on ``backend``; give it back with :meth:`release`."""

    __slots__ = ("_gate", "_since", "backend")

    def __init__(self, gate: PrefillGate, backend: Backend, since: float) -> None:
        self._gate: PrefillGate | None = gate
        self._since = since
        self.backend = backend

    def release(self) -> None:
        """Free the slot (the head of the queue may get it at once); idempotent."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate._free(self.backend, gate.now() - self._since)


class PrefillGate:
    """Slots of P legs per prefill engine, and the queue of requests waiting for one."""

    def __init__(
        self,
        pool: Pool,
        max_inflight: int,
        max_queued: int,
        queue_timeout: float,
        metrics: Metrics,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._cap = max_inflight  # 0: no cap, nothing ever queues
        self._max_queued = max_queued
        self._timeout = queue_timeout
        self._metrics = metrics
        self.now = now
        self._held: dict[Backend, int] = {b: 0 for b in pool.backends}
        # Insertion-ordered: the FIFO, with O(1) removal of a waiter that leaves.
        self._waiters: dict[_Waiter, None] = {}
        # Running mean of how long a slot is held, for the Retry-After estimate.
        self._mean_hold = 1.0

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

    def held(self, backend: Backend) -> int:
        """Slots of ``backend`` in use now."""
        return self._held[backend]

    def has_room(self, backend: Backend) -> bool:
        return not self._cap or self._held[backend] < self._cap

    async def acquire(
        self, tokens: int, exclude: Iterable[Backend] = (), queued_s: float = 0.0
    ) -> PrefillSlot | None:
        """A slot on a usable prefill engine not in ``exclude``; waits while all are full.

        ``queued_s`` is the time the request already spent queued on earlier
        attempts: all its waits together stay within ``--queue-timeout``.
        Returns None when no engine is usable at all; raises a 503
        :class:`~vllm_pd_proxy.errors.ProxyError` (``queue_full``,
        ``queue_timeout``) when the request cannot be admitted.
        """
        excluded = frozenset(exclude)
        usable = self._pool.usable(excluded)
        if not usable:
            return None
        free = [b for b in usable if self.has_room(b)]
        if free:  # no waiter can use these (invariant), so nobody is overtaken
            backend = self._pool.choose(free, tokens)
            self._held[backend] += 1
            return PrefillSlot(self, backend, self.now())
        if len(self._waiters) >= self._max_queued:
            raise errors.queue_rejected(
                errors.Outcome.QUEUE_FULL,
                f"{self._at_cap(len(usable))} and the queue is full "
                f"(--max-queued {self._max_queued})",
                self._retry_after(len(usable)),
            )
        budget = self._timeout - queued_s
        if budget <= 0:
            raise self._timed_out(len(usable), queued_s)
        waiter = _Waiter(tokens, excluded, asyncio.get_running_loop().create_future())
        self._waiters[waiter] = None
        self._metrics.queue_depth.set(len(self._waiters))
        started = self.now()
        try:
            async with asyncio.timeout(budget):
                granted = await waiter.future
        except TimeoutError:
            if not _is_resolved(waiter):
                waited = queued_s + self.now() - started
                raise self._timed_out(len(self._pool.usable(excluded)), waited) from None
            granted = waiter.future.result()  # resolved as the timer fired: keep it
        except BaseException:
            # Cancelled (the client went away): pass on a slot granted meanwhile.
            if _is_resolved(waiter) and (lost := waiter.future.result()) is not None:
                self._free(lost, None)
            raise
        finally:
            self._waiters.pop(waiter, None)
            self._metrics.queue_depth.set(len(self._waiters))
            self._metrics.queue_wait.observe(self.now() - started)
        return None if granted is None else PrefillSlot(self, granted, self.now())

    def wake(self) -> None:
        """A backend's health changed: free slots or failed waiters may follow."""
        self._dispatch()

    # -- internals -----------------------------------------------------------

    def _free(self, backend: Backend, held_s: float | None) -> None:
        self._held[backend] -= 1
        assert self._held[backend] >= 0, f"slot of {backend.url} released twice"
        if held_s is not None:
            self._mean_hold += _HOLD_WEIGHT * (held_s - self._mean_hold)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to the waiters, oldest first, until none can be used."""
        while self._waiters:
            grant = self._next_grant()
            if grant is None:
                return
            waiter, backend = grant
            if backend is not None:
                self._held[backend] += 1
            del self._waiters[waiter]
            self._metrics.queue_depth.set(len(self._waiters))
            waiter.future.set_result(backend)

    def _next_grant(self) -> tuple[_Waiter, Backend | None] | None:
        """The oldest waiter that can be answered now, and its answer."""
        for waiter in self._waiters:
            if waiter.future.done():
                continue  # cancelled; its own task removes it
            usable = self._pool.usable(waiter.exclude)
            if not usable:
                return waiter, None
            free = [b for b in usable if self.has_room(b)]
            if free:
                return waiter, self._pool.choose(free, waiter.tokens)
            if not any(self.has_room(b) for b in self._pool.usable()):
                return None  # nothing free anywhere: no need to look further back
        return None

    def _at_cap(self, num_usable: int) -> str:
        return f"all {num_usable} prefill engines are at --max-inflight-per-prefill={self._cap}"

    def _timed_out(self, num_usable: int, waited: float) -> errors.ProxyError:
        return errors.queue_rejected(
            errors.Outcome.QUEUE_TIMEOUT,
            f"{self._at_cap(num_usable)}; waited {waited:.1f} s in the queue "
            f"(--queue-timeout {self._timeout:g})",
            self._retry_after(num_usable),
        )

    def _retry_after(self, num_usable: int) -> int:
        """Seconds until the queue ahead has likely drained, in [1, --queue-timeout]."""
        capacity = max(1, num_usable * self._cap)
        seconds = math.ceil((len(self._waiters) + 1) * self._mean_hold / capacity)
        return min(max(1, seconds), max(1, math.ceil(self._timeout)))


def _is_resolved(waiter: _Waiter) -> bool:
    """Whether the dispatch answered ``waiter`` (a slot or None)."""
    return waiter.future.done() and not waiter.future.cancelled()
