"""D in push mode: sleep through engine steps that have nothing to do.

Why: vLLM steps an engine back to back while any request waits for remote
KV. Each such step schedules nothing, sends an RPC to the worker, and sleeps
1 ms; both sides of that RPC busy-wait (``sched_yield``) on vLLM's shared
memory queue. In push mode D holds every request for P's whole queueing and
prefill, so under concurrency D's EngineCore process burns a large share of
a core on empty steps. Where that process is not confined to D's own cores
it takes the CPU from P's prefill, P's queue grows, D waits longer still: a
loop that collapsed push throughput (issue 10; measured in
``docs/push-mode.md``).

What: on a step that schedules nothing while D only waits for pushed KV,
the scheduler half blocks in ``IdleWait.wait`` for at most
``push_idle_wait_ms``. It wakes at once when

- D's worker saw a push notification (``Waker``, called from the worker's
  NIXL progress pump, sends one byte over a local ZMQ PUSH socket whose
  address the worker publishes in its handshake metadata), or
- P's answer or failure notice reached D's scheduler half (``wake`` from the
  side-channel and outbox threads, over an in-process socket).

A request that arrives during the wait is scheduled at most
``push_idle_wait_ms`` later; a step with any work never waits
(``should_wait``).

The worker's wake carries the notifications it woke for (its rank, then
each one's bytes), so the scheduler can see a push land without the step
that would collect it (``scheduler/d_landing.py``). That copy is a hint:
a forwarded message lost to a full queue, or a notification the worker's
step thread took first, only leaves the request to the worker's own report.

Lifecycle: the worker creates its ``Waker`` in ``register_kv_caches``; the
scheduler creates one ``IdleWait``, connects it to every rank's waker in
``set_xfer_handshake_metadata``, waits before ``schedule()`` or from
``build_connector_meta``, takes what was forwarded (``take_forwarded``),
and closes it at shutdown.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.wire.zmq_context import GcSafeContext

logger = get_logger(__name__)

_ids = itertools.count()

#: Notifications forwarded per wake (a pump round rarely keeps more).
MAX_FORWARDED = 64
#: A longer message is no WRITE notification of ours (``pdx:<tag>/<id>``).
MAX_FORWARDED_BYTES = 512
#: Wakes queued between the worker and the scheduler before new ones drop.
WAKE_HWM = 256
#: Forwarded (rank, notifications) kept until the scheduler takes them.
MAX_INBOX = 4096


def should_wait(scheduled_tokens: int, num_push_waits: int, has_work_for_worker: bool,
                num_finished: int) -> bool:
    """A step may sleep only when it schedules nothing, D waits for pushed
    KV, and nothing must reach the worker now (new specs or failures to
    report, finished requests to free)."""
    return (scheduled_tokens == 0 and num_push_waits > 0 and not has_work_for_worker
            and num_finished == 0)


class Waker:
    """Worker side: wake the scheduler's ``IdleWait`` with the notifications
    rank ``rank`` kept (one thread calls ``wake``)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._ctx: zmq.Context[zmq.Socket[bytes]] = GcSafeContext()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Each wake carries its notifications; past this a wake is dropped,
        # which only leaves those pushes to the worker's own report.
        self._sock.setsockopt(zmq.SNDHWM, WAKE_HWM)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.num_wakes = 0

    def wake(self, notifs: Sequence[bytes] = ()) -> None:
        frames = [b"w", str(self.rank).encode()]
        frames += [n for n in notifs[:MAX_FORWARDED] if len(n) <= MAX_FORWARDED_BYTES]
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
            self.num_wakes += 1
        except zmq.ZMQError:  # the queue is full, or no scheduler yet
            pass

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


class IdleWait:
    """Scheduler side: block an empty step until a wake or ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = GcSafeContext()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        inproc = f"inproc://pd-idle-wait-{next(_ids)}"
        self._pull.bind(inproc)
        self._local = self._ctx.socket(zmq.PUSH)
        self._local.setsockopt(zmq.LINGER, 0)
        self._local.setsockopt(zmq.SNDHWM, 1)
        self._local.connect(inproc)
        # ZMQ sockets are single-threaded; several threads call ``wake``.
        self._local_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self.num_waits = 0
        self.num_woken = 0
        self.seconds_waited = 0.0
        #: (worker rank, notifications) forwarded by the workers' wakes, kept
        #: only for a scheduler that reads them (``keep_forwarded``).
        self._inbox: list[tuple[int, list[bytes]]] = []
        self.keep_forwarded = False

    def connect(self, endpoints: list[str]) -> None:
        for ep in endpoints:
            self._pull.connect(ep)

    def wake(self, *_: Any) -> None:
        """From any thread of this process."""
        # A full queue means a wake is already pending: as good as ours.
        with self._local_lock, contextlib.suppress(zmq.ZMQError):
            self._local.send(b"w", zmq.NOBLOCK)

    def wait(self) -> bool:
        """Block up to ``timeout_s``; True if woken. Drains queued wakes, so a
        wake that came while D was stepping ends the next wait at once."""
        t0 = time.monotonic()
        woken = bool(self._poller.poll(max(1, round(self.timeout_s * 1e3))))
        self.drain()
        self.num_waits += 1
        self.num_woken += woken
        self.seconds_waited += time.monotonic() - t0
        return woken

    def drain(self) -> None:
        """Take the queued wakes without blocking, keeping what they forwarded."""
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            if (not self.keep_forwarded or len(frames) < 3 or not frames[1].isdigit()
                    or len(frames[1]) > 4):
                continue  # nobody reads them, a local wake, or one that forwarded nothing
            self._inbox.append((int(frames[1]), frames[2:2 + MAX_FORWARDED]))
            if len(self._inbox) > MAX_INBOX:
                # Not taken for a while: the oldest go, as hints may.
                del self._inbox[:len(self._inbox) - MAX_INBOX]

    def take_forwarded(self) -> list[tuple[int, list[bytes]]]:
        """The workers' forwarded notifications since the last call, oldest first."""
        out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        self._local.close()
        self._pull.close()
        self._ctx.term()
