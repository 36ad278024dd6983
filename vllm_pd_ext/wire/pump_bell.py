"""The transfer target's NIXL progress pump: fast while a peer works with
us, slow otherwise, and woken by the scheduler half the moment one starts.

Why: the target of a transfer (P in pull mode, D in push mode, both in
multi-turn) must progress its NIXL agent for UCX's wire-up with a new peer,
over TCP for every READ, and in push to collect P's notifications
(``transport/nixl.py``). A Python thread that wakes every millisecond costs
about 4% of a core per worker even when nothing moves (a timed wake-up is
~40 us of CPU here), on every rank of every idle engine; on our 2-core CI
machines a dozen such engines took a tenth of the CPU.

What: ``PumpPace`` runs the pump at ``fast_s`` (``nixl_progress_interval_ms``)
for ``linger_s`` after any sign of work and at ``idle_s`` otherwise. Signs
of work are a ring of the worker's ``Bell`` and notifications the pump
collected. The scheduler half rings (``BellRinger``) when its side channel
answers a peer (handshake, lease pin or renewal, push registration: a READ
or WRITE follows) and on every step while D waits for pushed KV. A ring
wakes an idle pump at once, so the first transfer after an idle spell
waits for no pump period; without rings (a ring lost, UCX reconnecting on
its own) the pump still progresses every ``idle_s``.

Lifecycle: the worker creates its ``Bell`` in ``register_kv_caches`` (only
where it runs a pump), publishes ``Bell.endpoint`` in its handshake
metadata and hands the bell to the pump, whose thread closes it. The
scheduler creates one ``BellRinger`` for all ranks in
``set_xfer_handshake_metadata`` and closes it at shutdown.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

import zmq

from vllm_pd_ext.wire.zmq_context import GcSafeContext

#: The pump's period while nothing moves (about 0.2% of a core).
IDLE_INTERVAL_S = 0.02
#: How long the pump stays fast after the last sign of work; D renews its
#: pins and registrations more often than this while a transfer lasts.
LINGER_S = 10.0
#: A ringer sends at most one ring per this period: a ring makes the pump
#: fast for ``LINGER_S``, so more would change nothing.
RING_EVERY_S = 1.0
#: A pump that knows when work is pending (``pending``: a push D's expected
#: WRITEs) lingers only one idle period after the last sign of work: each
#: timed wake-up of the pump's thread preempts the step on the worker's
#: core and takes the GIL. On CPU, D's decode step took 6.4 ms with the pump
#: at 1 ms through the 10 s linger, 4.7 ms at 20 ms (tiny model, 300 tokens;
#: docs/slo.md, "The gap, fifth step").
PENDING_LINGER_S = 0.02


class PumpPace:
    """When the pump should next run; pure (one thread, injected clock)."""

    def __init__(self, fast_s: float, idle_s: float | None = None,
                 linger_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 pending: Callable[[], bool] | None = None) -> None:
        self.fast_s = fast_s
        self.idle_s = max(IDLE_INTERVAL_S if idle_s is None else idle_s, fast_s)
        #: ``pending`` (read on the pump's thread: it must be cheap and
        #: thread-safe) keeps the pump fast while it is true; then the
        #: linger after other signs of work is ``PENDING_LINGER_S``.
        self._pending = pending
        default_linger = LINGER_S if pending is None else PENDING_LINGER_S
        self.linger_s = default_linger if linger_s is None else linger_s
        self._clock = clock
        # Fast from the start: the engine's first peer usually comes at once.
        self._fast_until = clock() + self.linger_s

    def hurry(self) -> None:
        self._fast_until = max(self._fast_until, self._clock() + self.linger_s)

    @property
    def fast(self) -> bool:
        return self._clock() < self._fast_until

    def interval(self) -> float:
        if self.fast or (self._pending is not None and self._pending()):
            return self.fast_s
        return self.idle_s


class Bell:
    """Worker side: the pump waits on it (one thread: the pump's)."""

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = GcSafeContext()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        # A ring is one byte; bound what anything else may make us buffer
        # (not below ZMTP's own handshake, which the limit also counts).
        self._pull.setsockopt(zmq.MAXMSGSIZE, 1024)
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        # ``poke``: this process's own ring, through a pipe (any thread may
        # write one; no zmq socket is shared between threads).
        self._poke_r, self._poke_w = os.pipe()
        os.set_blocking(self._poke_r, False)
        os.set_blocking(self._poke_w, False)
        self._poke_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._poke_r, zmq.POLLIN)
        self.num_rings = 0

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True if rung or poked (queued ones drained)."""
        events = dict(self._poller.poll(max(1, round(timeout_s * 1e3))))
        if self._pull in events:
            while True:
                try:
                    self._pull.recv(zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
        if self._poke_r in events:
            with contextlib.suppress(OSError):
                os.read(self._poke_r, 4096)
        rung = bool(events)
        self.num_rings += rung
        return rung

    def poke(self) -> None:
        """Ring from this process (the worker, when it starts expecting a
        WRITE): the pump wakes now, as on a ring. Any thread; after
        ``close``, nothing."""
        with self._poke_lock:
            if self._poke_w < 0:
                return
            # A full pipe: a poke is already waiting.
            with contextlib.suppress(BlockingIOError):
                os.write(self._poke_w, b"p")

    def close(self) -> None:
        self._pull.close()
        self._ctx.term()
        with self._poke_lock:
            if self._poke_w >= 0:  # idempotent
                os.close(self._poke_r)
                os.close(self._poke_w)
                self._poke_r = self._poke_w = -1


class BellRinger:
    """Scheduler side: ring every rank's bell (from any thread)."""

    def __init__(self, endpoints: list[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ctx: zmq.Context[zmq.Socket[bytes]] = GcSafeContext()
        # One socket per rank: PUSH would round-robin one socket's rings.
        self._socks: list[zmq.Socket[bytes]] = []
        for ep in endpoints:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            # One queued ring is as good as many.
            sock.setsockopt(zmq.SNDHWM, 1)
            sock.connect(ep)
            self._socks.append(sock)
        self._lock = threading.Lock()
        self._last = -1e9
        self.num_rings = 0

    def ring(self, *_: object) -> None:
        now = self._clock()
        with self._lock:
            if now - self._last < RING_EVERY_S:
                return
            self._last = now
            for sock in self._socks:
                # A full queue: a ring is already waiting there.
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(b"r", zmq.NOBLOCK)
            self.num_rings += 1

    def close(self) -> None:
        with self._lock:
            for sock in self._socks:
                sock.close()
            self._socks = []
            self._ctx.term()
