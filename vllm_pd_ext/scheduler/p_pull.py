"""P's scheduler half in pull mode: lend a finished prefill's blocks to D.

Runs on P's scheduler thread (EngineCore process). The dispatcher calls
``lend`` from ``request_finished`` of a ``do_remote_decode`` prefill that
ended normally: the prompt's blocks are pinned under a lease keyed by P's
own request id (what D learns as ``remote_request_id``), for every D rank
to read (``tp_size`` consumers). D's workers then pin, READ and release it
over the side channel (``leases.service``); the sweep frees the blocks.

Concurrent pull (issue 29, protocol 9): the proxy sends D's leg beside
P's, so D does not know P's blocks yet. Both legs carry the proxy's
``pd_request_id``, which keys the lease instead. D parks its request and
sends ``PullWait``; the side-channel thread files it in ``_waits``
(``handle``). When the prefill ends, ``announce`` (scheduler thread, right
after the lease exists) sends D ``PullReady`` with P's answer and token #1
through an outbox, so neither thread waits on D; ``prefill_failed`` sends
the failure. Whichever of wait and prefill end comes second sends it,
right after extending the lease a whole duration (protocol 10: the answer
says how long, and which of D's waits P had, so D reads without a pin
round trip; ``_with_lease``). D's
``PullWaitCancel``, or D's answer that no request of its waits
(``unknown``), ends the lease early: D then never reads it, and only D
reads it. Waits, answers and tombstones are bounded and expire.

Both modes' P halves implement ``p_handover.PMode``; push mode's
(``p_push.PushProducer``) keys its leases by the proxy's ``pd_request_id``
and starts P's WRITEs once D registered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from vllm_pd_ext.leases.lender import BlockLender
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.wire.protocol import ErrorCode, KVTransferParams
from vllm_pd_ext.wire.side_channel import SideChannelError

logger = get_logger(__name__)

Endpoint = tuple[str, int]
_V = TypeVar("_V")

#: Waits, answers and tombstones kept at most, each (oldest dropped first).
MAX_ENTRIES = 65536
#: How long a failure answer (and a cancelled id) is remembered, s.
REMEMBER_S = 60.0
#: How often the sweep looks for expired entries, s.
EXPIRE_EVERY_S = 1.0


@dataclass
class _Wait:
    """D's parked request for one ``pd_request_id``."""

    engine_id: str
    request_id: str
    endpoint: Endpoint
    expires: float
    #: The latest ``PullWait.seq`` received (0: D named none).
    seq: int = 0


@dataclass
class _Ready:
    """The answer for one ``pd_request_id`` (sent, or waiting for D's wait)."""

    msg: proto.PullReady
    forget_at: float
    #: The D engine it went to: only that one may ask again or cancel.
    sent_to: str = ""


class PullProducer:
    """P's half of pull mode: D reads, so P only lends (and, for a concurrent
    pull, tells the waiting D when the prefill ended)."""

    def __init__(self, lender: BlockLender, tp_size: int, engine_id: str = "",
                 notify_timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 auth: FrameAuth | None = None, outbox: Outbox | None = None) -> None:
        self.lender = lender
        self.tp_size = tp_size
        self.engine_id = engine_id
        self._clock = clock
        self._lock = threading.Lock()
        self._waits: dict[str, _Wait] = {}
        self._ready: dict[str, _Ready] = {}
        self._cancelled: dict[str, float] = {}
        #: P legs with a ``pd_request_id`` P holds (arrived, not finished).
        self._held: set[str] = set()
        #: Leases D will never read (cancelled, or unknown to D): evicted
        #: by the scheduler thread's sweep (the lender is that thread's).
        self._evict: list[str] = []
        self._next_expire = 0.0
        self._notify_timeout_s = notify_timeout_s
        self._auth = auth
        self._outbox: Outbox | None = outbox
        self.num_ready_sent = 0
        self.num_cancelled = 0

    # ---------------------------------------------------------- scheduler
    def lease_key(self, request_id: str, params: KVTransferParams) -> str:
        # A concurrent pull's legs both carry the proxy's id; D cannot know P's.
        return params.pd_request_id or request_id

    def admit(self, key: str) -> None:
        with self._lock:
            self._held.add(key)

    def retire(self, key: str) -> None:
        with self._lock:
            self._held.discard(key)

    def prefill_failed(self, key: str, request_id: str, status: str) -> None:
        if key == request_id:
            return  # a sequential pull: D learns at its pin (the lease is unknown)
        self._answer(key, proto.PullReady(
            engine_id=self.engine_id, pd_request_id=key, ok=False,
            detail=f"P's prefill ended without KV to hand over ({status})"[:1024]),
            self._clock() + REMEMBER_S)

    def lend(self, key: str, request_id: str, block_ids: list[int], num_tokens: int,
             prompt_digest: str, first_token: int = -1) -> float:
        # Every D rank reads its share; the lease ends when all released.
        return self.lender.lend(key, block_ids, num_consumers=self.tp_size)

    def announce(self, key: str, request_id: str, params: KVTransferParams, first_token: int,
                 expiry: float) -> None:
        """The lease ``key`` exists and ``params`` name it: a concurrent
        pull's D (waiting now or later) gets them with token #1."""
        if key == request_id:
            return  # a sequential pull: the proxy forwards P's answer
        with self._lock:
            # (kept until it expires: a wait arriving later is refused)
            cancelled = key in self._cancelled
        if cancelled:
            # D's request ended before P's prefill did: nobody will read.
            logger.info("PDConnector: prefill %s done, but its decode request was cancelled; "
                        "lease %s freed", request_id, key)
            self.lender.evict(key)
            return
        self._answer(key, proto.PullReady(
            engine_id=self.engine_id, pd_request_id=key, ok=True, params=params,
            first_token=first_token), expiry)

    def sweep(self) -> None:
        now = self._clock()
        with self._lock:
            evict, self._evict = self._evict, []
            expire = now >= self._next_expire
            if expire:
                self._next_expire = now + EXPIRE_EVERY_S
                for key in [k for k, w in self._waits.items() if w.expires <= now]:
                    del self._waits[key]
                for key in [k for k, r in self._ready.items() if r.forget_at <= now]:
                    del self._ready[key]
                for key in [k for k, t in self._cancelled.items() if t <= now]:
                    del self._cancelled[key]
        for key in evict:
            if self.lender.evict(key):
                self.num_cancelled += 1

    def forget_expired(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._ready.pop(key, None)

    # ---------------------------------------------------------- side channel
    def handle(self, msg: proto.Request) -> proto.Reply:
        """Side-channel thread: D's ``PullWait`` and ``PullWaitCancel``."""
        if isinstance(msg, proto.PullWait):
            return self._wait(msg)
        if isinstance(msg, proto.PullWaitCancel):
            return self._cancel(msg)
        return proto.ErrorReply(ErrorCode.NOT_CONSUMER, f"engine {self.engine_id} is a pull "
                                "producer; it takes no pull answers")

    def _wait(self, msg: proto.PullWait) -> proto.Reply:
        if msg.expect_engine_id != self.engine_id:
            return proto.ErrorReply(
                ErrorCode.STALE, f"this is engine {self.engine_id}, not {msg.expect_engine_id} "
                "(P restarted?)")
        key = msg.pd_request_id
        now = self._clock()
        endpoint = (msg.notify_host, msg.notify_port)
        with self._lock:
            ready = self._ready.get(key)
            other = self._waits.get(key)
            owner = ready.sent_to if ready is not None else other.engine_id if other else ""
            if owner and owner != msg.engine_id:
                return proto.ErrorReply(ErrorCode.REFUSED, f"pull {key} is awaited by another "
                                        "engine")
            if key in self._cancelled:
                return proto.ErrorReply(ErrorCode.REFUSED, f"pull {key} was cancelled")
            if ready is None:
                if other is None and len(self._waits) >= MAX_ENTRIES:
                    return proto.ErrorReply(ErrorCode.REFUSED, f"engine {self.engine_id} holds "
                                            f"{MAX_ENTRIES} pull waits already")
                self._waits[key] = _Wait(msg.engine_id, msg.request_id, endpoint,
                                         now + msg.ttl_s, max(msg.seq, other.seq if other
                                                              else 0))
                state = (proto.PullWaitState.QUEUED if key in self._held
                         else proto.PullWaitState.WAITING)
                return proto.PullWaiting(engine_id=self.engine_id, state=state)
            ready.sent_to = msg.engine_id
        # Again (a renewal crossed it, or it was lost): D takes it once.
        self._send(endpoint, self._with_lease(ready.msg, msg.seq, msg.engine_id,
                                              msg.request_id))
        return proto.PullWaiting(engine_id=self.engine_id, state=proto.PullWaitState.READY)

    def _cancel(self, msg: proto.PullWaitCancel) -> proto.Reply:
        key = msg.pd_request_id
        with self._lock:
            wait, ready = self._waits.get(key), self._ready.get(key)
            owner = ready.sent_to if ready is not None else wait.engine_id if wait else ""
            if owner and owner != msg.engine_id:
                return proto.ErrorReply(ErrorCode.REFUSED, f"pull {key} is awaited by another "
                                        "engine")
            self._waits.pop(key, None)
            if ready is not None:
                del self._ready[key]
                if ready.msg.ok:
                    self._evict.append(key)
            else:
                self._cancelled[key] = self._clock() + REMEMBER_S
                _trim(self._cancelled)
        logger.info("PDConnector: pull %s cancelled by engine %s: %s", key, msg.engine_id,
                    msg.reason)
        return proto.Ack()

    # ---------------------------------------------------------- internals
    def _answer(self, key: str, msg: proto.PullReady, forget_at: float) -> None:
        with self._lock:
            wait = self._waits.pop(key, None)
            ready = self._ready[key] = _Ready(msg, forget_at)
            _trim(self._ready)
            if wait is not None:
                ready.sent_to = wait.engine_id
        if wait is not None:
            self._send(wait.endpoint, self._with_lease(msg, wait.seq, wait.engine_id,
                                                       wait.request_id))

    def _with_lease(self, msg: proto.PullReady, seq: int, engine_id: str, request_id: str
                    ) -> proto.PullReady:
        """``msg`` as sent now: with the lease extended to a whole duration
        from now and held for D's request (as D's pin would), after D's
        ``PullWait`` number ``seq`` arrived, and how long it lasts, so D
        reads without pinning (its own send time of ``seq`` bounds this
        moment from below on its clock). Unchanged when D named no ``seq``
        or the lease is gone (D's pin then says so)."""
        if not msg.ok or seq <= 0:
            return msg
        left = self.lender.leases.extend(msg.pd_request_id, engine_id, request_id)
        if left <= 0:
            return msg
        return msgspec.structs.replace(msg, lease_s=min(left, proto.MAX_TTL_S), wait_seq=seq)

    def _send(self, endpoint: Endpoint, msg: proto.PullReady) -> None:
        with self._lock:
            if self._outbox is None:
                # Only a concurrent pull needs one (two threads may get here).
                self._outbox = Outbox(self._notify_timeout_s, name="pd-pull-ready",
                                      auth=self._auth)
            outbox = self._outbox
            self.num_ready_sent += 1
        key = msg.pd_request_id
        outbox.send(endpoint[0], endpoint[1], msg,
                    lambda reply: self._on_reply(key, msg.ok, reply))

    def _on_reply(self, key: str, ok: bool, reply: proto.Reply | SideChannelError) -> None:
        """Outbox thread: D's answer to ``PullReady``. A definite "nobody
        waits" frees the lease now (D will never read it); no answer keeps
        it until it expires (D may have it)."""
        code = reply.code if isinstance(reply, SideChannelError | proto.ErrorReply) else ""
        if not code:
            return
        logger.warning("PDConnector: pull %s: D answered %s", key, reply)
        if ok and code in (ErrorCode.UNKNOWN, ErrorCode.REFUSED):
            with self._lock:
                self._ready.pop(key, None)
                self._evict.append(key)

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.close()


def _trim(entries: dict[str, _V]) -> None:
    """Drop the oldest entries beyond ``MAX_ENTRIES`` (dicts keep insertion order)."""
    while len(entries) > MAX_ENTRIES:
        del entries[next(iter(entries))]
