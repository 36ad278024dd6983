"""D, concurrent pull: park a request until P says its prefill ended.

Runs in D's EngineCore process. The proxy sends D's leg beside P's
(``KVTransferParams.is_pull_wait``: ``pd_seed_pending``, no blocks), so D
allocates nothing yet: ``park`` (scheduler thread, at arrival) asks P with
``PullWait`` to send its answer here. P's ``PullReady`` arrives on the
side-channel thread (``handle``) and lands in a mailbox under a lock;
``take`` (scheduler thread, from ``get_num_new_matched_tokens``, so the
step that sees it already allocates and starts the READ) returns it, and
the request continues as a sequential pull leg with P's params, plus token
#1. ``poll`` (every step while any request is parked) renews the wait and
fails one whose deadline passed; ``cancel`` tells P a parked request ended.

Deadlines as push's registration (``d_push``): ``wait_timeout_s`` bounds a P
that never confirms it holds the request; once P answers ``queued`` the
wait may last up to ``queue_timeout_s`` from arrival, ``wait_timeout_s`` at
a time. D renews every quarter of it; P keeps a wait ``ttl`` from each.

What this costs beyond the bytes: P's message (one side-channel hop), D's
scheduler noticing it (its next ``schedule()``), the allocation, the
crossing to the worker, the READ and its report. No pin: P extended the
lease as it answered, after it had a ``PullWait`` whose send time D knows
(``seq``), so D knows on its own clock how long the blocks stay P's
(``Parked.valid_until``, then ``RecvSpec.valid_until``). D's API server, its input
queue and the request's arrival overlap P's prefill.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.wire.protocol import ErrorCode, KVTransferParams
from vllm_pd_ext.wire.side_channel import SideChannelError

logger = get_logger(__name__)

Endpoint = tuple[str, int]

#: Send times kept per wait: P names the latest wait it had, and D renews
#: every quarter of ``push_timeout``, so older ones are never named.
MAX_SENT_KEPT = 16


@dataclass
class Parked:
    """One parked request (scheduler thread only)."""

    request_id: str
    pd_request_id: str
    endpoint: Endpoint
    expect_engine_id: str
    arrived: float
    deadline: float
    renew_at: float
    #: A ``PullWait`` is out and unanswered (never two at once).
    renewing: bool = True
    #: P confirmed it holds the request (queued or prefilling).
    queued: bool = False
    #: P's answer, once it came (``ok`` or not).
    ready: proto.PullReady | None = None
    #: When P's answer reached this engine (monotonic).
    ready_at: float = 0.0
    #: Why the wait failed ("" while it has not).
    failed: str = ""
    #: ``PullWait``s sent so far; seq -> when (the latest ``MAX_SENT_KEPT``).
    seq: int = 0
    sent: dict[int, float] = field(default_factory=dict)
    #: Until when (this engine's clock) P's answer guarantees the blocks:
    #: the send time of the ``PullWait`` it names + its ``lease_s``; 0:
    #: not known (the worker pins).
    valid_until: float = 0.0


@dataclass(frozen=True)
class _Event:
    request_id: str
    #: ``PullWaiting`` (P's answer to a wait), ``PullReady``, or why the wait
    #: could not be sent / was refused (``str``; ``definite``: P said no).
    what: proto.PullWaiting | proto.PullReady | str
    at: float
    definite: bool = False


class PullWaits:
    def __init__(self, engine_id: str, host: str, port: int, wait_timeout_s: float,
                 queue_timeout_s: float, side_channel_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 auth: FrameAuth | None = None, outbox: Outbox | None = None) -> None:
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.wait_timeout_s = wait_timeout_s
        self.queue_timeout_s = max(queue_timeout_s, wait_timeout_s)
        self.side_channel_timeout_s = side_channel_timeout_s
        #: Called after another thread queued an event (wakes an idle D).
        self.on_event: Callable[[], None] | None = None
        self._clock = clock
        self._outbox = outbox or Outbox(side_channel_timeout_s, name="pd-pull-wait", auth=auth)
        self._parked: dict[str, Parked] = {}
        self._lock = threading.Lock()
        #: pd_request_id -> (D's request id, the P engine asked): until the
        #: request's load was reported or it ended (a late duplicate of
        #: ``PullReady`` is then acknowledged, not answered ``unknown``,
        #: which would make P end a lease D may be reading).
        self._by_pd: dict[str, tuple[str, str]] = {}
        self._pd_of: dict[str, str] = {}
        self._events: list[_Event] = []
        #: ``PullReady`` refused: not from the P this engine asked.
        self.num_wrong_sender = 0

    def __contains__(self, rid: object) -> bool:
        return rid in self._parked

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def has_news(self) -> bool:
        """Another thread queued an event not applied yet (a racy read)."""
        return bool(self._events)

    # ------------------------------------------------------------ scheduler
    def park(self, rid: str, params: KVTransferParams) -> None:
        """A concurrent pull leg arrived: ask P to tell us when it is ready."""
        now = self._clock()
        pd_id = str(params.pd_request_id)
        endpoint = (str(params.remote_host), int(params.remote_port or 0))
        wait = Parked(rid, pd_id, endpoint, str(params.remote_engine_id), arrived=now,
                      deadline=now + self.wait_timeout_s + self.side_channel_timeout_s,
                      renew_at=now + self.wait_timeout_s / 4)
        self._parked[rid] = wait
        with self._lock:
            self._by_pd[pd_id] = (rid, wait.expect_engine_id)
            self._pd_of[rid] = pd_id
        self._send_wait(wait)
        logger.info("PDConnector: request %s waits for prefill %s on %s:%d (concurrent pull)",
                    rid, pd_id, *endpoint)

    def take(self, rid: str) -> Parked | None:
        """``rid``'s wait once it ended (P's answer, or why not); None while
        it goes on. The request is no longer parked afterwards."""
        self._apply_events()
        wait = self._parked.get(rid)
        if wait is None or (wait.ready is None and not wait.failed):
            return None
        del self._parked[rid]
        return wait

    def poll(self) -> dict[str, str]:
        """Renew waits, fail those past their deadline: request id -> why."""
        self._apply_events()
        now = self._clock()
        out: dict[str, str] = {}
        for wait in list(self._parked.values()):
            if wait.ready is not None:
                continue
            if wait.failed:
                out[wait.request_id] = wait.failed
            elif now >= wait.deadline:
                out[wait.request_id] = self._deadline_why(wait, now)
            elif not wait.renewing and now >= wait.renew_at:
                wait.renew_at = now + self.wait_timeout_s / 4
                wait.renewing = True
                self._send_wait(wait)
        for rid in out:
            del self._parked[rid]
        return out

    def cancel(self, rid: str, endpoint: Endpoint, why: str) -> None:
        """``rid`` ended before it read P's blocks (parked, or its wait
        ended without a load): P drops the wait and frees what it lent."""
        self._parked.pop(rid, None)
        pd_id = self.forget(rid)
        if pd_id is not None:
            self._outbox.send(endpoint[0], endpoint[1], proto.PullWaitCancel(
                engine_id=self.engine_id, pd_request_id=pd_id, reason=why[:1024]))

    def forget(self, rid: str) -> str | None:
        """``rid`` is done with P's answer (its load was reported, or it
        ended): its pd_request_id, if it had one."""
        with self._lock:
            pd_id = self._pd_of.pop(rid, None)
            if pd_id is not None:
                self._by_pd.pop(pd_id, None)
        return pd_id

    # ------------------------------------------------------------ threads
    def handle(self, msg: proto.Request) -> proto.Reply:
        """Side-channel thread: P's ``PullReady``."""
        if not isinstance(msg, proto.PullReady):
            return proto.ErrorReply(ErrorCode.NOT_PRODUCER, f"engine {self.engine_id} is a "
                                    "pull consumer; it holds no prefills")
        with self._lock:
            known = self._by_pd.get(msg.pd_request_id)
            if known is None:
                return proto.ErrorReply(ErrorCode.UNKNOWN, f"no request on engine "
                                        f"{self.engine_id} waits for {msg.pd_request_id}")
            rid, expect = known
            if msg.engine_id != expect:
                self.num_wrong_sender += 1
                logger.warning("PDConnector: pull answer for %s from engine %s refused: it "
                               "was asked of engine %s", msg.pd_request_id, msg.engine_id,
                               expect)
                return proto.ErrorReply(ErrorCode.REFUSED, f"pull {msg.pd_request_id} was not "
                                        f"asked of engine {msg.engine_id}")
            self._events.append(_Event(rid, msg, self._clock()))
        self._wake()
        return proto.Ack()

    def _on_wait_reply(self, rid: str, reply: proto.Reply | SideChannelError) -> None:
        """Outbox thread: P's answer to a ``PullWait``."""
        if isinstance(reply, proto.PullWaiting):
            event = _Event(rid, reply, self._clock())
        elif isinstance(reply, SideChannelError) and not reply.refused:
            event = _Event(rid, f"no answer from P: {reply}", self._clock())
        else:
            event = _Event(rid, f"P refused the wait: {reply}", self._clock(), definite=True)
        with self._lock:
            self._events.append(event)
        self._wake()

    # ------------------------------------------------------------ internals
    def _wake(self) -> None:
        if self.on_event is not None:
            self.on_event()

    def _send_wait(self, wait: Parked) -> None:
        rid = wait.request_id
        wait.seq += 1
        # Read before it leaves: P can only have it later.
        wait.sent[wait.seq] = self._clock()
        if len(wait.sent) > MAX_SENT_KEPT:
            del wait.sent[min(wait.sent)]
        self._outbox.send(wait.endpoint[0], wait.endpoint[1], proto.PullWait(
            engine_id=self.engine_id, expect_engine_id=wait.expect_engine_id,
            pd_request_id=wait.pd_request_id, request_id=rid, notify_host=self.host,
            notify_port=self.port, ttl_s=min(self.wait_timeout_s, proto.MAX_TTL_S),
            seq=wait.seq), lambda reply: self._on_wait_reply(rid, reply))

    def _apply_events(self) -> None:
        if not self._events:  # (a racy read: a late event is seen next time)
            return
        with self._lock:
            events, self._events = self._events, []
        for event in events:
            wait = self._parked.get(event.request_id)
            if wait is None or wait.ready is not None or wait.failed:
                continue
            what = event.what
            if isinstance(what, proto.PullReady):
                wait.ready, wait.ready_at = what, event.at
                sent = wait.sent.get(what.wait_seq)
                if what.ok and what.lease_s > 0 and sent is not None:
                    # P extended the lease after it had this wait, which
                    # left here at ``sent`` or later: a bound on our clock.
                    wait.valid_until = sent + what.lease_s
            elif isinstance(what, proto.PullWaiting):
                wait.renewing = False
                if what.state is proto.PullWaitState.QUEUED:
                    self._confirmed_queued(wait, event.at)
            elif event.definite:
                wait.failed = f"{what} (engine {wait.expect_engine_id} at {wait.endpoint[0]}:" \
                              f"{wait.endpoint[1]})"
            else:
                wait.renewing = False
                logger.warning("PDConnector: waiting for prefill %s: %s", wait.pd_request_id,
                               what)

    def _confirmed_queued(self, wait: Parked, now: float) -> None:
        """P holds the request: wait ``wait_timeout`` more, up to the queue timeout."""
        wait.queued = True
        cap = wait.arrived + self.queue_timeout_s + self.side_channel_timeout_s
        wait.deadline = max(wait.deadline, min(
            cap, now + self.wait_timeout_s + self.side_channel_timeout_s))

    def _deadline_why(self, wait: Parked, now: float) -> str:
        where = f"engine {wait.expect_engine_id} at {wait.endpoint[0]}:{wait.endpoint[1]}"
        if wait.queued:
            return (f"no answer from P ({where}) within push_queue_timeout "
                    f"({self.queue_timeout_s:.1f} s) although P reported the request queued "
                    f"(waited {now - wait.arrived:.1f} s)")
        return (f"no answer from P ({where}) within push_timeout ({self.wait_timeout_s:.1f} s);"
                " P never confirmed it holds the request (did the prefill leg reach it?)")

    def close(self) -> None:
        self._outbox.close()
